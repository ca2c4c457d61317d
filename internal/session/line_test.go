package session

import (
	"context"
	"fmt"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/advlock/advlock/internal/testkit/pgtest"
	"github.com/jackc/pgx/v5"
)

// A key's tickets are numbers of its own space, told apart from the key, its intent and other keys' tickets.
func TestTickets(t *testing.T) {
	for _, pair := range []bool{false, true} {
		k := ID{Pair: pair, V: 0x1234_5678_9abc_def0}
		for _, seq := range []int64{1, 2, lineMask} {
			tk := k.Ticket(seq)
			if tk.Pair != pair {
				t.Errorf("pair=%v: ticket %d is of the other space", pair, seq)
			}
			if got, ok := k.InLine(tk); !ok || got != seq {
				t.Errorf("pair=%v: InLine(Ticket(%d)) = %d, %v", pair, seq, got, ok)
			}
			if _, ok := (ID{Pair: !pair, V: tk.V}).InLine(tk); ok {
				t.Errorf("pair=%v: the other space's key claims ticket %d", pair, seq)
			}
		}
		if seq, ok := k.InLine(k.lineBase()); !ok || seq != 0 {
			t.Errorf("pair=%v: the line's door: InLine = %d, %v, want place 0", pair, seq, ok)
		}
		for _, x := range []ID{k, k.Intent(), k.Linger(), {Pair: !pair, V: k.Ticket(1).V}, (ID{Pair: pair, V: k.V + 1}).Ticket(1)} {
			if _, ok := k.InLine(x); ok {
				t.Errorf("pair=%v: %v is not a ticket of %v", pair, x, k)
			}
		}
	}
}

// The line's statements against the server: joins take places in arrival order (a reader's in front only of
// what comes after it), a member waits for the one in front of it (a reader for the nearest writer) and moves up
// when it leaves; a ticket granted as a slice ended is given back by the next statement; leaving gives back every
// ticket the session holds in the line.
func TestLineStatements(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	conn, q := lineConns(t, ctx)
	var must func(c *pgx.Conn, sql string) int64
	now := time.Now().UnixNano()
	for _, k := range []ID{{V: now}, {Pair: true, V: now}, {V: 6138966170140998771}} { // the last one's tickets from -2^63
		pair := k.Pair
		t.Run(fmt.Sprintf("pair=%v,%d", pair, k.V), func(t *testing.T) {
			must = mustQ(t, q)
			w, r := Target{ID: k}, Target{ID: k, Shared: true}
			holder, a, b, c := conn(), conn(), conn(), conn()
			must(holder, "SELECT length(pg_advisory_lock("+k.literal()+")::text) + 1")
			join := func(x *pgx.Conn, tg Target) (int64, bool) {
				t.Helper()
				res := must(x, JoinSQL(tg, false, 15000))
				if res > resultJoined {
					t.Fatalf("join: %d, want a place", res)
				}
				seq, head, intent, _ := joined(res)
				if intent != (head && !tg.Shared) {
					t.Fatalf("join: place %d head %v took the intent: %v (only a head writer takes it)", seq, head, intent)
				}
				return seq, head
			}
			if seq, head := join(a, w); seq != 1 || !head {
				t.Fatalf("the first writer: place %d head %v, want 1 true", seq, head)
			}
			if seq, head := join(b, w); seq != 2 || head {
				t.Fatalf("the second writer: place %d head %v, want 2 false", seq, head)
			}
			if seq, head := join(c, r); seq != 3 || head {
				t.Fatalf("a reader behind them: place %d head %v, want 3 false", seq, head)
			}
			// b waits for a: a slice ends.
			if _, err := q(b, LineSQL(w, 2, 50)); SQLState(err) != "55P03" {
				t.Fatalf("the second writer's slice while the first is in front: %v, want 55P03", err)
			}
			// c is in line behind b (a writer): it waits for b's ticket, not a's.
			done := make(chan int64, 1)
			go func() { v, _ := q(c, LineSQL(r, 3, 5000)); done <- v }()
			if got := must(a, LeaveSQL(w, 1, true, false)); got != 1 {
				t.Fatalf("the first writer leaves: %d", got)
			}
			// b's wait for a's ticket was granted as its slice ended (taken here by hand): its next statement gives
			// it back. A ticket past its own place is not touched by its waits, and is given back as it leaves.
			must(b, "SELECT length(pg_advisory_lock("+literalNums(k, 0, 0, 0).ticket("1")+")::text) + 1")
			must(b, "SELECT length(pg_advisory_lock("+literalNums(k, 0, 0, 0).ticket("7")+")::text) + 1")
			if got := must(b, LineSQL(w, 2, 2000)); got != resultAdvanced {
				t.Fatalf("the second writer holding the ticket in front of it: %d, want %d (given back)", got, resultAdvanced)
			}
			if got := must(b, LineSQL(w, 2, 2000)); got != resultHeadNow { // and takes the intent a's leave gave back
				t.Fatalf("the second writer, nothing in front: %d, want %d", got, resultHeadNow)
			}
			select {
			case v := <-done:
				t.Fatalf("the reader moved up while the writer in front of it is in line: %d", v)
			case <-time.After(100 * time.Millisecond):
			}
			if got := must(b, SettleSQL(w, true, true, false)); got != 1 { // leaves, ticket 7 too, and the intent
				t.Fatalf("the second writer gives up: %d", got)
			}
			if v := <-done; v != resultHead { // in the statement that waited: no writer in front any more
				t.Fatalf("the reader once the writer in front of it left: %d, want %d", v, resultHead)
			}
			if got := must(c, LineSQL(r, 3, 2000)); got != resultHead {
				t.Fatalf("the reader, no writer in front: %d, want %d", got, resultHead)
			}
			must(c, SettleSQL(r, false, true, false))
			var n int64
			if err := holder.QueryRow(ctx, "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND pid <> pg_backend_pid() AND pid = ANY($1)",
				[]int32{int32(a.PgConn().PID()), int32(b.PgConn().PID()), int32(c.PgConn().PID())}).Scan(&n); err != nil || n != 0 {
				t.Fatalf("locks left on the members' sessions: %d %v", n, err)
			}
			must(holder, "SELECT length(pg_advisory_unlock_all()::text) + 1")
			// With the key free, a join's try is granted.
			if got := must(a, JoinSQL(w, false, 15000)); got != resultAcquired {
				t.Fatalf("a join of a free key: %d, want a grant", got)
			}
			must(a, "SELECT length(pg_advisory_unlock_all()::text) + 1")
		})
	}
}

// The numbers go round: with the line's last two numbers held, the next wait joins at 1 and the one after at 2;
// each waits for the member in front of it going round (1 for the last number, 2 for 1), and the first becomes the
// head once the two at the ring's end left.
func TestLineRing(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	conn, q := lineConns(t, ctx)
	must := mustQ(t, q)
	k := ID{V: time.Now().UnixNano()}
	w := Target{ID: k}
	holder, end1, end2, a, b := conn(), conn(), conn(), conn(), conn()
	must(holder, "SELECT length(pg_advisory_lock("+k.literal()+")::text) + 1")
	must(end1, "SELECT length(pg_advisory_lock("+literalNums(k, 0, 0, 0).ticket(strconv.Itoa(lineMask-1))+")::text) + 1")
	must(end2, "SELECT length(pg_advisory_lock("+literalNums(k, 0, 0, 0).ticket(strconv.Itoa(lineMask))+")::text) + 1")
	for i, c := range []*pgx.Conn{a, b} {
		res := must(c, JoinSQL(w, false, 15000))
		if seq, head, _, _ := joined(res); res > resultJoined || seq != int64(i+1) || head {
			t.Fatalf("join %d after the ring's last two numbers: %d (place %d, head %v), want place %d behind them", i, res, seq, head, i+1)
		}
	}
	if _, err := q(a, LineSQL(w, 1, 50)); SQLState(err) != "55P03" {
		t.Fatalf("place 1 while the ring's last number is held: %v, want a slice's end", err)
	}
	must(end2, "SELECT length(pg_advisory_unlock_all()::text) + 1")
	if _, err := q(a, LineSQL(w, 1, 50)); SQLState(err) != "55P03" {
		t.Fatalf("place 1 while the number before the last is held: %v, want a slice's end", err)
	}
	if _, err := q(b, LineSQL(w, 2, 50)); SQLState(err) != "55P03" {
		t.Fatalf("place 2 behind place 1: %v, want a slice's end", err)
	}
	done := make(chan int64, 1)
	go func() { r, _ := q(a, LineSQL(w, 1, 5000)); done <- r }()
	time.Sleep(50 * time.Millisecond)
	must(end1, "SELECT length(pg_advisory_unlock_all()::text) + 1")
	if got := <-done; got != resultHeadNow { // in the statement that waited, with the intent
		t.Fatalf("place 1 once the number before the last left: %d, want %d", got, resultHeadNow)
	}
	// A third joins at 3 (the newest is 2, though the ring's greatest number held is gone).
	c := conn()
	if seq, _, _, _ := joined(must(c, JoinSQL(w, false, 15000))); seq != 3 {
		t.Fatalf("the next join: place %d, want 3", seq)
	}
	for _, x := range []*pgx.Conn{a, b, c, holder} {
		must(x, "SELECT length(pg_advisory_unlock_all()::text) + 1")
	}
}

// lineConns gives a test connections of its own to the server and a reader of a statement's last answer (the
// simple protocol: LineSQL's texts hold several statements).
func lineConns(t *testing.T, ctx context.Context) (conn func() *pgx.Conn, q func(*pgx.Conn, string) (int64, error)) {
	return lineConnsTo(t, ctx, pgtest.URL(t))
}

// lineConnsTo is lineConns to the database at url.
func lineConnsTo(t *testing.T, ctx context.Context, url string) (conn func() *pgx.Conn, q func(*pgx.Conn, string) (int64, error)) {
	conn = func() *pgx.Conn {
		c, err := pgx.Connect(ctx, url)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { c.Close(context.Background()) })
		return c
	}
	q = func(c *pgx.Conn, sql string) (int64, error) {
		res, err := c.PgConn().Exec(ctx, sql).ReadAll()
		if err != nil {
			return 0, err
		}
		last := res[len(res)-1]
		if len(last.Rows) != 1 {
			return 0, fmt.Errorf("%d rows", len(last.Rows))
		}
		return strconv.ParseInt(string(last.Rows[0][0]), 10, 64)
	}
	return conn, q
}

// A grant leaves the line in the statement that granted it: the head writer's WaitSQL, granted, gives back its
// ticket, the line's flag and the key's intent and restores the session's idle_session_timeout, so that the session
// holds the key alone when the grant is answered, and the member behind it moves up as the grant is made, with no
// statement of the holder's between.
func TestGrantLeavesLine(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	conn, q := lineConns(t, ctx)
	k := ID{V: time.Now().UnixNano()}
	w, r := Target{ID: k}, Target{ID: k, Shared: true}
	holder, a, c := conn(), conn(), conn()
	must := mustQ(t, q)
	must(holder, "SELECT length(pg_advisory_lock("+k.literal()+")::text) + 1")
	seq, head, intent, idle := joined(must(a, JoinSQL(w, false, 15000)))
	if seq != 1 || !head || !intent || !idle {
		t.Fatalf("the writer's join: place %d head %v intent %v idle %v, want 1 and all true", seq, head, intent, idle)
	}
	if rs, rh, _, _ := joined(must(c, JoinSQL(r, false, 15000))); rs != 2 || rh {
		t.Fatalf("the reader's join: place %d head %v, want 2 false", rs, rh)
	}
	granted, moved := make(chan int64, 1), make(chan int64, 1)
	go func() { v, _ := q(a, WaitSQL(w, 5000, false, false, true, 15000, seq, idle)); granted <- v }()
	go func() { v, _ := q(c, LineSQL(r, 2, 5000)); moved <- v }()
	time.Sleep(100 * time.Millisecond)
	select {
	case v := <-moved:
		t.Fatalf("the reader moved up while the writer in front of it waits: %d", v)
	default:
	}
	must(holder, "SELECT length(pg_advisory_unlock_all()::text) + 1")
	if v := <-granted; v != resultAcquired {
		t.Fatalf("the head writer's wait once the key was freed: %d, want a grant", v)
	}
	if v := <-moved; v != resultHead {
		t.Fatalf("the reader behind the granted writer: %d, want %d (the head)", v, resultHead)
	}
	holdsOnly(t, ctx, holder, a, "ExclusiveLock", k)
	idleRestored(t, ctx, a)
	for _, x := range []*pgx.Conn{a, c} {
		must(x, "SELECT length(pg_advisory_unlock_all()::text) + 1")
	}
}

// Waits that join together take places one after another in the statement that joins them: of 12 joins sent at
// once behind a holder, each gets a place of its own, places 1 to 12, and exactly one is the head.
func TestJoinsTogether(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	conn, q := lineConns(t, ctx)
	k := ID{V: time.Now().UnixNano()}
	w := Target{ID: k}
	holder := conn()
	if _, err := q(holder, "SELECT length(pg_advisory_lock("+k.literal()+")::text) + 1"); err != nil {
		t.Fatal(err)
	}
	const n = 12
	cs := make([]*pgx.Conn, n)
	for i := range cs {
		cs[i] = conn()
	}
	type res struct {
		seq   int64
		head  bool
		sends int
		err   error
	}
	out := make(chan res, n)
	start := make(chan struct{})
	for _, c := range cs {
		go func() {
			<-start
			for sends := 1; ; sends++ {
				r, err := q(c, JoinSQL(w, false, 15000))
				if err != nil || r > resultJoined && r != resultNotHeld {
					out <- res{err: fmt.Errorf("join: %d %v", r, err)}
					return
				}
				if r <= resultJoined {
					seq, head, _, _ := joined(r)
					out <- res{seq: seq, head: head, sends: sends}
					return
				}
			}
		}()
	}
	close(start)
	seen, heads, resent := map[int64]bool{}, 0, 0
	for range n {
		r := <-out
		if r.err != nil {
			t.Fatal(r.err)
		}
		if seen[r.seq] || r.seq < 1 || r.seq > n {
			t.Errorf("place %d: taken twice, or outside 1 to %d", r.seq, n)
		}
		seen[r.seq] = true
		if r.head {
			heads++
		}
		resent += r.sends - 1
	}
	t.Logf("12 joins at once: %d sent again", resent)
	if heads != 1 {
		t.Errorf("%d heads, want 1", heads)
	}
	for _, c := range append(cs, holder) {
		if _, err := q(c, "SELECT length(pg_advisory_unlock_all()::text) + 1"); err != nil {
			t.Fatal(err)
		}
	}
}

// A grant's error may come after the grant left the line: a fenced grant whose nextval waits for its sequence
// (locked by an ALTER SEQUENCE) past the slice's lock_timeout has given its ticket, the flag and the intent back
// and still fails with 55P03. The statement sent next, the requeue, takes the grant the server made (a token, not
// doubt) and finds nothing of the line to give back, and the session holds the key alone; a settle instead leaves
// it holding nothing. Both statements judge what the session holds by pg_locks.
func TestGrantErrorAfterLeave(t *testing.T) {
	if testing.Short() {
		t.Skip("makes a database")
	}
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	url := pgtest.FreshDB(t, pgtest.URL(t))
	conn, q := lineConnsTo(t, ctx, url)
	must := mustQ(t, q)
	setup := conn()
	if _, err := setup.Exec(ctx, "CREATE SEQUENCE "+FenceSeq); err != nil {
		t.Fatal(err)
	}
	held := func(x *pgx.Conn) []string { return advisoryHeld(t, ctx, setup, x) }
	for _, settle := range []bool{false, true} {
		t.Run(fmt.Sprintf("settle=%v", settle), func(t *testing.T) {
			k := ID{V: time.Now().UnixNano()}
			w := Target{ID: k}
			holder, seqLock, a := conn(), conn(), conn()
			must(holder, "SELECT length(pg_advisory_lock("+k.literal()+")::text) + 1")
			if _, err := seqLock.Exec(ctx, "BEGIN; ALTER SEQUENCE "+FenceSeq+" CACHE 1"); err != nil {
				t.Fatal(err)
			}
			seq, head, intent, idle := joined(must(a, JoinSQL(w, true, 15000)))
			if !head || !intent || !idle {
				t.Fatalf("the join: place %d head %v intent %v idle %v", seq, head, intent, idle)
			}
			failed := make(chan error, 1)
			go func() { _, err := q(a, WaitSQL(w, 1000, true, false, intent, 15000, seq, idle)); failed <- err }()
			time.Sleep(200 * time.Millisecond)
			must(holder, "SELECT length(pg_advisory_unlock_all()::text) + 1")
			if err := <-failed; SQLState(err) != "55P03" {
				t.Fatalf("the grant whose nextval waited past the slice: %v, want 55P03", err)
			}
			key := "ExclusiveLock " + strconv.FormatInt(k.V, 10)
			if got := held(a); len(got) != 1 || got[0] != key {
				t.Fatalf("after the failed grant the session holds %q, want only [%s] (the line left before the error)", got, key)
			}
			if _, err := seqLock.Exec(ctx, "COMMIT"); err != nil {
				t.Fatal(err)
			}
			if settle {
				if r := must(a, SettleSQL(w, intent, true, idle)); r != 1 {
					t.Fatalf("the settle: %d, want 1", r)
				}
				if got := held(a); len(got) != 0 {
					t.Fatalf("after the settle the session holds %q, want nothing", got)
				}
			} else {
				if r := must(a, WaitSQL(w, 1000, true, true, intent, 15000, seq, idle)); r < 1 {
					t.Fatalf("the requeue: %d, want the grant's token", r)
				}
				if got := held(a); len(got) != 1 || got[0] != key {
					t.Fatalf("after the requeue the session holds %q, want only [%s]", got, key)
				}
			}
			idleRestored(t, ctx, a)
			must(a, "SELECT length(pg_advisory_unlock_all()::text) + 1")
		})
	}
}

// A LineSQL sent after a slice's end may find the session holding the key's intent already: the statement before
// it took it as it found the wait the head, and its lock_timeout error was raised only after. The intent is then
// not taken a second time (the grant's leave gives it back once): one unlock later the session holds none.
func TestLineAgainTakesIntentOnce(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	conn, q := lineConns(t, ctx)
	k := ID{V: time.Now().UnixNano()}
	w := Target{ID: k}
	holder, a := conn(), conn()
	must := mustQ(t, q)
	must(holder, "SELECT length(pg_advisory_lock("+k.literal()+")::text) + 1")
	seq, head, intent, _ := joined(must(a, JoinSQL(w, false, 15000)))
	if !head || !intent {
		t.Fatalf("the join: head %v intent %v, want both", head, intent)
	}
	// The client took the slice's end for a wait still in the line: its next statement is a LineSQL, sent again.
	if r := must(a, lineSQL(w, seq, 50, true, nil)); r != resultHeadNow {
		t.Fatalf("the line statement sent again: %d, want %d (the head, holding the intent)", r, resultHeadNow)
	}
	must(a, "SELECT pg_advisory_unlock("+k.Intent().literal()+")::int")
	if got := advisoryHeld(t, ctx, holder, a); slices.Contains(got, "ExclusiveLock "+strconv.FormatInt(k.Intent().V, 10)) {
		t.Fatalf("one unlock of the intent left it held (%q): the line statement took it a second time", got)
	}
	must(a, "SELECT length(pg_advisory_unlock_all()::text) + 1")
	must(holder, "SELECT length(pg_advisory_unlock_all()::text) + 1")
}

// mustQ is q failing the test on an error.
func mustQ(t *testing.T, q func(*pgx.Conn, string) (int64, error)) func(*pgx.Conn, string) int64 {
	return func(c *pgx.Conn, sql string) int64 {
		t.Helper()
		v, err := q(c, sql)
		if err != nil {
			t.Fatal(err)
		}
		return v
	}
}

// advisoryHeld lists the advisory locks x's session holds or waits for, as "mode number", read through obs.
func advisoryHeld(t *testing.T, ctx context.Context, obs, x *pgx.Conn) []string {
	t.Helper()
	rows, err := obs.Query(ctx, "SELECT mode || ' ' || ((classid::int8 << 32) | objid::int8) FROM pg_locks WHERE locktype = 'advisory' AND pid = $1 ORDER BY 1",
		x.PgConn().PID())
	if err != nil {
		t.Fatal(err)
	}
	s, err := pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil {
		t.Fatal(err)
	}
	return s
}

// holdsOnly fails the test unless x's session holds k in mode (ExclusiveLock, ShareLock) and no other advisory
// lock, as read through obs.
func holdsOnly(t *testing.T, ctx context.Context, obs, x *pgx.Conn, mode string, k ID) {
	t.Helper()
	if got, want := advisoryHeld(t, ctx, obs, x), mode+" "+strconv.FormatInt(k.V, 10); len(got) != 1 || got[0] != want {
		t.Fatalf("pid %d holds %q, want only [%s]", x.PgConn().PID(), got, want)
	}
}

// grantedAlone fails the test unless the statement of x that answers on got was granted, and x's session then
// holds k alone in mode, with its idle_session_timeout restored.
func grantedAlone(t *testing.T, ctx context.Context, obs, x *pgx.Conn, got <-chan int64, mode string, k ID) {
	t.Helper()
	if v := <-got; v != resultAcquired {
		t.Fatalf("pid %d's wait: %d, want a grant", x.PgConn().PID(), v)
	}
	holdsOnly(t, ctx, obs, x, mode, k)
	idleRestored(t, ctx, x)
}

// passes has from let go of every advisory lock it holds (k among them) once to waits for k, and fails the test
// unless to's statement, which answers on got, is then granted, to holding k alone in mode.
func passes(t *testing.T, ctx context.Context, obs *pgx.Conn, must func(*pgx.Conn, string) int64, from, to *pgx.Conn, got <-chan int64, mode string, k ID) {
	t.Helper()
	awaitKeyWait(t, ctx, obs, to, k)
	must(from, "SELECT length(pg_advisory_unlock_all()::text) + 1")
	grantedAlone(t, ctx, obs, to, got, mode, k)
}

// idleRestored fails the test unless x's session has an idle_session_timeout of 0, as before its wait.
func idleRestored(t *testing.T, ctx context.Context, x *pgx.Conn) {
	t.Helper()
	var setting string
	if err := x.QueryRow(ctx, "SHOW idle_session_timeout").Scan(&setting); err != nil || setting != "0" {
		t.Fatalf("idle_session_timeout: %q %v, want 0 (restored)", setting, err)
	}
}

// A reader whose grant left the line before its slice's error (its fenced nextval held up by an ALTER SEQUENCE),
// then gave the key back in its requeue (the writer behind it had moved up and taken the intent), is granted in a
// later statement of its wait: every statement of the wait after its first 55P03 gives back what pg_locks says it
// holds (serverWait.timedOut), not its ticket a second time (which answered doubt, -5, and closed the session).
func TestBouncedReaderAfterLateError(t *testing.T) {
	if testing.Short() {
		t.Skip("makes a database")
	}
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	url := pgtest.FreshDB(t, pgtest.URL(t))
	conn, q := lineConnsTo(t, ctx, url)
	must := mustQ(t, q)
	holder, seqLock, rc, wc := conn(), conn(), conn(), conn()
	if _, err := holder.Exec(ctx, "CREATE SEQUENCE "+FenceSeq); err != nil {
		t.Fatal(err)
	}
	k := ID{V: time.Now().UnixNano()}
	r, w := Target{ID: k, Shared: true}, Target{ID: k}
	must(holder, "SELECT length(pg_advisory_lock("+k.literal()+")::text) + 1")
	if _, err := seqLock.Exec(ctx, "BEGIN; ALTER SEQUENCE "+FenceSeq+" CACHE 1"); err != nil {
		t.Fatal(err)
	}
	rseq, rhead, _, ridle := joined(must(rc, JoinSQL(r, true, 15000)))
	wseq, whead, _, _ := joined(must(wc, JoinSQL(w, true, 15000)))
	if !rhead || whead || wseq != rseq+1 {
		t.Fatalf("joins: the reader place %d head %v, the writer place %d head %v", rseq, rhead, wseq, whead)
	}
	rw := &serverWait{t: r, cfg: Config{Fencing: true}, seq: rseq, idle: ridle}
	moved, failed := make(chan int64, 1), make(chan error, 1)
	go func() { v, _ := q(wc, LineSQL(w, wseq, 10000)); moved <- v }()
	go func() {
		_, err := q(rc, rw.waitText(1000, false, literalNums(k, rseq, 1000, 15000)).String())
		failed <- err
	}()
	time.Sleep(200 * time.Millisecond)
	must(holder, "SELECT length(pg_advisory_unlock_all()::text) + 1")
	if v := <-moved; v != resultHeadNow {
		t.Fatalf("the writer behind the granted reader: %d, want %d (the head, with the intent)", v, resultHeadNow)
	}
	if err := <-failed; SQLState(err) != "55P03" {
		t.Fatalf("the reader's grant whose nextval waited past the slice: %v, want 55P03", err)
	}
	rw.timedOut = true // as run notes it
	if _, err := seqLock.Exec(ctx, "COMMIT"); err != nil {
		t.Fatal(err)
	}
	if v := must(rc, rw.waitText(1000, true, literalNums(k, rseq, 1000, 15000)).String()); v != resultBounced {
		t.Fatalf("the reader's requeue with the writer's intent standing: %d, want %d (given back)", v, resultBounced)
	}
	if v := must(wc, WaitSQL(w, 10000, true, false, true, 15000, wseq, false)); v < 1 {
		t.Fatalf("the writer: %d, want a token", v)
	}
	must(wc, "SELECT pg_advisory_unlock("+k.literal()+")::int")
	if v := must(rc, rw.waitText(1000, false, literalNums(k, rseq, 1000, 15000)).String()); v < 1 {
		t.Fatalf("the reader's next statement once the writer let go: %d, want a token", v)
	}
	holdsOnly(t, ctx, holder, rc, "ShareLock", k)
	idleRestored(t, ctx, rc)
}

// Joins of one key pass its line's door one at a time, each reading the line and taking its ticket in between: a
// join whose read was held up (pg_sleep after it, by hand) still takes place 1 as the head, and the joins sent
// meanwhile wait for the door (pg_locks) and then take places 2 and 3 behind it. Without the door they took 1 and 2
// during the sleep, and could be granted and leave while the join slept, which then took place 1 again in front of
// the wait that had become the head (two heads).
func TestJoinDoor(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	conn, q := lineConns(t, ctx)
	must := mustQ(t, q)
	for _, k := range []ID{{V: time.Now().UnixNano()}, {Pair: true, V: time.Now().UnixNano()}} {
		w := Target{ID: k}
		holder, j, a, b, obs := conn(), conn(), conn(), conn(), conn()
		must(holder, "SELECT length(pg_advisory_lock("+k.literal()+")::text) + 1")
		slow := strings.Replace(JoinSQL(w, false, 15000), " AS newest, ", " + 0 * length(pg_sleep(3)::text) AS newest, ", -1)
		if slow == JoinSQL(w, false, 15000) {
			t.Fatal("the join's read of the line is not where the test holds it up")
		}
		type res struct {
			who string
			v   int64
			err error
		}
		done := make(chan res, 3)
		send := func(who string, c *pgx.Conn, sql string) {
			go func() { v, err := q(c, sql); done <- res{who, v, err} }()
		}
		send("j", j, slow)
		awaitDoor(t, ctx, obs, k, true, 1) // j holds the door, and sleeps
		send("a", a, JoinSQL(w, false, 15000))
		awaitDoor(t, ctx, obs, k, false, 1)
		send("b", b, JoinSQL(w, false, 15000))
		awaitDoor(t, ctx, obs, k, false, 2)
		got := map[string]res{}
		for range 3 {
			r := <-done
			got[r.who] = r
		}
		for _, who := range []string{"j", "a", "b"} {
			r := got[who]
			if r.err != nil {
				t.Fatalf("%s's join: %v", who, r.err)
			}
			seq, head, _, _ := joined(r.v)
			if want := map[string]int64{"j": 1, "a": 2, "b": 3}[who]; seq != want || head != (who == "j") {
				t.Errorf("join %s: place %d, head %v; want j at 1 the head, a at 2, b at 3", who, seq, head)
			}
		}
		for _, x := range []*pgx.Conn{holder, j, a, b} {
			must(x, "SELECT length(pg_advisory_unlock_all()::text) + 1")
		}
	}
}

// awaitDoor waits until n sessions hold (granted) or wait for the door of k's line (pg_locks), and fails the test
// after 5 s.
func awaitDoor(t *testing.T, ctx context.Context, obs *pgx.Conn, k ID, granted bool, n int) {
	t.Helper()
	d := k.lineBase()
	sub, c, o := 1, uint64(d.V)>>32, uint64(uint32(d.V))
	if k.Pair {
		sub = 2
	}
	for deadline := time.Now().Add(5 * time.Second); ; time.Sleep(10 * time.Millisecond) {
		var got int
		if err := obs.QueryRow(ctx, "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND granted = $4 AND objsubid = $1 AND classid = $2::int8::oid AND objid = $3::int8::oid",
			sub, int64(c), int64(o), granted).Scan(&got); err != nil {
			t.Fatal(err)
		}
		if got == n {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("%d sessions hold (%v) the door of the line, want %d", got, granted, n)
		}
	}
}

// A member whose line statement finds it the head goes on to wait for the key in that statement (LineWaitSQL): when
// the head in front of it is granted (and leaves the line), the writer behind it waits for the key itself in the
// server's queue, holding the intent, with no statement of its own between, and is granted as the key is freed,
// holding the key alone; the reader behind it then does the same in shared mode.
func TestLineWaitQueuesAtOnce(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	conn, q := lineConns(t, ctx)
	must := mustQ(t, q)
	k := ID{V: time.Now().UnixNano()}
	w, r := Target{ID: k}, Target{ID: k, Shared: true}
	holder, a, b, c, obs := conn(), conn(), conn(), conn(), conn()
	must(holder, "SELECT length(pg_advisory_lock("+k.literal()+")::text) + 1")
	aseq, _, aintent, aidle := joined(must(a, JoinSQL(w, false, 15000)))
	bseq, _, _, bidle := joined(must(b, JoinSQL(w, false, 15000)))
	cseq, _, _, cidle := joined(must(c, JoinSQL(r, false, 15000)))
	if aseq != 1 || bseq != 2 || cseq != 3 {
		t.Fatalf("places %d %d %d, want 1 2 3", aseq, bseq, cseq)
	}
	ag, bg, cg := make(chan int64, 1), make(chan int64, 1), make(chan int64, 1)
	go func() { v, _ := q(a, WaitSQL(w, 5000, false, false, aintent, 15000, aseq, aidle)); ag <- v }()
	go func() { v, _ := q(b, LineWaitSQL(w, bseq, 5000, false, bidle)); bg <- v }()
	go func() { v, _ := q(c, LineWaitSQL(r, cseq, 5000, false, cidle)); cg <- v }()
	awaitKeyWait(t, ctx, obs, a, k)
	must(holder, "SELECT length(pg_advisory_unlock_all()::text) + 1")
	if v := <-ag; v != resultAcquired {
		t.Fatalf("a, the head, once the key was freed: %d, want a grant", v)
	}
	awaitKeyWait(t, ctx, obs, b, k) // b's statement, sent before a's grant, now waits for the key a holds
	if got := advisoryHeld(t, ctx, obs, b); !slices.Contains(got, "ExclusiveLock "+strconv.FormatInt(k.Intent().V, 10)) {
		t.Fatalf("b waits for the key without the intent: %q", got)
	}
	must(a, "SELECT length(pg_advisory_unlock_all()::text) + 1")
	grantedAlone(t, ctx, obs, b, bg, "ExclusiveLock", k)
	passes(t, ctx, obs, must, b, c, cg, "ShareLock", k)
	must(c, "SELECT length(pg_advisory_unlock_all()::text) + 1")
}

// A line statement that waited most of its slice (1.6 s of 2) for the member in front waits for the key only for
// what is left of the slice (a statement holds its snapshot for no longer than a slice), and a member whose
// statement ended so, holding the intent it took as it found itself the head, is granted by its next statement
// (sent with again), holding the key alone.
func TestLineWaitWithinSlice(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	conn, q := lineConns(t, ctx)
	must := mustQ(t, q)
	k := ID{V: time.Now().UnixNano()}
	w := Target{ID: k}
	holder, a, b, obs := conn(), conn(), conn(), conn()
	must(holder, "SELECT length(pg_advisory_lock("+k.literal()+")::text) + 1")
	aseq, _, aintent, aidle := joined(must(a, JoinSQL(w, false, 15000)))
	bseq, _, _, bidle := joined(must(b, JoinSQL(w, false, 15000)))
	type res struct {
		err  error
		took time.Duration
	}
	done := make(chan res, 1)
	start := time.Now()
	go func() { _, err := q(b, LineWaitSQL(w, bseq, 2000, false, bidle)); done <- res{err, time.Since(start)} }()
	time.Sleep(1600 * time.Millisecond)
	must(a, LeaveSQL(w, aseq, aintent, aidle)) // a gives up its place: b is the head
	got := <-done
	if SQLState(got.err) != "55P03" || got.took > 3*time.Second {
		t.Fatalf("b's statement: %v after %v, want 55P03 about 2 s after it was sent (a fresh lock_timeout for the key: 3.6 s)", got.err, got.took)
	}
	if held := advisoryHeld(t, ctx, obs, b); !slices.Contains(held, "ExclusiveLock "+strconv.FormatInt(k.Intent().V, 10)) {
		t.Fatalf("b after its slice: %q, want the intent it took as the head", held)
	}
	granted := make(chan int64, 1)
	go func() { v, _ := q(b, lineSQL(w, bseq, 5000, true, &lineWait{false, bidle})); granted <- v }()
	passes(t, ctx, obs, must, holder, b, granted, "ExclusiveLock", k)
	must(b, "SELECT length(pg_advisory_unlock_all()::text) + 1")
}

// awaitKeyWait waits until x's session waits for k itself (pg_locks, through obs), and fails the test after 5 s.
func awaitKeyWait(t *testing.T, ctx context.Context, obs, x *pgx.Conn, k ID) {
	t.Helper()
	for deadline := time.Now().Add(5 * time.Second); ; time.Sleep(5 * time.Millisecond) {
		var n int
		if err := obs.QueryRow(ctx, "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND NOT granted AND pid = $1 AND objsubid = $3 AND ((classid::int8 << 32) | objid::int8) = $2",
			x.PgConn().PID(), k.V, map[bool]int{false: 1, true: 2}[k.Pair]).Scan(&n); err != nil {
			t.Fatal(err)
		}
		if n == 1 {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("pid %d does not wait for the key", x.PgConn().PID())
		}
	}
}

// The statements of a wait prepared once per session, with the wait's numbers as parameters (stmt.prepared), do
// what the literal ones do: a session that has not prepared one answers 26000 and has run nothing; prepared, a
// writer's join takes place 1 as the head with the intent, a reader's place 2; the writer's wait is granted as the
// key is freed and leaves the line, and the reader's line statement then waits for the key and is granted as the
// writer lets go, each holding the key alone: int8 and pair keys, the pair's derived numbers as pairs.
func TestPreparedStatements(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	conn, q := lineConns(t, ctx)
	must := mustQ(t, q)
	now := time.Now().UnixNano()
	for _, k := range []ID{{V: now}, {Pair: true, V: now}} {
		w, r := Target{ID: k}, Target{ID: k, Shared: true}
		holder, a, b, obs := conn(), conn(), conn(), conn()
		must(holder, "SELECT length(pg_advisory_lock("+k.literal()+")::text) + 1")
		send := func(c *pgx.Conn, s stmt, seq, ms int64) (int64, error) { // prepared in the same query if the session has not
			run, prepare, _ := s.prepared(numValues(k, seq, ms, 15000))
			v, err := q(c, run)
			if SQLState(err) == "26000" {
				v, err = q(c, prepare+"; "+run)
			}
			return v, err
		}
		exec := func(c *pgx.Conn, s stmt, seq, ms int64) int64 {
			t.Helper()
			v, err := send(c, s, seq, ms)
			if err != nil {
				t.Fatal(err)
			}
			return v
		}
		join := joinStmt(w, params(k), false)
		run, _, _ := join.prepared(numValues(k, 0, 0, 15000))
		if _, err := q(a, run); SQLState(err) != "26000" {
			t.Fatalf("a join not prepared on the session: %v, want 26000", err)
		}
		if got := advisoryHeld(t, ctx, obs, a); len(got) != 0 {
			t.Fatalf("the session after its unprepared statement holds %q", got)
		}
		aseq, ahead, aintent, aidle := joined(exec(a, join, 0, 0))
		bseq, bhead, _, bidle := joined(exec(b, joinStmt(r, params(k), false), 0, 0))
		if aseq != 1 || !ahead || !aintent || !aidle || bseq != 2 || bhead || !bidle {
			t.Fatalf("joins: a place %d head %v intent %v idle %v; b place %d head %v idle %v", aseq, ahead, aintent, aidle, bseq, bhead, bidle)
		}
		if got := advisoryHeld(t, ctx, obs, a); !slices.Contains(got, "ExclusiveLock "+strconv.FormatInt(k.Intent().V, 10)) {
			t.Fatalf("a after its join: %q, want the intent (of the key's space)", got)
		}
		aw := &serverWait{t: w, seq: aseq, intent: aintent, idle: aidle}
		ag, bg := make(chan int64, 1), make(chan int64, 1)
		go func() { v, _ := send(a, aw.waitText(5000, false, params(k)), aseq, 5000); ag <- v }()
		awaitKeyWait(t, ctx, obs, a, k)
		go func() {
			v, _ := send(b, lineStmt(r, params(k), 5000, false, &lineWait{false, bidle}), bseq, 5000)
			bg <- v
		}()
		must(holder, "SELECT length(pg_advisory_unlock_all()::text) + 1")
		grantedAlone(t, ctx, obs, a, ag, "ExclusiveLock", k)
		passes(t, ctx, obs, must, a, b, bg, "ShareLock", k)
		must(b, "SELECT length(pg_advisory_unlock_all()::text) + 1")
	}
}

// A line statement sent after a slice's end (again) takes a grant that the statement before it was given: the key
// granted as the slice ended, the lock surviving the error (the session holds the key, its intent, the line's flag
// and its ticket), or granted and then failed after it left the line (it holds the key alone, and the wait behind
// it is the head now, at place 1, in front of its old place). It answers a grant at once, the session holding the
// key once (one unlock frees it), and nothing of the line; before, it waited for the key again (held twice: an
// unlock left it held) or for the new head's ticket while holding the key.
func TestLineAgainTakesRacedGrant(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	conn, q := lineConns(t, ctx)
	must := mustQ(t, q)
	once := func(t *testing.T, obs, x *pgx.Conn, k ID, mode string) {
		t.Helper()
		if got, want := advisoryHeld(t, ctx, obs, x), mode+" "+strconv.FormatInt(k.V, 10); len(got) != 1 || got[0] != want {
			t.Fatalf("after the grant: %q, want only [%s]", got, want)
		}
		must(x, "SELECT pg_advisory_unlock"+map[bool]string{false: "", true: "_shared"}[mode == "ShareLock"]+"("+k.literal()+")::int")
		if got := advisoryHeld(t, ctx, obs, x); len(got) != 0 {
			t.Fatalf("after one unlock: %q, want nothing (the key was held twice)", got)
		}
	}
	t.Run("granted as the slice ended", func(t *testing.T) {
		for _, shared := range []bool{false, true} {
			k := ID{V: time.Now().UnixNano()}
			w, m := Target{ID: k}, Target{ID: k, Shared: shared}
			holder, a, x, obs := conn(), conn(), conn(), conn()
			must(holder, "SELECT length(pg_advisory_lock("+k.literal()+")::text) + 1")
			aseq, _, aintent, aidle := joined(must(a, JoinSQL(w, false, 15000)))
			seq, _, _, idle := joined(must(x, JoinSQL(m, false, 15000)))
			must(a, LeaveSQL(w, aseq, aintent, aidle))
			// What x's line statement did before its error: found itself the head, took the intent (a writer),
			// waited for the key and was granted it.
			if !shared {
				must(x, "SELECT pg_try_advisory_lock("+k.Intent().literal()+")::int")
			}
			must(holder, "SELECT length(pg_advisory_unlock_all()::text) + 1")
			must(x, "SELECT length("+lockFn(false, shared, k.literal())+"::text) + 1")
			if v := must(x, lineSQL(m, seq, 1000, true, &lineWait{false, idle})); v != resultAcquired {
				t.Fatalf("shared=%v: the statement after the slice's end: %d, want a grant", shared, v)
			}
			once(t, obs, x, k, map[bool]string{false: "ExclusiveLock", true: "ShareLock"}[shared])
			idleRestored(t, ctx, x)
		}
	})
	t.Run("granted, left the line, then failed", func(t *testing.T) {
		k := ID{V: time.Now().UnixNano()}
		w := Target{ID: k}
		holder, a, x, nx, obs := conn(), conn(), conn(), conn(), conn()
		must(holder, "SELECT length(pg_advisory_lock("+k.literal()+")::text) + 1")
		aseq, _, aintent, aidle := joined(must(a, JoinSQL(w, false, 15000)))
		seq, _, _, idle := joined(must(x, JoinSQL(w, false, 15000)))
		must(a, LeaveSQL(w, aseq, aintent, aidle))
		must(holder, "SELECT length(pg_advisory_unlock_all()::text) + 1")
		// x was granted and left the line (its fenced nextval then failed): it holds the key alone.
		must(x, "SELECT length(pg_advisory_lock("+k.literal()+")::text) + 1")
		must(x, LeaveSQL(w, seq, false, idle))
		nseq, nhead, _, _ := joined(must(nx, JoinSQL(w, false, 15000)))
		if nseq != 1 || !nhead {
			t.Fatalf("the next join: place %d head %v, want 1, the head", nseq, nhead)
		}
		// Before, it waited for the new head's ticket while holding the key, until its slice ended (55P03).
		if v, err := q(x, lineSQL(w, seq, 2000, true, &lineWait{false, idle})); err != nil || v != resultAcquired {
			t.Fatalf("the statement after the late error: %d %v, want a grant", v, err)
		}
		once(t, obs, x, k, "ExclusiveLock")
		if got := advisoryHeld(t, ctx, obs, nx); !slices.Contains(got, "ExclusiveLock "+strconv.FormatInt(k.Ticket(1).V, 10)) {
			t.Fatalf("the new head: %q, want its ticket still held", got)
		}
		must(nx, "SELECT length(pg_advisory_unlock_all()::text) + 1")
	})
}

// A writer in the line whose statement ended at a slice's end asks pg_locks whether it holds the intent before it
// gives its session up (WithYield): heldIntentSharedNowSQL is 1 only when it holds it and readers (or nobody) hold
// the key.
func TestHeldIntentSharedNow(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	conn, q := lineConns(t, ctx)
	must := mustQ(t, q)
	k := ID{V: time.Now().UnixNano()}
	w := Target{ID: k}
	reader, x := conn(), conn()
	must(reader, "SELECT length(pg_advisory_lock_shared("+k.literal()+")::text) + 1")
	if v := must(x, heldIntentSharedNowSQL(w)); v != 0 {
		t.Fatalf("without the intent: %d, want 0", v)
	}
	must(x, "SELECT pg_try_advisory_lock("+k.Intent().literal()+")::int")
	if v := must(x, heldIntentSharedNowSQL(w)); v != 1 {
		t.Fatalf("holding the intent, a reader holding the key: %d, want 1", v)
	}
	must(reader, "SELECT length(pg_advisory_unlock_all()::text) + 1")
	must(reader, "SELECT length(pg_advisory_lock("+k.literal()+")::text) + 1")
	if v := must(x, heldIntentSharedNowSQL(w)); v != 0 {
		t.Fatalf("holding the intent, a writer holding the key: %d, want 0", v)
	}
}
