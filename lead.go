package advlock

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"time"
)

// Lead campaigns for key and runs fn while this process leads: it waits in the server (no polling) until elected,
// runs fn with a context that is cancelled when leadership is lost (the session ended) or ctx ends, releases
// leadership when fn returns, and campaigns again, until ctx ends (Lead then returns ctx's error) or fn returns an
// error that the loss did not cause (Lead returns it). A leader that loses its lock steps down at once and
// campaigns again after a short backoff (50 to 150 ms); so does a campaign that fails for a passing reason (the
// database unreachable for a moment), with a backoff that grows to 2 s. Configuration errors (ErrClosed,
// ErrStandby, ErrTxPooling, ErrUnverified, ErrFencing, ErrNoPool, ErrInvalidKey) end Lead at once.
//
// fn gets the leader's fencing token through [FenceToken] when the Locker has [WithFencing]: every term's token
// is greater than the last, so a deposed leader that was paused can be refused by what it writes to. Lead suits
// "one pod runs the scheduler": the leader's lock is a session lock like any other (advlock ls shows it, and
// [Leader] reads who leads from any process).
func (l *Locker) Lead(ctx context.Context, key Key, fn func(ctx context.Context) error) error {
	backoff := 50 * time.Millisecond
	for {
		lk, err := l.Lock(ctx, key)
		if err != nil {
			if ctx.Err() != nil {
				return ctx.Err()
			}
			for _, fatal := range []error{ErrClosed, ErrStandby, ErrTxPooling, ErrUnverified, ErrFencing, ErrNoPool, ErrInvalidKey} {
				if errors.Is(err, fatal) {
					return fmt.Errorf("advlock: lead %s: %w", key, err)
				}
			}
			if !sleep(ctx, jitter(backoff)) {
				return ctx.Err()
			}
			backoff = min(2*backoff, 2*time.Second)
			continue
		}
		backoff = 50 * time.Millisecond
		fctx, cancel := context.WithCancelCause(context.WithValue(ctx, lockKey{}, lk))
		stop := lk.h.AfterEnd(func() { cancel(lk.Err()) })
		ferr := fn(fctx)
		stop()
		cancel(nil)
		lost := errors.Is(lk.Err(), ErrLockLost)
		uctx, ucancel := context.WithTimeout(context.WithoutCancel(ctx), l.opts.ReleaseTimeout)
		uerr := lk.Unlock(uctx)
		ucancel()
		lost = lost || errors.Is(uerr, ErrLockLost)
		switch {
		case ctx.Err() != nil:
			return ctx.Err()
		case ferr != nil && !lost:
			return ferr
		case lost: // step down, then campaign again
			if !sleep(ctx, jitter(100*time.Millisecond)) {
				return ctx.Err()
			}
		}
	}
}

// jitter spreads d over [d/2, 3d/2).
func jitter(d time.Duration) time.Duration { return d/2 + time.Duration(rand.Int64N(int64(d))) }

// sleep waits d or until ctx ends; it reports whether d passed.
func sleep(ctx context.Context, d time.Duration) bool {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-t.C:
		return true
	case <-ctx.Done():
		return false
	}
}

// Leadership is who leads a key, as the server saw it at Observed.
type Leadership struct {
	LockInfo           // the leader's lock: its session's PID, ApplicationName, ClientAddr, BackendStart
	Observed time.Time // when the server was asked (its clock)
}

// Leader reports who leads key now (holds it exclusively), from any process, through conn (a *pgxpool.Pool,
// *pgx.Conn or pgx.Tx): false when nobody does. It reads pg_locks like [Inspect].
func Leader(ctx context.Context, conn Querier, key Key) (Leadership, bool, error) {
	rows, err := conn.Query(ctx, "SELECT now()")
	if err != nil {
		return Leadership{}, false, fmt.Errorf("advlock: leader: %w", err)
	}
	var now time.Time
	for rows.Next() {
		if err := rows.Scan(&now); err != nil {
			rows.Close()
			return Leadership{}, false, fmt.Errorf("advlock: leader: %w", err)
		}
	}
	rows.Close()
	locks, err := Inspect(ctx, conn)
	if err != nil {
		return Leadership{}, false, err
	}
	for _, li := range locks {
		if li.Granted && !li.Shared && li.Key.Equal(key) {
			li.Key = key
			return Leadership{LockInfo: li, Observed: now}, true, nil
		}
	}
	return Leadership{Observed: now}, false, nil
}
