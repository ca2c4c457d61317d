package advlock

import (
	"context"
	"errors"
	"math/rand/v2"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/advlock/advlock/internal/testkit/pgtest"
	"github.com/jackc/pgx/v5/pgxpool"
)

// Callers that hold one of six keys A wait for B from inside Do (watched waits: they pass by B's gate and wait in the server) while
// other callers of the same Locker hold B exclusively or shared, on shared sessions or sessions of their own, and
// tries come and go: no two callers ever hold B exclusively at once, nor exclusively and shared, whatever session
// each got; there is no cycle, so no wait ends with ErrDeadlock; and when all is over nothing is left waiting or
// held, in the Locker or in pg_locks.
func TestWatchedWaitsExclude(t *testing.T) {
	url := pgtest.URL(t)
	cases := []struct {
		name string
		l    func(t *testing.T) *Locker
	}{
		{"shared", func(t *testing.T) *Locker {
			l := New(pgtest.Pool(t, url, nil), WithSharedSessions(2))
			t.Cleanup(l.Close)
			return l
		}},
		{"own", func(t *testing.T) *Locker {
			l := New(pgtest.Pool(t, url, func(c *pgxpool.Config) { c.MaxConns = 12 }), WithSharedSessions(0))
			t.Cleanup(l.Close)
			return l
		}},
		{"open", func(t *testing.T) *Locker { return openApp(t, url, appName(t, "watched"), "") }},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			l := c.l(t)
			obs := pgtest.Conn(t, url)
			ctx := ctxT(t, 60*time.Second)
			as := []Key{key(t), key(t), key(t), key(t), key(t), key(t)}
			b := key(t)
			var aWs [6]atomic.Int32
			var bW, bR atomic.Int32
			var kinds [6]atomic.Int64
			var peakQueued atomic.Int64
			excl := func(n *atomic.Int32, r *atomic.Int32, what string) func() {
				if v := n.Add(1); v != 1 || r != nil && r.Load() != 0 {
					t.Errorf("%s: an exclusive holder alongside others (%d exclusive)", what, v)
				}
				time.Sleep(time.Duration(rand.N(2000)) * time.Microsecond)
				return func() { n.Add(-1) }
			}
			shr := func() func() {
				bR.Add(1)
				if bW.Load() != 0 {
					t.Errorf("B: a shared holder alongside an exclusive one")
				}
				time.Sleep(time.Duration(rand.N(2000)) * time.Microsecond)
				return func() { bR.Add(-1) }
			}
			check := func(err error, what string) {
				switch {
				case err == nil, ctx.Err() != nil, errors.Is(err, ErrNotAcquired):
				case errors.Is(err, ErrDeadlock):
					t.Errorf("%s: %v, but no caller holding B waits for A", what, err)
				default:
					t.Errorf("%s: %v", what, err)
				}
			}
			stop := time.Now().Add(4 * time.Second)
			var wg sync.WaitGroup
			for g := 0; g < 12; g++ {
				wg.Add(1)
				go func() {
					defer wg.Done()
					for time.Now().Before(stop) && ctx.Err() == nil {
						ai := rand.N(len(as))
						a, aW := as[ai], &aWs[ai]
						k := rand.N(len(kinds))
						kinds[k].Add(1)
						if q := int64(l.Stats().WaitingForSession); q > peakQueued.Load() {
							peakQueued.Store(q)
						}
						switch k {
						case 0, 1: // holds A, waits for B exclusively from inside Do
							check(l.Do(ctx, a, func(fctx context.Context) error {
								defer excl(aW, nil, "A")()
								return l.Do(fctx, b, func(context.Context) error { defer excl(&bW, &bR, "B")(); return nil })
							}), "Do(A){Do(B)}")
						case 2: // holds A, waits for B shared from inside Do
							check(l.Do(ctx, a, func(fctx context.Context) error {
								defer excl(aW, nil, "A")()
								lk, err := l.RLock(fctx, b)
								if err != nil {
									return err
								}
								shr()()
								return lk.Unlock(ctx)
							}), "Do(A){RLock(B)}")
						case 3:
							check(l.Do(ctx, b, func(context.Context) error { defer excl(&bW, &bR, "B")(); return nil }), "Do(B)")
						case 4:
							lk, err := l.RLock(ctx, b)
							check(err, "RLock(B)")
							if err == nil {
								shr()()
								check(lk.Unlock(ctx), "unlock")
							}
						case 5:
							check(l.TryDo(ctx, b, func(context.Context) error { defer excl(&bW, &bR, "B")(); return nil }), "TryDo(B)")
						}
					}
				}()
			}
			wg.Wait()
			t.Logf("calls by kind %v; most queued for a session: %d; deadlocks %d", func() (n [6]int64) {
				for i := range kinds {
					n[i] = kinds[i].Load()
				}
				return
			}(), peakQueued.Load(), l.Stats().Deadlocks)
			if st := l.Stats(); st.Held != 0 || st.WaitingInProcess != 0 || st.WaitingInServer != 0 || st.WaitingForSession != 0 {
				t.Errorf("after: %+v", st)
			}
			for _, k := range append(as, b) {
				v, _ := k.Int64()
				pgtest.WaitFree(t, obs, v, 10*time.Second)
			}
		})
	}
}
