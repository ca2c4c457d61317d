package session

import (
	"context"
	"fmt"
	"slices"
	"strconv"
	"testing"
	"time"

	"github.com/advlock/advlock/internal/testkit/pgtest"
	"github.com/jackc/pgx/v5"
)

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
