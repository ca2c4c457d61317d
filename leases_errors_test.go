package advlock

import (
	"context"
	"errors"
	"fmt"
	neturl "net/url"
	"strings"
	"testing"
	"time"

	"github.com/advlock/advlock/internal/lease"
	"github.com/advlock/advlock/internal/session"
	"github.com/advlock/advlock/internal/testkit/pgtest"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
)

// What a lease call says when it fails, and what ends a wait or Lead.

// Errors say what happened. A primary that refuses writes (default_transaction_read_only) is not a standby: it
// was reported as ErrStandby; here the error says read-only, keeps SQLSTATE 25006, and ends Lead at once, on a
// database without the lease tables and on one with them. Lead returns at once what Do and Lock return at once:
// ErrLeaseTable (the fencing sequence there, the lease tables missing, a role that may not create them), and
// errors.ErrUnsupported (a wait without a bound inside Do's fn), where it used to campaign for ever.
func TestLeaseErrorsSayWhatHappened(t *testing.T) {
	t.Parallel()
	url := pgtest.FreshDB(t, pgtest.URL(t))
	admin := pgtest.Conn(t, url)
	ctx := ctxT(t, 60*time.Second)
	dbname := strings.TrimPrefix(mustParse(t, url).Path, "/")
	readOnly := func(on bool) {
		t.Helper()
		if _, err := admin.Exec(ctx, fmt.Sprintf("ALTER DATABASE %s SET default_transaction_read_only = %v", dbname, on)); err != nil {
			t.Fatal(err)
		}
	}
	lead := func(l *Locker, k Key) error {
		lctx, cancel := context.WithTimeout(ctx, 10*time.Second)
		defer cancel()
		return l.Lead(lctx, k, func(context.Context) error { return nil })
	}
	for _, tables := range []bool{false, true} {
		if tables {
			l := New(pgtest.Pool(t, url, nil), WithLeases())
			if lk, err := l.TryLock(ctx, key(t)); err != nil {
				t.Fatal(err)
			} else if err := lk.Unlock(ctx); err != nil {
				t.Fatal(err)
			}
			l.Close()
		}
		readOnly(true)
		pool := pgtest.Pool(t, url, nil)
		l := New(pool, WithLeases())
		_, err := l.TryLock(ctx, key(t))
		if err == nil || errors.Is(err, ErrStandby) || session.SQLState(err) != "25006" || !strings.Contains(err.Error(), "read-only") {
			t.Errorf("TryLock on a read-only primary (lease tables there: %v): %v, want a read-only error with SQLSTATE 25006, not ErrStandby", tables, err)
		}
		if tables {
			// The server refused each grant, which rolled back: nothing to undo, and the connection is kept. (Each
			// try left a job retrying a delete the server refused too, until Close, and made two connections.)
			// (The jobs' attempts take the pool's connections: the count of connections made shows them.)
			n0 := pool.Stat().NewConnsCount()
			for range 20 {
				if _, err := l.TryLock(ctx, key(t)); session.SQLState(err) != "25006" {
					t.Fatalf("TryLock on a read-only primary: %v, want SQLSTATE 25006", err)
				}
			}
			time.Sleep(300 * time.Millisecond) // a job's next attempts, had the tries left any
			if n := pool.Stat().NewConnsCount() - n0; n > 1 {
				t.Errorf("20 tries refused as read-only made %d connections (undoing what the server refused), want at most 1", n)
			}
		}
		if err := lead(l, key(t)); err == nil || errors.Is(err, context.DeadlineExceeded) || session.SQLState(err) != "25006" {
			t.Errorf("Lead on a read-only primary (lease tables there: %v): %v, want the read-only error at once", tables, err)
		}
		l.Close()
		readOnly(false)
	}

	// ErrLeaseTable from Lead, at once: a role that may use the fencing sequence but not create the lease tables.
	fresh := pgtest.FreshDB(t, pgtest.URL(t))
	fadmin := pgtest.Conn(t, fresh)
	role := fmt.Sprintf("advlock_nocreate_%d", time.Now().UnixNano())
	if _, err := fadmin.Exec(ctx, "CREATE SEQUENCE "+session.FenceSeq+"; CREATE ROLE "+role+" LOGIN; "+
		"GRANT USAGE ON SEQUENCE "+session.FenceSeq+" TO "+role+"; REVOKE CREATE ON SCHEMA public FROM PUBLIC"); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _, _ = fadmin.Exec(context.Background(), "DROP OWNED BY "+role+"; DROP ROLE IF EXISTS "+role) })
	u := mustParse(t, fresh)
	u.User = neturl.User(role)
	nc := New(pgtest.Pool(t, u.String(), nil), WithLeases())
	defer nc.Close()
	if _, err := nc.TryLock(ctx, key(t)); !errors.Is(err, ErrLeaseTable) {
		t.Fatalf("TryLock without the lease tables, by a role that may not create them: %v, want ErrLeaseTable", err)
	}
	if err := lead(nc, key(t)); !errors.Is(err, ErrLeaseTable) {
		t.Errorf("Lead without the lease tables, by a role that may not create them: %v, want ErrLeaseTable at once", err)
	}

	// ErrFencing at once, saying what to run: the same role, the lease tables now there and its own to use, but
	// USAGE alone on the fencing sequence, which the first grant after a crash moves (UPDATE). It would have
	// failed only at that grant, after a crash.
	if _, err := fadmin.Exec(ctx, LeaseTableSQL); err != nil {
		t.Fatal(err)
	}
	if _, err := fadmin.Exec(ctx, "GRANT SELECT, INSERT, UPDATE, DELETE ON "+lease.Table+", "+lease.Timelines+", "+
		lease.Waits+", "+lease.Boot+" TO "+role); err != nil {
		t.Fatal(err)
	}
	uc := New(pgtest.Pool(t, u.String(), nil), WithLeases())
	defer uc.Close()
	if _, err := uc.TryLock(ctx, key(t)); !errors.Is(err, ErrFencing) || !strings.Contains(err.Error(), "GRANT USAGE, UPDATE ON SEQUENCE") {
		t.Errorf("TryLock by a role with USAGE alone on the fencing sequence: %v, want ErrFencing saying to grant UPDATE", err)
	}
	if _, err := fadmin.Exec(ctx, "GRANT UPDATE ON SEQUENCE "+session.FenceSeq+" TO "+role); err != nil {
		t.Fatal(err)
	}
	uc2 := New(pgtest.Pool(t, u.String(), nil), WithLeases())
	defer uc2.Close()
	if lk, err := uc2.TryLock(ctx, key(t)); err != nil {
		t.Errorf("TryLock once the role may move the fencing sequence: %v", err)
	} else if err := lk.Unlock(ctx); err != nil {
		t.Error(err)
	}

	// ErrUnsupported from a Lead inside Do's fn (a wait without a bound whose caller holds a lease), as Lock says.
	l := New(pgtest.Pool(t, url, nil), WithLeases())
	defer l.Close()
	nodl, cancelNodl := context.WithCancel(context.Background()) // no deadline
	defer cancelNodl()
	err := l.Do(nodl, key(t), func(fctx context.Context) error {
		inner, cancel := context.WithCancel(fctx)
		defer cancel()
		done := make(chan error, 1)
		go func() { done <- l.Lead(inner, key(t), func(context.Context) error { return nil }) }()
		select {
		case err := <-done:
			return err
		case <-time.After(5 * time.Second):
			cancel()
			<-done
			return errors.New("Lead inside Do's fn campaigned on")
		}
	})
	if !errors.Is(err, errors.ErrUnsupported) {
		t.Errorf("Lead without a bound inside Do's fn, on a Locker of leases: %v, want errors.ErrUnsupported at once", err)
	}
}

// A rolling upgrade works whoever owns an earlier version's functions: first use creates only the functions that
// are missing, never replacing one that exists (only its owner may). Here another role made the lease tables and
// the functions of an earlier version (the release function is the same as this version's); a role that may create
// in schema public but owns none of them takes leases, and the earlier functions keep their owner. It failed every
// call with ErrLeaseTable, re-creating functions it did not own.
func TestLeaseUpgradeBesideAnotherOwner(t *testing.T) {
	t.Parallel()
	url := pgtest.FreshDB(t, pgtest.URL(t))
	admin := pgtest.Conn(t, url)
	ctx := ctxT(t, 60*time.Second)
	stamp := time.Now().UnixNano()
	first, second := fmt.Sprintf("advlock_first_%d", stamp), fmt.Sprintf("advlock_second_%d", stamp)
	if _, err := admin.Exec(ctx, "CREATE ROLE "+first+" LOGIN; CREATE ROLE "+second+" LOGIN; "+
		"GRANT CREATE, USAGE ON SCHEMA public TO "+first+", "+second); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		_, _ = admin.Exec(context.Background(), "DROP OWNED BY "+first+", "+second+" CASCADE; DROP ROLE IF EXISTS "+first+", "+second)
	})
	// The first role's deploy: the sequence, the tables, this version's release function and stand-ins for an
	// earlier version's grant and renewal, all its own.
	u := mustParse(t, url)
	u.User = neturl.User(first)
	fc := pgtest.Conn(t, u.String())
	older := `CREATE FUNCTION public.advlock_lease_grant_v2(sp int, k int8, own text, hold text, len_ms int8, wt text)
		RETURNS int8 LANGUAGE sql AS 'SELECT 0::int8';
		CREATE FUNCTION public.advlock_lease_renew_v1(sp int, k int8, own text, tm int8, len_ms int8)
		RETURNS int8 LANGUAGE sql AS 'SELECT 0::int8';`
	ddl := LeaseTableSQL[:strings.Index(LeaseTableSQL, "SELECT pg_advisory_xact_lock")]
	release := LeaseTableSQL[strings.Index(LeaseTableSQL, "CREATE OR REPLACE FUNCTION public.advlock_lease_release_v1"):]
	if _, err := fc.Exec(ctx, "CREATE SEQUENCE "+session.FenceSeq+"; "+ddl+older+release); err != nil {
		t.Fatal(err)
	}
	if _, err := fc.Exec(ctx, "GRANT USAGE, UPDATE ON SEQUENCE "+session.FenceSeq+" TO "+second+"; GRANT SELECT, INSERT, UPDATE, DELETE ON "+
		lease.Table+", "+lease.Timelines+", "+lease.Waits+", "+lease.Boot+" TO "+second); err != nil {
		t.Fatal(err)
	}
	u.User = neturl.User(second)
	l := New(pgtest.Pool(t, u.String(), nil), WithLeases())
	defer l.Close()
	lk, err := l.TryLock(ctx, key(t))
	if err != nil {
		t.Fatalf("first use beside another role's functions of an earlier version: %v", err)
	}
	if err := lk.Unlock(ctx); err != nil {
		t.Fatal(err)
	}
	rows, err := admin.Query(ctx, `SELECT p.proname, r.rolname FROM pg_proc p JOIN pg_roles r ON r.oid = p.proowner
		WHERE p.proname LIKE 'advlock_lease_%' ORDER BY 1`)
	if err != nil {
		t.Fatal(err)
	}
	owners, err := pgx.CollectRows(rows, func(r pgx.CollectableRow) (string, error) {
		var name, owner string
		err := r.Scan(&name, &owner)
		return name + "=" + owner, err
	})
	if err != nil {
		t.Fatal(err)
	}
	for _, o := range owners {
		name, owner, _ := strings.Cut(o, "=")
		want := second // made by first use
		if name == "advlock_lease_grant_v2" || name == "advlock_lease_renew_v1" || name == "advlock_lease_release_v1" {
			want = first
		}
		if owner != want {
			t.Errorf("function %s is owned by %s, want %s", name, owner, want)
		}
	}
	t.Logf("the functions and their owners: %v", owners)
}

// What no retry can mend ends a wait at once, and its cause stays reachable: a Locker whose pool was closed under
// it (ErrNoPool) fails TryLock, a Lock without a deadline and Lead with ErrNoPool, where a failure to get a
// connection used to be reported as a statement unanswered within 5 s (its cause lost), and so tried again for
// ever. A Lock waiting for a connection (the pool's one connection taken by the application) ends as soon as it is
// cancelled, and Close ends it at once: the wait for a connection is the caller's, not the statement's.
func TestLeaseWaitEndsOnWhatCannotPass(t *testing.T) {
	t.Parallel()
	url := pgtest.URL(t)
	ctx := ctxT(t, 60*time.Second)
	pool := pgtest.Pool(t, url, nil)
	l := New(pool, WithLeases(), withLeasePoll(20*time.Millisecond))
	defer l.Close()
	warm, err := l.TryLock(ctx, key(t))
	if err != nil {
		t.Fatal(err)
	}
	if err := warm.Unlock(ctx); err != nil {
		t.Fatal(err)
	}
	pool.Close()
	if _, err := l.TryLock(ctx, key(t)); !errors.Is(err, ErrNoPool) {
		t.Errorf("TryLock on a closed pool: %v, want ErrNoPool", err)
	}
	nodl, cancel := context.WithCancel(context.Background())
	defer cancel()
	done := make(chan error, 1)
	go func() { _, err := l.Lock(nodl, key(t)); done <- err }()
	select {
	case err := <-done:
		if !errors.Is(err, ErrNoPool) {
			t.Errorf("Lock on a closed pool: %v, want ErrNoPool", err)
		}
	case <-time.After(10 * time.Second):
		t.Error("Lock (no deadline) on a closed pool still polling after 10 s")
	}
	lctx, lcancel := context.WithTimeout(ctx, 10*time.Second)
	defer lcancel()
	if err := l.Lead(lctx, key(t), func(context.Context) error { return nil }); !errors.Is(err, ErrNoPool) {
		t.Errorf("Lead on a closed pool: %v, want ErrNoPool at once", err)
	}

	one := pgtest.Pool(t, url, func(c *pgxpool.Config) { c.MaxConns = 1 })
	w := New(one, WithLeases())
	if lk, err := w.TryLock(ctx, key(t)); err != nil {
		t.Fatal(err)
	} else if err := lk.Unlock(ctx); err != nil {
		t.Fatal(err)
	}
	app, err := one.Acquire(ctx) // the application has the pool's one connection
	if err != nil {
		t.Fatal(err)
	}
	defer app.Release()
	cctx, ccancel := context.WithCancel(ctx)
	go func() { _, err := w.Lock(cctx, key(t)); done <- err }()
	time.Sleep(200 * time.Millisecond)
	ccancel()
	select {
	case err := <-done:
		if !errors.Is(err, context.Canceled) {
			t.Errorf("a Lock cancelled while it waited for a connection: %v, want context.Canceled", err)
		}
	case <-time.After(3 * time.Second):
		t.Fatal("a Lock cancelled while it waited for a connection did not return")
	}
	go func() { _, err := w.Lock(ctx, key(t)); done <- err }()
	time.Sleep(200 * time.Millisecond)
	closed := make(chan struct{})
	go func() { w.Close(); close(closed) }()
	select {
	case <-closed:
		if err := <-done; !errors.Is(err, ErrClosed) {
			t.Errorf("a Lock waiting for a connection as its Locker closed: %v, want ErrClosed", err)
		}
	case <-time.After(3 * time.Second):
		t.Fatal("Close with a Lock waiting for a connection did not return")
	}
}

// A holder whose renewal is answered "not yours" (broken, or taken over) is told at that renewal, not when its
// trust runs out: with the default lease (15 s, renewed every 5 s, trusted 14 s), a break is told within one renewal
// period, and the loss says what happened.
func TestLeaseNotYoursToldAtOnce(t *testing.T) {
	t.Parallel()
	b := setup(t, WithLeases())
	ctx := ctxT(t, 60*time.Second)
	k := key(t)
	lk, err := b.l.TryLock(ctx, k)
	if err != nil {
		t.Fatal(err)
	}
	if ok, err := BreakLease(ctx, b.obs, k, lk.Token()); err != nil || !ok {
		t.Fatalf("BreakLease: %v %v", ok, err)
	}
	took := pgtest.WaitClosed(t, lk.Done(), 8*time.Second, "a broken lease told at the next renewal (within 5 s), not at the trust's end (14 s)")
	if !errors.Is(lk.Err(), ErrLockLost) || !strings.Contains(lk.Err().Error(), "no longer has the lease") {
		t.Errorf("the broken lease's loss: %v, want ErrLockLost saying the server no longer has it", lk.Err())
	}
	t.Logf("told %v after the break", took.Round(time.Millisecond))
}

// A wait that ends before any of its polls was answered (no connection free in the pool) says so: its error read
// "...: %!w(<nil>)".
func TestLeaseWaitEndedBeforeAnyPoll(t *testing.T) {
	t.Parallel()
	url := pgtest.URL(t)
	pool := pgtest.Pool(t, url, func(c *pgxpool.Config) { c.MaxConns = 1 })
	l := New(pool, WithLeases())
	defer l.Close()
	ctx := ctxT(t, 30*time.Second)
	if lk, err := l.TryLock(ctx, key(t)); err != nil {
		t.Fatal(err)
	} else if err := lk.Unlock(ctx); err != nil {
		t.Fatal(err)
	}
	c, err := pool.Acquire(ctx) // the pool's one connection, taken
	if err != nil {
		t.Fatal(err)
	}
	defer c.Release()
	wctx, cancel := context.WithTimeout(ctx, 300*time.Millisecond)
	defer cancel()
	_, err = l.Lock(wctx, key(t))
	if !errors.Is(err, context.DeadlineExceeded) || strings.Contains(err.Error(), "%!") {
		t.Errorf("a wait whose deadline came before any poll was answered: %v, want DeadlineExceeded with a readable text", err)
	}
}

// What the wait after a crash relies on, made otherwise by hand, is refused at the first lease call with what to
// run, instead of failing after a crash: a fencing sequence that may not grow by 2^32 (AS integer: the move after a
// crash would fail every first grant), and a table of restarts made logged (a crash would not empty it: no wait).
func TestLeaseGuardMadeOtherwise(t *testing.T) {
	t.Parallel()
	url := pgtest.FreshDB(t, pgtest.URL(t))
	admin := pgtest.Conn(t, url)
	ctx := ctxT(t, 60*time.Second)
	if _, err := admin.Exec(ctx, "CREATE SEQUENCE "+session.FenceSeq+" AS integer"); err != nil {
		t.Fatal(err)
	}
	try := func() error {
		l := New(pgtest.Pool(t, url, nil), WithLeases())
		defer l.Close()
		lk, err := l.TryLock(ctx, key(t))
		if err == nil {
			err = lk.Unlock(ctx)
		}
		return err
	}
	if err := try(); !errors.Is(err, ErrFencing) || !strings.Contains(err.Error(), "ALTER SEQUENCE") {
		t.Errorf("leases over a sequence AS integer: %v, want ErrFencing saying what to run", err)
	}
	if _, err := admin.Exec(ctx, "ALTER SEQUENCE "+session.FenceSeq+" AS bigint MAXVALUE 9223372036854775807; "+
		LeaseTableSQL+"; ALTER TABLE "+lease.Boot+" SET LOGGED"); err != nil {
		t.Fatal(err)
	}
	if err := try(); !errors.Is(err, ErrLeaseTable) || !strings.Contains(err.Error(), "SET UNLOGGED") {
		t.Errorf("leases with a logged table of restarts: %v, want ErrLeaseTable saying what to run", err)
	}
	if _, err := admin.Exec(ctx, "ALTER TABLE "+lease.Boot+" SET UNLOGGED"); err != nil {
		t.Fatal(err)
	}
	if err := try(); err != nil {
		t.Errorf("leases once both are as they should be: %v", err)
	}
}
