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

// Callers of one key whose contexts end at every moment of their wait in the gate (before their turn, as it is
// handed to them, just after), mixed with shared callers and tries: the slot never leaks (a last Lock gets the
// key at once, nothing waits, no gate is left), and no two callers hold the key exclusively at once.
func TestGateCancelRace(t *testing.T) {
	for _, n := range []int{4, 0} {
		t.Run(map[int]string{4: "shared", 0: "own"}[n], func(t *testing.T) {
			b := setup(t, WithSharedSessions(n))
			ctx := ctxT(t, 90*time.Second)
			k := key(t)
			var writers, readers atomic.Int32
			var granted, gaveUp atomic.Int64
			var wg sync.WaitGroup
			stop := time.Now().Add(4 * time.Second)
			for g := 0; g < 8; g++ {
				wg.Add(1)
				go func() {
					defer wg.Done()
					for time.Now().Before(stop) && ctx.Err() == nil {
						shared := rand.N(3) == 0
						var lk *Lock
						var err error
						switch rand.N(6) {
						case 0:
							if shared {
								lk, err = b.l.TryRLock(ctx, k)
							} else {
								lk, err = b.l.TryLock(ctx, k)
							}
						default:
							cctx, cancel := context.WithTimeout(ctx, time.Duration(rand.N(3000))*time.Microsecond)
							if shared {
								lk, err = b.l.RLock(cctx, k)
							} else {
								lk, err = b.l.Lock(cctx, k)
							}
							cancel()
						}
						if err != nil {
							if ctx.Err() == nil && !errors.Is(err, ErrNotAcquired) && !errors.Is(err, context.DeadlineExceeded) {
								t.Errorf("acquire: %v", err)
								return
							}
							gaveUp.Add(1)
							continue
						}
						granted.Add(1)
						if shared {
							readers.Add(1)
							if w := writers.Load(); w != 0 {
								t.Errorf("a shared holder alongside %d exclusive", w)
							}
						} else {
							if w := writers.Add(1); w != 1 || readers.Load() != 0 {
								t.Errorf("an exclusive holder alongside %d exclusive and %d shared", w-1, readers.Load())
							}
						}
						time.Sleep(time.Duration(rand.N(300)) * time.Microsecond)
						if shared {
							readers.Add(-1)
						} else {
							writers.Add(-1)
						}
						if err := lk.Unlock(ctx); err != nil {
							t.Errorf("unlock: %v", err)
						}
					}
				}()
			}
			wg.Wait()
			t.Logf("%d granted, %d gave up or found it taken", granted.Load(), gaveUp.Load())
			st := b.l.Stats()
			b.l.mu.Lock()
			gates := len(b.l.gates)
			b.l.mu.Unlock()
			if st.WaitingInProcess != 0 || st.Held != 0 || gates != 0 {
				t.Fatalf("after every caller returned: %+v, %d gates left", st, gates)
			}
			lctx, cancel := context.WithTimeout(ctx, 5*time.Second)
			defer cancel()
			lk, err := b.l.Lock(lctx, k)
			if err != nil {
				t.Fatalf("a last Lock: %v (%+v)", err, b.l.Stats())
			}
			if pid := b.pidOf(t, lk); pid != lk.PID() {
				t.Errorf("pg_locks: %d holds it, the lock says %d", pid, lk.PID())
			}
			if err := lk.Unlock(ctx); err != nil {
				t.Fatal(err)
			}
			b.waitFree(t, k)
		})
	}
}

// Close while callers of a few keys queue in their gates, are handed the slot, give it back and start new calls:
// Close returns with no connection taken from the pool (it waited for every release), every call ends (ErrClosed
// once Close began), no connection back in the pool holds a lock, and the server shows none of the keys held once
// the sessions Close destroyed have ended (a CI run read pg_locks the moment Close returned and saw one key still
// held by such a session).
func TestGateCloseRace(t *testing.T) {
	url := pgtest.URL(t)
	// No health check takes the pool's idle connections while the test counts those taken.
	pool := pgtest.Pool(t, url, func(c *pgxpool.Config) { c.HealthCheckPeriod = time.Hour })
	obs := pgtest.Conn(t, url)
	ctx := ctxT(t, 90*time.Second)
	keys := []Key{key(t), key(t)}
	for round := 0; round < 40; round++ {
		l := New(pool, WithSharedSessions(rand.N(3)))
		var wg sync.WaitGroup
		var writers [2]atomic.Int32
		for g := 0; g < 6; g++ {
			wg.Add(1)
			go func() {
				defer wg.Done()
				for ctx.Err() == nil {
					i := rand.N(len(keys))
					shared := rand.N(3) == 0
					lock := l.Lock
					if shared {
						lock = l.RLock
					}
					cctx, cancel := context.WithTimeout(ctx, time.Duration(rand.N(5000))*time.Microsecond)
					lk, err := lock(cctx, keys[i])
					cancel()
					if errors.Is(err, ErrClosed) {
						return
					}
					if err != nil {
						continue
					}
					if !shared && writers[i].Add(1) != 1 {
						t.Errorf("two exclusive holders of one key")
					}
					time.Sleep(time.Duration(rand.N(200)) * time.Microsecond)
					if !shared {
						writers[i].Add(-1)
					}
					_ = lk.Unlock(ctx)
				}
			}()
		}
		time.Sleep(time.Duration(rand.N(30)) * time.Millisecond)
		closed := make(chan struct{})
		go func() { l.Close(); close(closed) }()
		select {
		case <-closed:
		case <-time.After(15 * time.Second):
			t.Fatalf("round %d: Close did not return within 15 s: %+v", round, l.Stats())
		}
		if n := pool.Stat().AcquiredConns(); n != 0 { // Close waited for every release
			t.Fatalf("round %d: Close returned with %d connections still taken from the pool", round, n)
		}
		wg.Wait()
		// A session Close destroyed (a wait it cut, an unlock in doubt) ends on the server a moment after its
		// socket closes: each key is free within 10 s, and no connection back in the pool holds a lock.
		pgtest.NoIdleLocks(t, pool, obs)
		for _, k := range keys {
			v, _ := k.Int64()
			pgtest.WaitFree(t, obs, v, 10*time.Second)
		}
	}
}
