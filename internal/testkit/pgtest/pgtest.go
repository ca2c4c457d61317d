// Package pgtest finds or starts the PostgreSQL that tests run against, and reads server truth from pg_locks.
//
// [URL] uses, in order: $ADVLOCK_TEST_DATABASE_URL; in a package whose TestMain calls [MainOwnServer], a private
// cluster of the package's own; the local server on 127.0.0.1:5432 (database test, user postgres) when it answers;
// else a private throwaway cluster started from the installed server binaries and removed by [Cleanup]. Tests that
// restart or reconfigure a server call [StartCluster] for a cluster of their own, never the shared one.
package pgtest

import (
	"context"
	"fmt"
	"hash/fnv"
	neturl "net/url"
	"os"
	"sync"
	"testing"
	"time"

	"github.com/advlock/advlock/internal/pgcluster"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"go.uber.org/goleak"
)

// EnvURL names the variable that points tests at a server.
const EnvURL = "ADVLOCK_TEST_DATABASE_URL"

const localURL = "postgres://postgres@127.0.0.1:5432/test?sslmode=disable"

var (
	urlOnce   sync.Once
	sharedURL string
	sharedErr error
	private   *pgcluster.Cluster
)

// StartCluster starts a private cluster with extra postgresql.conf lines and removes it when the test ends.
func StartCluster(tb testing.TB, settings ...string) *pgcluster.Cluster {
	tb.Helper()
	c, err := pgcluster.Start(settings...)
	if err != nil {
		tb.Fatalf("pgtest: start private cluster: %v", err)
	}
	tb.Cleanup(c.Remove)
	return c
}

// StartFaketimeCluster starts a private cluster whose wall clock the test steps (pgcluster.StartFaketime,
// Cluster.StepClock) and removes it when the test ends. It fails the test where libfaketime is not installed
// (.ci/run installs it).
func StartFaketimeCluster(tb testing.TB, settings ...string) *pgcluster.Cluster {
	tb.Helper()
	c, err := pgcluster.StartFaketime(settings...)
	if err != nil {
		tb.Fatalf("pgtest: start private cluster under libfaketime: %v", err)
	}
	tb.Cleanup(c.Remove)
	return c
}

// Standby starts a hot standby of c and removes it when the test ends.
func Standby(tb testing.TB, c *pgcluster.Cluster) *pgcluster.Cluster {
	tb.Helper()
	s, err := c.Standby()
	if err != nil {
		tb.Fatalf("pgtest: start standby: %v", err)
	}
	tb.Cleanup(s.Remove)
	return s
}

// URL returns the database URL for tests, failing the test if none can be had.
func URL(tb testing.TB) string {
	tb.Helper()
	urlOnce.Do(func() {
		if u := os.Getenv(EnvURL); u != "" {
			sharedURL = u
			return
		}
		if answers(localURL) {
			sharedURL = localURL
			return
		}
		private, sharedErr = pgcluster.Start()
		if sharedErr == nil {
			sharedURL = private.URL
		}
	})
	if sharedErr != nil {
		tb.Fatalf("pgtest: no PostgreSQL: set %s, run one on 127.0.0.1:5432, or install the server binaries: %v", EnvURL, sharedErr)
	}
	return sharedURL
}

// Cleanup stops the private cluster URL may have started. Call it from TestMain after m.Run.
func Cleanup() {
	if private != nil {
		private.Remove()
	}
}

func answers(url string) bool {
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Second)
	defer cancel()
	c, err := pgx.Connect(ctx, url)
	if err != nil {
		return false
	}
	defer c.Close(ctx)
	return c.Ping(ctx) == nil
}

// Pool returns a new pool on url, closed when the test ends. Settings in cfg (may be nil) are applied first.
func Pool(tb testing.TB, url string, cfg func(*pgxpool.Config)) *pgxpool.Pool {
	tb.Helper()
	pc, err := pgxpool.ParseConfig(url)
	if err != nil {
		tb.Fatal(err)
	}
	pc.MaxConns = 32
	DropCancels(&pc.ConnConfig.Config)
	if cfg != nil {
		cfg(pc)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	p, err := pgxpool.NewWithConfig(ctx, pc)
	if err != nil {
		tb.Fatal(err)
	}
	tb.Cleanup(p.Close)
	return p
}

// Conn returns a plain connection on url (for observing pg_locks or for raw-pgx baselines), closed when the test
// ends.
func Conn(tb testing.TB, url string) *pgx.Conn {
	tb.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	cfg, err := pgx.ParseConfig(url)
	if err != nil {
		tb.Fatal(err)
	}
	DropCancels(&cfg.Config)
	c, err := pgx.ConnectConfig(ctx, cfg)
	if err != nil {
		tb.Fatal(err)
	}
	tb.Cleanup(func() { c.Close(context.Background()) })
	return c
}

// Row is one advisory-lock row of pg_locks.
type Row struct {
	PID      uint32
	ClassID  uint32
	ObjID    uint32
	ObjSubID int16
	Mode     string // ExclusiveLock or ShareLock
	Granted  bool
}

// Locks returns every advisory lock in the current database, granted or waited for.
func Locks(ctx context.Context, q interface {
	Query(context.Context, string, ...any) (pgx.Rows, error)
}) ([]Row, error) {
	rows, err := q.Query(ctx, `SELECT pid, classid::text::int8, objid::text::int8, objsubid, mode, granted
		FROM pg_locks WHERE locktype = 'advisory' AND database = (SELECT oid FROM pg_database WHERE datname = current_database())`)
	if err != nil {
		return nil, err
	}
	return pgx.CollectRows(rows, func(r pgx.CollectableRow) (Row, error) {
		var x Row
		var pid int32
		var cls, obj int64
		err := r.Scan(&pid, &cls, &obj, &x.ObjSubID, &x.Mode, &x.Granted)
		x.PID, x.ClassID, x.ObjID = uint32(pid), uint32(cls), uint32(obj)
		return x, err
	})
}

// Int64Key reports whether r is the int8 key v.
func (r Row) Int64Key(v int64) bool {
	return r.ObjSubID == 1 && r.ClassID == uint32(uint64(v)>>32) && r.ObjID == uint32(v)
}

// Holders returns the pids granted int8 key v.
func Holders(ctx context.Context, c *pgx.Conn, v int64) ([]uint32, error) {
	rows, err := Locks(ctx, c)
	if err != nil {
		return nil, err
	}
	var pids []uint32
	for _, r := range rows {
		if r.Granted && r.Int64Key(v) {
			pids = append(pids, r.PID)
		}
	}
	return pids, nil
}

// WaitFree polls until no session holds or waits for int8 key v, and fails the test after timeout. A destroyed
// session's backend exits a moment after its socket closes; this is the wait for that.
func WaitFree(tb testing.TB, c *pgx.Conn, v int64, timeout time.Duration) {
	tb.Helper()
	deadline := time.Now().Add(timeout)
	for {
		rows, err := Locks(context.Background(), c)
		if err != nil {
			tb.Fatal(err)
		}
		var left []Row
		for _, r := range rows {
			if r.Int64Key(v) {
				left = append(left, r)
			}
		}
		if len(left) == 0 {
			return
		}
		if time.Now().After(deadline) {
			tb.Fatalf("key %d still in pg_locks after %v: %+v", v, timeout, left)
		}
		time.Sleep(2 * time.Millisecond)
	}
}

// NoIdleLocks fails the test if any idle connection of pool holds an advisory lock: it takes every idle
// connection, reads their pids, and checks pg_locks through the separate connection obs.
func NoIdleLocks(tb testing.TB, pool *pgxpool.Pool, obs *pgx.Conn) {
	tb.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	idle := pool.AcquireAllIdle(ctx)
	defer func() {
		for _, c := range idle {
			c.Release()
		}
	}()
	pids := map[uint32]bool{}
	for _, c := range idle {
		pids[c.Conn().PgConn().PID()] = true
	}
	rows, err := Locks(ctx, obs)
	if err != nil {
		tb.Fatal(err)
	}
	for _, r := range rows {
		if pids[r.PID] {
			tb.Errorf("idle pooled connection pid %d holds advisory lock %+v", r.PID, r)
		}
	}
}

// Terminate ends the backend pid with pg_terminate_backend through c.
func Terminate(tb testing.TB, c *pgx.Conn, pid uint32) {
	tb.Helper()
	var ok bool
	if err := c.QueryRow(context.Background(), "SELECT pg_terminate_backend($1)", int32(pid)).Scan(&ok); err != nil || !ok {
		tb.Fatalf("pg_terminate_backend(%d) = %v, %v", pid, ok, err)
	}
}

// String renders a row for messages.
func (r Row) String() string {
	return fmt.Sprintf("pid=%d key=(%d,%d,%d) %s granted=%v", r.PID, r.ClassID, r.ObjID, r.ObjSubID, r.Mode, r.Granted)
}

// Main runs a package's tests, stops the private cluster URL may have started, and fails the run if goroutines
// are left behind (goleak). Call it as os.Exit(pgtest.Main(m)) from TestMain.
func Main(m *testing.M) int {
	code := m.Run()
	Cleanup()
	if code == 0 {
		if err := goleak.Find(); err != nil {
			fmt.Fprintln(os.Stderr, "goleak:", err)
			code = 1
		}
	}
	return code
}

// MainOwnServer is Main for a package whose tests take many connections at once: beside the other packages' tests
// (go test runs two packages at a time on 2 cores) they would take a shared server past its max_connections
// (100 by default), and a connection refused there (53300) fails whichever test asked for it. Unless $ADVLOCK_TEST_DATABASE_URL
// names a server, URL is then a private cluster of the package's own, started before its tests and removed after,
// with a server's default settings (where StartCluster's clusters run with fsync and synchronous_commit off).
func MainOwnServer(m *testing.M) int {
	if os.Getenv(EnvURL) == "" {
		urlOnce.Do(func() {
			private, sharedErr = pgcluster.Start("fsync = on", "synchronous_commit = on", "full_page_writes = on",
				"max_connections = 100", "shared_buffers = 128MB")
			if sharedErr == nil {
				sharedURL = private.URL
			}
		})
	}
	return Main(m)
}

// WaitClosed waits for ch to close, fails the test naming what after within, and returns how long it took.
func WaitClosed(tb testing.TB, ch <-chan struct{}, within time.Duration, what string) time.Duration {
	tb.Helper()
	start := time.Now()
	select {
	case <-ch:
		return time.Since(start)
	case <-time.After(within):
		tb.Fatalf("%s: not within %v", what, within)
		return 0
	}
}

// FreshDB creates a database that has never seen advlock (no fencing sequence, nothing else), on the server url
// points at, and drops it when the test ends. It returns the new database's URL.
func FreshDB(tb testing.TB, url string) string {
	tb.Helper()
	u, err := neturl.Parse(url)
	if err != nil {
		tb.Fatal(err)
	}
	name := fmt.Sprintf("advlock_fresh_%d", time.Now().UnixNano())
	admin := Conn(tb, url)
	if _, err := admin.Exec(context.Background(), "CREATE DATABASE "+name); err != nil {
		tb.Fatal(err)
	}
	tb.Cleanup(func() {
		// DROP DATABASE waits for an immediate checkpoint, which on a machine busy writing (every test package at
		// once, the chaos campaigns' servers) took more than 30 s once.
		ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
		defer cancel()
		start := time.Now()
		if _, err := admin.Exec(ctx, "DROP DATABASE IF EXISTS "+name+" WITH (FORCE)"); err != nil {
			tb.Errorf("drop %s: %v (after %v)", name, err, time.Since(start).Round(time.Millisecond))
		} else if took := time.Since(start); took > 10*time.Second {
			tb.Logf("drop %s took %v", name, took.Round(time.Millisecond))
		}
	})
	u.Path = "/" + name
	return u.String()
}

// MigrationDB creates a fresh database (FreshDB: no other test's transaction there for a concurrent index build to
// wait for) with a table m (id, v) of 1,000 rows, for MigrateBeside, and returns its URL.
func MigrationDB(tb testing.TB, url string) string {
	tb.Helper()
	url = FreshDB(tb, url)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	if _, err := Conn(tb, url).Exec(ctx, "CREATE TABLE m (id int PRIMARY KEY, v int); "+
		"INSERT INTO m SELECT g, g FROM generate_series(1, 1000) g"); err != nil {
		tb.Fatal(err)
	}
	return url
}

// MigrateBeside is the migration of a process that holds int8 key v in a transaction, run on a connection of its
// own to the MigrationDB at url: it checks that the transaction holding v has no snapshot (backend_xmin), then builds
// an index on m concurrently and drops it. The build waits for every transaction with an older snapshot; it is
// bounded (15 s), so that a lock's transaction that pins the horizon fails the test instead of hanging it.
func MigrateBeside(tb testing.TB, url string, v int64) error {
	tb.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 15*time.Second)
	defer cancel()
	app := Conn(tb, url) // a statement cut by its timeout closes the connection
	var xmin *string
	err := app.QueryRow(ctx, `SELECT a.backend_xmin::text FROM pg_locks l JOIN pg_stat_activity a USING (pid)
		WHERE l.locktype = 'advisory' AND l.granted AND l.classid = $1::int8::oid AND l.objid = $2::int8::oid
		AND l.objsubid = 1`, int64(uint64(v)>>32), int64(uint32(v))).Scan(&xmin)
	if err != nil {
		return fmt.Errorf("the backend holding the key: %w", err)
	}
	if xmin != nil {
		tb.Errorf("the transaction holding the lock has a snapshot (backend_xmin %s)", *xmin)
	}
	start := time.Now()
	if _, err := app.Exec(ctx, "CREATE INDEX CONCURRENTLY m_v ON m (v)"); err != nil {
		return fmt.Errorf("CREATE INDEX CONCURRENTLY beside the transaction lock: %w after %v", err, time.Since(start))
	}
	_, err = app.Exec(ctx, "DROP INDEX m_v")
	return err
}

// Alone makes the rest of the test the only one of its kind on the server at url (name says which kind), across
// the test binaries that run at once: it holds an advisory lock of its own kind's number on a connection of its
// own until the test ends, waiting for it first. For tests that take many connections at once, which beside each
// other would take the server past max_connections.
func Alone(tb testing.TB, url, name string) {
	tb.Helper()
	c := Conn(tb, url)
	h := fnv.New64a()
	h.Write([]byte("advlock tests alone: " + name))
	if _, err := c.Exec(context.Background(), "SELECT pg_advisory_lock($1)", int64(h.Sum64())); err != nil {
		tb.Fatalf("pgtest: alone (%s): %v", name, err)
	}
}
