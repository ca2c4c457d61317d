package session

import (
	"context"
	"errors"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/advlock/advlock/internal/testkit/pgtest"
	"github.com/jackc/pgx/v5/pgconn"
)

// A fenced grant whose nextval logs nothing is covered by the WAL record of the nextval that logged ahead, in
// another transaction, which is flushed when that transaction commits. Here that transaction stays open (one that
// drew from the sequence itself, as the chaos campaign's DoTx does; or a shared session's batch whose first row
// logged and whose later rows still run), a shared session's grant is answered meanwhile, and the server crashes.
// The grant flushes the WAL before it (its own logical-decoding message, then its commit): after recovery nextval
// goes on above its token. Before, nextval handed the same token out again, every time (taking a transaction id in
// every grant did not help: a commit that wrote no WAL flushes nothing).
func TestTokenDurableWhileAnotherLogs(t *testing.T) {
	if testing.Short() {
		t.Skip("starts a private cluster")
	}
	// Nothing else flushes WAL meanwhile: no autovacuum commits, no running-xacts records (wal_level minimal), the
	// WAL writer flushes only completed pages or async commits (none here).
	c := pgtest.StartCluster(t, "autovacuum = off", "wal_level = minimal", "max_wal_senders = 0",
		"wal_writer_delay = 10s")
	ctx, cancel := context.WithTimeout(context.Background(), 120*time.Second)
	defer cancel()
	connect := func() *pgconn.PgConn {
		t.Helper()
		for deadline := time.Now().Add(10 * time.Second); ; time.Sleep(50 * time.Millisecond) {
			pc, err := pgconn.Connect(ctx, c.URL)
			if err == nil {
				return pc
			}
			if time.Now().After(deadline) {
				t.Fatal(err)
			}
		}
	}
	queryInt := func(pc *pgconn.PgConn, sql string) int64 {
		t.Helper()
		res, err := pc.Exec(ctx, sql).ReadAll()
		if err != nil {
			t.Fatalf("%s: %v", sql, err)
		}
		last := res[len(res)-1]
		n, err := strconv.ParseInt(string(last.Rows[0][0]), 10, 64)
		if err != nil {
			t.Fatal(err)
		}
		return n
	}
	{
		obs := connect()
		queryInt(obs, "CREATE SEQUENCE "+FenceSeq+"; SELECT 1")
		_ = obs.Close(ctx)
	}

	for _, how := range []string{"open transaction", "long batch"} {
		t.Run(how, func(t *testing.T) {
			obs := connect()
			defer obs.Close(context.Background())
			mpc := connect()
			m, err := OpenMux(ctx, &wireConn{pc: mpc}, 30*time.Second, nil, nil, true)
			if err != nil {
				t.Fatal(err)
			}
			defer m.Close()
			base := time.Now().UnixNano()
			h, err := m.Try(ctx, Target{ID: ID{V: base}}, nil)
			if err != nil {
				t.Fatal(err)
			}
			_, before := TokenParts(h.Token()) // the sequence's value
			_ = h.Release(ctx, ErrNotHeld)
			queryInt(obs, "CHECKPOINT; SELECT 1") // the next nextval logs the sequence (and takes a transaction id)

			// A: the transaction whose nextval logs, still open.
			a := connect()
			defer a.Close(context.Background())
			aDone := make(chan error, 1)
			switch how {
			case "open transaction":
				queryInt(a, "BEGIN; SELECT nextval('"+FenceSeq+"')")
				aDone <- nil
			case "long batch":
				// The shared session's own statement: the first row is a granted try (its token logs), the rest are
				// tries of a key held elsewhere, which take nothing and draw no token, and keep the transaction open.
				const held, rows = 7, 2_000_000
				queryInt(obs, "SELECT length(pg_advisory_lock("+strconv.Itoa(held)+")::text) + 1")
				var ops, keys, flags strings.Builder // flags: what an exclusive try tests besides its key (gateOf)
				ops.WriteString("{1")
				keys.WriteString("{" + strconv.FormatInt(base+1, 10))
				flags.WriteString("{" + strconv.FormatInt(ID{V: base + 1}.Waiting().V, 10))
				heldFlag := "," + strconv.FormatInt(ID{V: held}.Waiting().V, 10)
				for range rows {
					ops.WriteString(",1")
					keys.WriteString("," + strconv.Itoa(held))
					flags.WriteString(heldFlag)
				}
				ops.WriteString("}")
				keys.WriteString("}")
				flags.WriteString("}")
				go func() {
					_, err := a.ExecParams(ctx, muxSQL[1], [][]byte{[]byte(ops.String()), []byte(keys.String()), []byte(flags.String())},
						nil, nil, nil).Close()
					aDone <- err
				}()
				for deadline := time.Now().Add(30 * time.Second); queryInt(obs, "SELECT last_value FROM "+FenceSeq) <= before; time.Sleep(time.Millisecond) {
					if time.Now().After(deadline) {
						t.Fatal("the batch drew no token")
					}
				}
			}

			// B: a grant on the shared session, answered while A's transaction is open.
			hb, err := m.Try(ctx, Target{ID: ID{V: base + 2}}, nil)
			if err != nil {
				t.Fatal(err)
			}
			token := hb.Token()
			unflushed := queryInt(obs, "SELECT (pg_current_wal_insert_lsn() > pg_current_wal_flush_lsn())::int")
			t.Logf("token %d handed out (before the checkpoint: %d); WAL not yet flushed: %v", token, before, unflushed == 1)

			if err := c.Stop("immediate"); err != nil { // a crash
				t.Fatal(err)
			}
			select {
			case err := <-aDone:
				if how == "long batch" && err == nil {
					t.Fatal("the batch committed before the crash: nothing shown")
				}
			case <-time.After(10 * time.Second):
				t.Fatal("A did not end with the server")
			}
			if err := c.Start(); err != nil {
				t.Fatal(err)
			}
			after := connect()
			defer after.Close(context.Background())
			var again []int64
			for range 3 {
				again = append(again, queryInt(after, "SELECT "+grant(true)))
			}
			if again[0] <= token {
				t.Errorf("token %d was handed out before an immediate restart; after it nextval returns %v: the same "+
					"tokens again", token, again)
			}
		})
	}
}

// The settling of a fenced Mux's round trips under injected failures, racing kill and Close: a row refused for lack
// of lock-table space (with its undo queued first), or a round trip in doubt; many callers trying and releasing.
// Every caller returns, none is woken twice into a wrong state (the race detector watches), undo requests (no
// caller, no sig) are never signalled, and the Mux ends. The injections do not match what the server did (rows
// after an injected failure did run), so lock counts on the server are not checked, only the Mux's settling.
func TestMuxInjectedFailures(t *testing.T) {
	url := pgtest.FreshDB(t, pgtest.URL(t))
	ctx, cancel := context.WithTimeout(context.Background(), 120*time.Second)
	defer cancel()
	{
		pc, err := pgconn.Connect(ctx, url)
		if err != nil {
			t.Fatal(err)
		}
		if _, err := pc.Exec(ctx, "CREATE SEQUENCE "+FenceSeq).ReadAll(); err != nil {
			t.Fatal(err)
		}
		_ = pc.Close(ctx)
	}
	full := TranslateErr(&pgconn.PgError{Severity: "ERROR", Code: "53200", Message: "out of shared memory (injected)"})
	doubt := errors.New("in doubt (injected)")
	var fulls, doubts, multi atomic.Int64
	for iter := range 30 {
		pc, err := pgconn.Connect(ctx, url)
		if err != nil {
			t.Fatal(err)
		}
		gone := make(chan struct{})
		m, err := OpenMux(ctx, &wireConn{pc: pc}, 5*time.Second, func(*Mux) { close(gone) }, nil, true)
		if err != nil {
			t.Fatal(err)
		}
		var n atomic.Int64
		setHookSettle(t, func(hm *Mux, where string) {
			if hm != m || where != "complete" || len(hm.wire) == 0 {
				return
			}
			k := n.Add(1)
			if len(hm.wire) > 1 {
				multi.Add(1)
			}
			switch {
			case k%7 == 0: // a try's row refused, the rows after it unanswered
				for i, r := range hm.wire {
					if isTry(r.op) {
						hm.batchErr = full
						fulls.Add(1)
						for j := i; j < len(hm.results); j++ {
							hm.results[j] = -1
						}
						return
					}
				}
			case k == int64(3+iter%10): // a round trip in doubt
				hm.batchErr = doubt
				doubts.Add(1)
				hm.results[len(hm.results)-1] = -1
			}
		})
		var wg sync.WaitGroup
		for g := range 12 {
			wg.Add(1)
			go func() {
				defer wg.Done()
				for i := range 40 {
					h, err := m.Try(ctx, Target{ID: ID{V: int64(iter*100000 + g*1000 + i + 1)}, Shared: i%3 == 0}, nil)
					if err != nil {
						continue
					}
					_ = h.Release(ctx, ErrNotHeld)
				}
			}()
		}
		switch iter % 3 {
		case 1:
			time.AfterFunc(time.Duration(iter)*time.Millisecond, func() { m.kill(errKilled) })
		case 2:
			time.AfterFunc(time.Duration(iter)*time.Millisecond, m.Close)
		}
		done := make(chan struct{})
		go func() { wg.Wait(); close(done) }()
		select {
		case <-done:
		case <-time.After(20 * time.Second):
			t.Fatalf("iteration %d: callers still wait", iter)
		}
		closed := make(chan struct{})
		go func() { m.Close(); close(closed) }()
		select {
		case <-closed:
		case <-time.After(10 * time.Second):
			t.Fatalf("iteration %d: Close hangs", iter)
		}
		select {
		case <-gone:
		case <-time.After(5 * time.Second):
			t.Fatalf("iteration %d: the Mux was never settled", iter)
		}
		testHookSettle.Store(nil)
	}
	t.Logf("injected: %d refused tries, %d round trips in doubt; %d round trips of several requests", fulls.Load(), doubts.Load(), multi.Load())
}

// A fenced round trip [try A, try B] where B finds no lock-table space: A was granted and drew its token in the
// statement's transaction, which then aborted and flushed nothing, so A's token could be handed out again after a
// crash. A's grant is undone and sent again, and the token A gets comes from a transaction whose commit flushes:
// after a crash the sequence goes on above it. The table stays full until the crash, so no other commit flushes A's
// token by chance. (Answered from the aborted round trip, A's token came back from the first nextval after the
// crash, every time.)
func TestMuxFencedBatchTokensSurviveCrash(t *testing.T) {
	if testing.Short() {
		t.Skip("starts a private cluster")
	}
	c := pgtest.StartCluster(t, "max_locks_per_transaction = 10", "autovacuum = off", "wal_level = minimal",
		"max_wal_senders = 0", "wal_writer_delay = 10s")
	ctx, obs := sequenced(t, c.URL)
	m, _ := openMuxAt(t, c.URL, true)
	a, b := time.Now().UnixNano(), time.Now().UnixNano()+1
	if _, err := m.Try(ctx, Target{ID: ID{V: a}, Shared: true}, nil); err != nil { // A held: trying it again needs no space
		t.Fatal(err)
	}
	fillLockTable(t, ctx, c.URL, obs, 1) // room for A's transaction id
	// Rows A and B queued, then a try of a third key, which sends all three as one round trip.
	r1 := &req{op: opTryShared, key: a, sig: make(chan struct{}, 1)}
	r2 := &req{op: opTry, key: b, sig: make(chan struct{}, 1)}
	m.mu.Lock()
	m.queue = append(m.queue, r1, r2)
	m.mu.Unlock()
	third := make(chan error, 1)
	go func() {
		h, err := m.Try(ctx, Target{ID: ID{V: b + 1}}, nil)
		if err == nil {
			_ = h.Release(ctx, ErrNotHeld)
		}
		third <- err
	}()
	m.wait(r2)
	if !errors.Is(r2.err, ErrLockTableFull) {
		t.Fatalf("row B: %v, want ErrLockTableFull", r2.err)
	}
	// The table stays full: the third row fails too, and its round trip commits nothing that would flush A's.
	m.wait(r1)
	if err := <-third; err != nil && !errors.Is(err, ErrLockTableFull) {
		t.Fatalf("the third row: %v", err)
	}
	if r1.err != nil || r1.res < 1 {
		t.Fatalf("row A: %d, %v; want a grant", r1.res, r1.err)
	}
	token := r1.res
	if err := c.Restart("immediate"); err != nil {
		t.Fatal(err)
	}
	obs2, err := pgconn.Connect(ctx, c.URL)
	if err != nil {
		t.Fatal(err)
	}
	defer obs2.Close(context.Background())
	res, err := obs2.Exec(ctx, "SELECT "+grant(true)).ReadAll()
	if err != nil {
		t.Fatal(err)
	}
	next, _ := strconv.ParseInt(string(res[0].Rows[0][0]), 10, 64)
	t.Logf("row A's token %d; the first nextval after a crash %d", token, next)
	if next <= token {
		t.Errorf("after a crash the sequence handed out %d again (row A got %d)", next, token)
	}
}
