package advlock

import (
	"context"
	"errors"
	"fmt"
)

// Do takes key exclusively (waiting like Lock; [Wait] bounds that wait apart from ctx), runs fn, and unlocks, also
// when fn panics. The context given to fn is ctx, cancelled with cause ErrLockLost as soon as the lock is lost.
// Do returns fn's error together with the unlock's, on one line, each matchable with errors.Is; when the lock was
// lost at any point the result matches ErrLockLost, since fn may have overlapped with another holder.
//
// When the loss is what cancelled fn's context (judged when fn returns, from the context's cause), the result
// matches ErrLockLost and never context.Canceled, whatever fn returned: a loss does not read as a caller that went
// away. fn's error stays reachable with errors.Is (for anything but context.Canceled) and errors.As, and its text
// shows ("...: lock lost: ...; fn returned: context canceled"). When ctx itself was cancelled first, fn's context
// ended because of it, and the result matches context.Canceled as fn's error does.
//
// fn's context says that its caller holds key: a Lock, Do or Lead inside fn whose wait closes a cycle of waits
// (another caller holds what it waits for and waits for key) may end with ErrDeadlock, having taken nothing; a Do
// that gets ErrDeadlock for its own key does not run fn. fn should return it: Do releases key, and its caller may
// take the keys again.
func (l *Locker) Do(ctx context.Context, key Key, fn func(ctx context.Context) error, opts ...CallOption) (err error) {
	lk, err := l.Lock(ctx, key, opts...)
	if err != nil {
		return err
	}
	fctx, cancel := context.WithCancelCause(Holding(ctx, lk))
	stop := lk.h.AfterEnd(func() { cancel(lk.Err()) })
	var lostCause error // what cancelled fn's context, when it was the loss
	defer func() {
		stop()
		cancel(nil)
		uctx, ucancel := context.WithTimeout(context.WithoutCancel(ctx), l.opts.ReleaseTimeout)
		defer ucancel()
		uerr := lk.Unlock(uctx)
		switch {
		case lostCause != nil:
			loss := uerr
			if !errors.Is(uerr, ErrLockLost) {
				loss = &keyError{op: "do", key: key, err: lostCause}
				if uerr != nil {
					loss = fmt.Errorf("%w; and %w", loss, uerr)
				}
			}
			err = &lostError{fn: err, loss: loss}
		case uerr == nil:
		case err == nil:
			err = uerr
		default:
			err = fmt.Errorf("%w; and %w", err, uerr)
		}
	}()
	err = fn(fctx)
	if fctx.Err() != nil && errors.Is(context.Cause(fctx), ErrLockLost) { // judged now, before anything else moves
		lostCause = context.Cause(fctx)
	}
	return err
}

// TryDo is Do that does not wait: it takes key if no other session holds it (else ErrNotAcquired), runs fn with a
// context cancelled when the lock is lost, and unlocks. It is Do(ctx, key, fn, Wait(0)).
func (l *Locker) TryDo(ctx context.Context, key Key, fn func(ctx context.Context) error, opts ...CallOption) error {
	return l.Do(ctx, key, fn, append(opts[:len(opts):len(opts)], Wait(0))...) // never into the caller's array
}

// FenceToken returns the fencing token of the lock that Do (or TryDo) holds while running the fn that got ctx (the
// innermost, when Do runs inside Do or [Holding] adds locks), or 0 (no such lock, or no fencing: [WithFencing]).
func FenceToken(ctx context.Context) int64 {
	if h, ok := ctx.Value(holdingKey{}).(*holding); ok {
		return h.lk.Token()
	}
	return 0
}
