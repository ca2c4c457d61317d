package advlock

import (
	"container/list"
	"context"
	"errors"

	"github.com/advlock/advlock/internal/mutant"
	"github.com/advlock/advlock/internal/session"
)

// gate is the in-process side of one key: one exclusive holder or any number of shared ones, each of which then
// takes its own session. Callers that must wait queue in order: a waiting exclusive caller holds back new shared
// ones, as PostgreSQL's queue does, and the slot goes to the head of the queue when it frees.
//
// A watched wait (its caller holds locks, so it may close a cycle of waits) does not wait here: it passes at once
// and waits in the server on a session of its own, where every client's deadlock detection sees it (a wait in
// this gate is seen by nobody else, and a cycle through the gates of two processes by nobody at all). Two
// callers of one Locker may then hold or wait for one key on two sessions at once; the server excludes them from
// each other, as it does any two sessions. The gate's one duty, keeping a second caller off a shared session that
// holds the key already (PostgreSQL would grant it again on that session), stays: a caller that passed by does
// not try on a shared session (take).
type gate struct {
	exclusive int // exclusive holders, and callers past the gate waiting for the key
	shared    int
	queue     list.List // of *gateWaiter: callers waiting in enter, first come first served
}

// gateWaiter is one caller waiting in enter. Its turn is handed to it under the Locker's lock (the slot counted for
// it), and ready is closed then; or ready is closed by Close, with granted false.
type gateWaiter struct {
	shared  bool
	granted bool
	ready   chan struct{}
}

func (g *gate) admits(shared bool) bool {
	if mutant.On(mutant.GuardOff) {
		return true
	}
	if shared {
		return g.exclusive == 0
	}
	return g.exclusive == 0 && g.shared == 0
}

func (g *gate) take(shared bool) {
	if shared {
		g.shared++
	} else {
		g.exclusive++
	}
}

// handOff gives the slot to the callers at the head of the queue that it admits now, in order (a run of shared
// ones together, or one exclusive one): no later caller passes an earlier one, as in PostgreSQL's queue, so that
// every caller of a busy key gets its turn (a caller woken with all the others to race for it could wait for
// ever).
func (g *gate) handOff() {
	for e := g.queue.Front(); e != nil; e = g.queue.Front() {
		w := e.Value.(*gateWaiter)
		if !g.admits(w.shared) {
			return
		}
		g.queue.Remove(e)
		g.take(w.shared)
		w.granted = true
		close(w.ready)
	}
}

// enter takes t's in-process slot, waiting (if wait) its turn behind the callers before it, until the slot is
// free or ctx ends. A wait that may pass (pass: a watched wait, or one that takes any of several keys) does not
// wait: when the slot is not free it passes by (passed is true), and must then lock on a session of its own.
func (l *Locker) enter(ctx context.Context, t session.Target, wait, pass bool) (passed bool, err error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.closed {
		// Close has woken the gates already (or is about to): a slot taken now would be in a gate nobody wakes,
		// or in one made anew after a woken waiter's gc dropped the old one.
		return false, ErrClosed
	}
	g := l.gates[t.ID]
	if g == nil {
		g = &gate{}
		l.gates[t.ID] = g
	}
	free := g.admits(t.Shared) && g.queue.Len() == 0
	switch {
	case free:
	case !wait:
		l.gc(t.ID, g)
		return false, errHeldInProcess
	case pass:
		passed = true
	default:
		gw := &gateWaiter{shared: t.Shared, ready: make(chan struct{})}
		e := g.queue.PushBack(gw)
		l.mu.Unlock()
		select {
		case <-gw.ready:
		case <-ctx.Done():
		}
		l.mu.Lock()
		switch {
		case gw.granted && l.closed:
			l.leaveLocked(t)
			return false, ErrClosed
		case gw.granted: // its turn came, maybe as ctx ended: it is taken
			return false, nil
		case l.closed:
			g.queue.Remove(e)
			l.gc(t.ID, g)
			return false, ErrClosed
		default:
			g.queue.Remove(e)
			g.handOff() // an exclusive caller that gives up may let shared ones behind it go
			l.gc(t.ID, g)
			return false, session.WithContext(ctx, errors.New("gave up waiting behind another holder of the key in this process"))
		}
	}
	g.take(t.Shared)
	return passed, nil
}

func (l *Locker) leaveLocked(t session.Target) {
	g := l.gates[t.ID]
	if t.Shared {
		g.shared--
	} else {
		g.exclusive--
	}
	g.handOff()
	l.gc(t.ID, g)
}

// closeGates wakes every caller waiting in a gate: they find the Locker closed. l.mu is held.
func (l *Locker) closeGates() {
	for _, g := range l.gates {
		for e := g.queue.Front(); e != nil; e = g.queue.Front() {
			g.queue.Remove(e)
			close(e.Value.(*gateWaiter).ready)
		}
	}
}

// gc drops an idle gate so that the map does not grow with every key ever used; only g itself (a waiter woken by
// Close may hold a gate that is no longer the key's).
func (l *Locker) gc(id session.ID, g *gate) {
	if l.gates[id] == g && g.exclusive == 0 && g.shared == 0 && g.queue.Len() == 0 {
		delete(l.gates, id)
	}
}
