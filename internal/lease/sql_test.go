package lease

import (
	"context"
	"errors"
	"os"
	"strconv"
	"strings"
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

// ask runs a grant and reads its answer.
func ask(t *testing.T, c *pgx.Conn, sql string) answer {
	t.Helper()
	var s string
	if err := c.QueryRow(context.Background(), sql).Scan(&s); err != nil {
		t.Fatalf("%v\n%s", err, sql)
	}
	a, err := parseAnswer(s)
	if err != nil {
		t.Fatal(err)
	}
	return a
}

// term runs a grant that must grant, and returns its term.
func term(t *testing.T, c *pgx.Conn, sql string) int64 {
	t.Helper()
	a := ask(t, c, sql)
	if a.kind != 'g' {
		t.Fatalf("a grant answered %c, want g\n%s", a.kind, sql)
	}
	return a.term
}

// renewed runs a renewal and returns its first field ("1", "0" or "l").
func renewed(t *testing.T, c *pgx.Conn, sql string) string {
	t.Helper()
	var s string
	if err := c.QueryRow(context.Background(), sql).Scan(&s); err != nil {
		t.Fatalf("%v\n%s", err, sql)
	}
	return strings.Fields(s)[0]
}

// freshTables makes a database of its own with the fencing sequence and the lease tables and functions, and returns
// its URL.
func freshTables(t testing.TB) string {
	t.Helper()
	url := pgtest.FreshDB(t, pgtest.URL(t))
	if _, err := pgtest.Conn(t, url).Exec(context.Background(), "CREATE SEQUENCE "+session.FenceSeq+"; "+CreateSQL); err != nil {
		t.Fatal(err)
	}
	return url
}

// retired runs RetireSQL and returns how many leases it deleted.
func retired(t *testing.T, c *pgx.Conn, sql string) string { return renewed(t, c, sql) }

// The statements at the moments they race, on a real server: a grant takes a free key and refuses a held one,
// answering with the row's record; a renewal, a release and a grant's undo are keyed on the owner and the term, so
// a holder whose lease was taken over can neither renew nor release the new holder's; the server's clock decides
// nothing (a renewal after the row's expiry on the server's clock renews it, and a row is taken over only by naming
// its record, not because it expired); each renewal makes the record new, so a takeover that names the record seen
// before it is refused; the takeover's term is greater; a grant or renewal that arrives after its until grants
// nothing.
func TestStatements(t *testing.T) {
	url := freshTables(t)
	c := pgtest.Conn(t, url)
	ctx := context.Background()
	for _, id := range []session.ID{{V: 42}, {Pair: true, V: 7<<32 | 9}} {
		length := 300 * time.Millisecond
		a := term(t, c, GrantSQL(id, "owner-a/300", "a", length, "", record{}, 0))
		held := ask(t, c, GrantSQL(id, "owner-b/300", "b", length, "", record{}, 0))
		if held.kind != 'h' || held.rec.term != a || held.holderLen != length {
			t.Fatalf("grant of a held key: %+v, want held by term %d of a 300ms holder", held, a)
		}
		if r := renewed(t, c, RenewSQL(id, "owner-a/300", a, length, 0)); r != "1" {
			t.Fatalf("renewal by the holder: %s", r)
		}
		if r := renewed(t, c, RenewSQL(id, "owner-b/300", a, length, 0)); r != "0" {
			t.Errorf("renewal by another owner: %s", r)
		}
		if r := renewed(t, c, RenewSQL(id, "owner-a/300", a+1, length, 0)); r != "0" {
			t.Errorf("renewal of another term: %s", r)
		}
		if r := ask(t, c, GrantSQL(id, "owner-b/300", "b", length, "", held.rec, 0)); r.kind != 'h' || r.rec == held.rec {
			t.Fatalf("a takeover naming the record before a renewal: %+v, want held by a new record", r)
		}
		time.Sleep(length + 50*time.Millisecond)
		seen := ask(t, c, GrantSQL(id, "owner-b/300", "b", length, "", record{}, 0))
		if seen.kind != 'h' || seen.left >= 0 {
			t.Fatalf("a row expired on the server's clock, named by no taker: %+v, want held, expired", seen)
		}
		if r := renewed(t, c, RenewSQL(id, "owner-a/300", a, length, 0)); r != "1" {
			t.Errorf("renewal of a row expired on the server's clock, taken over by nobody: %s", r)
		}
		if r := ask(t, c, GrantSQL(id, "owner-b/300", "b", length, "", seen.rec, 0)); r.kind != 'h' {
			t.Fatalf("a takeover naming the record the renewal replaced: %+v", r)
		}
		seen = ask(t, c, GrantSQL(id, "owner-b/300", "b", length, "", record{}, 0))
		if r := ask(t, c, GrantSQL(id, "owner-b/300", "b", length, "", seen.rec, 1)); r.kind != 'l' {
			t.Errorf("a takeover arriving after its until: %+v, want l", r)
		}
		b := term(t, c, GrantSQL(id, "owner-b/300", "b", length, "", seen.rec, 0))
		if b <= a {
			t.Fatalf("takeover: term %d, want a term greater than %d", b, a)
		}
		for what, sql := range map[string]string{
			"renewal": RenewSQL(id, "owner-a/300", a, length, 0), "release": ReleaseSQL(id, "owner-a/300", a),
			"retire": RetireSQL([]session.ID{id}, "owner-a/300"),
		} {
			var r string
			if err := c.QueryRow(ctx, sql).Scan(&r); err != nil {
				t.Fatal(err)
			}
			if f := strings.Fields(r)[0]; f != "0" {
				t.Errorf("%s by the holder whose lease was taken over: %s", what, r)
			}
		}
		if r := renewed(t, c, RenewSQL(id, "owner-b/300", b, length, 1)); r != "l" {
			t.Errorf("a renewal arriving after its until: %s, want l", r)
		}
		if r := renewed(t, c, RenewSQL(id, "owner-b/300", b, length, 0)); r != "1" {
			t.Errorf("the new holder's renewal after the old holder's tries: %s", r)
		}
		if r := one(t, c, ReleaseSQL(id, "owner-b/300", b)); r != 1 {
			t.Errorf("release by the holder: %d", r)
		}
		if r := one(t, c, ReleaseSQL(id, "owner-b/300", b)); r != 0 {
			t.Errorf("second release: %d", r)
		}
	}
	// The two key spaces never overlap: int8 key 7<<32|9 is not the pair (7, 9).
	term(t, c, GrantSQL(session.ID{V: 7<<32 | 9}, "x", "x", time.Second, "", record{}, 0))
	term(t, c, GrantSQL(session.ID{Pair: true, V: 7<<32 | 9}, "y", "y", time.Second, "", record{}, 0))
}

// Rows no Locker writes (written by hand): an expiry at infinity, -infinity or past year 9999 is held, answered
// with a record (not an SQL error, as the grants of earlier versions gave), by a holder of no known length with the
// longest time left, so that no sighting of it matures into a takeover, whatever its owner says; naming its record
// takes nothing. An expiry within the years, however far, is a row like any other: its owner's length, its time
// left within a time.Duration, taken over by naming its record.
func TestGrantRowsWrittenByHand(t *testing.T) {
	url := freshTables(t)
	c := pgtest.Conn(t, url)
	ctx := context.Background()
	far := []string{"infinity", "-infinity", "20000-01-01 00:00:00+00"}
	for i, exp := range append(far, "9000-01-01 00:00:00+00", "1000-01-01 00:00:00+00") {
		id := session.ID{V: int64(100 + i)}
		if _, err := c.Exec(ctx, "INSERT INTO "+Table+" (space, key, owner, term, expires) VALUES (1, $1, 'hand/500', 7, $2::timestamptz)", id.V, exp); err != nil {
			t.Fatal(err)
		}
		a := ask(t, c, GrantSQL(id, "asker/300", "asker", 300*time.Millisecond, "", record{}, 0))
		if a.kind != 'h' || a.rec.term != 7 {
			t.Fatalf("a try of a key whose row expires at %s: %+v, want held by term 7", exp, a)
		}
		if i < len(far) {
			if a.holderLen != 0 || a.left != time.Duration(maxLeft)*time.Millisecond {
				t.Errorf("expiry %s: holder's length %v, left %v; want 0 and the longest time.Duration", exp, a.holderLen, a.left)
			}
			cl := &Client{cfg: Config{Length: 300 * time.Millisecond}, seen: map[session.ID]sighting{}}
			cl.observe(id, a, time.Now())
			if r := cl.matured(id, time.Now().Add(100*365*24*time.Hour)); r != (record{}) {
				t.Errorf("expiry %s: a sighting matured a century on", exp)
			}
			if r := ask(t, c, GrantSQL(id, "asker/300", "asker", 300*time.Millisecond, "", a.rec, 0)); r.kind != 'h' {
				t.Errorf("expiry %s: a takeover naming its record: %+v, want held", exp, r)
			}
			continue
		}
		if a.holderLen != 500*time.Millisecond || (a.left > 0) != (i == len(far)) {
			t.Errorf("expiry %s: holder's length %v, left %v; want 500ms, left of the expiry's sign", exp, a.holderLen, a.left)
		}
		if g := ask(t, c, GrantSQL(id, "asker/300", "asker", 300*time.Millisecond, "", a.rec, 0)); g.kind != 'g' {
			t.Errorf("expiry %s: a takeover naming its record: %+v, want granted", exp, g)
		}
	}
}

// One statement renews many leases, each as its own statement would, and answers a letter for each in order: "1"
// for a holder's lease (an int8 key and a pair), "0" for another owner's or another term's, "l" past its until;
// a row another transaction has locked (a taker's grant under way) is "b" at once, the statement waiting for no row
// lock, and "1" once that transaction has ended without taking it.
func TestRenewMany(t *testing.T) {
	url := freshTables(t)
	c := pgtest.Conn(t, url)
	ctx := context.Background()
	length := 5 * time.Second
	ids := []session.ID{{V: 1}, {Pair: true, V: 1}, {V: 2}, {V: 3}, {V: 4}}
	terms := make([]int64, len(ids))
	for i, id := range ids {
		terms[i] = term(t, c, GrantSQL(id, "o/5000", "h", length, "", record{}, 0))
	}
	batch := []Renewal{
		{ids[0], "o/5000", terms[0], 0}, {ids[1], "o/5000", terms[1], 0}, {ids[2], "other/5000", terms[2], 0},
		{ids[3], "o/5000", terms[3] + 1, 0}, {ids[4], "o/5000", terms[4], 1},
	}
	if r := renewed(t, c, RenewManySQL(batch, length)); r != "1100l" {
		t.Errorf("renewals of five leases: %s, want 1100l", r)
	}
	other := pgtest.Conn(t, url)
	tx, err := other.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := tx.Exec(ctx, "SELECT 1 FROM "+Table+" WHERE space = 1 AND key = 1 FOR UPDATE"); err != nil {
		t.Fatal(err)
	}
	// lock_timeout is not set: a statement that waited for the row would wait until the transaction ends.
	qctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	var r string
	if err := c.QueryRow(qctx, RenewManySQL(batch[:2], length)).Scan(&r); err != nil {
		t.Fatalf("renewals beside a row another transaction has locked: %v (waited for its lock)", err)
	}
	if r = strings.Fields(r)[0]; r != "b1" {
		t.Errorf("renewals of a row another transaction has locked and of one it has not: %s, want b1", r)
	}
	if err := tx.Rollback(ctx); err != nil {
		t.Fatal(err)
	}
	if r := renewed(t, c, RenewManySQL(batch[:1], length)); r != "1" {
		t.Errorf("the renewal once the other transaction ended: %s, want 1", r)
	}
}

// Each grant and renewal of a row makes its record new, whatever the server's clock does: the expiry moves on by at
// least a microsecond even when clock_timestamp() plus the length is earlier than the expiry so far (a clock that
// stepped back), so that a taker never sees the same record twice across a change.
func TestRecordsNeverComeBack(t *testing.T) {
	url := freshTables(t)
	c := pgtest.Conn(t, url)
	ctx := context.Background()
	id := session.ID{V: 77}
	a := term(t, c, GrantSQL(id, "o/1000", "a", time.Second, "", record{}, 0))
	// As if the server's clock had stepped back an hour since the grant.
	if _, err := c.Exec(ctx, "UPDATE "+Table+" SET expires = expires + interval '1 hour' WHERE key = 77"); err != nil {
		t.Fatal(err)
	}
	before := ask(t, c, GrantSQL(id, "p/1000", "b", time.Second, "", record{}, 0))
	if r := renewed(t, c, RenewSQL(id, "o/1000", a, time.Second, 0)); r != "1" {
		t.Fatal(r)
	}
	after := ask(t, c, GrantSQL(id, "p/1000", "b", time.Second, "", record{}, 0))
	if after.rec.exp != before.rec.exp+1 || after.rec.term != a {
		t.Errorf("a renewal under a clock behind the expiry: record %+v then %+v, want the expiry a microsecond later", before.rec, after.rec)
	}
}

// Text is data: a holder and an owner are carried as escape strings, which read the same under every setting of
// standard_conforming_strings and backslash_quote, whatever they hold (a trailing backslash, a quote after a
// backslash, a statement after them).
func TestQuoteEverySetting(t *testing.T) {
	c := pgtest.Conn(t, pgtest.URL(t))
	ctx := context.Background()
	texts := []string{`pod\`, `a\'b`, `x\'); DELETE FROM ` + Table + `; --`, `'`, `\\'\`, "caf\u00e9\x00\n"}
	for _, scs := range []string{"on", "off"} {
		for _, bq := range []string{"on", "off", "safe_encoding"} {
			if _, err := c.Exec(ctx, "SET standard_conforming_strings = "+scs+"; SET backslash_quote = "+bq); err != nil {
				t.Fatal(err)
			}
			for _, s := range texts {
				// Over the simple protocol as advlock sends it (pgx's own simple mode refuses to interpolate under
				// standard_conforming_strings off; a lease statement has nothing to interpolate).
				res, err := c.PgConn().Exec(ctx, "SELECT "+quote(s)).ReadAll()
				if err != nil {
					t.Fatalf("standard_conforming_strings=%s backslash_quote=%s: %q: %v", scs, bq, s, err)
				}
				got := string(res[0].Rows[0][0])
				want := strings.Map(func(r rune) rune {
					if r < ' ' || r > '~' {
						return '?'
					}
					return r
				}, s)
				if got != want {
					t.Errorf("standard_conforming_strings=%s backslash_quote=%s: %q reads %q, want %q", scs, bq, s, got, want)
				}
			}
		}
	}
}

// The queue of waits, statement by statement: waiters that find the key held enter its queue in order; once it is
// free the key goes to the one that has waited longest, not to a later waiter nor to a try; a granted waiter's rows
// are gone; a wait last seen more than WaitStale ago holds nobody back; LeaveSQL takes a wait out.
func TestWaitQueue(t *testing.T) {
	url := freshTables(t)
	c := pgtest.Conn(t, url)
	ctx := context.Background()
	id := session.ID{V: 42}
	length := time.Minute
	a := term(t, c, GrantSQL(id, "a", "a", length, "", record{}, 0))
	for _, w := range []string{"w1", "w2", "w3"} {
		if r := ask(t, c, GrantSQL(id, "o-"+w, w, length, w, record{}, 0)); r.kind != 'h' {
			t.Fatalf("%s's poll of a held key: %+v", w, r)
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
	if r := ask(t, c, GrantSQL(id, "o-w2", "w2", length, "w2", record{}, 0)); r.kind != 'w' {
		t.Errorf("the second waiter took the key before the first: %+v", r)
	}
	if r := ask(t, c, GrantSQL(id, "try", "try", length, "", record{}, 0)); r.kind != 'w' {
		t.Errorf("a try took the key while waiters wait: %+v", r)
	}
	w1 := term(t, c, GrantSQL(id, "o-w1", "w1", length, "w1", record{}, 0))
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
	w3 := term(t, c, GrantSQL(id, "o-w3", "w3", length, "w3", record{}, 0))
	if w3 <= w1 {
		t.Fatalf("the next live waiter, past a stale one: %d", w3)
	}
	one(t, c, ReleaseSQL(id, "o-w3", w3))
	if r := ask(t, c, GrantSQL(id, "o-w4", "w4", length, "w4", record{}, 0)); r.kind != 'g' {
		t.Errorf("a new waiter, with only a stale wait queued: %+v", r)
	}
	retired(t, c, RetireSQL([]session.ID{id}, "o-w4"))
	// A wait's row seen ahead of the server's clock (it stepped back since) does not hold the queue back.
	if _, err := c.Exec(ctx, "UPDATE "+Waits+" SET seen = clock_timestamp() + interval '1 hour' WHERE waiter = 'w2'"); err != nil {
		t.Fatal(err)
	}
	if r := ask(t, c, GrantSQL(id, "o-w5", "w5", length, "w5", record{}, 0)); r.kind != 'g' {
		t.Errorf("a new waiter, with a wait seen ahead of the clock queued: %+v", r)
	}
	retired(t, c, RetireSQL([]session.ID{id}, "o-w5"))
	if r := one(t, c, LeaveSQL("w2")); r != 1 {
		t.Errorf("LeaveSQL of a queued wait: %d", r)
	}
	if r := ask(t, c, GrantSQL(id, "try2", "try", length, "", record{}, 0)); r.kind != 'g' {
		t.Errorf("a try with no wait queued: %+v", r)
	}
}

// A grant's term is drawn once the row is the grant's, after any wait: a grant that waited for another grant's
// insert of the key (which then released it, in the same transaction here, as a quick holder does before the
// waiter runs again) draws a term greater than any drawn while it waited. Drawn in the inserted values, before
// the wait, it came out lower than a term another grant drew meanwhile: terms out of the grants' order.
func TestGrantTermAfterAWaitedInsert(t *testing.T) {
	url := freshTables(t)
	a, b, c := pgtest.Conn(t, url), pgtest.Conn(t, url), pgtest.Conn(t, url)
	ctx := context.Background()
	id := session.ID{V: 4242}
	tx, err := a.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer tx.Rollback(ctx)
	var txt string
	if err := tx.QueryRow(ctx, GrantSQL(id, "owner-a", "a", time.Minute, "", record{}, 0)).Scan(&txt); err != nil {
		t.Fatalf("the first grant: %v", err)
	}
	fa, err := parseAnswer(txt)
	if err != nil || fa.kind != 'g' {
		t.Fatalf("the first grant: %q %v", txt, err)
	}
	first := fa.term
	second := make(chan int64, 1)
	go func() {
		var r string
		if err := b.QueryRow(ctx, GrantSQL(id, "owner-b", "b", time.Minute, "", record{}, 0)).Scan(&r); err != nil {
			t.Error(err)
		}
		a, _ := parseAnswer(r)
		second <- a.term
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

// A Client that tries more held keys than it may remember still takes them over: once full, it forgets one record
// at random for each new one (it used to forget them all, and no record ever stayed long enough). The keys tried
// again and again are mostly remembered from one round to the next.
func TestSightingsPastTheirBound(t *testing.T) {
	c := NewClient(nil, Defaults())
	defer c.Close()
	n := maxSightings + maxSightings/20
	t0 := time.Now()
	for round := range 3 {
		at := t0.Add(time.Duration(round) * 10 * time.Second)
		for k := range n {
			c.observe(session.ID{V: int64(k)}, answer{kind: 'h', rec: record{int64(k) + 1, 1}, holderLen: time.Second}, at)
		}
	}
	matured := 0
	for k := range n {
		if c.matured(session.ID{V: int64(k)}, t0.Add(time.Minute)) != (record{}) {
			matured++
		}
	}
	if matured < n/2 {
		t.Errorf("%d of %d keys seen in three rounds could be taken over, want most", matured, n)
	}
	if len(c.seen) > maxSightings {
		t.Errorf("%d records remembered, more than %d", len(c.seen), maxSightings)
	}
}

// A holder stops trusting its lease when its trust window has passed on its monotonic clock or on its wall clock
// (the monotonic clock stops while a machine sleeps), and Err says so at once, whether or not the renewer has run:
// a starved process's renewer may run late.
func TestTrustEndsOnEitherClock(t *testing.T) {
	c := NewClient(nil, Defaults())
	defer c.Close()
	window := c.cfg.Length - c.cfg.Margin
	fresh := c.newLease(session.ID{V: 1}, "o", 1, time.Now(), nil)
	if err := fresh.Err(); err != nil {
		t.Fatalf("a lease granted now: %v", err)
	}
	old := c.newLease(session.ID{V: 1}, "o", 1, time.Now().Add(-window), nil)
	if err := old.Err(); !errors.Is(err, session.ErrLockLost) {
		t.Errorf("a lease whose window passed on the monotonic clock, its renewer never run: %v, want ErrLockLost", err)
	}
	slept := c.newLease(session.ID{V: 1}, "o", 1, time.Now(), nil)
	slept.wall = time.Now().Add(-time.Second).UnixNano() // as after a sleep: the wall clock went on, the monotonic did not
	if err := slept.Err(); !errors.Is(err, session.ErrLockLost) {
		t.Errorf("a lease whose window passed on the wall clock alone: %v, want ErrLockLost", err)
	}
}

// The statements of a cycle, built in one allocation, read exactly as the same calls spelled out: every kind of
// argument, quotes, backslashes and letters outside ASCII in the strings, negative keys and pairs.
func TestCallSQLText(t *testing.T) {
	for _, id := range []session.ID{{V: 42}, {V: -9223372036854775808}, {Pair: true, V: 7<<32 | 9}} {
		for _, s := range []string{"", "owner-a/300", `o'w\ner`, "hölder\x00\n", strings.Repeat("x", 300)} {
			sp := "1"
			if id.Pair {
				sp = "2"
			}
			key := strconv.FormatInt(id.V, 10)
			want := "SELECT " + grantFunc + "(" + sp + ", " + key + ", " + quote(s) + ", " + quote(s+"h") + ", 1500, " +
				quote("w"+s) + ", -3, 1700000000000000, 0)"
			if got := GrantSQL(id, s, s+"h", 1500*time.Millisecond, "w"+s, record{term: -3, exp: 1700000000000000}, 0); got != want {
				t.Errorf("GrantSQL:\n got %s\nwant %s", got, want)
			}
			want = "SELECT " + renewFunc + "('{" + sp + "}', '{" + key + "}', ARRAY[" + quote(s) + "]::text[], '{5}', '{123456789}', 15000)"
			if got := RenewSQL(id, s, 5, 15*time.Second, 123456789); got != want {
				t.Errorf("RenewSQL:\n got %s\nwant %s", got, want)
			}
			want = "SELECT " + renewFunc + "('{" + sp + ",2}', '{" + key + ",-1}', ARRAY[" + quote(s) + "," + quote("o2") +
				"]::text[], '{5,-6}', '{123456789,0}', 15000)"
			if got := RenewManySQL([]Renewal{{id, s, 5, 123456789}, {session.ID{Pair: true, V: -1}, "o2", -6, 0}}, 15*time.Second); got != want {
				t.Errorf("RenewManySQL:\n got %s\nwant %s", got, want)
			}
			want = "SELECT " + releaseFunc + "(" + sp + ", " + key + ", " + quote(s) + ", 9223372036854775807)"
			if got := ReleaseSQL(id, s, 9223372036854775807); got != want {
				t.Errorf("ReleaseSQL:\n got %s\nwant %s", got, want)
			}
		}
	}
	if got, want := quote(`a'b\c`+"é\x01"), `E'a''b\\c??'`; got != want {
		t.Errorf("quote: %s, want %s", got, want)
	}
}
