package advsql_test

import (
	"context"
	"database/sql"
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

// A semaphore's Acquire inside Do is not held to the Locker's share of a pool of 4 (one session of its own), which Do
// itself took (its lock came after a wait in the server): it takes the slot once another goroutine frees it. Held
// to the share, it waited for the session Do holds, for ever.
func TestShareSemaphoreInsideDo(t *testing.T) {
	url := pgtest.URL(t)
	for _, driver := range []string{"postgres", "pgx"} {
		t.Run(driver, func(t *testing.T) {
			ctx := ctxT(t, 30*time.Second)
			db := openDB(t, driver, url)
			db.SetMaxOpenConns(4)
			l := advsql.New(db)
			defer l.Close()
			other := advsql.New(openDB(t, "pgx", url))
			defer other.Close()
			k1 := conformance.Key(t)
			sem := l.Semaphore(fmt.Sprintf("share-sem-%d", time.Now().UnixNano()), 1)
			// G2 holds the semaphore's one slot for 300 ms.
			slot, err := sem.TryAcquire(ctx)
			if err != nil {
				t.Fatal(err)
			}
			time.AfterFunc(300*time.Millisecond, func() { _ = slot.Unlock(context.Background()) })
			// K1 held elsewhere for 100 ms: G1 waits in the server for it.
			olk, err := other.TryLock(ctx, k1)
			if err != nil {
				t.Fatal(err)
			}
			time.AfterFunc(100*time.Millisecond, func() { _ = olk.Unlock(context.Background()) })
			start := time.Now()
			err = l.Do(ctx, k1, func(ctx context.Context) error {
				st := l.Stats()
				t.Logf("holding K1: OwnSessions=%d MaxOwnSessions=%d SharedSessions=%d", st.OwnSessions, st.MaxOwnSessions, st.SharedSessions)
				actx, cancel := context.WithTimeout(ctx, 5*time.Second)
				defer cancel()
				s, err := sem.Acquire(actx)
				if err != nil {
					return fmt.Errorf("Acquire inside Do after %v (slot freed at 300 ms): %w", time.Since(start).Round(time.Millisecond), err)
				}
				return s.Unlock(ctx)
			})
			t.Logf("Do: %v after %v; Stats %+v", err, time.Since(start).Round(time.Millisecond), l.Stats())
			if err != nil {
				t.Error(err)
			}
		})
	}
}

// A semaphore's Acquire whose slot another goroutine of the Locker holds (it passes the slot's gate) is not held to
// the share of a pool of 4 that a leader's lease of its one session of its own takes: it gets the slot once freed.
func TestShareSemaphoreBehindLeader(t *testing.T) {
	url := pgtest.URL(t)
	for _, driver := range []string{"postgres", "pgx"} {
		t.Run(driver, func(t *testing.T) {
			ctx := ctxT(t, 30*time.Second)
			db := openDB(t, driver, url)
			db.SetMaxOpenConns(4)
			l := advsql.New(db)
			defer l.Close()
			other := advsql.New(openDB(t, "pgx", url))
			defer other.Close()
			kl := conformance.Key(t)
			olk, err := other.TryLock(ctx, kl)
			if err != nil {
				t.Fatal(err)
			}
			time.AfterFunc(100*time.Millisecond, func() { _ = olk.Unlock(context.Background()) })
			leading := make(chan struct{})
			lctx, stopLead := context.WithCancel(ctx)
			var wg sync.WaitGroup
			wg.Add(1)
			go func() {
				defer wg.Done()
				_ = l.Lead(lctx, kl, func(ctx context.Context) error {
					close(leading)
					<-ctx.Done()
					return nil
				})
			}()
			defer func() { stopLead(); wg.Wait() }()
			select {
			case <-leading:
			case <-time.After(10 * time.Second):
				t.Fatal("not leading")
			}
			sem := l.Semaphore(fmt.Sprintf("share-sem2-%d", time.Now().UnixNano()), 1)
			slot, err := sem.TryAcquire(ctx)
			if err != nil {
				t.Fatal(err)
			}
			time.AfterFunc(300*time.Millisecond, func() { _ = slot.Unlock(context.Background()) })
			start := time.Now()
			actx, cancel := context.WithTimeout(ctx, 5*time.Second)
			defer cancel()
			s, err := sem.Acquire(actx)
			t.Logf("Acquire: %v after %v (slot freed at 300 ms); Stats %+v", err, time.Since(start).Round(time.Millisecond), l.Stats())
			if err != nil {
				t.Error(err)
				return
			}
			_ = s.Unlock(ctx)
		})
	}
}

// Over pools of 2 and 3, four goroutines Do a key first held elsewhere and query the pool inside fn: every query
// finds a connection (over a pool of 2 the Locker takes no session of its own: waits take the key on the shared
// session once it is free).
func TestShareSmallPools(t *testing.T) {
	url := pgtest.URL(t)
	for _, driver := range []string{"postgres", "pgx"} {
		for _, size := range []int{2, 3} {
			t.Run(fmt.Sprintf("%s/pool=%d", driver, size), func(t *testing.T) {
				ctx := ctxT(t, 40*time.Second)
				db := openDB(t, driver, url)
				db.SetMaxOpenConns(size)
				l := advsql.New(db)
				defer l.Close()
				other := advsql.New(openDB(t, "pgx", url))
				defer other.Close()
				k := conformance.Key(t)
				lk, err := other.TryLock(ctx, k)
				if err != nil {
					t.Fatal(err)
				}
				time.AfterFunc(300*time.Millisecond, func() { _ = lk.Unlock(context.Background()) })
				var wg sync.WaitGroup
				var mu sync.Mutex
				var errs []string
				start := time.Now()
				for range 4 {
					wg.Add(1)
					go func() {
						defer wg.Done()
						for range 5 {
							err := l.Do(ctx, k, func(ctx context.Context) error {
								qctx, cancel := context.WithTimeout(ctx, 3*time.Second)
								defer cancel()
								var one int
								return db.QueryRowContext(qctx, "SELECT 1").Scan(&one)
							})
							if err != nil {
								mu.Lock()
								errs = append(errs, err.Error())
								mu.Unlock()
							}
						}
					}()
				}
				wg.Wait()
				t.Logf("20 Do calls in %v, %d failed; Stats %+v", time.Since(start).Round(time.Millisecond), len(errs), l.Stats())
				for i, e := range errs {
					if i < 2 {
						t.Error(e)
					}
				}
			})
		}
	}
}

// floodNotify makes n of db's pooled connections LISTEN, and floods them with notifications until the test ends: a
// lib/pq connection then often has a notification in its read buffer, unread, as it is taken over.
func floodNotify(t *testing.T, ctx context.Context, db *sql.DB, n int, url string) {
	t.Helper()
	var conns []*sql.Conn
	for range n {
		c, err := db.Conn(ctx)
		if err != nil {
			t.Fatal(err)
		}
		if _, err := c.ExecContext(ctx, "LISTEN share_flood"); err != nil {
			t.Fatal(err)
		}
		conns = append(conns, c)
	}
	db.SetMaxIdleConns(n)
	for _, c := range conns {
		c.Close()
	}
	fctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	fc := pgtest.Conn(t, url)
	go func() {
		defer close(done)
		for fctx.Err() == nil {
			_, _ = fc.Exec(fctx, "SELECT pg_notify('share_flood', g::text) FROM generate_series(1, 200) g")
		}
	}()
	t.Cleanup(func() { cancel(); <-done })
}

// A lib/pq connection whose read buffer holds a message it has not read (a notification that came after its last
// answer) is still taken over for a shared session, the message read first: 100 Lockers over a pool whose
// connections are flooded with notifications each hold 6 locks at once on a shared session, and no TryLock fails.
// (Refused, one such connection turned shared sessions off for the Locker's life, and its TryLocks failed.)
func TestShareTakeoverWithUnreadInput(t *testing.T) {
	url := pgtest.URL(t)
	ctx := ctxT(t, 60*time.Second)
	db := openDB(t, "postgres", url)
	db.SetMaxOpenConns(10)
	floodNotify(t, ctx, db, 10, url)
	for n := range 100 {
		l := advsql.New(db)
		var held []*advlock.Lock
		for range 6 {
			lk, err := l.TryLock(ctx, conformance.Key(t))
			if err != nil {
				t.Errorf("Locker %d: TryLock of a free key: %v", n, err)
				continue
			}
			held = append(held, lk)
		}
		if st := l.Stats(); st.SharedSessions == 0 || st.HeldShared != len(held) {
			t.Errorf("Locker %d: %d of %d locks on %d shared sessions", n, st.HeldShared, len(held), st.SharedSessions)
		}
		for _, lk := range held {
			_ = lk.Unlock(ctx)
		}
		l.Close()
	}
}
