package advsql_test

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"net"
	"net/url"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/advlock/advlock"
	"github.com/advlock/advlock/advsql"
	"github.com/advlock/advlock/internal/testkit/conformance"
	"github.com/advlock/advlock/internal/testkit/faults"
	"github.com/advlock/advlock/internal/testkit/pgtest"
)

// advsql.Open: a pool of its own, whose lock sessions carry Open's settings (application_name=advlock among them,
// unless the DSN names one); Close closes the pool; Open does not connect: a database that is down fails Ping and
// the lock calls, not Open.
func TestOpen(t *testing.T) {
	base := pgtest.URL(t)
	obs := pgtest.Conn(t, base)
	ctx := context.Background()
	appOf := func(t *testing.T, lk *advlock.Lock) string {
		t.Helper()
		v, _ := lk.Key().Int64()
		pids, err := pgtest.Holders(ctx, obs, v)
		if err != nil || len(pids) != 1 {
			t.Fatalf("holders of %s: %v %v", lk.Key(), pids, err)
		}
		var app string
		if err := obs.QueryRow(ctx, "SELECT application_name FROM pg_stat_activity WHERE pid = $1", int32(pids[0])).Scan(&app); err != nil {
			t.Fatal(err)
		}
		return app
	}
	for _, driver := range []string{"pgx", "postgres"} {
		t.Run(driver, func(t *testing.T) {
			l, err := advsql.Open(ctx, driver, base)
			if err != nil {
				t.Fatal(err)
			}
			lk, err := l.TryLock(ctx, conformance.Key(t))
			if err != nil {
				t.Fatal(err)
			}
			if app := appOf(t, lk); app != "advlock" {
				t.Errorf("application_name of an Open lock session = %q, want advlock", app)
			}
			if st := l.Stats(); st.Pool.Max != advlock.DefaultOpenConns {
				t.Errorf("Open's pool: %+v, want at most %d connections", st.Pool, advlock.DefaultOpenConns)
			}
			l.Close()
			if !errors.Is(lk.Err(), advlock.ErrClosed) {
				t.Errorf("a lock after Close: %v", lk.Err())
			}

			name := fmt.Sprintf("advsql-open-%d", time.Now().UnixNano())
			u, _ := url.Parse(base)
			q := u.Query()
			q.Set("application_name", name)
			u.RawQuery = q.Encode()
			l, err = advsql.Open(ctx, driver, u.String())
			if err != nil {
				t.Fatal(err)
			}
			lk, err = l.TryLock(ctx, conformance.Key(t))
			if err != nil {
				t.Fatal(err)
			}
			if app := appOf(t, lk); app != name {
				t.Errorf("application_name = %q, want the DSN's %q", app, name)
			}
			l.Close()
			for deadline := time.Now().Add(5 * time.Second); ; time.Sleep(20 * time.Millisecond) {
				var n int
				if err := obs.QueryRow(ctx, "SELECT count(*) FROM pg_stat_activity WHERE application_name = $1", name).Scan(&n); err != nil {
					t.Fatal(err)
				}
				if n == 0 {
					break
				}
				if time.Now().After(deadline) {
					t.Fatalf("%d sessions of the Locker's pool still open after Close", n)
				}
			}

			ln, err := net.Listen("tcp", "127.0.0.1:0")
			if err != nil {
				t.Fatal(err)
			}
			u.Host = ln.Addr().String()
			ln.Close()
			cctx, cancel := context.WithTimeout(ctx, 5*time.Second)
			defer cancel()
			l, err = advsql.Open(cctx, driver, u.String())
			if err != nil {
				t.Fatalf("Open of a database that is down: %v, want a Locker (Open does not connect)", err)
			}
			defer l.Close()
			if err := l.Ping(cctx); err == nil || !strings.Contains(err.Error(), "connection refused") {
				t.Errorf("Ping of a database that is down: %v, want the refused connection", err)
			}
			if _, err := l.TryLock(cctx, conformance.Key(t)); err == nil || !strings.Contains(err.Error(), "connection refused") {
				t.Errorf("TryLock on a database that is down: %v, want the refused connection", err)
			}
			if cctx.Err() != nil {
				t.Error("the calls on a database that is down waited for their ctx")
			}
		})
	}
}

// A Locker from advsql.Open while the database refuses connections works once it accepts them (Open used to ping
// and fail).
func TestOpenWhileDown(t *testing.T) {
	base := pgtest.URL(t)
	obs := pgtest.Conn(t, base)
	u, err := url.Parse(base)
	if err != nil {
		t.Fatal(err)
	}
	for _, driver := range []string{"pgx", "postgres"} {
		t.Run(driver, func(t *testing.T) {
			ctx := ctxT(t, 30*time.Second)
			p := faults.Start(t, u.Host)
			p.Refuse(true)
			down := *u
			down.Host = p.Addr()
			l, err := advsql.Open(ctx, driver, down.String())
			if err != nil {
				t.Fatalf("Open while the database refuses: %v", err)
			}
			defer l.Close()
			k := conformance.Key(t)
			if err := l.Ping(ctx); err == nil {
				t.Fatal("Ping succeeded while the database refuses")
			}
			if _, err := l.TryLock(ctx, k); err == nil || errors.Is(err, advlock.ErrNotAcquired) {
				t.Fatalf("TryLock while the database refuses: %v, want a connection error", err)
			}
			p.Refuse(false)
			if err := l.Ping(ctx); err != nil {
				t.Fatalf("Ping once the database accepts: %v", err)
			}
			lk, err := l.Lock(ctx, k)
			if err != nil {
				t.Fatalf("Lock once the database accepts: %v", err)
			}
			v, _ := k.Int64()
			if pids, err := pgtest.Holders(ctx, obs, v); err != nil || len(pids) != 1 {
				t.Errorf("pg_locks shows holders %v (%v), want one", pids, err)
			}
			if err := lk.Unlock(ctx); err != nil {
				t.Fatal(err)
			}
		})
	}
}

// A small application pool (database/sql, 2 connections) shared with a busy Locker: shared sessions never take
// more than half of it, so the application's own queries always find a connection. Two shared sessions pinned both
// before, and every query of the application timed out.
func TestSmallPoolLeavesTheApplicationConnections(t *testing.T) {
	db := openDB(t, "pgx", pgtest.URL(t))
	db.SetMaxOpenConns(2)
	l := advsql.New(db)
	defer l.Close()
	ctx := context.Background()
	stop := make(chan struct{})
	var wg sync.WaitGroup
	var most atomic.Int32
	for range 8 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for {
				select {
				case <-stop:
					return
				default:
				}
				if lk, err := l.TryLock(ctx, conformance.Key(t)); err == nil {
					_ = lk.Unlock(ctx)
				}
				if n := int32(l.Stats().SharedSessions); n > most.Load() {
					most.Store(n)
				}
			}
		}()
	}
	failed := 0
	for range 30 {
		qctx, cancel := context.WithTimeout(ctx, time.Second)
		var one int
		if err := db.QueryRowContext(qctx, "SELECT 1").Scan(&one); err != nil {
			failed++
		}
		cancel()
		time.Sleep(20 * time.Millisecond)
	}
	close(stop)
	wg.Wait()
	if failed > 0 {
		t.Errorf("%d of 30 application queries found no connection within 1 s", failed)
	}
	if most.Load() > 1 {
		t.Errorf("%d shared sessions on a pool of 2, want at most 1", most.Load())
	}
}

// Lead over database/sql, both drivers: two Lockers take turns (never two terms at once); a leader whose fn
// panics steps down. With lib/pq through PgBouncer (whose pid is not the server session's, so a second connection
// must prove that the pooler pins sessions) and a pool of 2 whose other connection the application holds, the
// campaign cannot prove a new connection for 3 s (ErrUnverified) and tries again until it can, then leads: it
// ended with ErrUnverified after 2 s before.
func TestLead(t *testing.T) {
	url := pgtest.URL(t)
	ctx := ctxT(t, 60*time.Second)
	for _, driver := range []string{"pgx", "postgres"} {
		t.Run(driver, func(t *testing.T) {
			k := conformance.Key(t)
			var inside, terms atomic.Int32
			done := make(chan struct{})
			var once sync.Once
			fn := func(context.Context) error {
				if inside.Add(1) != 1 {
					t.Error("two leaders at once")
				}
				time.Sleep(5 * time.Millisecond)
				inside.Add(-1)
				if terms.Add(1) >= 10 {
					once.Do(func() { close(done) })
				}
				return nil
			}
			lctx, cancel := context.WithCancel(ctx)
			var wg sync.WaitGroup
			for range 2 {
				l := advsql.New(openDB(t, driver, url))
				defer l.Close()
				wg.Add(1)
				go func() {
					defer wg.Done()
					if err := l.Lead(lctx, k, fn); !errors.Is(err, context.Canceled) {
						t.Errorf("Lead: %v", err)
					}
				}()
			}
			select {
			case <-done:
			case <-time.After(20 * time.Second):
				t.Fatal("fewer than 10 terms")
			}
			cancel()
			wg.Wait()

			l := advsql.New(openDB(t, driver, url))
			defer l.Close()
			func() {
				defer func() {
					if r := recover(); r != "boom" {
						t.Errorf("recovered %v, want the panic", r)
					}
				}()
				_ = l.Lead(ctx, k, func(context.Context) error { panic("boom") })
			}()
			v, _ := k.Int64()
			pgtest.WaitFree(t, pgtest.Conn(t, url), v, 5*time.Second)
		})
	}
	t.Run("unverified passes", func(t *testing.T) {
		if testing.Short() {
			t.Skip("starts pgbouncer")
		}
		db := openDB(t, "postgres", pgtest.Bouncer(t, url, "session"))
		db.SetMaxOpenConns(2)
		l := advsql.New(db, advlock.WithSharedSessions(0)) // a session per lock: each campaign verifies one
		defer l.Close()
		app, err := db.Conn(ctx)
		if err != nil {
			t.Fatal(err)
		}
		time.AfterFunc(3*time.Second, func() { app.Close() })
		start := time.Now()
		lctx, cancel := context.WithCancel(ctx)
		defer cancel()
		led := make(chan advlock.Stats, 1)
		res := make(chan error, 1)
		go func() {
			res <- l.Lead(lctx, conformance.Key(t), func(ctx context.Context) error {
				led <- l.Stats()
				<-ctx.Done()
				return nil
			})
		}()
		select {
		case st := <-led:
			t.Logf("led %v after the campaign began, after %d failed campaigns", time.Since(start).Round(time.Millisecond), st.CampaignRetries)
			if st.CampaignRetries < 1 {
				t.Error("the campaigns that could not verify a connection are not counted")
			}
		case err := <-res:
			t.Fatalf("Lead ended: %v", err)
		case <-time.After(15 * time.Second):
			t.Fatal("Lead did not lead once the application freed its connection")
		}
		cancel()
		<-res
	})
}

// A semaphore over database/sql with lib/pq (a session per lock) and a pool of 2 holding 2 of its 3 slots: a
// waiting Acquire waits for a connection and a slot (another process frees the third slot after 500 ms, one of
// its own holders its connection after 1 s), then takes one. It returned ErrPoolExhausted at once before.
func TestSemaphoreSmallPool(t *testing.T) {
	url := pgtest.URL(t)
	ctx := ctxT(t, 30*time.Second)
	db := openDB(t, "postgres", url)
	db.SetMaxOpenConns(2)
	l, other := advsql.New(db, advlock.WithSharedSessions(0)), advsql.New(openDB(t, "pgx", url))
	defer l.Close()
	defer other.Close()
	name := fmt.Sprintf("sql-%d", time.Now().UnixNano())
	sem := l.Semaphore(name, 3)
	var mine []*advlock.Lock
	for range 2 {
		lk, err := sem.TryAcquire(ctx)
		if err != nil {
			t.Fatal(err)
		}
		mine = append(mine, lk)
	}
	theirs, err := other.Semaphore(name, 3).TryAcquire(ctx)
	if err != nil {
		t.Fatal(err)
	}
	time.AfterFunc(500*time.Millisecond, func() { _ = theirs.Unlock(context.Background()) })
	time.AfterFunc(time.Second, func() { _ = mine[0].Unlock(context.Background()) })
	start := time.Now()
	lk, err := sem.Acquire(ctx)
	if err != nil {
		t.Fatalf("Acquire after %v: %v", time.Since(start), err)
	}
	if took := time.Since(start); took < 900*time.Millisecond {
		t.Errorf("Acquire took a slot after %v, before a connection was free", took)
	}
	_ = lk.Unlock(ctx)
	_ = mine[1].Unlock(ctx)
}

var _ = sql.ErrNoRows

func ctxT(t *testing.T, d time.Duration) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), d)
	t.Cleanup(cancel)
	return ctx
}

// advsql.Open's lock sessions carry idle_session_timeout (3 keepalive intervals), so the server ends them when
// they sit idle in the pool; lib/pq hands out pooled connections unchecked. Open's pool closes idle connections
// before the server does, so a lock taken after a quiet spell gets a live one. It failed with "driver: bad
// connection" before.
func TestOpenAfterIdle(t *testing.T) {
	ctx := ctxT(t, 30*time.Second)
	l, err := advsql.Open(ctx, "postgres", pgtest.URL(t), advlock.WithKeepalive(time.Second), advlock.WithSharedSessions(0))
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	for i := range 3 {
		lk, err := l.TryLock(ctx, conformance.Key(t))
		if err != nil {
			t.Fatalf("TryLock %d, after %d idle spells of 3.5 s: %v", i, i, err)
		}
		if err := lk.Unlock(ctx); err != nil {
			t.Fatal(err)
		}
		if i < 2 {
			time.Sleep(3500 * time.Millisecond)
		}
	}
}

// Semaphore.Acquire through a pooler (lib/pq through PgBouncer, a pool of 2, the application holding one
// connection for 3 s): a new connection cannot be proved a session of its own meanwhile (ErrUnverified), which is a
// passing failure: Acquire waits, and takes a slot once the connection is free. It returned ErrUnverified after 2 s.
func TestSemaphoreUnverifiedPasses(t *testing.T) {
	if testing.Short() {
		t.Skip("starts pgbouncer")
	}
	ctx := ctxT(t, 30*time.Second)
	db := openDB(t, "postgres", pgtest.Bouncer(t, pgtest.URL(t), "session"))
	db.SetMaxOpenConns(2)
	l := advsql.New(db)
	defer l.Close()
	app, err := db.Conn(ctx)
	if err != nil {
		t.Fatal(err)
	}
	time.AfterFunc(3*time.Second, func() { app.Close() })
	start := time.Now()
	lk, err := l.Semaphore(fmt.Sprintf("unverified-%d", time.Now().UnixNano()), 3).Acquire(ctx)
	if err != nil {
		t.Fatalf("Acquire after %v: %v", time.Since(start), err)
	}
	t.Logf("Acquire took a slot after %v", time.Since(start).Round(time.Millisecond))
	_ = lk.Unlock(ctx)
}

// advlock.WithMaxConns sizes Open's *sql.DB: with lib/pq (no shared sessions) every connection but the one kept
// for the Locker's reads holds a lock.
func TestOpenMaxConns(t *testing.T) {
	ctx := context.Background()
	for _, tc := range []struct {
		driver   string
		opts     []advlock.Option
		max, own int
	}{
		{"postgres", nil, advlock.DefaultOpenConns, advlock.DefaultOpenConns - 2},
		{"postgres", []advlock.Option{advlock.WithMaxConns(24)}, 24, 19},
		{"postgres", []advlock.Option{advlock.WithMaxConns(24), advlock.WithSharedSessions(0)}, 24, 23},
		{"pgx", []advlock.Option{advlock.WithMaxConns(24)}, 24, 19},
	} {
		l, err := advsql.Open(ctx, tc.driver, pgtest.URL(t), tc.opts...)
		if err != nil {
			t.Fatal(err)
		}
		st := l.Stats()
		l.Close()
		if st.Pool.Max != tc.max || st.MaxOwnSessions != tc.own {
			t.Errorf("%s, %d options: pool %d, %d sessions of their own; want %d and %d", tc.driver, len(tc.opts), st.Pool.Max, st.MaxOwnSessions, tc.max, tc.own)
		}
	}
}

// A connection string pgx's driver would read other than meant (an unescaped '@' in a password) is refused with
// ErrInvalidDSN, showing no part of it; lib/pq reads the same string as meant (its URL's user information ends at
// the last '@'), so it is accepted there. A string neither driver parses is refused alike.
func TestOpenDSN(t *testing.T) {
	ctx := ctxT(t, 20*time.Second)
	u, err := url.Parse(pgtest.URL(t))
	if err != nil {
		t.Fatal(err)
	}
	dsn := "postgres://" + u.User.Username() + ":s3cr@tPw9@" + u.Host + u.Path + "?sslmode=disable"
	if _, err := advsql.Open(ctx, "pgx", dsn); !errors.Is(err, advlock.ErrInvalidDSN) || strings.Contains(err.Error(), "tPw9") {
		t.Errorf("advsql.Open(pgx) with '@' in the password: %v, want ErrInvalidDSN showing no part of it", err)
	}
	l, err := advsql.Open(ctx, "postgres", dsn)
	if err != nil {
		t.Fatalf("advsql.Open(postgres) with '@' in the password: %v", err)
	}
	defer l.Close()
	if err := l.Ping(ctx); err != nil {
		t.Errorf("Ping through lib/pq with '@' in the password (trust authentication): %v", err)
	}
	for _, driver := range []string{"pgx", "postgres"} {
		if _, err := advsql.Open(ctx, driver, "postgres://u:p%zzSecr3t@h/db"); !errors.Is(err, advlock.ErrInvalidDSN) ||
			strings.Contains(err.Error(), "Secr3t") {
			t.Errorf("advsql.Open(%s) of a string that does not parse: %v, want ErrInvalidDSN showing no part of it", driver, err)
		}
	}
}
