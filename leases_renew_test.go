package advlock

import (
	"fmt"
	"testing"
	"time"

	"github.com/advlock/advlock/internal/config"
	"github.com/advlock/advlock/internal/testkit/pgtest"
	"github.com/jackc/pgx/v5/pgxpool"
)

// A Locker renews the leases it holds together: the server counts one call of the renewal function for many rows
// renewed, not one for each (a Locker holding 2,000 leases sent 2,000 statements a second before). Counted by the
// server itself: its statistics of the function's calls (track_functions) and of the rows updated, in a database
// nobody else uses. Every lease stays held throughout, renewed several times over.
func TestLeaseRenewalsShareStatements(t *testing.T) {
	t.Parallel()
	url := pgtest.FreshDB(t, pgtest.URL(t))
	pool := pgtest.Pool(t, url, func(c *pgxpool.Config) { c.ConnConfig.RuntimeParams["track_functions"] = "pl" })
	obs := pgtest.Conn(t, url)
	ctx := ctxT(t, 60*time.Second)
	const n = 200
	l := New(pool, WithLeases(), WithLeaseLength(1500*time.Millisecond)) // renewed every 500 ms
	defer l.Close()
	var held []*Lock
	for i := range n {
		lk, err := l.TryLock(ctx, NameKey(fmt.Sprintf("renewals-%d", i)))
		if err != nil {
			t.Fatal(err)
		}
		held = append(held, lk)
	}
	time.Sleep(3 * time.Second) // twice the length: held only if renewed, twice or more each
	for _, lk := range held {
		select {
		case <-lk.Done():
			t.Fatalf("a lease ended while its holder lived: %v", lk.Err())
		default:
		}
		if err := lk.Unlock(ctx); err != nil {
			t.Fatal(err)
		}
	}
	l.Close()
	pool.Close() // its backends exit, and report their statistics as they do
	var calls, updates int64
	for deadline := time.Now().Add(10 * time.Second); ; time.Sleep(200 * time.Millisecond) {
		var c, u int64
		err := obs.QueryRow(ctx, `SELECT pg_stat_clear_snapshot()::text || '',
			coalesce((SELECT calls FROM pg_stat_user_functions WHERE schemaname = 'public' AND funcname = $1), 0),
			coalesce((SELECT n_tup_upd FROM pg_stat_user_tables WHERE schemaname = 'public' AND relname = $2), 0)`,
			"advlock_lease_renew_many_v2", "advlock_lease").Scan(new(string), &c, &u)
		if err != nil {
			t.Fatal(err)
		}
		if c > 0 && c == calls && u == updates || time.Now().After(deadline) {
			break
		}
		calls, updates = c, u
	}
	renewed := updates - n // each grant updates its own row once, to draw its term
	t.Logf("%d leases held 3 s: %d rows renewed by %d calls of the renewal function (%.1f a call)", n, renewed, calls,
		float64(renewed)/float64(max(calls, 1)))
	if renewed < 2*n {
		t.Fatalf("%d rows renewed, want 2 or more for each of %d leases held twice their length: the count is not the server's", renewed, n)
	}
	if calls == 0 || renewed < 20*calls {
		t.Errorf("%d renewals in %d statements, want 20 or more a statement", renewed, calls)
	}
}

// Close waits for the renewal statements still on the wire: nothing of the Locker's runs after it returns (the
// caller may close the pool next, which waits for every connection given out). Here every renewal's answer reaches
// the holder 400 ms after the server sent it, and the leases are released and the Locker closed while one is on
// its way; before, Close returned with the renewal's goroutine still reading it.
func TestLeaseCloseWaitsForRenewals(t *testing.T) {
	t.Parallel()
	ctx := ctxT(t, 60*time.Second)
	p := &lateReplies{Pool: pgxPool{p: pgtest.Pool(t, pgtest.URL(t), nil)}, delay: 400 * time.Millisecond}
	p.slow.Store(true)
	l := New(nil, option(func(o *config.Options) { o.Backend = p }), WithLeases(), WithLeaseLength(1500*time.Millisecond))
	defer l.Close()
	var held []*Lock
	for range 20 {
		lk, err := l.TryLock(ctx, key(t))
		if err != nil {
			t.Fatal(err)
		}
		held = append(held, lk)
	}
	for deadline := time.Now().Add(10 * time.Second); p.onWire.Load() == 0; time.Sleep(time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatal("no renewal went out")
		}
	}
	for _, lk := range held {
		if err := lk.Unlock(ctx); err != nil {
			t.Fatal(err)
		}
	}
	l.Close()
	if n := p.onWire.Load(); n != 0 {
		t.Errorf("Close returned with %d renewal statements still on the wire", n)
	}
}
