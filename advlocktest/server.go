package advlocktest

import (
	"context"
	"fmt"
	neturl "net/url"
	"os"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/advlock/advlock"
	"github.com/advlock/advlock/internal/pgcluster"
	"github.com/jackc/pgx/v5"
)

// EnvURL is the variable [DSN] reads by default: a PostgreSQL connection string for tests.
const EnvURL = "ADVLOCK_TEST_DATABASE_URL"

// An Option changes what [DSN] and [StartServer] do.
type Option func(*options)

type options struct {
	env     string
	require bool
	fresh   bool
}

// Env makes [DSN] read the variable name instead of ADVLOCK_TEST_DATABASE_URL.
func Env(name string) Option { return func(o *options) { o.env = name } }

// Require makes [DSN] and [StartServer] fail the test, instead of skipping it, when no server can be had.
func Require() Option { return func(o *options) { o.require = true } }

// FreshDatabase makes [DSN] create a database for the test (one that has never seen advlock: no lease table, no
// fencing sequence) and drop it when the test ends.
func FreshDatabase() Option { return func(o *options) { o.fresh = true } }

func collect(opts []Option) options {
	o := options{env: EnvURL}
	for _, f := range opts {
		f(&o)
	}
	return o
}

// The server of the test binary, per variable read: the variable's value, or one throwaway cluster for all.
var (
	serversMu sync.Mutex
	servers   = map[string]string{} // variable -> admin DSN
	fresh     = map[string]bool{}   // the admin DSNs of the fresh databases of running tests
	throwaway *pgcluster.Cluster
	noServer  error // why no throwaway cluster could be started (tried once)
	seq       atomic.Int64
)

// server returns the admin DSN of the test binary's server, starting a throwaway cluster when the variable is unset.
func server(o options) (string, error) {
	serversMu.Lock()
	defer serversMu.Unlock()
	if dsn, ok := servers[o.env]; ok {
		return dsn, nil
	}
	if dsn := os.Getenv(o.env); dsn != "" {
		if _, err := pgx.ParseConfig(dsn); err != nil {
			return "", fmt.Errorf("$%s does not parse as a PostgreSQL connection string", o.env) // never the value
		}
		servers[o.env] = dsn
		return dsn, nil
	}
	if throwaway == nil && noServer == nil {
		throwaway, noServer = pgcluster.StartRemovedWhenGone(os.Getpid(), "max_connections = 200")
	}
	if noServer != nil {
		return "", fmt.Errorf("$%s is not set and no throwaway PostgreSQL could be started from the installed server "+
			"binaries (initdb): %v", o.env, noServer)
	}
	servers[o.env] = throwaway.URL
	return throwaway.URL, nil
}

// noneFor skips or fails t when there is no server.
func noneFor(t TB, o options, err error) {
	t.Helper()
	if o.require {
		t.Fatalf("advlocktest: no PostgreSQL for this test: %v", err)
	}
	t.Skipf("advlocktest: no PostgreSQL for this test, skipped: %v", err)
}

// DSN returns a connection string for the test's locks: ADVLOCK_TEST_DATABASE_URL (or the variable named with
// [Env]; read once per test binary), else a throwaway PostgreSQL started from the installed server binaries for
// the test binary (once, for every test of the binary, and removed once the binary has exited, however it exits).
// With neither, the test is skipped with the reason ([Require] fails it instead). With [FreshDatabase], a database
// of the test's own, dropped when it ends.
//
// The DSN gives the test's sessions an application_name of their own (advlocktest-PID-N, replacing one the
// variable gave). When the test ends (after its other cleanups, so after the Lockers it closed in them), an
// advisory lock still held by a session with that name fails the test, naming the key and the session, and the
// session is ended; so does a lease still held whose holder names it (a Locker of leases from advlock.Open,
// advsql.Open or advlock.New over a pgxpool names its DSN's application_name; one from advsql.New cannot), and the
// lease is broken. Open every Locker of the test on this DSN, or on a [Link]
// to it, for that check to see them.
func DSN(t TB, opts ...Option) string {
	t.Helper()
	o := collect(opts)
	admin, err := server(o)
	if err != nil {
		noneFor(t, o, err)
		return ""
	}
	db := admin
	if o.fresh {
		db = freshDatabase(t, admin)
	}
	tag := newTag()
	dsn, err := withParam(db, "application_name", tag)
	if err != nil {
		t.Fatalf("advlocktest: %v", err)
	}
	t.Cleanup(func() { checkLeftHeld(t, admin, db, tag) })
	return dsn
}

// isURL reports whether dsn is a URL rather than key=value settings.
func isURL(dsn string) bool {
	return strings.HasPrefix(dsn, "postgres://") || strings.HasPrefix(dsn, "postgresql://")
}

// newTag is a test's application_name: unique among the test binaries that share a server.
func newTag() string { return fmt.Sprintf("advlocktest-%d-%d", os.Getpid(), seq.Add(1)) }

// withParam returns dsn (a URL or key=value settings) with the run-time parameter name set to value.
func withParam(dsn, name, value string) (string, error) {
	if isURL(dsn) {
		u, err := neturl.Parse(dsn)
		if err != nil { // pgx reads more URLs than net/url does (a socket directory as the host, percent-encoded)
			sep := "?"
			if strings.Contains(dsn, "?") {
				sep = "&"
			}
			return dsn + sep + name + "=" + neturl.QueryEscape(value), nil
		}
		q := u.Query()
		q.Set(name, value)
		u.RawQuery = q.Encode()
		return u.String(), nil
	}
	return dsn + " " + name + "='" + strings.NewReplacer(`\`, `\\`, `'`, `\'`).Replace(value) + "'", nil
}

// freshDatabase creates a database on the server at admin, dropped when t ends, and returns a DSN for it.
func freshDatabase(t TB, admin string) string {
	t.Helper()
	name := fmt.Sprintf("advlocktest_%d_%d", os.Getpid(), seq.Add(1))
	ctx, cancel := context.WithTimeout(context.Background(), bound)
	defer cancel()
	conn, err := connect(ctx, admin, "advlocktest")
	if err != nil {
		t.Fatalf("advlocktest: connect to create a database: %v", err)
	}
	defer conn.Close(context.Background())
	if _, err := conn.Exec(ctx, "CREATE DATABASE "+name); err != nil {
		t.Fatalf("advlocktest: create database %s: %v", name, err)
	}
	dsn := admin + " dbname=" + name
	if isURL(admin) {
		u, err := neturl.Parse(admin)
		if err != nil {
			t.Fatalf("advlocktest: the server's connection string does not parse as a URL")
		}
		u.Path = "/" + name
		dsn = u.String()
	}
	serversMu.Lock()
	fresh[dsn] = true
	serversMu.Unlock()
	t.Cleanup(func() {
		serversMu.Lock()
		delete(fresh, dsn)
		serversMu.Unlock()
		ctx, cancel := context.WithTimeout(context.Background(), bound)
		defer cancel()
		conn, err := connect(ctx, admin, "advlocktest")
		if err == nil {
			defer conn.Close(context.Background())
			_, err = conn.Exec(ctx, "DROP DATABASE IF EXISTS "+name+" WITH (FORCE)")
		}
		if err != nil {
			t.Errorf("advlocktest: drop database %s: %v", name, err)
		}
	})
	return dsn
}

// leftHeldGrace is how long the check waits for locks to go before it calls them left held: a Locker's Close may
// return before the server has seen its sessions end.
const leftHeldGrace = 3 * time.Second

// checkLeftHeld fails t if a session named tag still holds an advisory lock, or a lease whose holder names tag is
// still held, after leftHeldGrace, and ends those sessions (waiting, leftHeldGrace at most, until they are gone) and
// breaks those leases.
func checkLeftHeld(t TB, admin, db, tag string) {
	t.Helper()
	if stopped(admin) {
		return // a stopped server holds nothing
	}
	ctx, cancel := context.WithTimeout(context.Background(), bound)
	defer cancel()
	conn, err := connect(ctx, admin, "advlocktest")
	if err != nil {
		t.Errorf("advlocktest: connect to check for locks left held: %v", err)
		return
	}
	defer conn.Close(context.Background())
	leaseConn := conn // pg_locks is the server's, the lease table the test's database's
	if db != admin {
		if leaseConn, err = connect(ctx, db, "advlocktest"); err != nil {
			t.Errorf("advlocktest: connect to check for leases left held: %v", err)
			return
		}
		defer leaseConn.Close(context.Background())
	}
	var held, leases []string
	var pids []uint32
	var rows []leaseRow
	for deadline := time.Now().Add(leftHeldGrace); ; {
		held, pids, err = heldBy(ctx, conn, tag)
		if err == nil {
			leases, rows, err = leasesHeldBy(ctx, leaseConn, tag)
		}
		if err != nil {
			t.Errorf("advlocktest: check for locks left held: %v", err)
			return
		}
		if len(held)+len(leases) == 0 || time.Now().After(deadline) {
			break
		}
		time.Sleep(20 * time.Millisecond)
	}
	if len(held) > 0 {
		t.Errorf("advlocktest: %s still held as the test ended (a Lock not unlocked, or a Locker not closed): %s",
			countOf(len(held), "advisory lock"), strings.Join(held, "; "))
		for _, pid := range pids {
			_, _ = conn.Exec(ctx, "SELECT pg_terminate_backend($1)", pid)
		}
		// A terminated backend exits, and lets its locks go, a moment after it is signalled: the check returns once
		// those sessions are gone (within its bound), so that what follows the test finds their keys free.
		ended := make([]int64, len(pids))
		for i, pid := range pids {
			ended[i] = int64(pid)
		}
		for deadline := time.Now().Add(leftHeldGrace); time.Now().Before(deadline); time.Sleep(10 * time.Millisecond) {
			var left int
			if err := conn.QueryRow(ctx, "SELECT count(*) FROM pg_stat_activity WHERE pid = ANY($1::int8[])", ended).Scan(&left); err != nil {
				t.Errorf("advlocktest: wait for the sessions left holding locks to end: %v", err)
				break
			} else if left == 0 {
				break
			}
		}
	}
	if len(leases) > 0 {
		t.Errorf("advlocktest: %s still held as the test ended (a Lock not unlocked, or a Locker not closed): %s",
			countOf(len(leases), "lease"), strings.Join(leases, "; "))
		for _, r := range rows { // broken as advlock break does: its holder is told at its next renewal
			_, _ = leaseConn.Exec(ctx, "DELETE FROM public.advlock_lease WHERE space = $1 AND key = $2 AND term = $3", r.space, r.key, r.term)
		}
	}
}

// leaseRow names one row of the lease table.
type leaseRow struct {
	space int16
	key   int64
	term  int64
}

// leasesHeldBy lists the leases not yet expired whose holder names tag: a Locker of leases opened on the test's DSN
// names its application_name in its holder, after the host and pid.
func leasesHeldBy(ctx context.Context, conn *pgx.Conn, tag string) (held []string, rows []leaseRow, err error) {
	var exists bool
	if err := conn.QueryRow(ctx, "SELECT to_regclass('public.advlock_lease') IS NOT NULL").Scan(&exists); err != nil || !exists {
		return nil, nil, err
	}
	rs, err := conn.Query(ctx, `SELECT space, key, term, holder FROM public.advlock_lease
		WHERE expires > clock_timestamp() AND holder ~ (' ' || $1 || '($|[^0-9])') ORDER BY space, key`, tag)
	if err != nil {
		return nil, nil, err
	}
	defer rs.Close()
	for rs.Next() {
		var r leaseRow
		var holder string
		if err := rs.Scan(&r.space, &r.key, &r.term, &holder); err != nil {
			return nil, nil, err
		}
		what := fmt.Sprintf("(space %d, key %d)", r.space, r.key)
		switch r.space {
		case 1:
			what = advlock.Int64Key(r.key).String()
		case 2:
			what = advlock.PairKey(int32(r.key>>32), int32(r.key)).String()
		}
		held = append(held, fmt.Sprintf("key %s, term %d, held by %s", what, r.term, holder))
		rows = append(rows, r)
	}
	return held, rows, rs.Err()
}

// heldBy lists the advisory locks granted to sessions whose application_name is tag, and their sessions.
func heldBy(ctx context.Context, conn *pgx.Conn, tag string) (held []string, pids []uint32, err error) {
	rows, err := conn.Query(ctx, `SELECT l.pid, l.classid::int8, l.objid::int8, l.objsubid, l.mode
		FROM pg_locks l JOIN pg_stat_activity a USING (pid)
		WHERE l.locktype = 'advisory' AND l.granted AND a.application_name = $1 ORDER BY l.pid`, tag)
	if err != nil {
		return nil, nil, err
	}
	defer rows.Close()
	seen := map[uint32]bool{}
	for rows.Next() {
		var pid uint32
		var classid, objid int64
		var objsubid int16
		var mode string
		if err := rows.Scan(&pid, &classid, &objid, &objsubid, &mode); err != nil {
			return nil, nil, err
		}
		what := fmt.Sprintf("(%d,%d,%d)", classid, objid, objsubid)
		if k, err := advlock.KeyFromPgLocks(uint32(classid), uint32(objid), objsubid); err == nil {
			what = k.String()
		}
		held = append(held, fmt.Sprintf("key %s (%s) by server session %d", what, mode, pid))
		if !seen[pid] {
			seen[pid] = true
			pids = append(pids, pid)
		}
	}
	return held, pids, rows.Err()
}

// countOf is n and noun, plural unless n is 1: "1 lease", "2 leases".
func countOf(n int, noun string) string {
	if n == 1 {
		return "1 " + noun
	}
	return strconv.Itoa(n) + " " + noun + "s"
}
