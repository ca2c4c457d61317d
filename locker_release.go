package advlock

import (
	"context"
	"time"

	"github.com/advlock/advlock/internal/session"
)

// release unlocks lk's session and frees its in-process slot; after is what lk.Err reports on a clean release.
func (l *Locker) release(lk *Lock, after error) error {
	ctx, cancel := context.WithTimeout(context.Background(), l.opts.ReleaseTimeout)
	defer cancel()
	return l.releaseCtx(ctx, lk, after)
}

func (l *Locker) releaseCtx(ctx context.Context, lk *Lock, after error) error {
	return lk.h.Release(ctx, after) // the handle's end frees the slot (forget)
}

// forget drops lk from the Locker and gives its in-process slot back, once. It reports whether lk was in the
// Locker's held locks, whose count (heldWG) its caller then gives back, once it is done with the lock's end.
func (l *Locker) forget(lk *Lock) (wasHeld bool) {
	l.mu.Lock()
	defer l.mu.Unlock()
	if lk.forgotten {
		return false
	}
	lk.forgotten = true
	if lk.stopLinger() {
		l.inflight.Done() // ended (lost) during its hold: nothing left to release later
	}
	_, wasHeld = l.held[lk]
	delete(l.held, lk)
	l.leaveLocked(session.Target{ID: lk.key.id, Shared: lk.shared})
	return wasHeld
}

// ended is what a lock's session tells the Locker as the lock ends (session.OnEnd): the slot is given back at once,
// the observers are told once Done has closed, and then Close may count the lock gone.
func (l *Locker) ended(lk *Lock) session.OnEnd {
	return func(err error) func() {
		held := l.forget(lk)
		return func() {
			l.lockEnded(lk, err)
			if held {
				l.heldWG.Done()
			}
		}
	}
}

// lingerFor releases lk, which its caller unlocked before its HoldAtLeast had passed, d from now (or when Close
// comes first). A Locker closed already has released it, or is about to. It reports false, arming nothing, when
// lk has ended already (lost: the Locker forgot it before its Err said so), which Unlock then reports.
func (l *Locker) lingerFor(lk *Lock, d time.Duration) bool {
	l.mu.Lock()
	defer l.mu.Unlock()
	if lk.forgotten {
		// Released already: by Close, which found it lingering and released it as its caller's unlock (the caller
		// then hears what a release would have told, as when Close comes after), or lost.
		return lk.ended.Load() == unlockedByCaller
	}
	if l.closed {
		return true // Close releases every lingering lock it finds
	}
	l.inflight.Add(1)
	lk.hold.linger = time.AfterFunc(d, func() {
		defer l.inflight.Done()
		if lk.ended.CompareAndSwap(lingering, unlockedByCaller) {
			_ = l.release(lk, ErrNotHeld)
		}
	})
	return true
}
