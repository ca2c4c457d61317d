package advsql_test

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/advlock/advlock"
	"github.com/advlock/advlock/advsql"
	"github.com/advlock/advlock/internal/testkit/conformance"
	"github.com/advlock/advlock/internal/testkit/pgtest"
)

// advsql.New over the application's pool of 10, as examples/sql uses it: ten goroutines each run Do and query the
// same pool inside fn, on keys of their own, free or held by another process at first (so that all ten wait in the
// server, each on a session of its own, and then hold their locks there). With either driver the locks ride on
// shared sessions, the waits take at most a share of the pool, and the application's queries always find a
// connection: every run finishes. (With lib/pq every held lock took a connection of its own, and the ten holders
// waited for each other in database/sql for ever; without the share, so did ten holders whose waits had taken the
// pool.) pg_locks shows the held keys on few sessions.
func TestNewLeavesThePoolToFn(t *testing.T) {
	url := pgtest.URL(t)
	obs := pgtest.Conn(t, url)
	for _, driver := range []string{"postgres", "pgx"} {
		for _, heldFirst := range []bool{false, true} {
			t.Run(fmt.Sprintf("%s/held_first=%v", driver, heldFirst), func(t *testing.T) {
				ctx := ctxT(t, 60*time.Second)
				db := openDB(t, driver, url)
				db.SetMaxOpenConns(10)
				l := advsql.New(db)
				defer l.Close()
				other := advsql.New(openDB(t, "pgx", url))
				defer other.Close()
				var inside, most atomic.Int32
				var sampled atomic.Bool // obs is read once: a pgx.Conn is not for concurrent use
				var wg sync.WaitGroup
				errs := make(chan error, 10*20)
				for range 10 {
					k := conformance.Key(t)
					if heldFirst {
						lk, err := other.TryLock(ctx, k)
						if err != nil {
							t.Fatal(err)
						}
						time.AfterFunc(300*time.Millisecond, func() { _ = lk.Unlock(context.Background()) })
					}
					wg.Add(1)
					go func() {
						defer wg.Done()
						for range 20 {
							errs <- l.Do(ctx, k, func(ctx context.Context) error {
								n := inside.Add(1)
								defer inside.Add(-1)
								if n > most.Load() {
									most.Store(n)
								}
								if n == 10 && !sampled.Swap(true) { // all ten hold a lock: how many sessions hold them?
									if rows, err := pgtest.Locks(ctx, obs); err == nil {
										pids := map[uint32]bool{}
										for _, r := range rows {
											if r.Granted {
												pids[r.PID] = true
											}
										}
										t.Logf("ten locks held on %d server sessions in all", len(pids))
									}
								}
								var one int
								qctx, cancel := context.WithTimeout(ctx, 10*time.Second)
								defer cancel()
								return db.QueryRowContext(qctx, "SELECT 1").Scan(&one)
							})
						}
					}()
				}
				wg.Wait()
				close(errs)
				for err := range errs {
					if err != nil {
						t.Fatal(err)
					}
				}
				st := l.Stats()
				t.Logf("most holders at once %d; Stats %+v", most.Load(), st)
				if st.MaxOwnSessions == 0 || st.MaxOwnSessions > 5 {
					t.Errorf("sessions of their own at most %d over a pool of 10, want a share of it", st.MaxOwnSessions)
				}
			})
		}
	}
}

// advsql.Open with lib/pq and its defaults carries the locks of a request-scoped service (TryDo on 10 ids from 40
// goroutines) on its shared session: no call fails for want of a connection (with a session per lock, the pool of
// 5 held at most 4 locks, and most calls failed with ErrPoolExhausted), and the server shows the Locker within its
// budget.
func TestOpenLibpqManyLocks(t *testing.T) {
	url := pgtest.URL(t)
	ctx := ctxT(t, 60*time.Second)
	app := fmt.Sprintf("advsql-many-%d", time.Now().UnixNano())
	l, err := advsql.Open(ctx, "postgres", url+"&application_name="+app)
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	keys := make([]advlock.Key, 10)
	for i := range keys {
		keys[i] = conformance.Key(t)
	}
	var ran, busy, exhausted, other atomic.Int64
	var wg sync.WaitGroup
	stop := time.Now().Add(2 * time.Second)
	for g := range 40 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := 0; time.Now().Before(stop); i++ {
				err := l.TryDo(ctx, keys[(g+i)%len(keys)], func(context.Context) error {
					time.Sleep(time.Millisecond)
					return nil
				})
				switch {
				case err == nil:
					ran.Add(1)
				case errors.Is(err, advlock.ErrPoolExhausted):
					exhausted.Add(1)
				case errors.Is(err, advlock.ErrNotAcquired):
					busy.Add(1)
				default:
					other.Add(1)
					t.Error(err)
				}
			}
		}()
	}
	wg.Wait()
	var sessions int
	if err := pgtest.Conn(t, url).QueryRow(ctx, "SELECT count(*) FROM pg_stat_activity WHERE application_name = $1", app).Scan(&sessions); err != nil {
		t.Fatal(err)
	}
	t.Logf("%d ran, %d busy, %d ErrPoolExhausted, %d other; %d sessions in pg_stat_activity", ran.Load(), busy.Load(),
		exhausted.Load(), other.Load(), sessions)
	if exhausted.Load() > 0 || ran.Load() == 0 {
		t.Errorf("%d calls failed for want of a connection (%d ran)", exhausted.Load(), ran.Load())
	}
	if sessions > advlock.DefaultOpenConns {
		t.Errorf("%d sessions of the Locker, want at most %d", sessions, advlock.DefaultOpenConns)
	}
}
