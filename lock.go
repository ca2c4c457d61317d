package advlock

import (
	"context"
	"errors"
	"sync/atomic"
	"time"
)

// Lock is a held advisory lock: a key held by a shared session (with other locks) or by a session of its own. It
// is safe for concurrent use.
type Lock struct {
	l         *Locker
	key       Key
	h         handle
	grantedAt time.Duration // since clockStart, set before observed
	hold      *minHold      // HoldAtLeast only: made before the Lock is shared (Close reads it under l.mu)
	ended     atomic.Int32  // lockHeld, then unlockedByCaller or releasedByClose, whichever comes first
	observed  atomic.Bool   // its grant was reported to the Locker's observers and its end not yet
	shared    bool
	forgotten bool // guarded by l.mu: released or lost, and dropped by the Locker
}

// minHold is a Lock's HoldAtLeast, apart so that the locks without one (most) stay small.
type minHold struct {
	until  time.Time   // Unlock before then lingers
	linger *time.Timer // the lingering lock's release, once Unlock was called early (guarded by l.mu)
}

// clockStart is where the Locks' grant times count from (a monotonic clock, 8 bytes a Lock).
var clockStart = time.Now()

// handle is where a lock is held: a *session.Session of its own, or a *session.Held on a shared session.
type handle interface {
	Done() <-chan struct{}
	Err() error
	Release(ctx context.Context, after error) error
	Confirm(ctx context.Context) error // a round trip after the call: nil if still held, else how the lock ended
	AfterEnd(f func()) (stop func() bool)
	Token() int64
	PID() uint32
}

// holdLeft is how long lk's HoldAtLeast has still to run (0 without one).
func (lk *Lock) holdLeft() time.Duration {
	if lk.hold == nil {
		return 0
	}
	return time.Until(lk.hold.until)
}

// stopLinger stops the release armed for a lingering lk, and reports whether it stopped it before it ran
// (guarded by l.mu).
func (lk *Lock) stopLinger() bool {
	return lk.hold != nil && lk.hold.linger != nil && lk.hold.linger.Stop()
}

// Values of Lock.ended.
const (
	lockHeld int32 = iota
	unlockedByCaller
	releasedByClose
	lingering // unlocked by the caller before its HoldAtLeast: released when that has passed (or by Close)
)

// Token is the grant's fencing token: strictly greater than every token handed out before it (see [WithFencing]);
// 0 when the Locker has no fencing.
func (lk *Lock) Token() int64 { return lk.h.Token() }

// PID is the pid of the server session that holds the lock (pg_locks.pid; 0 when the driver does not tell).
func (lk *Lock) PID() uint32 { return lk.h.PID() }

// Key returns the key this lock holds.
func (lk *Lock) Key() Key { return lk.key }

// Shared reports whether the lock is held in shared mode.
func (lk *Lock) Shared() bool { return lk.shared }

// Done is closed once the lock is released or lost. Watch it to learn at once that the session holding the lock
// died: a terminated backend, an idle-session timeout or a server shutdown is seen as soon as the server says so;
// a network that silently drops is noticed within about twice the keepalive interval ([WithKeepalive]).
func (lk *Lock) Done() <-chan struct{} { return lk.h.Done() }

// Err is nil while the lock is held. After Done is closed it matches ErrLockLost if the lock was lost (wrapping the
// reason, such as the server's *pgconn.PgError), ErrNotHeld after Unlock, or ErrClosed after [Locker.Close].
func (lk *Lock) Err() error { return lk.h.Err() }

// Unlock releases the lock. When the server confirms the unlock the session goes back to the pool and Unlock
// returns nil. Otherwise the session is closed, never pooled, so that the server drops the lock, and Unlock says
// why: ErrLockLost if the lock had been lost (or the server said the session no longer held it), ErrUnlockFailed if
// the unlock failed, timed out or ctx had ended. A second call returns ErrNotHeld; a call after Close released the
// lock returns ErrClosed. Before the lock's [HoldAtLeast] has passed, Unlock leaves the key held until it has, and
// asks the server whether the lock still is: nil, ErrLockLost, or an error matching ErrUnlockFailed and ctx's
// error when no answer came before ctx ended (the key stays held as asked).
func (lk *Lock) Unlock(ctx context.Context) error {
	if lk == nil {
		return ErrNotHeld
	}
	if d := lk.holdLeft(); d > 0 && lk.h.Err() == nil && lk.ended.CompareAndSwap(lockHeld, lingering) {
		if lk.l.lingerFor(lk, d) {
			return lk.confirm(ctx)
		}
		// Lost as it was unlocked (the Locker forgot it before its Err said so): reported as any loss.
		lk.ended.Store(unlockedByCaller)
	} else if !lk.ended.CompareAndSwap(lockHeld, unlockedByCaller) {
		if lk.ended.Load() == releasedByClose {
			return &keyError{op: "unlock", key: lk.key, err: ErrClosed}
		}
		return &keyError{op: "unlock", key: lk.key, err: ErrNotHeld}
	}
	if err := lk.l.releaseCtx(ctx, lk, ErrNotHeld); err != nil {
		return &keyError{op: "unlock", key: lk.key, err: err}
	}
	return nil
}

// confirm asks the server, for an Unlock before the lock's HoldAtLeast has passed, whether the lock is still held:
// what a release would have told. A release that came first (the hold passed, or Close) told it.
func (lk *Lock) confirm(ctx context.Context) error {
	err := lk.h.Confirm(ctx)
	if err == nil || errors.Is(err, ErrNotHeld) || errors.Is(err, ErrClosed) {
		return nil
	}
	return &keyError{op: "unlock", key: lk.key, err: err}
}
