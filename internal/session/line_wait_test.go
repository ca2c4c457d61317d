package session

import (
	"context"
	"slices"
	"strconv"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
)

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
