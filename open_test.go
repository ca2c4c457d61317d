package advlock_test

import (
	"context"
	"errors"
	"github.com/advlock/advlock/internal/faults"
	neturl "net/url"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/advlock/advlock"
	"github.com/advlock/advlock/internal/conformance"
	"github.com/advlock/advlock/internal/pgtest"
	"github.com/advlock/advlock/internal/session"
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
	go func() {
		l, err := advlock.Open(context.Background(), u.String())
		if err == nil {
			l.Close()
		}
		done <- err
	}()
	select {
	case err := <-done:
		took := time.Since(start)
		if err == nil {
			t.Fatal("Open succeeded through a blackhole")
		}
		if took < advlock.DefaultConnectTimeout-time.Second {
			t.Fatalf("Open failed after %v, before the connect timeout: %v", took, err)
		}
		t.Logf("Open failed after %v: %v", took.Round(time.Millisecond), err)
	case <-time.After(advlock.DefaultConnectTimeout + 20*time.Second):
		p.Blackhole(false)
		p.Cut()
		<-done
		t.Fatal("Open hung in a blackhole")
	}
}
