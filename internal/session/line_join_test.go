package session

import (
	"context"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
)

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
