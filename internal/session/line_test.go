package session

import (
	"context"
	"fmt"
	"slices"
	"strconv"
	"testing"
	"time"

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
