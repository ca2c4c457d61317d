package session

import (
	"context"
	"errors"
	"fmt"
	"os"
	"strconv"
	"testing"
	"time"

	"github.com/advlock/advlock/internal/testkit/pgtest"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgproto3"
)

// A fenced shared session's round trip whose rows all arrive, followed by an error (here a statement_timeout
// that fires after the last row, before the executor finishes: the server checks for interrupts once more when it
// asks the scan for the next row; a cancel request landing then does the same): the statement's transaction
// aborted and flushed nothing. Its granted tries are undone and sent again, so the token a caller gets comes from
// a transaction whose commit flushed, and an immediate restart goes on above it. (Every row used to be applied as
// answered: the token came from the aborted transaction, and after the restart nextval handed it out again.)
//
// The moment is a few microseconds wide (the scan's last fetch after the last row), so the test hunts for it, for up
// to 90 s; on a loaded machine (the race detector and every package's tests at once on 2 cores) it may not come
// at all. It runs with ADVLOCK_LONG=1; TestMuxTrailingErrorInjected puts the same error on the wire at that
// moment every time, for the test command.
func TestMuxTrailingErrorToken(t *testing.T) {
	if os.Getenv("ADVLOCK_LONG") == "" {
		t.Skip("hunts a moment a few microseconds wide for up to 90 s: ADVLOCK_LONG=1 runs it (TestMuxTrailingErrorInjected makes it happen)")
	}
	c := pgtest.StartCluster(t, "autovacuum = off", "wal_level = minimal", "max_wal_senders = 0",
		"wal_writer_delay = 10s")
	ctx, cancel := context.WithTimeout(context.Background(), 170*time.Second)
	defer cancel()
	obs, err := pgconn.Connect(ctx, c.URL)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = obs.Close(context.Background()) }()
	const held = 7
	if _, err := obs.Exec(ctx, "CREATE SEQUENCE "+FenceSeq+"; SELECT pg_advisory_lock(7)").ReadAll(); err != nil {
		t.Fatal(err)
	}
	cfg, err := pgconn.ParseConfig(c.URL)
	if err != nil {
		t.Fatal(err)
	}
	var hit struct {
		err      error
		rows     int
		trailing bool // a round trip carrying first answered every row, then failed
	}
	var cur *Mux
	var first *req
	setHookSettle(t, func(hm *Mux, at string) {
		if hm != cur || at != "complete" || len(hm.wire) == 0 {
			return
		}
		hit.err, hit.rows = hm.batchErr, 0
		for _, r := range hm.results {
			if r >= 0 {
				hit.rows++
			}
		}
		for _, r := range hm.wire {
			if r == first && hit.err != nil && hit.rows == len(hm.wire) {
				hit.trailing = true
			}
		}
	})
	n, outcomes := 400, map[string]int{}
	timeout := 5 // ms: the session's statement_timeout, raised when a loaded machine cannot even prepare within it
	openFails := 0
	base := time.Now().UnixNano()
	start := time.Now()
	for it := 0; time.Since(start) < 90*time.Second; it++ {
		if _, err := obs.Exec(ctx, "CHECKPOINT").ReadAll(); err != nil { // the next nextval logs, in its own transaction
			t.Fatal(err)
		}
		pc, err := pgconn.ConnectConfig(ctx, cfg)
		if err != nil {
			t.Fatal(err)
		}
		// The session's statement_timeout (a role's or a pool's default; advlock.New leaves it) is set once the
		// new backend has loaded its caches (its first statement alone may take a few ms), and long enough for the
		// shared session's preparation: 5 ms. The round trip below grows until it lasts about that long.
		if _, err := pc.Exec(ctx, fmt.Sprintf("SELECT pg_is_in_recovery(); SET statement_timeout = %d", timeout)).ReadAll(); err != nil {
			t.Fatal(err)
		}
		m, err := OpenMux(ctx, &wireConn{pc: pc}, 5*time.Second, nil, nil, true)
		if err != nil {
			outcomes["open failed"]++
			if outcomes["open failed"] == 1 {
				t.Log("open:", err) // shown only if the window is never hit
			}
			if openFails++; openFails >= 2 && timeout < 40 { // a load spike is not enough: two in a row
				timeout, n, openFails = timeout*5/4+1, n*5/4, 0
			}
			continue
		}
		openFails = 0
		hit.err, hit.rows, hit.trailing = nil, -1, false
		// One round trip: a granted try of a fresh key (its nextval logs), then tries of a key held elsewhere
		// (answered 0, no token) that make the statement last about statement_timeout.
		first = &req{op: opTry, key: base + int64(it), sig: make(chan struct{}, 1)}
		cur = m
		var rest []*req
		for range n - 1 {
			rest = append(rest, &req{op: opTry, key: held, sig: make(chan struct{}, 1)})
		}
		m.mu.Lock()
		m.queue = append(m.queue, first)
		m.queue = append(m.queue, rest[:len(rest)-1]...)
		m.mu.Unlock()
		m.do(rest[len(rest)-1])
		m.wait(first)
		switch {
		case hit.trailing:
			outcomes["every row answered, then an error"]++
		case hit.err == nil:
			outcomes["committed"]++
			n += 20
		default:
			outcomes["failed mid-statement (session destroyed)"]++
			n -= 20
		}
		if !hit.trailing || first.err != nil || first.res < 1 {
			m.Close()
			continue
		}
		token := first.res
		t.Logf("iteration %d: a round trip of %d rows answered every row, then failed; the try returned token %d",
			it, n, token)
		if err := c.Stop("immediate"); err != nil {
			t.Fatal(err)
		}
		m.Close()
		if err := c.Start(); err != nil {
			t.Fatal(err)
		}
		after, err := pgconn.Connect(ctx, c.URL)
		if err != nil {
			t.Fatal(err)
		}
		res, err := after.Exec(ctx, "SELECT "+grant(true)).ReadAll()
		_ = after.Close(ctx)
		if err != nil {
			t.Fatal(err)
		}
		next, _ := strconv.ParseInt(string(res[0].Rows[0][0]), 10, 64)
		t.Logf("outcomes %v", outcomes)
		if next <= token {
			t.Fatalf("token %d came from a round trip that ended in an error after its last row (its transaction "+
				"aborted); after an immediate restart nextval returned %d: the same token again", token, next)
		}
		t.Logf("after the restart nextval returned %d, above the token", next)
		return
	}
	t.Fatalf("outcomes %v (statement_timeout %d ms at the end); the window was never hit in 90 s: nothing shown",
		outcomes, timeout)
}

// A fenced round trip whose every row arrives and which then ends with an error (here put on the wire in place of
// the statement's CommandComplete: what a statement_timeout or a cancel request landing after the last row looks
// like to the client) is treated as aborted, whatever the rows said: each granted try is undone and sent again, so
// its caller's token comes from a later transaction (greater than the one in the aborted rows), each key is held
// exactly once, and a try that was refused stays refused. Applied as answered, the tries kept the tokens of a
// transaction that flushed nothing.
func TestMuxTrailingErrorInjected(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	url := pgtest.FreshDB(t, pgtest.URL(t))
	obs, err := pgconn.Connect(ctx, url)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = obs.Close(context.Background()) }()
	held := time.Now().UnixNano()
	if _, err := obs.Exec(ctx, fmt.Sprintf("CREATE SEQUENCE %s; SELECT pg_advisory_lock(%d)", FenceSeq, held)).ReadAll(); err != nil {
		t.Fatal(err)
	}
	m, _ := openMuxAt(t, url, true)
	a, b := held+1, held+2
	rs := []*req{{op: opTry, key: a}, {op: opTry, key: held}, {op: opTry, key: b}}
	for _, r := range rs {
		r.sig = make(chan struct{}, 1)
	}
	var injected bool
	var aborted []int64 // what the aborted round trip's rows said
	hook := func(hm *Mux, msg pgproto3.BackendMessage) pgproto3.BackendMessage {
		if _, ok := msg.(*pgproto3.CommandComplete); ok && hm == m && !injected {
			injected = true
			return &pgproto3.ErrorResponse{Severity: "ERROR", SeverityUnlocalized: "ERROR", Code: "57014",
				Message: "canceling statement due to statement timeout (put on the wire by the test)"}
		}
		return msg
	}
	testHookMessage.Store(&hook)
	defer testHookMessage.Store(nil)
	setHookSettle(t, func(hm *Mux, at string) {
		if hm == m && at == "complete" && hm.batchErr != nil && aborted == nil {
			aborted = append([]int64(nil), hm.results...)
		}
	})
	m.mu.Lock()
	m.queue = append(m.queue, rs[:2]...)
	m.mu.Unlock()
	m.do(rs[2])
	for _, r := range rs[:2] {
		m.wait(r)
	}
	testHookMessage.Store(nil)
	if !injected || len(aborted) != 3 || aborted[0] < 1 || aborted[1] != 0 || aborted[2] < 1 {
		t.Fatalf("the round trip was not answered in full before the error (injected %v, rows %v)", injected, aborted)
	}
	for i, want := range []bool{true, false, true} {
		r := rs[i]
		switch {
		case r.err != nil:
			t.Errorf("try %d: %v", i, r.err)
		case want && r.res <= aborted[i]:
			t.Errorf("try %d got token %d, from the aborted round trip (its rows said %d): not drawn again", i, r.res, aborted[i])
		case !want && r.res != 0:
			t.Errorf("try %d of a key held elsewhere answered %d", i, r.res)
		}
	}
	// The server: the Mux's session holds a and b once each (one unlock frees each), and not the held key.
	pid := m.pid
	for _, k := range []int64{a, b} {
		u := &req{op: opUnlock, key: k, sig: make(chan struct{}, 1)}
		m.do(u)
		if u.err != nil || u.res != 1 {
			t.Fatalf("unlock of %d: %d %v", k, u.res, u.err)
		}
	}
	rows, err := obs.Exec(ctx, fmt.Sprintf(`SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND pid = %d`, pid)).ReadAll()
	if err != nil {
		t.Fatal(err)
	}
	if n := string(rows[0].Rows[0][0]); n != "0" {
		t.Errorf("after one unlock of each key the Mux's session still holds %s advisory locks: a try was granted twice", n)
	}
}

// The undo-and-resend of a fenced round trip refused for lack of lock-table space, where the key of a granted try
// also appears elsewhere in the round trip: [unlock A, try A, try B] (A was held by this session before) and
// [try A, try A, try B] (shared, twice). B finds no space after A's grant and its transaction id took the last
// slots. Afterwards the session must hold A exactly as often as the answers say (checked by unlocking until the
// server answers false), B not at all, and the tries of A end granted with fresh tokens.
func TestMuxUndoSameKey(t *testing.T) {
	if testing.Short() {
		t.Skip("starts a private cluster")
	}
	c := pgtest.StartCluster(t, "max_locks_per_transaction = 10", "autovacuum = off")
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	obs, err := pgconn.Connect(ctx, c.URL)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = obs.Close(context.Background()) }()
	if _, err := obs.Exec(ctx, "CREATE SEQUENCE "+FenceSeq).ReadAll(); err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		name  string
		pre   bool    // the session holds A (shared) before the round trip
		ops   []int16 // the round trip, before B
		free  int     // slots the filler gives back
		holds int     // how often the session holds A afterwards
	}{
		{"unlock A, try A, try B", true, []int16{opUnlockShared, opTryShared}, 1, 1},
		// Exclusive tries: an exclusive try tests the key's line's flag after its grant (as a shared try tests the
		// key's intent), which takes a lock table entry for a moment even when the session holds the key already:
		// one slot more than the tries alone take.
		{"try A, try A, try B", false, []int16{opTry, opTry}, 3, 2},
	} {
		t.Run(tc.name, func(t *testing.T) {
			m, _ := openMuxAt(t, c.URL, true)
			do := func(rs ...*req) {
				t.Helper()
				for _, r := range rs {
					r.sig = make(chan struct{}, 1)
				}
				m.mu.Lock()
				m.queue = append(m.queue, rs[:len(rs)-1]...)
				m.mu.Unlock()
				m.do(rs[len(rs)-1]) // returns once its own request is answered (it may have used sig itself)
				for _, r := range rs[:len(rs)-1] {
					m.wait(r)
				}
			}
			a, b := time.Now().UnixNano(), time.Now().UnixNano()+1
			if tc.pre {
				r := &req{op: opTryShared, key: a}
				do(r)
				if r.err != nil || r.res < 1 {
					t.Fatalf("taking A first: %d %v", r.res, r.err)
				}
			}
			filler := fillLockTable(t, ctx, c.URL, obs, tc.free)
			var rs []*req
			for _, op := range tc.ops {
				rs = append(rs, &req{op: op, key: a})
			}
			rb := &req{op: opTry, key: b}
			var rounds, fails int
			var refused []int64 // the answers of the refused round trip (-1: none)
			setHookSettle(t, func(hm *Mux, at string) {
				if hm == m && at == "complete" && len(hm.wire) > 0 {
					rounds++
					if hm.batchErr != nil {
						fails++
						refused = append([]int64(nil), hm.results...)
					}
				}
			})
			do(append(rs, rb)...)
			testHookSettle.Store(nil)
			t.Logf("%d round trips, %d refused (its rows answered %v); answers: %v", rounds, fails, refused, func() (s []string) {
				for _, r := range append(rs, rb) {
					s = append(s, strconv.FormatInt(r.res, 10)+"/"+strconv.FormatBool(r.err != nil))
				}
				return s
			}())
			if fails == 0 || len(refused) != len(rs)+1 || refused[len(rs)-1] < 1 || refused[len(rs)] != -1 {
				t.Fatalf("the scenario did not happen: A's try granted, then B refused (%v)", refused)
			}
			if !errors.Is(rb.err, ErrLockTableFull) {
				t.Errorf("B: %d %v, want ErrLockTableFull", rb.res, rb.err)
			}
			if _, err := filler.Exec(ctx, "SELECT pg_advisory_unlock_all()").ReadAll(); err != nil {
				t.Fatal(err)
			}
			for _, r := range rs {
				if r.err != nil || (isTry(r.op) && r.res < 1) || (!isTry(r.op) && r.res != 1) {
					t.Errorf("op %d: %d %v", r.op, r.res, r.err)
				}
			}
			unlockA := int16(opUnlockShared)
			if tc.ops[len(tc.ops)-1] == opTry {
				unlockA = opUnlock
			}
			n := 0
			for ; n < 10; n++ {
				r := &req{op: unlockA, key: a}
				do(r)
				if r.err != nil {
					t.Fatal(r.err)
				}
				if r.res != 1 {
					break
				}
			}
			if n != tc.holds {
				t.Errorf("the session held A %d times, want %d", n, tc.holds)
			}
			r := &req{op: opUnlock, key: b}
			do(r)
			if r.err != nil || r.res != 0 {
				t.Errorf("B still held by the session: %d %v", r.res, r.err)
			}
		})
	}
}
