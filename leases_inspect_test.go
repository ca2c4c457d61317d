package advlock

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/advlock/advlock/internal/testkit/pgtest"
)

// Leases where people look: Inspect, Leader, BreakLease, Stats and the observers.

// Inspect and Leader see leases as the server's rows: a held lease is listed with its term, its holder and the
// time it has left, a pair key decoded as the pair; Leader finds it, a lease Locker's Leader answers for its
// leases and a session Locker's for its session locks (a session lock of the same number held beside it is the
// package Leader's first answer). BreakLease of another term deletes nothing; of the holder's term it deletes the
// row and the holder is told at its next renewal. A database without the lease table lists none, even inside a
// transaction that goes on afterwards.
func TestLeaseInspect(t *testing.T) {
	b := setup(t)
	ctx := ctxT(t, 60*time.Second)
	l := New(b.pool, WithLeases(), WithLeaseLength(3*time.Second))
	defer l.Close()
	sl := New(b.pool)
	defer sl.Close()
	k, pk := key(t), PairKey(int32(time.Now().UnixNano()), -7)
	lk, err := l.TryLock(ctx, k)
	if err != nil {
		t.Fatal(err)
	}
	plk, err := l.TryLock(ctx, pk)
	if err != nil {
		t.Fatal(err)
	}
	defer plk.Unlock(ctx)
	rows, err := Inspect(ctx, b.obs)
	if err != nil {
		t.Fatal(err)
	}
	found := map[string]*LeaseInfo{}
	for _, r := range rows {
		if r.Lease != nil && (r.Key.Equal(k) || r.Key.Equal(pk)) { // other tests' leases and waits may be listed too
			if !r.Granted || r.Shared || r.PID != 0 {
				t.Errorf("a lease row: granted %v, shared %v, pid %d", r.Granted, r.Shared, r.PID)
			}
			found[r.Key.String()] = r.Lease
		}
	}
	for _, c := range []struct {
		k  Key
		lk *Lock
	}{{k, lk}, {pk, plk}} {
		li := found[c.k.String()]
		switch {
		case li == nil:
			t.Fatalf("Inspect did not list the lease of %s: %v", c.k, found)
		case li.Token != c.lk.Token():
			t.Errorf("%s: listed term %d, the lock's token is %d", c.k, li.Token, c.lk.Token())
		case li.Left <= 0 || li.Left > 3*time.Second:
			t.Errorf("%s: %v left of a 3s lease", c.k, li.Left)
		case !strings.Contains(li.Holder, " pid "+strconv.Itoa(os.Getpid())):
			t.Errorf("%s: holder %q does not name this process", c.k, li.Holder)
		}
	}
	who, ok, err := Leader(ctx, b.obs, k)
	if err != nil || !ok || who.Lease == nil || who.Lease.Token != lk.Token() {
		t.Fatalf("Leader of a key held as a lease: %+v %v %v", who, ok, err)
	}
	slk, err := sl.TryLock(ctx, k) // a session lock of the same number: leases do not exclude it
	if err != nil {
		t.Fatalf("a session lock of a number held as a lease: %v", err)
	}
	if who, ok, err := Leader(ctx, b.obs, k); err != nil || !ok || who.Lease != nil || who.PID != int32(slk.PID()) {
		t.Errorf("package Leader with a session lock beside the lease: %+v %v %v, want the session (pid %d)", who, ok, err, slk.PID())
	}
	if who, ok, err := l.Leader(ctx, k); err != nil || !ok || who.Lease == nil {
		t.Errorf("a lease Locker's Leader: %+v %v %v, want the lease", who, ok, err)
	}
	_ = slk.Unlock(ctx)
	if _, ok, err := sl.Leader(ctx, k); err != nil || ok {
		t.Errorf("a session Locker's Leader of a key held only as a lease: %v %v, want none", ok, err)
	}

	if gone, err := BreakLease(ctx, b.obs, k, lk.Token()+1); err != nil || gone {
		t.Fatalf("BreakLease of another term: %v %v", gone, err)
	}
	if term, ok := leaseRow(t, b.obs, k); !ok || term != lk.Token() {
		t.Fatal("BreakLease of another term deleted the lease")
	}
	if gone, err := BreakLease(ctx, b.obs, k, lk.Token()); err != nil || !gone {
		t.Fatalf("BreakLease of the holder's term: %v %v", gone, err)
	}
	if _, ok := leaseRow(t, b.obs, k); ok {
		t.Error("BreakLease left the row")
	}
	pgtest.WaitClosed(t, lk.Done(), 3*time.Second, "a broken lease told at the next renewal")
	if !errors.Is(lk.Err(), ErrLockLost) {
		t.Errorf("a broken lease: %v", lk.Err())
	}

	fresh := pgtest.Conn(t, pgtest.FreshDB(t, pgtest.URL(t)))
	tx, err := fresh.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer tx.Rollback(ctx)
	if rows, err := Inspect(ctx, tx); err != nil || len(rows) != 0 {
		t.Fatalf("Inspect of a database without the lease table: %v %v", rows, err)
	}
	if _, err := tx.Exec(ctx, "SELECT 1"); err != nil {
		t.Errorf("the transaction Inspect read in: %v", err)
	}
}

// A lease holds no session, and says so: Stats counts it in Held and HeldLeases, not in OwnSessions, and the
// observer's LockEnd names it a lease, with its token and no pid.
func TestLeaseStatsAndObserver(t *testing.T) {
	b := setup(t)
	ctx := ctxT(t, 30*time.Second)
	ends := make(chan LockEnd, 1)
	l := New(b.pool, WithLeases(), WithObserver(endObserver(func(e LockEnd) { ends <- e })))
	defer l.Close()
	lk, err := l.TryLock(ctx, key(t))
	if err != nil {
		t.Fatal(err)
	}
	if st := l.Stats(); st.Held != 1 || st.HeldLeases != 1 || st.OwnSessions != 0 || st.HeldShared != 0 {
		t.Errorf("Stats while a lease is held: %+v", st)
	}
	if err := lk.Unlock(ctx); err != nil {
		t.Fatal(err)
	}
	select {
	case e := <-ends:
		if e.Session != "lease" || e.PID != 0 || e.Token != lk.Token() || e.Cause != CauseReleased {
			t.Errorf("LockEnd of a lease: %+v", e)
		}
	case <-time.After(5 * time.Second):
		t.Fatal("no LockEnd")
	}
}

// endObserver is an Observer that hands each LockEnd to f.
type endObserver func(LockEnd)

func (f endObserver) LockStart(ctx context.Context, _ LockCall) (context.Context, func(LockOutcome)) {
	return ctx, func(LockOutcome) {}
}
func (f endObserver) Session(SessionEvent) {}
func (f endObserver) LockEnd(e LockEnd)    { f(e) }

// Inspect lists rows that no Locker writes (an expiry at infinity, a time past any driver's years, written by hand)
// as held for ever, beside the others, instead of failing: such a row holds its key until someone deletes it, and
// a try or a wait for its key is refused or waits.
func TestLeaseInspectRowsWrittenByHand(t *testing.T) {
	ctx := ctxT(t, 30*time.Second)
	url := pgtest.FreshDB(t, pgtest.URL(t))
	conn := pgtest.Conn(t, url)
	l := New(pgtest.Pool(t, url, nil), WithLeases())
	defer l.Close()
	k := key(t)
	lk, err := l.TryLock(ctx, k) // makes the tables
	if err != nil {
		t.Fatal(err)
	}
	defer lk.Unlock(ctx)
	for _, q := range []string{
		"INSERT INTO public.advlock_lease (space, key, owner, term, expires, granted, holder) VALUES " +
			"(1, 1, 'by hand', 1, 'infinity', '-infinity', 'hand 1'), (1, 2, 'by hand', 2, '20000-01-01', 'infinity', 'hand 2'), " +
			"(1, 3, 'by hand/500', 3, '-infinity', clock_timestamp(), 'hand 3')",
		"INSERT INTO public.advlock_lease_wait (space, key, waiter, since, seen, holder) VALUES " +
			"(1, 1, 'by hand', '-infinity', clock_timestamp(), 'hand 3')",
	} {
		if _, err := conn.Exec(ctx, q); err != nil {
			t.Fatal(err)
		}
	}
	rows, err := Inspect(ctx, conn)
	if err != nil {
		t.Fatalf("Inspect with rows written by hand: %v", err)
	}
	got := map[string]LockInfo{}
	for _, r := range rows {
		if r.Lease != nil {
			got[fmt.Sprint(r.Granted, " ", r.Key)] = r
		}
	}
	one, two, three := Int64Key(1).String(), Int64Key(2).String(), Int64Key(3).String()
	for _, want := range []string{"true " + one, "true " + two, "true " + three, "false " + one} {
		if _, ok := got[want]; !ok {
			t.Errorf("Inspect did not list %q: %v", want, got)
		}
	}
	year := func(at time.Time) int { return at.UTC().Year() }
	if r := got["true "+one]; r.Lease != nil && (r.Lease.Left < 100*365*24*time.Hour || year(r.Lease.Expires) != 9999 || year(r.Lease.Granted) != 1) {
		t.Errorf("a lease whose expiry is infinity: %+v, want 9999-12-30, the longest time left, granted 0001-01-02", *r.Lease)
	}
	if r := got["true "+two]; r.Lease != nil && (year(r.Lease.Expires) != 9999 || year(r.Lease.Granted) != 9999) {
		t.Errorf("a lease of year 20000: %+v, want 9999-12-30", *r.Lease)
	}
	if r := got["true "+three]; r.Lease != nil && (r.Lease.Left < 100*365*24*time.Hour || year(r.Lease.Expires) != 9999) {
		t.Errorf("a lease whose expiry is -infinity (held until deleted): %+v, want 9999-12-30, the longest time left", *r.Lease)
	}
	if r := got["false "+one]; r.WaitStart == nil || year(*r.WaitStart) != 1 {
		t.Errorf("a wait since -infinity: %+v, want since 0001-01-02", r)
	}
	// What advlock ls --json prints: Go's JSON encoding of a time needs years 0 to 9999, in whatever zone the
	// driver gives it.
	for _, zone := range []*time.Location{time.FixedZone("+14", 14*3600), time.FixedZone("-12", -12*3600)} {
		for _, r := range got {
			at := []time.Time{r.Lease.Granted, r.Lease.Expires}
			if r.WaitStart != nil {
				at = append(at, *r.WaitStart)
			}
			for _, a := range at {
				if _, err := json.Marshal(a.In(zone)); err != nil {
					t.Errorf("%s in zone %s: %v", a, zone, err)
				}
			}
		}
	}
	if _, ok := got["true "+k.String()]; !ok {
		t.Errorf("Inspect did not list the Locker's own lease of %s beside them", k)
	}
	// Their keys are held: a try is refused, a wait waits (the grants of earlier versions failed with an SQL error).
	for _, hk := range []Key{Int64Key(1), Int64Key(2), Int64Key(3)} {
		if _, err := l.TryLock(ctx, hk); !errors.Is(err, ErrNotAcquired) {
			t.Errorf("TryLock of %s, held by a row written by hand: %v, want ErrNotAcquired", hk, err)
		}
		wctx, cancel := context.WithTimeout(ctx, 500*time.Millisecond)
		_, err := l.Lock(wctx, hk)
		cancel()
		if !errors.Is(err, context.DeadlineExceeded) {
			t.Errorf("Lock of %s with 500 ms, held by a row written by hand: %v, want the deadline", hk, err)
		}
	}
	// What ls lists, break deletes (the row at -infinity was listed by nobody before, and so could not be broken).
	if r := got["true "+three]; r.Lease == nil {
		t.Fatal("the row at -infinity was not listed: nothing to break")
	}
	if ok, err := BreakLease(ctx, conn, Int64Key(3), got["true "+three].Lease.Token); err != nil || !ok {
		t.Errorf("BreakLease of the row at -infinity: %v, %v", ok, err)
	}
	if lk, err := l.TryLock(ctx, Int64Key(3)); err != nil {
		t.Errorf("TryLock after the row at -infinity was broken: %v", err)
	} else {
		_ = lk.Unlock(ctx)
	}
}
