package advlock_test

import (
	"context"
	"errors"
	"fmt"
	"net"
	neturl "net/url"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/advlock/advlock"
	"github.com/advlock/advlock/internal/session"
	"github.com/advlock/advlock/internal/testkit/conformance"
	"github.com/advlock/advlock/internal/testkit/faults"
	"github.com/advlock/advlock/internal/testkit/pgtest"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
)

// The settings Open applies, as pg_settings reports them (milliseconds, seconds).
var openWants = map[string]string{
	"statement_timeout":                   "0",
	"lock_timeout":                        "0",
	"idle_session_timeout":                "15000", // 3 keepalive intervals: a frozen holder's sessions end
	"idle_in_transaction_session_timeout": "0",
	"tcp_keepalives_idle":                 "10",
	"tcp_keepalives_interval":             "5",
	"tcp_keepalives_count":                "3",
	"client_connection_check_interval":    "5000",
}

// The private cluster's defaults, all different from Open's, so that a setting that leaked shows.
var clusterConf = []string{
	"statement_timeout = '3min'", "lock_timeout = '2min'", "idle_session_timeout = '1h'",
	"idle_in_transaction_session_timeout = '1h'", "tcp_keepalives_idle = 60", "tcp_keepalives_interval = 30",
	"tcp_keepalives_count = 7", "client_connection_check_interval = 0",
}

// spy reads the settings of the session a lock is about to be taken on, from that very session, and counts how
// often the settings are applied.
type spy struct {
	mu      sync.Mutex
	seen    []map[string]string
	applied int
}

type spyConn struct {
	session.Conn
	s *spy
}

func (s *spy) wrap(c session.Conn) session.Conn { return spyConn{c, s} }

func (c spyConn) QueryInt(ctx context.Context, sql string, args ...any) (int64, error) {
	if strings.HasPrefix(sql, "SET statement_timeout") {
		c.s.mu.Lock()
		c.s.applied++
		c.s.mu.Unlock()
	}
	// A lock statement on a session of its own, or the setup of a shared session (which runs after the settings
	// are applied, on the session that then holds the locks).
	if strings.Contains(sql, "pg_try_advisory_lock") || strings.Contains(sql, "pg_is_in_recovery()::int") {
		got := map[string]string{}
		for name := range openWants {
			// The setting as a number: QueryInt reads integers.
			v, err := c.Conn.QueryInt(ctx, "SELECT setting::int8 FROM pg_settings WHERE name = '"+name+"'")
			if err != nil {
				return 0, err
			}
			got[name] = strconv.FormatInt(v, 10)
		}
		c.s.mu.Lock()
		c.s.seen = append(c.s.seen, got)
		c.s.mu.Unlock()
	}
	return c.Conn.QueryInt(ctx, sql, args...)
}

// plainSettings reads the cluster settings through a plain client connection (what another client of a pooler
// gets): each must still be the cluster's default.
func plainSettings(t *testing.T, url string) {
	t.Helper()
	ctx := context.Background()
	var conns []*pgx.Conn
	for range 4 { // several clients, so that a pooler hands out several server sessions
		c, err := pgx.Connect(ctx, url)
		if err != nil {
			t.Fatal(err)
		}
		conns = append(conns, c)
	}
	for _, c := range conns {
		var st, it string
		if err := c.QueryRow(ctx, "SELECT current_setting('statement_timeout'), current_setting('idle_session_timeout')").Scan(&st, &it); err != nil {
			t.Fatal(err)
		}
		if st != "3min" || it != "1h" {
			t.Errorf("another client of the server got statement_timeout=%s idle_session_timeout=%s, want the defaults 3min and 1h: a lock session's settings leaked", st, it)
		}
		c.Close(ctx)
	}
}

// Open connects directly, through a stock PgBouncer in session mode and in transaction mode; its settings are in
// force on every lock session where they can be, applied once per physical connection, and never left on a
// server session that another client gets.
func TestOpenSettings(t *testing.T) {
	if testing.Short() {
		t.Skip("starts a private cluster and pgbouncer")
	}
	c := pgtest.StartCluster(t, clusterConf...)
	direct := c.URL
	session := pgtest.Bouncer(t, c.URL, "session")
	txn := pgtest.Bouncer(t, c.URL, "transaction") + "&default_query_exec_mode=simple_protocol"
	for _, mode := range []struct {
		name   string
		shared int
	}{{"shared sessions", 4}, {"a session per lock", 0}} {
		for _, tc := range []struct {
			name, url string
			txPooled  bool
		}{
			{"direct", direct, false},
			{"pgbouncer session", session, false},
			{"pgbouncer transaction", txn, true},
		} {
			t.Run(mode.name+"/"+tc.name, func(t *testing.T) { openSettings(t, tc.url, tc.txPooled, tc.name == "pgbouncer session", mode.shared) })
		}
	}
}

func openSettings(t *testing.T, url string, txPooled, reset bool, shared int) {
	ctx := context.Background()
	sp := &spy{}
	l, err := advlock.Open(ctx, url, conformance.WithWrap(sp.wrap), advlock.WithSharedSessions(shared),
		advlock.WithPoolConfig(func(c *pgxpool.Config) { c.MaxConns = 2 }))
	if err != nil {
		t.Fatalf("Open: %v", err)
	}
	if txPooled {
		if _, err := l.TryLock(ctx, conformance.Key(t)); !errors.Is(err, advlock.ErrTxPooling) {
			t.Errorf("TryLock through transaction pooling: %v, want ErrTxPooling", err)
		}
		if err := l.DoTx(ctx, conformance.Key(t), func(context.Context, pgx.Tx) error { return nil }); err != nil {
			t.Errorf("DoTx through transaction pooling: %v", err)
		}
		if sp.applied != 0 {
			t.Errorf("settings applied %d times through a transaction pooler", sp.applied)
		}
		plainSettings(t, url)
		l.Close()
		plainSettings(t, url)
		return
	}
	for range 30 {
		lk, err := l.TryLock(ctx, conformance.Key(t))
		if err != nil {
			t.Fatal(err)
		}
		if err := lk.Unlock(ctx); err != nil {
			t.Fatal(err)
		}
	}
	sp.mu.Lock()
	for i, got := range sp.seen {
		for name, want := range openWants {
			if got[name] != want {
				t.Errorf("session %d: %s = %s on the lock session, want %s", i, name, got[name], want)
			}
		}
	}
	if shared == 0 && len(sp.seen) != 30 || shared > 0 && len(sp.seen) != 1 {
		t.Errorf("read the settings of %d lock sessions, want 30 sessions of their own or 1 shared session", len(sp.seen))
	}
	if sp.applied < 1 || sp.applied > 2 {
		t.Errorf("settings applied %d times for 30 locks on a pool of at most 2 connections, want once per connection", sp.applied)
	}
	sp.mu.Unlock()
	l.Close()
	if reset {
		plainSettings(t, url) // PgBouncer's server_reset_query (DISCARD ALL) reset them
	}
}

// A connection attempt into a network that drops every packet ends after DefaultConnectTimeout when the DSN sets
// no connect_timeout, instead of hanging the caller that needed it (found by the chaos campaign: a TryLock under a
// context without a deadline waited forever for a connection whose startup packet a blackhole had swallowed).
func TestOpenConnectTimeout(t *testing.T) {
	if testing.Short() {
		t.Skip("waits for the 10 s default (-short)")
	}
	url := pgtest.URL(t)
	u, err := neturl.Parse(url)
	if err != nil {
		t.Fatal(err)
	}
	p := faults.Start(t, u.Host)
	p.Blackhole(true)
	u.Host = p.Addr()
	done := make(chan error, 1)
	start := time.Now()
	l, err := advlock.Open(context.Background(), u.String())
	if err != nil {
		t.Fatalf("Open does not connect, yet failed: %v", err)
	}
	defer l.Close()
	go func() { done <- l.Ping(context.Background()) }()
	select {
	case err := <-done:
		took := time.Since(start)
		if err == nil {
			t.Fatal("Ping succeeded through a blackhole")
		}
		if took < advlock.DefaultConnectTimeout-time.Second {
			t.Fatalf("Ping failed after %v, before the connect timeout: %v", took, err)
		}
		t.Logf("Ping failed after %v: %v", took.Round(time.Millisecond), err)
	case <-time.After(advlock.DefaultConnectTimeout + 20*time.Second):
		p.Blackhole(false)
		p.Cut()
		<-done
		t.Fatal("Ping hung in a blackhole")
	}
}

// timeout returns a context that ends after d or with the test.
func timeout(t *testing.T, d time.Duration) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), d)
	t.Cleanup(cancel)
	return ctx
}

// closedPort returns 127.0.0.1:port where nothing listens (a port just freed).
func closedPort(t *testing.T) string {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := ln.Addr().String()
	ln.Close()
	return addr
}

// withHost returns url with its host:port replaced.
func withHost(t *testing.T, url, host string) string {
	t.Helper()
	u, err := neturl.Parse(url)
	if err != nil {
		t.Fatal(err)
	}
	u.Host = host
	return u.String()
}

// Open does not connect: against a port where nothing listens it succeeds, and Ping, TryLock, Lock, Do, Inspect,
// Leader and LockTable each fail at once with the refused connection in their error (not a context error, not a missing pool). Only a
// malformed dsn or an invalid pool configuration fails Open.
func TestOpenDatabaseDown(t *testing.T) {
	ctx := timeout(t, 30*time.Second)
	down := withHost(t, pgtest.URL(t), closedPort(t))
	for _, shared := range []int{4, 0} {
		t.Run(fmt.Sprintf("shared %d", shared), func(t *testing.T) {
			l, err := advlock.Open(ctx, down, advlock.WithSharedSessions(shared))
			if err != nil {
				t.Fatalf("Open of a database that is down: %v, want a Locker", err)
			}
			defer l.Close()
			k := conformance.Key(t)
			start := time.Now()
			calls := map[string]error{"Ping": l.Ping(ctx)}
			_, calls["TryLock"] = l.TryLock(ctx, k)
			_, calls["Lock"] = l.Lock(ctx, k)
			calls["Do"] = l.Do(ctx, k, func(context.Context) error { t.Error("fn ran"); return nil })
			_, calls["Inspect"] = l.Inspect(ctx)
			_, _, calls["Leader"] = l.Leader(ctx, k)
			_, calls["LockTable"] = l.LockTable(ctx)
			for name, err := range calls {
				if err == nil {
					t.Errorf("%s against a closed port succeeded", name)
					continue
				}
				if errors.Is(err, context.DeadlineExceeded) || errors.Is(err, context.Canceled) ||
					errors.Is(err, advlock.ErrNoPool) || errors.Is(err, advlock.ErrNotAcquired) {
					t.Errorf("%s: %v, want the connection error", name, err)
				}
				if !strings.Contains(err.Error(), "connection refused") {
					t.Errorf("%s: %q does not say the connection was refused", name, err)
				}
				t.Logf("%s: %v", name, err)
			}
			if took := time.Since(start); took > 5*time.Second {
				t.Errorf("the calls took %v against a closed port, want at once", took)
			}
		})
	}
	for _, bad := range []string{"postgres://postgres@127.0.0.1:5432/test?sslmode=bogus", "host=127.0.0.1 port=notaport"} {
		if l, err := advlock.Open(ctx, bad); err == nil {
			l.Close()
			t.Errorf("Open(%q) succeeded, want a parse error", bad)
		}
	}
	if l, err := advlock.Open(ctx, down, advlock.WithPoolConfig(func(c *pgxpool.Config) { c.MaxConns = 0 })); err == nil {
		l.Close()
		t.Error("Open with MaxConns 0 succeeded, want the pool configuration refused")
	}
}

// A Locker opened while its database refuses connections works once the database accepts them: Open succeeds,
// Ping and TryLock fail while it refuses, and once it accepts, Ping, Lock and TryLock succeed and pg_locks shows
// the lock. Then a refusal again (connections cut, new ones refused) fails Ping, and the Locker recovers again.
// Open used to ping and fail, which left a Locker made once at start (var locks, _ = advlock.Open(...)) without a
// pool for ever.
func TestOpenWhileDown(t *testing.T) {
	url := pgtest.URL(t)
	obs := pgtest.Conn(t, url)
	u, err := neturl.Parse(url)
	if err != nil {
		t.Fatal(err)
	}
	for _, shared := range []int{4, 0} {
		t.Run(fmt.Sprintf("shared %d", shared), func(t *testing.T) {
			ctx := timeout(t, 30*time.Second)
			p := faults.Start(t, u.Host)
			p.Refuse(true)
			l, err := advlock.Open(ctx, withHost(t, url, p.Addr()), advlock.WithSharedSessions(shared))
			if err != nil {
				t.Fatalf("Open while the database refuses: %v", err)
			}
			defer l.Close()
			k := conformance.Key(t)
			if err := l.Ping(ctx); err == nil {
				t.Fatal("Ping succeeded while the database refuses")
			} else {
				t.Logf("Ping while down: %v", err)
			}
			if _, err := l.TryLock(ctx, k); err == nil || errors.Is(err, advlock.ErrNotAcquired) {
				t.Fatalf("TryLock while the database refuses: %v, want a connection error", err)
			}
			for round := range 2 {
				p.Refuse(false)
				if err := l.Ping(ctx); err != nil {
					t.Fatalf("round %d: Ping once the database accepts: %v", round, err)
				}
				lk, err := l.Lock(ctx, k)
				if err != nil {
					t.Fatalf("round %d: Lock once the database accepts: %v", round, err)
				}
				v, _ := k.Int64()
				if pids, err := pgtest.Holders(ctx, obs, v); err != nil || len(pids) != 1 {
					t.Errorf("round %d: pg_locks shows holders %v (%v), want one", round, pids, err)
				}
				if err := lk.Unlock(ctx); err != nil {
					t.Fatal(err)
				}
				lk, err = l.TryLock(ctx, k)
				if err != nil {
					t.Fatalf("round %d: TryLock once the database accepts: %v", round, err)
				}
				if err := lk.Unlock(ctx); err != nil {
					t.Fatal(err)
				}
				// Down again: every connection cut, new ones refused.
				p.Refuse(true)
				p.Cut()
				if err := l.Ping(ctx); err == nil {
					t.Fatalf("round %d: Ping succeeded while the database refuses", round)
				}
			}
		})
	}
}

// Ping makes one round trip; a Locker without a pool says ErrNoPool, a closed one ErrClosed.
func TestPing(t *testing.T) {
	ctx := timeout(t, 10*time.Second)
	url := pgtest.URL(t)
	l, err := advlock.Open(ctx, url)
	if err != nil {
		t.Fatal(err)
	}
	if err := l.Ping(ctx); err != nil {
		t.Errorf("Ping: %v", err)
	}
	l.Close()
	if err := l.Ping(ctx); !errors.Is(err, advlock.ErrClosed) {
		t.Errorf("Ping after Close: %v, want ErrClosed", err)
	}
	var nilLocker *advlock.Locker
	for name, l := range map[string]*advlock.Locker{"New(nil)": advlock.New(nil), "nil": nilLocker} {
		if err := l.Ping(ctx); !errors.Is(err, advlock.ErrNoPool) {
			t.Errorf("Ping of %s: %v, want ErrNoPool", name, err)
		}
	}
	pool := pgtest.Pool(t, url, nil)
	over := advlock.New(pool)
	defer over.Close()
	if err := over.Ping(ctx); err != nil {
		t.Errorf("Ping over a pool: %v", err)
	}
	pool.Close()
	if err := over.Ping(ctx); !errors.Is(err, advlock.ErrNoPool) {
		t.Errorf("Ping over a closed pool: %v, want ErrNoPool", err)
	}
	cctx, cancel := context.WithCancel(ctx)
	cancel()
	l2, err := advlock.Open(ctx, url)
	if err != nil {
		t.Fatal(err)
	}
	defer l2.Close()
	if err := l2.Ping(cctx); !errors.Is(err, context.Canceled) {
		t.Errorf("Ping with a cancelled ctx: %v, want context.Canceled", err)
	}
}

// A connection string that does not parse, or parses other than meant (an unescaped '@' in a password leaves part
// of it in the host), is refused by Open with ErrInvalidDSN, and no error shows any part of a password: not Open's,
// not Ping's for a string that parses.
func TestOpenDSNShowsNoPassword(t *testing.T) {
	ctx := timeout(t, 20*time.Second)
	u, err := neturl.Parse(pgtest.URL(t))
	if err != nil {
		t.Fatal(err)
	}
	hostport, db := u.Host, u.Path
	for _, tc := range []struct{ dsn, password string }{
		{"postgres://postgres:s3cr@tPw9@" + hostport + db, "s3cr@tPw9"},
		{"postgres://postgres:ab/cdEfg7@" + hostport + db, "ab/cdEfg7"},
		{"postgres://postgres:p%zzSecr3t@" + hostport + db, "p%zzSecr3t"},
		{"postgres://postgres:Pa55Xq7z@" + hostport + db + "?pool_max_conns=many", "Pa55Xq7z"},
		{"host=127.0.0.1 password='Unterm1nated", "Unterm1nated"},
	} {
		_, err := advlock.Open(ctx, tc.dsn)
		if !errors.Is(err, advlock.ErrInvalidDSN) {
			t.Errorf("Open(%q): %v, want ErrInvalidDSN", tc.dsn, err)
			continue
		}
		if leak := passwordPart(err.Error(), tc.password); leak != "" {
			t.Errorf("Open(%q)'s error shows %q of the password: %v", tc.dsn, leak, err)
		}
	}
	// Strings that parse as meant: the error of a role that does not exist names no part of the password; an '@'
	// written %40 is a password's.
	l, err := advlock.Open(ctx, "postgres://advlock_no_such_role:s3cr%40tPw9@"+hostport+db)
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	if err := l.Ping(ctx); err == nil {
		t.Error("Ping as a role that does not exist: nil")
	} else if leak := passwordPart(err.Error(), "s3cr@tPw9"); leak != "" {
		t.Errorf("Ping's error shows %q of the password: %v", leak, err)
	}
	l2, err := advlock.Open(ctx, "postgres://"+u.User.Username()+":s3cr%40tPw9@"+hostport+db)
	if err != nil {
		t.Fatal(err)
	}
	defer l2.Close()
	if err := l2.Ping(ctx); err != nil {
		t.Errorf("Ping with '@' in the password written %%40 (trust authentication): %v", err)
	}
}

// passwordPart returns a part of password (4 characters or more) that s shows, or "".
func passwordPart(s, password string) string {
	for i := 0; i+4 <= len(password); i++ {
		if strings.Contains(s, password[i:i+4]) {
			return password[i : i+4]
		}
	}
	return ""
}
