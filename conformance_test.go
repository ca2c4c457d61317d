package advlock_test

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/advlock/advlock"
	"github.com/advlock/advlock/internal/session"
	"github.com/advlock/advlock/internal/testkit/conformance"
	"github.com/advlock/advlock/internal/testkit/pgtest"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
)

// harnessConns bounds each conformance Locker's pool: the test packages run at once against one server whose
// max_connections is 100 by default.
const harnessConns = 8

// PgxBackend is the conformance backend for Lockers over pgxpool.
func pgxBackend(url, obsURL string) conformance.Backend {
	return conformance.Backend{
		Name: "pgxpool", URL: url, ObsURL: obsURL, EventDriven: true, Shares: true,
		Open: func(t *testing.T, url string, opts ...advlock.Option) conformance.Harness {
			pool := pgtest.Pool(t, url, func(c *pgxpool.Config) { c.MaxConns = harnessConns })
			return conformance.Harness{
				L:     advlock.New(pool, opts...),
				InUse: func() int { return int(pool.Stat().AcquiredConns()) },
				Idle:  func(t *testing.T) []uint32 { return idlePIDs(t, pool) },
				Exhaust: func(t *testing.T) func() {
					var conns []*pgxpool.Conn
					for pool.Stat().AcquiredConns() < pool.Config().MaxConns {
						c, err := pool.Acquire(context.Background())
						if err != nil {
							for _, c := range conns {
								c.Release() // else the pool's Close, as the test ends, waits for them for ever
							}
							t.Fatal(err)
						}
						conns = append(conns, c)
					}
					var once sync.Once
					return func() {
						once.Do(func() {
							for _, c := range conns {
								c.Release()
							}
						})
					}
				},
			}
		},
	}
}

func idlePIDs(t *testing.T, pool *pgxpool.Pool) []uint32 {
	t.Helper()
	ctx := context.Background()
	var pids []uint32
	for _, c := range pool.AcquireAllIdle(ctx) {
		var pid int32
		if err := c.QueryRow(ctx, "SELECT pg_backend_pid()").Scan(&pid); err != nil {
			if !session.Ended(err) {
				t.Error(err)
			}
			c.Release() // a session ended while idle (a test terminated it) holds nothing; the pool drops it
			continue
		}
		pids = append(pids, uint32(pid))
		c.Release()
	}
	return pids
}

// The suite over pgxpool, directly and through PgBouncer in session pooling mode (where session locks keep every
// guarantee), the two at once: they wait far more than they compute, and each keys its locks apart.
func TestConformance(t *testing.T) {
	url := pgtest.URL(t)
	t.Run("direct", func(t *testing.T) {
		t.Parallel()
		conformance.Run(t, pgxBackend(url, url))
	})
	t.Run("pgbouncer-session", func(t *testing.T) {
		t.Parallel()
		if testing.Short() {
			t.Skip("starts pgbouncer")
		}
		b := pgtest.StartBouncer(t, url, "session")
		pgtest.NoCancelsReached(t, b)
		be := pgxBackend(b.URL, url)
		be.Pooled = true
		be.CancelIterations = 300 // the cancel race's 1000 run on the direct backend
		conformance.Run(t, be)
	})
}

// Leases over pgxpool keep their guarantees directly and through PgBouncer in transaction mode, with the DSN as
// a user writes it.
func TestConformanceLeases(t *testing.T) {
	url := pgtest.URL(t)
	t.Run("direct", func(t *testing.T) { conformance.Leases(t, pgxBackend(url, url)) })
	t.Run("pgbouncer-transaction", func(t *testing.T) {
		if testing.Short() {
			t.Skip("starts pgbouncer")
		}
		conformance.Leases(t, pgxBackend(pgtest.Bouncer(t, url, "transaction"), url))
	})
}

// Through PgBouncer in transaction pooling mode, session locks cannot work: they are detected and refused, never
// reported as held, and never left on a server session. Transaction-scoped locks work.
func TestPgBouncerTransactionMode(t *testing.T) {
	if testing.Short() {
		t.Skip("starts pgbouncer")
	}
	url := pgtest.URL(t)
	// Simple protocol: PgBouncer 1.18 in transaction mode cannot keep prepared statements.
	burl := pgtest.Bouncer(t, url, "transaction") + "&default_query_exec_mode=simple_protocol"
	obs := pgtest.Conn(t, url)
	pool := pgtest.Pool(t, burl, nil)
	l := advlock.New(pool)
	defer l.Close()
	ctx := context.Background()
	for i := range 20 {
		k := conformance.Key(t)
		var err error
		if i%2 == 0 {
			_, err = l.TryLock(ctx, k)
		} else {
			_, err = l.Lock(ctx, k)
		}
		if !errors.Is(err, advlock.ErrTxPooling) || !strings.Contains(err.Error(), "XactLock") {
			t.Fatalf("session lock through transaction pooling: %v, want ErrTxPooling pointing to XactLock", err)
		}
		rows, err := pgtest.Locks(ctx, obs)
		if err != nil {
			t.Fatal(err)
		}
		v, _ := k.Int64()
		for _, r := range rows {
			if r.Int64Key(v) {
				t.Fatalf("a refused lock left %s on the server: %v", k, r)
			}
		}
	}

	// Transaction-scoped locks pass through: two DoTx on one key never overlap, and nothing outlives them.
	k := conformance.Key(t)
	v, _ := k.Int64()
	var inside, overlaps atomic.Int32
	var wg sync.WaitGroup
	for range 4 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for range 10 {
				err := l.DoTx(ctx, k, func(ctx context.Context, tx pgx.Tx) error {
					if inside.Add(1) > 1 {
						overlaps.Add(1)
					}
					time.Sleep(2 * time.Millisecond)
					inside.Add(-1)
					_, err := tx.Exec(ctx, "SELECT 1")
					return err
				})
				if err != nil {
					t.Error(err)
					return
				}
			}
		}()
	}
	wg.Wait()
	if overlaps.Load() != 0 {
		t.Errorf("%d overlapping DoTx runs through transaction pooling", overlaps.Load())
	}
	pgtest.WaitFree(t, obs, v, 5*time.Second)

	tx, err := pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if err := advlock.XactLock(ctx, tx, k); err != nil {
		t.Fatal(err)
	}
	if pids, _ := pgtest.Holders(ctx, obs, v); len(pids) != 1 {
		t.Errorf("xact lock through transaction pooling: holders %v, want 1", pids)
	}
	if err := tx.Rollback(ctx); err != nil {
		t.Fatal(err)
	}
	pgtest.WaitFree(t, obs, v, 5*time.Second)
}

// Behind a pooler, a connection that cannot be proved to pin its server session (no second connection to ask)
// is refused with ErrUnverified, and nothing is locked.
func TestPgBouncerUnverified(t *testing.T) {
	if testing.Short() {
		t.Skip("starts pgbouncer")
	}
	url := pgtest.URL(t)
	obs := pgtest.Conn(t, url)
	pool := pgtest.Pool(t, pgtest.Bouncer(t, url, "session"), func(c *pgxpool.Config) { c.MaxConns = 1 })
	l := advlock.New(pool)
	defer l.Close()
	k := conformance.Key(t)
	_, err := l.TryLock(context.Background(), k)
	if !errors.Is(err, advlock.ErrUnverified) {
		t.Fatalf("TryLock behind a pooler with a one-connection pool: %v, want ErrUnverified", err)
	}
	v, _ := k.Int64()
	if pids, _ := pgtest.Holders(context.Background(), obs, v); len(pids) != 0 {
		t.Errorf("a refused lock is held by %v", pids)
	}
}

// DoTx through a pooler in transaction mode works with the DSN as a user writes it: a Locker from Open uses no
// named prepared statements, which PgBouncer before 1.21 hands to other clients' server sessions (DoTx then failed
// with 42P05, "prepared statement already exists", in 3 to 200 of 200 calls). fn's own statements with arguments
// go through too; no two runs overlap, and nothing outlives them. Over a pool of the user's own that does use them,
// an error that the pooler causes says what to set. (There fn's statements fail, and PostgreSQL ends a
// transaction's locks at its first error, while fn runs on until it returns: the next run may start meanwhile, so
// no overlap is judged there.)
func TestDoTxThroughTransactionPooler(t *testing.T) {
	if testing.Short() {
		t.Skip("starts pgbouncer")
	}
	url := pgtest.URL(t)
	burl := pgtest.Bouncer(t, url, "transaction")
	obs := pgtest.Conn(t, url)
	ctx := timeout(t, 60*time.Second)
	l, err := advlock.Open(ctx, burl)
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	own := advlock.New(pgtest.Pool(t, burl, nil)) // pgx's default: named prepared statements
	defer own.Close()
	for _, tc := range []struct {
		name string
		l    *advlock.Locker
	}{{"Open", l}, {"New with named statements", own}} {
		k := conformance.Key(t)
		v, _ := k.Int64()
		free := []advlock.Key{conformance.Key(t), conformance.Key(t), conformance.Key(t), conformance.Key(t)}
		var overlaps, committed, runs atomic.Int32
		var failed []error
		var mu sync.Mutex
		in := map[*bool]bool{} // the runs of k inside fn now; each marked once another was inside with it
		var wg sync.WaitGroup
		for g := range 8 {
			wg.Add(1)
			go func() {
				defer wg.Done()
				for i := range 25 {
					key := k // half the goroutines take one key in turn, the others keys of their own
					if g%2 == 1 {
						key = free[g/2]
					}
					overlapped := new(bool)
					err := tc.l.DoTx(ctx, key, func(ctx context.Context, tx pgx.Tx) error {
						if key == k {
							mu.Lock()
							for o := range in {
								*o, *overlapped = true, true
							}
							if *overlapped {
								overlaps.Add(1)
							}
							in[overlapped] = true
							mu.Unlock()
							defer func() { mu.Lock(); delete(in, overlapped); mu.Unlock() }()
						}
						var n int64
						if err := tx.QueryRow(ctx, "SELECT $1::int8 + $2::int8", int64(g), int64(i)).Scan(&n); err != nil {
							return err
						}
						_, err := tx.Exec(ctx, "SELECT $1::text", fmt.Sprint(n))
						return err
					})
					if err != nil {
						mu.Lock()
						failed = append(failed, err)
						mu.Unlock()
						continue
					}
					runs.Add(1)
					mu.Lock()
					if *overlapped {
						committed.Add(1) // a run that overlapped another, and committed
					}
					mu.Unlock()
				}
			}()
		}
		wg.Wait()
		t.Logf("%s: %d of 200 DoTx calls ran, %d failed, %d overlaps (%d runs that overlapped committed)", tc.name,
			runs.Load(), len(failed), overlaps.Load(), committed.Load())
		if tc.l == l {
			if overlaps.Load() != 0 {
				t.Errorf("%s: %d overlapping DoTx runs through transaction pooling", tc.name, overlaps.Load())
			}
			for _, err := range failed {
				t.Errorf("%s: DoTx through transaction pooling with the DSN as written: %v", tc.name, err)
			}
		} else {
			for _, err := range failed {
				if c := session.SQLState(err); (c == "42P05" || c == "26000") && !strings.Contains(err.Error(), "default_query_exec_mode=cache_describe") {
					t.Errorf("%s: an error of named statements through the pooler says nothing of what to set: %v", tc.name, err)
				}
			}
		}
		pgtest.WaitFree(t, obs, v, 5*time.Second)
	}
	if _, err := l.TryLock(ctx, conformance.Key(t)); !errors.Is(err, advlock.ErrTxPooling) ||
		!strings.Contains(err.Error(), "Open works with the DSN as written") {
		t.Errorf("a session lock through transaction pooling: %v, want ErrTxPooling saying what works there", err)
	}
}
