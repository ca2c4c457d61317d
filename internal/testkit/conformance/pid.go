package conformance

import (
	"context"
	"sync/atomic"
	"testing"
	"time"

	"github.com/advlock/advlock"
	"github.com/advlock/advlock/internal/testkit/pgtest"
)

// pidRecorder keeps the pid the last grant and the last lock end reported.
type pidRecorder struct{ granted, ended atomic.Uint32 }

func (r *pidRecorder) LockStart(ctx context.Context, _ advlock.LockCall) (context.Context, func(advlock.LockOutcome)) {
	return ctx, func(o advlock.LockOutcome) {
		if o.Result == advlock.ResultAcquired {
			r.granted.Store(o.PID)
		}
	}
}
func (r *pidRecorder) LockEnd(e advlock.LockEnd)    { r.ended.Store(e.PID) }
func (r *pidRecorder) Session(advlock.SessionEvent) {}

// observerPID: the server session a grant names (LockOutcome.PID, then LockEnd.PID) is the one pg_locks shows
// holding the key, through a pooler in session mode too (whose own pid the client sees instead).
func (s *suite) observerPID(t *testing.T) {
	rec := new(pidRecorder)
	h, obs := s.open(t, advlock.WithObserver(rec)), s.observer(t)
	ctx := ctxT(t, 10*time.Second)
	k := Key(t)
	v, _ := k.Int64()
	for _, lock := range []func(context.Context, advlock.Key, ...advlock.CallOption) (*advlock.Lock, error){h.L.Lock, h.L.RLock} {
		lk, err := lock(ctx, k)
		if err != nil {
			t.Fatal(err)
		}
		rows, err := pgtest.Locks(ctx, obs)
		if err != nil {
			t.Fatal(err)
		}
		var holder uint32
		for _, r := range rows {
			if r.Int64Key(v) && r.Granted {
				holder = r.PID
			}
		}
		if holder == 0 || rec.granted.Load() != holder {
			t.Errorf("LockOutcome.PID %d; pg_locks shows pid %d holding the key", rec.granted.Load(), holder)
		}
		if err := lk.Unlock(ctx); err != nil {
			t.Fatal(err)
		}
		if rec.ended.Load() != holder {
			t.Errorf("LockEnd.PID %d; the lock was held by pid %d", rec.ended.Load(), holder)
		}
	}
}
