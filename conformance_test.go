package advlock_test

import (
	"context"
	"errors"
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

func TestConformance(t *testing.T) {
	url := pgtest.URL(t)
	conformance.Run(t, pgxBackend(url, url))
}

// Through PgBouncer in session pooling mode, session locks keep every guarantee.
func TestConformancePgBouncerSession(t *testing.T) {
	if testing.Short() {
		t.Skip("starts pgbouncer")
	}
	url := pgtest.URL(t)
	be := pgxBackend(pgtest.Bouncer(t, url, "session"), url)
	be.Pooled = true
	be.CancelIterations = 300 // the cancel race's 1000 run on the direct backend; PgBouncer relays the same cancel
	conformance.Run(t, be)
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
