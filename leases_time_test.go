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
		lk := tryUntilServed(ctx, t, holder, k) // the round before cut the holder off
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
		proxy.EndBlackholeReset() // as a network that lost a connection's bytes ends it (see TestLeaseTrustEndsBeforeTakeover)
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
	// The server ends the connections of the waiter's first checks (of the fencing sequence, then of the lease
	// tables) as they ask.
	hang.killFence.Store(true)
	hang.killTables.Store(true)
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
	if hang.killFence.Load() || hang.killTables.Load() {
		t.Fatal("the first checks' connections were not ended: the test proves nothing")
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

// hangingPolls is a pool whose next lease grant, once next is set, does not answer for 1.5 s, and whose next check
// of the fencing sequence (killFence) or of the lease tables (killTables) has its connection ended by the server.
type hangingPolls struct {
	session.Pool
	next       atomic.Bool
	hung       atomic.Int32
	killFence  atomic.Bool
	killTables atomic.Bool
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

// terminated ends the connection's own backend, and returns what the server says then.
func (c *hangingConn) terminated(ctx context.Context) error {
	_, err := c.Conn.QueryInt(ctx, "SELECT pg_terminate_backend(pg_backend_pid())::int")
	if err == nil {
		err = errors.New("the server did not end the connection")
	}
	return err
}

func (c *hangingConn) QueryInt(ctx context.Context, sql string, args ...any) (int64, error) {
	if strings.Contains(sql, "to_regclass('"+session.FenceSeq) && c.p.killFence.CompareAndSwap(true, false) {
		return 0, c.terminated(ctx)
	}
	return c.Conn.QueryInt(ctx, sql, args...)
}

func (c *hangingConn) QueryText(ctx context.Context, sql string) (string, error) {
	if strings.Contains(sql, lease.ExistsSQL) && c.p.killTables.CompareAndSwap(true, false) {
		return "", c.terminated(ctx)
	}
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
	// No cancel request: the try's, given up in the stopped PgBouncer, would reach it with the try's statement and
	// its client's close, the moment PgBouncer 1.18 can crash at, and could end the late grant this test is about.
	l, err := Open(ctx, b.URL, WithLeases(), WithLeaseLength(length),
		WithPoolConfig(func(c *pgxpool.Config) { pgtest.DropCancels(&c.ConnConfig.Config) }))
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
// Locker had seen it unchanged for a lease length. The lease is 10 s, so that the sweep (which deletes such a row
// once it has watched it past its expiry for a lease length) cannot be what deletes it here.
func TestLeaseUndoneOnceTheLinkIsBack(t *testing.T) {
	t.Parallel()
	url := pgtest.URL(t)
	obs := pgtest.Conn(t, url)
	ctx := ctxT(t, 30*time.Second)
	link := &lostAnswer{Pool: pgxPool{p: pgtest.Pool(t, url, nil)}, down: 1500 * time.Millisecond}
	l := New(nil, option(func(o *config.Options) { o.Backend = link }), WithLeases(), WithLeaseLength(10*time.Second))
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

// lostAnswer is a pool whose next grant, once next is set, is made but its answer is lost, and whose link is then
// down (every connection refused) for down. The link's window is kept on the monotonic clock: a step of the
// machine's wall clock (seen once in a suite run: the test's sleep, counted from a wall-clock end, came out 2 s
// short) neither shortens nor lengthens it.
type lostAnswer struct {
	session.Pool
	down time.Duration
	next atomic.Bool

	mu        sync.Mutex
	downUntil time.Time // with its monotonic reading; zero: the link is up
}

// linkDown takes the link down for d from now (0: up now).
func (p *lostAnswer) linkDown(d time.Duration) {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.downUntil = time.Time{}
	if d > 0 {
		p.downUntil = time.Now().Add(d)
	}
}

// upIn is how long until the link is up again (0 or less: it is).
func (p *lostAnswer) upIn() time.Duration {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.downUntil.IsZero() {
		return 0
	}
	return time.Until(p.downUntil)
}

func (p *lostAnswer) Acquire(ctx context.Context) (session.Conn, error) {
	if p.upIn() > 0 {
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

// QueryText loses the answer of a grant that was made ("g"), not of one refused (a step of the server's clock may
// make a grant too late, which the client then sends again).
func (c *lostAnswerConn) QueryText(ctx context.Context, sql string) (string, error) {
	r, err := c.Conn.QueryText(ctx, sql)
	if err == nil && strings.Contains(sql, "advlock_lease_grant") && strings.HasPrefix(r, "g ") && c.p.next.CompareAndSwap(true, false) {
		c.p.linkDown(c.p.down)
		return "", errors.New("connection reset: the answer was lost")
	}
	return r, err
}

// A taker waits the holder's lease length, not its own: the holder's length is in its row (after its owner id). A
// holder of 3 s leases cut off, a taker of 1 s leases polling: the taker is granted only after the holder has
// stopped trusting its lease (counted from its own 1 s, it was granted two seconds too early).
func TestLeaseTakeoverWaitsTheHolderLength(t *testing.T) {
	t.Parallel()
	url := pgtest.URL(t)
	ctx := ctxT(t, 60*time.Second)
	proxy, pool := proxiedPool(t, url, 4)
	holder := New(pool, WithLeases(), WithLeaseLength(3*time.Second))
	defer holder.Close()
	taker := New(pgtest.Pool(t, url, nil), WithLeases(), WithLeaseLength(time.Second), withLeasePoll(5*time.Millisecond))
	defer taker.Close()
	k := key(t)
	lk, err := holder.TryLock(ctx, k)
	if err != nil {
		t.Fatal(err)
	}
	wait := startTakeover(ctx, t, taker, k, lk, 20*time.Second)
	time.Sleep(1200 * time.Millisecond) // a renewal confirmed, then silence
	proxy.Blackhole(true)
	defer proxy.Blackhole(false)
	_, told, granted := wait()
	t.Logf("the holder stopped trusting %v before the taker's grant", granted.Sub(told).Round(time.Millisecond))
}

// What its holder lost is deleted once the server answers, and Close makes one last attempt: a lease whose
// renewals went unanswered (the link down for longer than its trust) has its row deleted soon after the link is
// back, without waiting for another Locker's watch of it; and a grant in doubt when Close is called (its answer
// lost, the link back just before) is deleted by Close. Without them each row stayed until a takeover.
func TestLeaseLostRowsDeleted(t *testing.T) {
	t.Parallel()
	url := pgtest.URL(t)
	obs := pgtest.Conn(t, url)
	ctx := ctxT(t, 60*time.Second)
	link := &lostAnswer{Pool: pgxPool{p: pgtest.Pool(t, url, nil)}, down: 2500 * time.Millisecond}
	l := New(nil, option(func(o *config.Options) { o.Backend = link }), WithLeases(), WithLeaseLength(time.Second))
	defer l.Close()
	k := key(t)
	lk, err := l.TryLock(ctx, k)
	if err != nil {
		t.Fatal(err)
	}
	link.linkDown(link.down) // every renewal fails from now on, for 2.5 s
	pgtest.WaitClosed(t, lk.Done(), 5*time.Second, "a lease whose renewals all fail")
	time.Sleep(link.upIn() + time.Second)
	if owners := leaseOwners(t, obs, k); len(owners) != 0 {
		t.Errorf("a second after the link came back, the lost lease's rows: %v", owners)
	}

	k2 := key(t)
	link.down = time.Minute
	link.next.Store(true)
	if lk, err := l.TryLock(ctx, k2); err == nil {
		t.Fatalf("a try whose answer was lost was granted (token %d)", lk.Token())
	}
	time.Sleep(time.Second) // its undo tried apart, and failing, every half second
	if owners := leaseOwners(t, obs, k2); len(owners) != 1 {
		t.Fatalf("the grant whose answer was lost: rows %v, want its lease still there (the test proves nothing otherwise)", owners)
	}
	link.linkDown(0) // the link back as Close is called: its last attempt goes through
	l.Close()
	if owners := leaseOwners(t, obs, k2); len(owners) != 0 {
		t.Errorf("after Close, the grant in doubt's rows: %v", owners)
	}
}

// A try whose grant goes unanswered (a network that swallows it) returns after the grant's bound, 5 s at most,
// and leaves its undo to go on apart: the undo's first attempt, made in the call, met the same silence and doubled
// the wait (10 s for a try whose ctx ended after 200 ms). Once the link is back the key is free.
func TestLeaseTryUnansweredReturnsWithinItsBound(t *testing.T) {
	t.Parallel()
	url := pgtest.URL(t)
	obs := pgtest.Conn(t, url)
	ctx := ctxT(t, 60*time.Second)
	proxy, pool := proxiedPool(t, url, 4)
	l := New(pool, WithLeases())
	defer l.Close()
	if lk, err := l.TryLock(ctx, key(t)); err != nil { // the tables, the clock, a connection made
		t.Fatal(err)
	} else if err := lk.Unlock(ctx); err != nil {
		t.Fatal(err)
	}
	k := key(t)
	proxy.Blackhole(true)
	tctx, cancel := context.WithTimeout(ctx, 200*time.Millisecond)
	defer cancel()
	start := time.Now()
	_, err := l.TryLock(tctx, k)
	took := time.Since(start)
	proxy.Blackhole(false)
	if err == nil {
		t.Fatal("a try through a link that swallows everything was granted")
	}
	// The bound is 5 s; 8 s leaves a loaded machine its slack, and fails the doubled wait.
	if took > 8*time.Second {
		t.Errorf("a try whose grant went unanswered returned after %v, want the grant's bound (5 s): %v", took, err)
	}
	t.Logf("returned after %v: %v", took.Round(time.Millisecond), err)
	for deadline := time.Now().Add(10 * time.Second); ; time.Sleep(100 * time.Millisecond) {
		if _, held := leaseRow(t, obs, k); !held {
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("the unanswered grant's row was still there 10 s after the link came back")
		}
	}
}
