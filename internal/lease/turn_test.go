package lease

import (
	"context"
	"strings"
	"sync"
	"testing"

	"github.com/advlock/advlock/internal/testkit/pgtest"
	"github.com/jackc/pgx/v5"
)

// take runs turnTakeSQL(i, want) on c: whether it took (or beat) the turn, and the beat it wrote or found.
func take(t *testing.T, c *pgx.Conn, i int, want string) (bool, string) {
	t.Helper()
	yn, b, _ := strings.Cut(lastRow(t, c, turnTakeSQL(i, want)), " ")
	return yn == "y", b
}

// beats reads the turns' beats on c.
func beats(t *testing.T, c *pgx.Conn) []string {
	t.Helper()
	var s string
	if err := c.QueryRow(context.Background(), turnsReadSQL()).Scan(&s); err != nil {
		t.Fatal(err)
	}
	return strings.Fields(s)
}

// A turn goes to one Client of those that try at once, and is beaten by it alone, on the server: eight Clients that
// find no row take turn 1 at once (a database that has never seen a sweep), and one has it; then, 40 times, its
// sweeper beats it at the moment another, which saw that beat unchanged, takes it: one of the two has it. The
// server's beat is the winner's; a loser is told the beat its statement's snapshot held (the winner's, the one it
// wanted, or none while the winner inserted it), which its next read corrects. A beat moves on whatever the
// server's clock says (a turn's row set an hour ahead, as after the clock stepped back; one at infinity and one at
// PostgreSQL's last microsecond, written by hand), so that a live sweeper's beat never looks unchanged. A give-back
// deletes the row where its beat is the sweeper's last or later (a beat cut by Close may have been written), never
// an earlier one.
func TestTurnTakenOnce(t *testing.T) {
	url := freshTables(t)
	obs := pgtest.Conn(t, url)
	if got := beats(t, obs); len(got) != Turns || got[0] != "-" || got[1] != "-" {
		t.Fatalf("beats of a database that has never seen a sweep: %q", got)
	}
	conns := make([]*pgx.Conn, 8)
	for i := range conns {
		conns[i] = pgtest.Conn(t, url)
	}
	type result struct {
		ok   bool
		beat string
	}
	race := func(wants []string) []result {
		out := make([]result, len(wants))
		var wg sync.WaitGroup
		start := make(chan struct{})
		for i, w := range wants {
			wg.Add(1)
			go func() {
				defer wg.Done()
				<-start
				ok, b := take(t, conns[i], 1, w)
				out[i] = result{ok, b}
			}()
		}
		close(start)
		wg.Wait()
		return out
	}
	check := func(what string, wants []string, out []result) string {
		t.Helper()
		var winner string
		n := 0
		for _, r := range out {
			if r.ok {
				n++
				winner = r.beat
			}
		}
		if n != 1 {
			t.Fatalf("%s: %d took the turn, want 1: %+v", what, n, out)
		}
		for i, r := range out {
			// What the statement's snapshot held: the row as the winner found it, or none while it inserted it.
			if !r.ok && r.beat != winner && r.beat != wants[i] && r.beat != "-" {
				t.Fatalf("%s: a Client that did not take the turn was told %q, the winner wrote %q", what, r.beat, winner)
			}
		}
		if got := beats(t, obs); got[0] != winner || got[1] != "-" {
			t.Fatalf("%s: the server's beats %q, want %q and none", what, got, winner)
		}
		return winner
	}
	first := []string{"-", "-", "-", "-", "-", "-", "-", "-"}
	beat := check("eight first takes", first, race(first))
	for range 40 {
		both := []string{beat, beat}
		beat = check("a beat and a take at once", both, race(both))
	}
	if ok, b := take(t, obs, 1, "-"); ok || b != beat {
		t.Fatalf("a take of a turn that has a row, as if it had none: %v %q, want refused and %q", ok, b, beat)
	}

	if _, err := obs.Exec(context.Background(), "UPDATE "+Timelines+" SET since = clock_timestamp() + interval '1 hour' WHERE timeline = -1"); err != nil {
		t.Fatal(err)
	}
	ahead := beats(t, obs)[0]
	ok, moved := take(t, obs, 1, ahead)
	if !ok || moved == ahead {
		t.Fatalf("the beat of a row an hour ahead of the server's clock: %v %q, was %q; want taken and moved on", ok, moved, ahead)
	}
	if _, err := obs.Exec(context.Background(), "UPDATE "+Timelines+" SET since = 'infinity' WHERE timeline = -1"); err != nil {
		t.Fatal(err)
	}
	ok, moved = take(t, obs, 1, "infinite")
	if !ok || moved == "infinite" {
		t.Fatalf("the beat of a row at infinity: %v %q; want taken and moved on", ok, moved)
	}
	if _, err := obs.Exec(context.Background(), "UPDATE "+Timelines+" SET since = '294276-12-31 23:59:59.999999+00' WHERE timeline = -1"); err != nil {
		t.Fatal(err)
	}
	last := beats(t, obs)[0]
	if ok, moved = take(t, obs, 1, last); !ok || moved == last {
		t.Fatalf("the beat of a row at PostgreSQL's last microsecond (%q): %v %q; want taken and moved on", last, ok, moved)
	}
	if ok, b := take(t, obs, 2, "-"); !ok || b == "-" {
		t.Fatalf("turn 2, which has no row: %v %q, want taken", ok, b)
	}
	got := beats(t, obs)
	if got[0] != moved || got[1] == "-" {
		t.Fatalf("the beats %q, want %q and turn 2's", got, moved)
	}
	// A give-back deletes its own beat, or a later one (its last beat may have been written though cut), never an
	// earlier one.
	if _, err := obs.Exec(context.Background(), "UPDATE "+Timelines+" SET since = since - interval '1 microsecond' WHERE timeline = -2"); err != nil {
		t.Fatal(err)
	}
	if n := lastRow(t, obs, turnGiveBackSQL(2, got[1])); n != "0" {
		t.Fatalf("a give-back of a beat later than the row's deleted %s rows", n)
	}
	if n := lastRow(t, obs, turnGiveBackSQL(2, beats(t, obs)[1])); n != "1" || beats(t, obs)[1] != "-" || beats(t, obs)[0] != moved {
		t.Fatalf("a give-back by turn 2's sweeper deleted %s rows; beats now %q", n, beats(t, obs))
	}
	if ok, _ := take(t, obs, 2, "-"); !ok {
		t.Fatal("turn 2 given back: not taken")
	}
	if n := lastRow(t, obs, turnGiveBackSQL(2, got[1])); n != "1" || beats(t, obs)[1] != "-" {
		t.Fatalf("a give-back of an earlier beat than the row's (a cut beat was written) deleted %s rows", n)
	}
	if n := lastRow(t, obs, turnGiveBackSQL(1, "infinite")); n != "0" || beats(t, obs)[0] != moved {
		t.Fatalf("a give-back of a beat at infinity deleted %s rows of a finite one", n)
	}
}

// lastRow runs sql on c and returns the text of its last statement's one row.
func lastRow(t *testing.T, c *pgx.Conn, sql string) string {
	t.Helper()
	rs, err := c.PgConn().Exec(context.Background(), sql).ReadAll()
	if err != nil {
		t.Fatal(err)
	}
	if r := rs[len(rs)-1]; len(r.Rows) == 1 {
		return string(r.Rows[0][0])
	}
	t.Fatalf("%d rows\n%s", len(rs[len(rs)-1].Rows), sql)
	return ""
}
