package lease

import (
	"context"
	"os"
	"testing"
	"time"

	"github.com/advlock/advlock/internal/session"
	"github.com/advlock/advlock/internal/testkit/pgtest"
	"github.com/jackc/pgx/v5"
)

func TestMain(m *testing.M) { os.Exit(pgtest.Main(m)) }

func one(t *testing.T, c *pgx.Conn, sql string) int64 {
	t.Helper()
	var r int64
	if err := c.QueryRow(context.Background(), sql).Scan(&r); err != nil {
		t.Fatalf("%v\n%s", err, sql)
	}
	return r
}

// The statements at the moments they race, on a real server: a grant takes a free key and refuses a held one; a
// renewal, a release and a grant's undo are keyed on the owner and the term, so a holder whose lease expired and
// was taken over can neither renew nor release the new holder's (a renewal racing expiry fails even with nobody
// waiting); the takeover's term is greater; an expired lease is taken over, a live one never.
func TestStatements(t *testing.T) {
	url := pgtest.FreshDB(t, pgtest.URL(t))
	c := pgtest.Conn(t, url)
	ctx := context.Background()
	if _, err := c.Exec(ctx, "CREATE SEQUENCE "+session.FenceSeq+"; "+CreateSQL); err != nil {
		t.Fatal(err)
	}
	for _, id := range []session.ID{{V: 42}, {Pair: true, V: 7<<32 | 9}} {
		length := 300 * time.Millisecond
		a := one(t, c, GrantSQL(id, "owner-a", "a", length, ""))
		if a <= 0 {
			t.Fatalf("grant of a free key: %d", a)
		}
		if r := one(t, c, GrantSQL(id, "owner-b", "b", length, "")); r != resultHeld {
			t.Fatalf("grant of a held key: %d, want %d", r, resultHeld)
		}
		if r := one(t, c, RenewSQL(id, "owner-a", a, length)); r != 1 {
			t.Fatalf("renewal by the holder: %d", r)
		}
		if r := one(t, c, RenewSQL(id, "owner-b", a, length)); r != 0 {
			t.Errorf("renewal by another owner: %d", r)
		}
		if r := one(t, c, RenewSQL(id, "owner-a", a+1, length)); r != 0 {
			t.Errorf("renewal of another term: %d", r)
		}
		time.Sleep(length + 50*time.Millisecond)
		if r := one(t, c, RenewSQL(id, "owner-a", a, length)); r != 0 {
			t.Errorf("renewal of an expired lease (nobody took it over): %d", r)
		}
		b := one(t, c, GrantSQL(id, "owner-b", "b", length, ""))
		if b <= a {
			t.Fatalf("takeover of an expired lease: %d, want a term greater than %d", b, a)
		}
		for what, sql := range map[string]string{
			"renewal": RenewSQL(id, "owner-a", a, length), "release": ReleaseSQL(id, "owner-a", a), "undo": UndoSQL(id, "owner-a"),
		} {
			if r := one(t, c, sql); r != 0 {
				t.Errorf("%s by the holder whose lease was taken over: %d", what, r)
			}
		}
		if r := one(t, c, RenewSQL(id, "owner-b", b, length)); r != 1 {
			t.Errorf("the new holder's renewal after the old holder's tries: %d", r)
		}
		if r := one(t, c, ReleaseSQL(id, "owner-b", b)); r != 1 {
			t.Errorf("release by the holder: %d", r)
		}
		if r := one(t, c, ReleaseSQL(id, "owner-b", b)); r != 0 {
			t.Errorf("second release: %d", r)
		}
	}
	// The two key spaces never overlap: int8 key 7<<32|9 is not the pair (7, 9).
	if r := one(t, c, GrantSQL(session.ID{V: 7<<32 | 9}, "x", "x", time.Second, "")); r <= 0 {
		t.Errorf("int8 key beside a pair of the same bits: %d", r)
	}
	if r := one(t, c, GrantSQL(session.ID{Pair: true, V: 7<<32 | 9}, "y", "y", time.Second, "")); r <= 0 {
		t.Errorf("pair beside an int8 key of the same bits: %d", r)
	}
}

// The queue of waits, statement by statement: waiters that find the key held enter its queue in order; once it is
// free the key goes to the one that has waited longest, not to a later waiter nor to a try; a granted waiter's rows
// are gone; a wait last seen more than WaitStale ago holds nobody back; LeaveSQL takes a wait out.
func TestWaitQueue(t *testing.T) {
	url := pgtest.FreshDB(t, pgtest.URL(t))
	c := pgtest.Conn(t, url)
	ctx := context.Background()
	if _, err := c.Exec(ctx, "CREATE SEQUENCE "+session.FenceSeq+"; "+CreateSQL); err != nil {
		t.Fatal(err)
	}
	id := session.ID{V: 42}
	length := time.Minute
	a := one(t, c, GrantSQL(id, "a", "a", length, ""))
	for _, w := range []string{"w1", "w2", "w3"} {
		if r := one(t, c, GrantSQL(id, "o-"+w, w, length, w)); r != resultHeld {
			t.Fatalf("%s's poll of a held key: %d", w, r)
		}
		time.Sleep(5 * time.Millisecond) // distinct since
	}
	var queued int
	if err := c.QueryRow(ctx, "SELECT count(*) FROM "+Waits+" WHERE key = 42").Scan(&queued); err != nil || queued != 3 {
		t.Fatalf("waits queued: %d %v, want 3", queued, err)
	}
	if r := one(t, c, ReleaseSQL(id, "a", a)); r != 1 {
		t.Fatal("release")
	}
	if r := one(t, c, GrantSQL(id, "o-w2", "w2", length, "w2")); r != resultHeld {
		t.Errorf("the second waiter took the key before the first: %d", r)
	}
	if r := one(t, c, GrantSQL(id, "try", "try", length, "")); r != resultHeld {
		t.Errorf("a try took the key while waiters wait: %d", r)
	}
	w1 := one(t, c, GrantSQL(id, "o-w1", "w1", length, "w1"))
	if w1 <= a {
		t.Fatalf("the first waiter's poll of the free key: %d", w1)
	}
	if err := c.QueryRow(ctx, "SELECT count(*) FROM "+Waits+" WHERE waiter = 'w1'").Scan(&queued); err != nil || queued != 0 {
		t.Errorf("the granted waiter's rows: %d %v", queued, err)
	}
	one(t, c, ReleaseSQL(id, "o-w1", w1))
	// w2's wait goes stale (its process died): w3 is next; then w3 leaves, and a try takes the key.
	if _, err := c.Exec(ctx, "UPDATE "+Waits+" SET seen = clock_timestamp() - interval '4 seconds' WHERE waiter = 'w2'"); err != nil {
		t.Fatal(err)
	}
	w3 := one(t, c, GrantSQL(id, "o-w3", "w3", length, "w3"))
	if w3 <= w1 {
		t.Fatalf("the next live waiter, past a stale one: %d", w3)
	}
	one(t, c, ReleaseSQL(id, "o-w3", w3))
	if r := one(t, c, GrantSQL(id, "o-w4", "w4", length, "w4")); r <= 0 {
		t.Errorf("a new waiter, with only a stale wait queued: %d", r)
	}
	one(t, c, UndoSQL(id, "o-w4"))
	if r := one(t, c, LeaveSQL("w2")); r != 1 {
		t.Errorf("LeaveSQL of a queued wait: %d", r)
	}
	if r := one(t, c, GrantSQL(id, "try2", "try", length, "")); r <= 0 {
		t.Errorf("a try with no wait queued: %d", r)
	}
}

// A grant's term is drawn once the row is the grant's, after any wait: a grant that waited for another grant's
// insert of the key (which then released it, in the same transaction here, as a quick holder does before the
// waiter runs again) draws a term greater than any drawn while it waited. Drawn in the inserted values, before
// the wait, it came out lower than a term another grant drew meanwhile: terms out of the grants' order.
func TestGrantTermAfterAWaitedInsert(t *testing.T) {
	url := pgtest.FreshDB(t, pgtest.URL(t))
	a, b, c := pgtest.Conn(t, url), pgtest.Conn(t, url), pgtest.Conn(t, url)
	ctx := context.Background()
	if _, err := a.Exec(ctx, "CREATE SEQUENCE "+session.FenceSeq+"; "+CreateSQL); err != nil {
		t.Fatal(err)
	}
	id := session.ID{V: 4242}
	tx, err := a.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer tx.Rollback(ctx)
	var first int64
	if err := tx.QueryRow(ctx, GrantSQL(id, "owner-a", "a", time.Minute, "")).Scan(&first); err != nil || first <= 0 {
		t.Fatalf("the first grant: %d %v", first, err)
	}
	second := make(chan int64, 1)
	go func() {
		var r int64
		if err := b.QueryRow(ctx, GrantSQL(id, "owner-b", "b", time.Minute, "")).Scan(&r); err != nil {
			t.Error(err)
		}
		second <- r
	}()
	for deadline := time.Now().Add(10 * time.Second); ; time.Sleep(10 * time.Millisecond) {
		var waiting bool
		if err := c.QueryRow(ctx, `SELECT EXISTS (SELECT 1 FROM pg_stat_activity
			WHERE wait_event_type = 'Lock' AND query LIKE '%owner-b%')`).Scan(&waiting); err != nil {
			t.Fatal(err)
		}
		if waiting {
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("the second grant never waited for the first")
		}
	}
	meanwhile := one(t, c, "SELECT nextval('"+session.FenceSeq+"')") // another grant's draw, while the second waits
	var released int64
	if err := tx.QueryRow(ctx, ReleaseSQL(id, "owner-a", first)).Scan(&released); err != nil || released != 1 {
		t.Fatalf("the first holder's release: %d %v", released, err)
	}
	if err := tx.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	got := <-second
	if got <= 0 {
		t.Fatalf("the second grant, after the first's release: %d, want a term", got)
	}
	if seq := got & (1<<48 - 1); seq <= meanwhile {
		t.Errorf("the second grant drew sequence value %d (term %d), not after %d, drawn while it waited", seq, got, meanwhile)
	}
}
