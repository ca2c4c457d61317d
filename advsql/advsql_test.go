package advsql_test

import (
	"context"
	"database/sql"
	"errors"
	"os"
	"sync"
	"testing"
	"time"

	"github.com/advlock/advlock"
	"github.com/advlock/advlock/advsql"
	"github.com/advlock/advlock/internal/session"
	"github.com/advlock/advlock/internal/testkit/conformance"
	"github.com/advlock/advlock/internal/testkit/pgtest"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/stdlib"
	_ "github.com/lib/pq"
)

func TestMain(m *testing.M) { os.Exit(pgtest.MainOwnServer(m)) } // beside the root package's tests, a server of its own

// openDB opens a *sql.DB with driver ("pgx" or "postgres") and closes it when the test ends. pgx's connections
// send no cancel request to a PgBouncer that one can crash (see pgtest.DropCancels; lib/pq's suite runs with
// NoCancel there).
func openDB(t *testing.T, driver, url string) *sql.DB {
	t.Helper()
	var db *sql.DB
	if driver == "pgx" {
		cfg, err := pgx.ParseConfig(url)
		if err != nil {
			t.Fatal(err)
		}
		pgtest.DropCancels(&cfg.Config)
		db = stdlib.OpenDB(*cfg)
	} else {
		var err error
		if db, err = sql.Open(driver, url); err != nil {
			t.Fatal(err)
		}
	}
	t.Cleanup(func() { db.Close() })
	return db
}

// harnessConns bounds each conformance Locker's pool: the package's tests run at once against a server whose
// max_connections is 100, as a server's is by default (its own: pgtest.MainOwnServer).
const harnessConns = 8

// Backend is the conformance backend for Lockers over database/sql with driver: both share sessions (lib/pq's taken
// over, see libpqConn); only pgx's driver reads the idle socket of a session of its own (EventDriven).
func Backend(driver, url, obsURL string) conformance.Backend {
	return conformance.Backend{
		Name: "database/sql+" + driver, URL: url, ObsURL: obsURL, EventDriven: driver == "pgx", Shares: true,
		Open: func(t *testing.T, url string, opts ...advlock.Option) conformance.Harness {
			db := openDB(t, driver, url)
			db.SetMaxOpenConns(harnessConns)
			return conformance.Harness{
				L:     advsql.New(db, opts...),
				InUse: func() int { return db.Stats().InUse },
				Idle:  func(t *testing.T) []uint32 { return idlePIDs(t, db) },
				Exhaust: func(t *testing.T) func() {
					db.SetMaxOpenConns(1)
					c, err := db.Conn(context.Background())
					if err != nil {
						t.Fatal(err)
					}
					var once sync.Once
					return func() {
						once.Do(func() {
							c.Close()
							db.SetMaxOpenConns(harnessConns)
						})
					}
				},
			}
		},
	}
}

// idlePIDs takes as many connections as are idle (database/sql hands out idle ones first), reads their server
// pids, and puts them back.
func idlePIDs(t *testing.T, db *sql.DB) []uint32 {
	t.Helper()
	ctx := context.Background()
	n := db.Stats().Idle
	var conns []*sql.Conn
	var pids []uint32
	for range n {
		c, err := db.Conn(ctx)
		if err != nil {
			t.Fatal(err)
		}
		conns = append(conns, c)
		var pid int64
		if err := c.QueryRowContext(ctx, "SELECT pg_backend_pid()").Scan(&pid); err != nil {
			if !session.Ended(err) {
				t.Fatal(err)
			}
			continue // a session ended while idle (a test terminated it) holds nothing
		}
		pids = append(pids, uint32(pid))
	}
	for _, c := range conns {
		c.Close()
	}
	return pids
}

// The two drivers' suites run at once: they wait far more than they compute, and each keys its locks apart.
func TestConformance(t *testing.T) {
	url := pgtest.URL(t)
	for _, driver := range []string{"pgx", "postgres"} {
		t.Run(driver, func(t *testing.T) {
			t.Parallel()
			be := Backend(driver, url, url)
			if driver == "pgx" {
				// database/sql over pgx's stdlib cancels as pgx does (its 1000 iterations run in the root package);
				// lib/pq's own cancel keeps the full count.
				be.CancelIterations = 400
			}
			conformance.Run(t, be)
		})
	}
}

// Leases over database/sql, with either driver, directly and through PgBouncer in transaction mode with the DSN as
// a user writes it.
func TestConformanceLeases(t *testing.T) {
	url := pgtest.URL(t)
	burl := ""
	for _, via := range []string{"direct", "pgbouncer-transaction"} {
		t.Run(via, func(t *testing.T) {
			u := url
			if via != "direct" {
				if testing.Short() {
					t.Skip("starts pgbouncer")
				}
				if burl == "" {
					burl = pgtest.Bouncer(t, url, "transaction")
				}
				u = burl
			}
			for _, driver := range []string{"pgx", "postgres"} {
				t.Run(driver, func(t *testing.T) { conformance.Leases(t, Backend(driver, u, url)) })
			}
		})
	}
}

func TestNilDB(t *testing.T) {
	if _, err := advsql.New(nil).TryLock(context.Background(), advlock.Int64Key(1)); !errors.Is(err, advlock.ErrNoPool) {
		t.Errorf("New(nil).TryLock = %v, want ErrNoPool", err)
	}
	if err := advsql.DoTx(context.Background(), nil, advlock.Int64Key(1), nil); !errors.Is(err, advlock.ErrNoPool) {
		t.Errorf("DoTx(nil db) = %v, want ErrNoPool", err)
	}
}

// Transaction-scoped locks over *sql.Tx: released by COMMIT, by ROLLBACK, and by ROLLBACK TO SAVEPOINT.
func TestXact(t *testing.T) {
	url := pgtest.URL(t)
	obs := pgtest.Conn(t, url)
	for _, driver := range []string{"pgx", "postgres"} {
		t.Run(driver, func(t *testing.T) {
			db := openDB(t, driver, url)
			ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
			defer cancel()
			held := func(k advlock.Key) int {
				v, _ := k.Int64()
				pids, err := pgtest.Holders(ctx, obs, v)
				if err != nil {
					t.Fatal(err)
				}
				return len(pids)
			}
			for _, end := range []string{"commit", "rollback"} {
				k := conformance.Key(t)
				tx, err := db.BeginTx(ctx, nil)
				if err != nil {
					t.Fatal(err)
				}
				if err := advsql.XactLock(ctx, tx, k); err != nil {
					t.Fatal(err)
				}
				if held(k) != 1 {
					t.Fatalf("%s: not held inside the transaction", end)
				}
				other, err := db.BeginTx(ctx, nil)
				if err != nil {
					t.Fatal(err)
				}
				if err := advsql.TryXactLock(ctx, other, k); !errors.Is(err, advlock.ErrNotAcquired) {
					t.Errorf("TryXactLock from another transaction: %v, want ErrNotAcquired", err)
				}
				if err := advsql.TryXactRLock(ctx, other, k); !errors.Is(err, advlock.ErrNotAcquired) {
					t.Errorf("TryXactRLock from another transaction: %v, want ErrNotAcquired", err)
				}
				_ = other.Rollback()
				if end == "commit" {
					err = tx.Commit()
				} else {
					err = tx.Rollback()
				}
				if err != nil {
					t.Fatal(err)
				}
				if held(k) != 0 {
					t.Errorf("still held after %s", end)
				}
			}

			k := conformance.Key(t)
			tx, err := db.BeginTx(ctx, nil)
			if err != nil {
				t.Fatal(err)
			}
			defer tx.Rollback()
			if _, err := tx.ExecContext(ctx, "SAVEPOINT s"); err != nil {
				t.Fatal(err)
			}
			if err := advsql.XactRLock(ctx, tx, k); err != nil {
				t.Fatal(err)
			}
			if held(k) != 1 {
				t.Fatal("shared xact lock not held after the savepoint")
			}
			if _, err := tx.ExecContext(ctx, "ROLLBACK TO SAVEPOINT s"); err != nil {
				t.Fatal(err)
			}
			if held(k) != 0 {
				t.Error("lock taken after a SAVEPOINT survived ROLLBACK TO SAVEPOINT")
			}
		})
	}
}

func TestDoTx(t *testing.T) {
	url := pgtest.URL(t)
	obs := pgtest.Conn(t, url)
	db := openDB(t, "postgres", url)
	ctx := context.Background()
	k := conformance.Key(t)
	v, _ := k.Int64()
	err := advsql.DoTx(ctx, db, k, func(ctx context.Context, tx *sql.Tx) error {
		if pids, _ := pgtest.Holders(ctx, obs, v); len(pids) != 1 {
			t.Errorf("inside DoTx, holders %v", pids)
		}
		_, err := tx.ExecContext(ctx, "SELECT 1")
		return err
	})
	if err != nil {
		t.Fatal(err)
	}
	boom := errors.New("boom")
	if err := advsql.DoTx(ctx, db, k, func(context.Context, *sql.Tx) error { return boom }); !errors.Is(err, boom) {
		t.Errorf("DoTx = %v, want fn's error", err)
	}
	func() {
		defer func() {
			if r := recover(); r != "panic in fn" {
				t.Errorf("recovered %v", r)
			}
		}()
		_ = advsql.DoTx(ctx, db, k, func(context.Context, *sql.Tx) error { panic("panic in fn") })
	}()
	pgtest.WaitFree(t, obs, v, 5*time.Second)
}

func TestPgBouncer(t *testing.T) {
	if testing.Short() {
		t.Skip("starts pgbouncer")
	}
	url := pgtest.URL(t)
	t.Run("session", func(t *testing.T) {
		b := pgtest.StartBouncer(t, url, "session")
		pgtest.NoCancelsReached(t, b)
		crashes, err := pgtest.BouncerCrashesOnCancel()
		if err != nil {
			t.Fatal(err)
		}
		burl := b.URL
		for _, driver := range []string{"pgx", "postgres"} {
			t.Run(driver, func(t *testing.T) {
				t.Parallel() // as in TestConformance
				be := Backend(driver, burl, url)
				be.Pooled = true
				be.CancelIterations = 300 // the full count runs on the direct backends
				be.NoCancel = driver == "postgres" && crashes
				conformance.Run(t, be)
			})
		}
	})
	t.Run("transaction", func(t *testing.T) {
		burl := pgtest.Bouncer(t, url, "transaction")
		obs := pgtest.Conn(t, url)
		for _, driver := range []string{"pgx", "postgres"} {
			t.Run(driver, func(t *testing.T) {
				durl := burl
				if driver == "pgx" { // PgBouncer 1.18 in transaction mode cannot keep pgx's prepared statements
					durl += "&default_query_exec_mode=simple_protocol"
				}
				db := openDB(t, driver, durl)
				l := advsql.New(db)
				defer l.Close()
				ctx := context.Background()
				for range 10 {
					k := conformance.Key(t)
					_, err := l.TryLock(ctx, k)
					if !errors.Is(err, advlock.ErrTxPooling) {
						t.Fatalf("session lock through transaction pooling: %v, want ErrTxPooling", err)
					}
					v, _ := k.Int64()
					if pids, _ := pgtest.Holders(ctx, obs, v); len(pids) != 0 {
						t.Fatalf("a refused lock left %s held on the server by %v", k, pids)
					}
				}
				// Lead ends at once: a pooler in transaction mode is for an operator to fix, not a passing failure.
				if err := l.Lead(ctx, conformance.Key(t), func(context.Context) error { return nil }); !errors.Is(err, advlock.ErrTxPooling) {
					t.Errorf("Lead through transaction pooling: %v, want ErrTxPooling", err)
				}
				k := conformance.Key(t)
				v, _ := k.Int64()
				err := advsql.DoTx(ctx, db, k, func(ctx context.Context, tx *sql.Tx) error {
					if pids, _ := pgtest.Holders(ctx, obs, v); len(pids) != 1 {
						t.Errorf("inside DoTx through transaction pooling: holders %v", pids)
					}
					return nil
				})
				if err != nil {
					t.Fatal(err)
				}
				pgtest.WaitFree(t, obs, v, 5*time.Second)
			})
		}
	})
}

// DoTx leaves its transaction without a snapshot once the lock is granted, with either driver: the holder's own
// CREATE INDEX CONCURRENTLY, on another connection inside fn, finishes (see the root package's
// TestXactLockHoldsNoSnapshot).
func TestDoTxHoldsNoSnapshot(t *testing.T) {
	url := pgtest.MigrationDB(t, pgtest.URL(t))
	for _, driver := range []string{"pgx", "postgres"} {
		t.Run(driver, func(t *testing.T) {
			db := openDB(t, driver, url)
			k := conformance.Key(t)
			v, _ := k.Int64()
			err := advsql.DoTx(context.Background(), db, k, func(ctx context.Context, tx *sql.Tx) error {
				return pgtest.MigrateBeside(t, url, v)
			})
			if err != nil {
				t.Fatal(err)
			}
		})
	}
}
