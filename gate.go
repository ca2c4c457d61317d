package advlock

import (
	"context"
	"errors"

	"github.com/advlock/advlock/internal/mutant"
	"github.com/advlock/advlock/internal/session"
)

// gate is the in-process side of one key: one exclusive holder or any number of shared ones, each of which then
// takes its own session. A waiting exclusive caller holds back new shared ones, as PostgreSQL's queue does.
type gate struct {
	exclusive      bool
	shared         int
	waiting        int // callers blocked in enter
	waitingWriters int
	wake           chan struct{} // made by a waiter; closed (and dropped) whenever the gate changes
}

func (g *gate) admits(shared bool) bool {
	if mutant.On(mutant.GuardOff) {
		return true
	}
	if shared {
		return !g.exclusive && g.waitingWriters == 0
	}
	return !g.exclusive && g.shared == 0
}

func (g *gate) changed() {
	if g.wake != nil {
		close(g.wake)
		g.wake = nil
	}
}

// enter takes t's in-process slot, waiting (if wait) until it is free or ctx ends.
func (l *Locker) enter(ctx context.Context, t session.Target, wait bool) error {
	l.mu.Lock()
	defer l.mu.Unlock()
	g := l.gates[t.ID]
	if g == nil {
		g = &gate{}
		l.gates[t.ID] = g
	}
	writerQueued := false
	defer func() {
		if writerQueued {
			g.waitingWriters--
			g.changed() // shared callers held back by this writer may go
		}
		l.gc(t.ID, g)
	}()
	for !g.admits(t.Shared) {
		if !wait {
			return errHeldInProcess
		}
		if !t.Shared && !writerQueued {
			writerQueued = true
			g.waitingWriters++
		}
		if g.wake == nil {
			g.wake = make(chan struct{})
		}
		ch := g.wake
		g.waiting++
		l.mu.Unlock()
		select {
		case <-ch:
		case <-ctx.Done():
		}
		l.mu.Lock()
		g.waiting--
		if l.closed {
			return ErrClosed
		}
		if ctx.Err() != nil {
			return session.WithContext(ctx, errors.New("gave up waiting behind another holder of the key in this process"))
		}
	}
	if t.Shared {
		g.shared++
	} else {
		g.exclusive = true
	}
	return nil
}

func (l *Locker) leaveLocked(t session.Target) {
	g := l.gates[t.ID]
	if t.Shared {
		g.shared--
	} else {
		g.exclusive = false
	}
	g.changed()
	l.gc(t.ID, g)
}

// gc drops an idle gate so that the map does not grow with every key ever used.
func (l *Locker) gc(id session.ID, g *gate) {
	if !g.exclusive && g.shared == 0 && g.waiting == 0 && g.waitingWriters == 0 {
		delete(l.gates, id)
	}
}
