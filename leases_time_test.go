package advlock

import (
	"context"
	"errors"
	"fmt"
	neturl "net/url"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/advlock/advlock/internal/config"
	"github.com/advlock/advlock/internal/lease"
	"github.com/advlock/advlock/internal/session"
	"github.com/advlock/advlock/internal/testkit/pgtest"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
)

// The leases' promises when time misbehaves: answers that come late, a server clock that steps, a pooler that
// stalls, text that is not what it seems, failures that pass. Each test here failed before the mechanism it names.

// leaseRows reads key k's rows of the lease table: owner and term by owner.
func leaseOwners(t *testing.T, c *pgx.Conn, k Key) map[string]int64 {
	t.Helper()
	v, _ := k.Int64()
	rows, err := c.Query(context.Background(), "SELECT owner, term FROM "+lease.Table+" WHERE space = 1 AND key = $1", v)
	if err != nil {
		t.Fatal(err)
	}
	out := map[string]int64{}
	for rows.Next() {
		var o string
		var term int64
		if err := rows.Scan(&o, &term); err != nil {
			t.Fatal(err)
		}
		out[o] = term
	}
	if err := rows.Err(); err != nil {
		t.Fatal(err)
	}
	return out
}

// A grant answered after its holder could no longer trust it is never handed out. A Locker with a 1 s lease behind
// a link that delays every chunk 1.5 s (a request reaches the server 1.5 s after it was sent, its answer 1.5 s
// later) tries a key, and another Locker asks for it once the try has reached the server: the slow Locker's
// TryLock returns an error, never a lock (it was handed out as held, 500 ms after the other Locker's grant, when the
// grant's statement was bounded at 5 s and the answer not checked against the trust window), and the grant, which
// reached the server after its caller had given up on it, granted nothing: the key goes to the other Locker at
// once, whose lease the table shows.
func TestLeaseLateGrantNotHandedOut(t *testing.T) {
	t.Parallel()
	url := pgtest.URL(t)
	obs := pgtest.Conn(t, url)
	ctx := ctxT(t, 60*time.Second)
	proxy, pool := proxiedPool(t, url, 4)
	slow := New(pool, WithLeases(), WithLeaseLength(time.Second))
	defer slow.Close()
	other := New(pgtest.Pool(t, url, nil), WithLeases(), WithLeaseLength(time.Second), withLeasePoll(5*time.Millisecond))
	defer other.Close()
	warm, err := slow.TryLock(ctx, key(t)) // the tables checked, a connection made, before the link slows
	if err != nil {
		t.Fatal(err)
	}
	if err := warm.Unlock(ctx); err != nil {
		t.Fatal(err)
	}
	k := key(t)
	proxy.Latency(1500 * time.Millisecond)
	type result struct {
		lk  *Lock
		err error
	}
	tried := make(chan result, 1)
	go func() {
		lk, err := slow.TryLock(ctx, k)
		tried <- result{lk, err}
	}()
	// The other Locker asks for the key once the slow one's grant has reached the server, its answer on its way.
	time.Sleep(1600 * time.Millisecond)
	got, err := other.Lock(ctx, k, Wait(10*time.Second))
	if err != nil {
		t.Fatal(err)
	}
	r := <-tried
	if r.err == nil {
		t.Fatalf("the slow Locker's TryLock returned a lock (token %d, Err %v) while another Locker held the key "+
			"(token %d): a grant answered after its lease's trust window", r.lk.Token(), r.lk.Err(), got.Token())
	}
	if errors.Is(r.err, context.DeadlineExceeded) {
		t.Errorf("a try whose caller set no deadline: %v, matches context.DeadlineExceeded", r.err)
	}
	t.Logf("the slow Locker's TryLock: %v", r.err)
	time.Sleep(2 * time.Second) // the slow grant has reached the server by now, and granted nothing
	if owners := leaseOwners(t, obs, k); len(owners) != 1 || owners[ownerOf(t, got)] != got.Token() {
		t.Errorf("the key's rows after the slow grant arrived: %v, want only the other Locker's (term %d)", owners, got.Token())
	}
	if err := got.Err(); err != nil {
		t.Errorf("the other Locker's lease: %v", err)
	}
	proxy.Latency(0)
	if err := got.Unlock(ctx); err != nil {
		t.Fatal(err)
	}
}

// ownerOf is the owner the lease table names for lk.
func ownerOf(t *testing.T, lk *Lock) string {
	t.Helper()
	l, ok := lk.h.(*lease.Lease)
	if !ok {
		t.Fatalf("%T is not a lease", lk.h)
	}
	return l.Owner()
}

// A step of the server's clock gives no second holder: the server's clock orders records, it decides nothing.
// Forward 20 s (an NTP step, a resumed VM), every lease expires at once on the server's clock while its holder
// still trusts it: a waiter was granted 150 ms after such a step. Here the waiter is not granted for as long as the
// holder renews (it sees the record change at each renewal), and is once the holder lets go. Back 40 s: the holder
// renews as before (each expiry later than the last whatever the clock says), and a holder cut off is taken over
// about one lease length after its last renewal, after it stopped trusting its lease.
func TestLeaseServerClockSteps(t *testing.T) {
	t.Parallel()
	if testing.Short() {
		t.Skip("starts a private cluster under libfaketime (-short)")
	}
	c := pgtest.StartFaketimeCluster(t)
	ctx := ctxT(t, 120*time.Second)
	obs := pgtest.Conn(t, c.URL)
	const length = 3 * time.Second
	proxy, pool := proxiedPool(t, c.URL, 4)
	holder := New(pool, WithLeases(), WithLeaseLength(length))
	defer holder.Close()
	waiter := New(pgtest.Pool(t, c.URL, nil), WithLeases(), WithLeaseLength(length), withLeasePoll(20*time.Millisecond))
	defer waiter.Close()
	for _, step := range []struct {
		offset time.Duration
		what   string
	}{{20 * time.Second, "forward 20s"}, {-20 * time.Second, "back 40s"}} {
		k := key(t)
		lk, err := holder.TryLock(ctx, k)
		if err != nil {
			t.Fatal(err)
		}
		wait := startTakeover(ctx, t, waiter, k, lk, 60*time.Second)
		time.Sleep(500 * time.Millisecond)
		var before, after time.Time
		if err := obs.QueryRow(ctx, "SELECT clock_timestamp()").Scan(&before); err != nil {
			t.Fatal(err)
		}
		if err := c.StepClock(step.offset); err != nil {
			t.Fatal(err)
		}
		if err := obs.QueryRow(ctx, "SELECT clock_timestamp()").Scan(&after); err != nil {
			t.Fatal(err)
		}
		t.Logf("%s: the server's clock read %v, then %v", step.what, before.Format(time.TimeOnly), after.Format(time.TimeOnly))
		time.Sleep(2 * length) // renewed all along, or lost
		select {
		case <-lk.Done():
			t.Fatalf("%s: the holder's lease ended while it renewed: %v", step.what, lk.Err())
		default:
		}
		if owners := leaseOwners(t, obs, k); len(owners) != 1 || owners[ownerOf(t, lk)] != lk.Token() {
			t.Fatalf("%s: the key's rows %v, want the holder's term %d alone", step.what, owners, lk.Token())
		}
		// Cut off: it stops trusting its lease, and only then is the waiter granted.
		proxy.Blackhole(true)
		got, told, granted := wait()
		t.Logf("%s: the cut-off holder stopped trusting %v before the waiter's grant", step.what, granted.Sub(told).Round(time.Millisecond))
		if got.Token() <= lk.Token() {
			t.Errorf("%s: the takeover's token %d is not greater than %d", step.what, got.Token(), lk.Token())
		}
		proxy.Blackhole(false)
		if err := got.Unlock(ctx); err != nil {
			t.Fatal(err)
		}
	}
}

// Text is data: no holder text, under either setting of standard_conforming_strings, changes a lease statement. A
// holder ending in a backslash made every grant a syntax error where the setting is off, and a crafted one ran
// statements of its own (it deleted another process's live lease); here each grant works, the holder reads back as
// written, and another lease's row stands.
func TestLeaseHolderTextIsData(t *testing.T) {
	t.Parallel()
	url := pgtest.FreshDB(t, pgtest.URL(t))
	obs := pgtest.Conn(t, url)
	ctx := ctxT(t, 60*time.Second)
	bystander := New(pgtest.Pool(t, url, nil), WithLeases())
	defer bystander.Close()
	bk := key(t)
	blk, err := bystander.TryLock(ctx, bk)
	if err != nil {
		t.Fatal(err)
	}
	defer blk.Unlock(ctx)
	dbname := strings.TrimPrefix(mustParse(t, url).Path, "/")
	holders := []string{`pod\`, `x\'); DELETE FROM ` + lease.Table + `; CREATE TABLE advlock_pwned (); --`,
		`\'`, `'); DELETE FROM ` + lease.Table + `; --`}
	for _, scs := range []string{"off", "on"} {
		if _, err := obs.Exec(ctx, fmt.Sprintf("ALTER DATABASE %s SET standard_conforming_strings = %s", dbname, scs)); err != nil {
			t.Fatal(err)
		}
		for _, h := range holders {
			l := New(pgtest.Pool(t, url, nil), WithLeases(), WithLeaseHolder(h))
			k := key(t)
			lk, err := l.TryLock(ctx, k)
			if err != nil {
				l.Close()
				t.Fatalf("standard_conforming_strings=%s, holder %q: %v", scs, h, err)
			}
			infos, err := l.Inspect(ctx)
			if err != nil {
				t.Fatal(err)
			}
			found := false
			for _, li := range infos {
				if li.Lease != nil && li.Key == k {
					found = strings.HasSuffix(li.Lease.Holder, " "+h)
					if !found {
						t.Errorf("standard_conforming_strings=%s: the holder reads %q, want it to end with %q", scs, li.Lease.Holder, h)
					}
				}
			}
			if !found {
				t.Errorf("standard_conforming_strings=%s, holder %q: the lease is not listed", scs, h)
			}
			if err := lk.Unlock(ctx); err != nil {
				t.Error(err)
			}
			l.Close()
			if owners := leaseOwners(t, obs, bk); len(owners) != 1 {
				t.Fatalf("standard_conforming_strings=%s, holder %q: the bystander's lease rows: %v", scs, h, owners)
			}
		}
	}
	var pwned bool
	if err := obs.QueryRow(ctx, "SELECT to_regclass('advlock_pwned') IS NOT NULL").Scan(&pwned); err != nil || pwned {
		t.Errorf("a holder's text created a table: %v %v", pwned, err)
	}
	if err := blk.Err(); err != nil {
		t.Errorf("the bystander's lease: %v", err)
	}
}

func mustParse(t *testing.T, url string) *neturl.URL {
	t.Helper()
	u, err := neturl.Parse(url)
	if err != nil {
		t.Fatal(err)
	}
	return u
}

// A waiting Lock rides out failures that pass: its polls' connections ended by the server (here every one of them,
// again and again), a poll left unanswered past its bound. It ended on the first one, with an error that matched
// context.DeadlineExceeded though the caller set no deadline; here it is granted once the holder lets go.
func TestLeaseWaitRidesOutFailures(t *testing.T) {
	t.Parallel()
	url := pgtest.URL(t)
	obs := pgtest.Conn(t, url)
	ctx := ctxT(t, 60*time.Second)
	app := fmt.Sprintf("advlock-wait-%d", time.Now().UnixNano())
	hang := &hangingPolls{Pool: pgxPool{p: pgtest.Pool(t, url, func(c *pgxpool.Config) {
		c.ConnConfig.RuntimeParams["application_name"] = app
	})}}
	waiter := New(nil, option(func(o *config.Options) { o.Backend = hang }), WithLeases(),
		WithLeaseLength(time.Second), withLeasePoll(20*time.Millisecond))
	defer waiter.Close()
	holder := New(pgtest.Pool(t, url, nil), WithLeases())
	defer holder.Close()
	k := key(t)
	lk, err := holder.TryLock(ctx, k)
	if err != nil {
		t.Fatal(err)
	}
	res := make(chan error, 1)
	var got *Lock
	go func() {
		var err error
		got, err = waiter.Lock(ctx, k)
		res <- err
	}()
	for range 5 { // the waiter's connections ended by the server, one round after another
		time.Sleep(200 * time.Millisecond)
		if _, err := obs.Exec(ctx, "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE application_name = $1", app); err != nil {
			t.Fatal(err)
		}
	}
	hang.next.Store(true) // the next poll goes unanswered past its bound (the 1 s lease's, less its margin)
	time.Sleep(1500 * time.Millisecond)
	select {
	case err := <-res:
		t.Fatalf("the wait ended before the holder let go: %v", err)
	default:
	}
	if hang.hung.Load() == 0 {
		t.Fatal("no poll hung: the test proves nothing")
	}
	if err := lk.Unlock(ctx); err != nil {
		t.Fatal(err)
	}
	if err := <-res; err != nil {
		t.Fatalf("the wait, once the holder let go: %v", err)
	}
	if err := got.Unlock(ctx); err != nil {
		t.Fatal(err)
	}
}

// hangingPolls is a pool whose next lease grant, once next is set, does not answer for 1.5 s.
type hangingPolls struct {
	session.Pool
	next atomic.Bool
	hung atomic.Int32
}

func (p *hangingPolls) Acquire(ctx context.Context) (session.Conn, error) {
	c, err := p.Pool.Acquire(ctx)
	if err != nil {
		return nil, err
	}
	return &hangingConn{Conn: c, p: p}, nil
}

type hangingConn struct {
	session.Conn
	p *hangingPolls
}

func (c *hangingConn) QueryText(ctx context.Context, sql string) (string, error) {
	if strings.Contains(sql, "advlock_lease_grant") && c.p.next.CompareAndSwap(true, false) {
		c.p.hung.Add(1)
		select {
		case <-time.After(1500 * time.Millisecond):
		case <-ctx.Done():
			return "", ctx.Err()
		}
	}
	return c.Conn.QueryText(ctx, sql)
}

// A renewal stuck on a dead connection is sent again on another before the trust runs out: a 9 s lease (renewed
// every 3 s, trusted 8.4 s) lived through a partition of 2 s that began as a renewal went out. It was lost: the stuck
// renewal spent its whole bound of 5 s, and the next came after the trust had ended. The lease table shows the
// renewals after the partition.
func TestLeaseRenewalAroundAPartition(t *testing.T) {
	t.Parallel()
	url := pgtest.URL(t)
	obs := pgtest.Conn(t, url)
	ctx := ctxT(t, 60*time.Second)
	proxy, pool := proxiedPool(t, url, 4)
	const length = 9 * time.Second
	l := New(pool, WithLeases(), WithLeaseLength(length))
	defer l.Close()
	k := key(t)
	v, _ := k.Int64()
	lk, err := l.TryLock(ctx, k)
	if err != nil {
		t.Fatal(err)
	}
	time.Sleep(length/3 - 100*time.Millisecond) // just before the first renewal
	proxy.Blackhole(true)
	time.Sleep(2 * time.Second)
	proxy.Blackhole(false)
	var renewedAfter bool
	for deadline := time.Now().Add(length); time.Now().Before(deadline) && lk.Err() == nil; time.Sleep(100 * time.Millisecond) {
		if err := obs.QueryRow(ctx, "SELECT expires > clock_timestamp() + interval '8 seconds' FROM "+lease.Table+
			" WHERE space = 1 AND key = $1", v).Scan(&renewedAfter); err != nil {
			t.Fatal(err)
		}
		if renewedAfter {
			break
		}
	}
	if err := lk.Err(); err != nil {
		t.Fatalf("a 9 s lease lost to a 2 s partition: %v", err)
	}
	if !renewedAfter {
		t.Fatal("the lease was not renewed after the partition")
	}
	if err := lk.Unlock(ctx); err != nil {
		t.Fatal(err)
	}
}

// A grant held back by a stalled pooler grants nothing when it arrives after its caller gave up. PgBouncer stopped
// (SIGSTOP) while a try's grant was in it: the try fails after its bound; continued, PgBouncer forwards the grant,
// which used to commit and leave the key held by nobody for the lease length. Here the key has no row a second
// after PgBouncer continued, and another Locker takes it at once.
func TestLeaseStalledPoolerGrantsNothingLate(t *testing.T) {
	t.Parallel()
	if testing.Short() {
		t.Skip("starts pgbouncer (-short)")
	}
	url := pgtest.URL(t)
	obs := pgtest.Conn(t, url)
	ctx := ctxT(t, 60*time.Second)
	b := pgtest.StartBouncer(t, url, "transaction")
	const length = 2 * time.Second
	l, err := Open(ctx, b.URL, WithLeases(), WithLeaseLength(length))
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	other := New(pgtest.Pool(t, url, nil), WithLeases())
	defer other.Close()
	warm, err := l.TryLock(ctx, key(t))
	if err != nil {
		t.Fatal(err)
	}
	if err := warm.Unlock(ctx); err != nil {
		t.Fatal(err)
	}
	k := key(t)
	if err := b.Stall(true); err != nil {
		t.Fatal(err)
	}
	stalled := true
	defer func() {
		if stalled {
			_ = b.Stall(false)
		}
	}()
	lk, err := l.TryLock(ctx, k)
	if err == nil {
		t.Fatalf("a try through a stopped PgBouncer was granted (token %d)", lk.Token())
	}
	t.Logf("the try through the stopped PgBouncer: %v", err)
	if err := b.Stall(false); err != nil {
		t.Fatal(err)
	}
	stalled = false
	time.Sleep(time.Second)
	if owners := leaseOwners(t, obs, k); len(owners) != 0 {
		t.Fatalf("a second after PgBouncer continued, the key's rows: %v (a lease held by nobody)", owners)
	}
	got, err := other.TryLock(ctx, k)
	if err != nil {
		t.Fatalf("another Locker's try of the key: %v", err)
	}
	if err := got.Unlock(ctx); err != nil {
		t.Fatal(err)
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
		l := New(pgtest.Pool(t, url, nil), WithLeases())
		_, err := l.TryLock(ctx, key(t))
		if err == nil || errors.Is(err, ErrStandby) || session.SQLState(err) != "25006" || !strings.Contains(err.Error(), "read-only") {
			t.Errorf("TryLock on a read-only primary (lease tables there: %v): %v, want a read-only error with SQLSTATE 25006, not ErrStandby", tables, err)
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
	if _, err := fc.Exec(ctx, "GRANT USAGE ON SEQUENCE "+session.FenceSeq+" TO "+second+"; GRANT SELECT, INSERT, UPDATE, DELETE ON "+
		lease.Table+", "+lease.Timelines+", "+lease.Waits+" TO "+second); err != nil {
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

// A grant that reaches the server after its caller gave up on it, and after the delete that undid it ran, grants
// nothing: it carries the latest moment it may still grant, on the server's clock as the client last knew it.
// Here a try's grant is held back on its way (it reaches the server 300 ms after the try's bound, on a connection
// of its own, as a request held in a stalled pooler or a retransmission would), while the try's undo goes through
// at once and finds nothing. Without that moment the grant committed a lease that nobody held.
func TestLeaseLateRequestGrantsNothing(t *testing.T) {
	t.Parallel()
	url := pgtest.URL(t)
	obs := pgtest.Conn(t, url)
	ctx := ctxT(t, 30*time.Second)
	late := &lateRequests{Pool: pgxPool{p: pgtest.Pool(t, url, nil)}, delay: 300 * time.Millisecond}
	l := New(nil, option(func(o *config.Options) { o.Backend = late }), WithLeases(), WithLeaseLength(time.Second))
	defer l.Close()
	defer late.wg.Wait()
	warm, err := l.TryLock(ctx, key(t)) // the tables checked and the server's clock known first
	if err != nil {
		t.Fatal(err)
	}
	if err := warm.Unlock(ctx); err != nil {
		t.Fatal(err)
	}
	k := key(t)
	late.next.Store(true)
	if lk, err := l.TryLock(ctx, k); err == nil {
		t.Fatalf("a try whose grant never answered was granted (token %d)", lk.Token())
	}
	late.wg.Wait() // the grant has reached the server
	if late.answer == "" {
		t.Fatal("the held-back grant never reached the server: the test proves nothing")
	}
	t.Logf("the held-back grant's answer: %q", late.answer)
	if owners := leaseOwners(t, obs, k); len(owners) != 0 {
		t.Fatalf("after a grant that arrived once its caller had given up and undone it: the key's rows %v (a lease held by nobody)", owners)
	}
}

// lateRequests is a pool whose next lease grant, once next is set, is held back: its caller waits for it until its
// bound ends, and the grant reaches the server delay after that, on a connection of its own.
type lateRequests struct {
	session.Pool
	delay  time.Duration
	next   atomic.Bool
	wg     sync.WaitGroup
	answer string // what the held-back grant was answered (after wg.Wait)
}

func (p *lateRequests) Acquire(ctx context.Context) (session.Conn, error) {
	c, err := p.Pool.Acquire(ctx)
	if err != nil {
		return nil, err
	}
	return &lateRequestConn{Conn: c, p: p}, nil
}

type lateRequestConn struct {
	session.Conn
	p *lateRequests
}

func (c *lateRequestConn) QueryText(ctx context.Context, sql string) (string, error) {
	if !strings.Contains(sql, "advlock_lease_grant") || !c.p.next.CompareAndSwap(true, false) {
		return c.Conn.QueryText(ctx, sql)
	}
	<-ctx.Done() // the caller gives up at its bound
	c.p.wg.Add(1)
	go func() {
		defer c.p.wg.Done()
		time.Sleep(c.p.delay)
		bg, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		other, err := c.p.Pool.Acquire(bg)
		if err != nil {
			return
		}
		c.p.answer, err = other.QueryText(bg, sql)
		if err != nil {
			other.Destroy()
			return
		}
		other.Release()
	}()
	return "", ctx.Err()
}

// A grant whose answer is lost is undone, and tried again until the server answers: here the grant commits, its
// answer is lost and the link goes down for 1.5 s, so the undo the try sends at once fails; the undo goes on apart,
// and the key has no row soon after the link is back. Undone once only, the lease stayed to nobody until another
// Locker had seen it unchanged for a lease length.
func TestLeaseUndoneOnceTheLinkIsBack(t *testing.T) {
	t.Parallel()
	url := pgtest.URL(t)
	obs := pgtest.Conn(t, url)
	ctx := ctxT(t, 30*time.Second)
	link := &lostAnswer{Pool: pgxPool{p: pgtest.Pool(t, url, nil)}, down: 1500 * time.Millisecond}
	l := New(nil, option(func(o *config.Options) { o.Backend = link }), WithLeases(), WithLeaseLength(time.Second))
	defer l.Close()
	k := key(t)
	if lk, err := l.TryLock(ctx, key(t)); err != nil { // the tables made first
		t.Fatal(err)
	} else if err := lk.Unlock(ctx); err != nil {
		t.Fatal(err)
	}
	link.next.Store(true)
	if lk, err := l.TryLock(ctx, k); err == nil {
		t.Fatalf("a try whose grant's answer was lost was granted (token %d)", lk.Token())
	}
	if owners := leaseOwners(t, obs, k); len(owners) != 1 {
		t.Fatalf("the grant whose answer was lost: the key's rows %v, want its lease (the test proves nothing otherwise)", owners)
	}
	time.Sleep(link.down + 1500*time.Millisecond)
	if owners := leaseOwners(t, obs, k); len(owners) != 0 {
		t.Fatalf("1.5 s after the link came back, the key's rows: %v (a lease held by nobody)", owners)
	}
}

// lostAnswer is a pool whose next lease grant, once next is set, runs but its answer is lost, and whose link is
// then down (every connection refused) for down.
type lostAnswer struct {
	session.Pool
	down      time.Duration
	next      atomic.Bool
	downUntil atomic.Int64 // unix nanoseconds
}

func (p *lostAnswer) Acquire(ctx context.Context) (session.Conn, error) {
	if time.Now().UnixNano() < p.downUntil.Load() {
		return nil, errors.New("link down")
	}
	c, err := p.Pool.Acquire(ctx)
	if err != nil {
		return nil, err
	}
	return &lostAnswerConn{Conn: c, p: p}, nil
}

type lostAnswerConn struct {
	session.Conn
	p *lostAnswer
}

func (c *lostAnswerConn) QueryText(ctx context.Context, sql string) (string, error) {
	r, err := c.Conn.QueryText(ctx, sql)
	if err == nil && strings.Contains(sql, "advlock_lease_grant") && c.p.next.CompareAndSwap(true, false) {
		c.p.downUntil.Store(time.Now().Add(c.p.down).UnixNano())
		return "", errors.New("connection reset: the answer was lost")
	}
	return r, err
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
