package advlock

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net/url"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/advlock/advlock/internal/testkit/pgtest"
	"github.com/jackc/pgx/v5"
)

// Inspect reports holders and waiters as the server sees them, with who they are.
func TestInspect(t *testing.T) {
	url := pgtest.URL(t)
	ctx := ctxT(t, 20*time.Second)
	holder, err := Open(ctx, url)
	if err != nil {
		t.Fatal(err)
	}
	defer holder.Close()
	waiter := New(pgtest.Pool(t, url, nil))
	defer waiter.Close()
	k := NameKey("inspect-" + key(t).String())
	lk, err := holder.RLock(ctx, k)
	if err != nil {
		t.Fatal(err)
	}
	got := make(chan error, 1)
	go func() {
		w, err := waiter.Lock(ctx, k)
		if err == nil {
			err = w.Unlock(ctx)
		}
		got <- err
	}()
	obs := pgtest.Conn(t, url)
	var mine []LockInfo
	for deadline := time.Now().Add(10 * time.Second); len(mine) < 2; time.Sleep(5 * time.Millisecond) {
		rows, err := Inspect(ctx, obs)
		if err != nil {
			t.Fatal(err)
		}
		mine = mine[:0]
		for _, r := range rows {
			if r.Key.Equal(k) {
				mine = append(mine, r)
			}
		}
		if time.Now().After(deadline) {
			t.Fatalf("want a holder and a waiter, got %+v", mine)
		}
	}
	h, w := mine[0], mine[1]
	if !h.Granted || !h.Shared || h.ApplicationName != "advlock" || h.WaitStart != nil || len(h.BlockedBy) != 0 ||
		h.BackendStart.IsZero() || h.ClientAddr == "" {
		t.Errorf("holder row = %+v", h)
	}
	if w.Granted || w.Shared || w.WaitStart == nil || !slices.Equal(w.BlockedBy, []int32{h.PID}) || w.State != "active" {
		t.Errorf("waiter row = %+v (holder pid %d)", w, h.PID)
	}
	js, err := json.Marshal(w)
	if err != nil {
		t.Fatal(err)
	}
	var m map[string]any
	_ = json.Unmarshal(js, &m)
	for _, f := range []string{"key", "mode", "granted", "wait_start", "blocked_by", "pid", "application_name",
		"client_addr", "backend_start", "state", "client_sessions"} {
		if _, ok := m[f]; !ok {
			t.Errorf("JSON lacks %q: %s", f, js)
		}
	}
	if err := lk.Unlock(ctx); err != nil {
		t.Fatal(err)
	}
	if err := <-got; err != nil {
		t.Fatal(err)
	}
}

// LockTable counts what this test holds against the server's approximate table size.
func TestLockTable(t *testing.T) {
	b := setup(t)
	ctx := ctxT(t, 10*time.Second)
	before, err := LockTable(ctx, b.obs)
	if err != nil {
		t.Fatal(err)
	}
	if before.Capacity < 64*100 {
		t.Errorf("capacity %d, want at least max_locks_per_transaction 64 x max_connections 100", before.Capacity)
	}
	var held []*Lock
	for range 50 {
		lk, err := b.l.TryLock(ctx, key(t))
		if err != nil {
			t.Fatal(err)
		}
		held = append(held, lk)
	}
	after, err := LockTable(ctx, b.obs)
	if err != nil {
		t.Fatal(err)
	}
	// Other tests run at the same time against the same server: at least our 50 more.
	if after.Advisory < 50 || after.Used < after.Advisory {
		t.Errorf("with 50 more advisory locks held: %+v (before %+v)", after, before)
	}
	for _, lk := range held {
		if err := lk.Unlock(ctx); err != nil {
			t.Fatal(err)
		}
	}
}

// While holders and waiters of one key come and go, every Inspect shows each waiter as active and blocked by
// someone: locks and activity come from one consistent picture.
func TestInspectConsistent(t *testing.T) {
	b := setup(t)
	ctx := ctxT(t, 30*time.Second)
	k := key(t)
	var others []*Locker
	for range 4 {
		l := New(b.pool, WithSharedSessions(0))
		t.Cleanup(l.Close)
		others = append(others, l)
	}
	stop := make(chan struct{})
	var wg sync.WaitGroup
	for i, l := range others {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for {
				select {
				case <-stop:
					return
				default:
				}
				lock := l.Lock
				if i%2 == 1 {
					lock = l.RLock
				}
				lk, err := lock(ctx, k)
				if err != nil {
					t.Error(err)
					return
				}
				time.Sleep(time.Duration(1+i) * time.Millisecond)
				if err := lk.Unlock(ctx); err != nil {
					t.Error(err)
					return
				}
			}
		}()
	}
	waiting := 0
	// At least 200 readings, and on until 50 waiting rows were checked (a loaded machine starts the lockers late).
	for i, deadline := 0, time.Now().Add(15*time.Second); i < 200 || waiting < 50 && time.Now().Before(deadline); i++ {
		rows, err := Inspect(ctx, b.obs)
		if err != nil {
			t.Fatal(err)
		}
		for _, r := range rows {
			if !r.Key.Equal(k) || r.Granted {
				continue
			}
			waiting++
			if r.State != "active" || len(r.BlockedBy) == 0 {
				t.Errorf("a waiter shown %q and blocked by %v", r.State, r.BlockedBy)
			}
		}
	}
	close(stop)
	wg.Wait()
	if waiting == 0 {
		t.Error("no waiter seen: the test did not exercise the race")
	}
	t.Logf("%d waiting rows checked", waiting)
}

// A reading of pg_locks taken while a wait of advlock waited, paired with pg_stat_activity once its statement has
// ended at its slice's end and the session runs its next, untagged statement, is read again: Inspect once listed
// the slice's start as the wait's (2.2 s after the calls began, in 1 of 54 readings of
// TestInspectWaitStartAcrossYields in a CI run). The moment is made by serving Inspect's first read of pg_locks from
// a copy taken during the wait. Also read from the server: a waiting statement's query_start comes before its
// pg_locks.waitstart, the next statement's after it (what the rule relies on). And through a transaction whose
// pg_stat_activity was read during an earlier wait of the session, a wait is listed from what it runs now.
func TestInspectWaitShown(t *testing.T) {
	url := pgtest.URL(t)
	ctx := ctxT(t, 30*time.Second)
	obs, holder, waiter := pgtest.Conn(t, url), pgtest.Conn(t, url), pgtest.Conn(t, url)
	k := key(t)
	if _, err := holder.Exec(ctx, "SELECT pg_advisory_lock($1)", k.id.V); err != nil {
		t.Fatal(err)
	}
	var pid int32
	if err := waiter.QueryRow(ctx, "SELECT pg_backend_pid()").Scan(&pid); err != nil {
		t.Fatal(err)
	}
	if _, err := waiter.Exec(ctx, "SET lock_timeout = '1500ms'"); err != nil {
		t.Fatal(err)
	}
	ended := make(chan error, 1)
	go func() {
		// A wait of advlock's shape: its statement says it has waited 5 s.
		_, err := waiter.Exec(ctx, "/*advlock q=5000*/ SELECT pg_sleep(0.2), pg_advisory_lock("+strconv.FormatInt(k.id.V, 10)+")")
		if err == nil || !strings.Contains(err.Error(), "55P03") {
			ended <- fmt.Errorf("the wait ended with %v, want 55P03", err)
			return
		}
		// The session's next statement, untagged, running until the test cancels it.
		if _, err = waiter.Exec(ctx, "SELECT pg_sleep(30)"); err == nil || !strings.Contains(err.Error(), "57014") {
			ended <- fmt.Errorf("the next statement ended with %v, want 57014 (cancelled)", err)
			return
		}
		ended <- nil
	}()
	var waitstart, during *time.Time
	for deadline := time.Now().Add(5 * time.Second); waitstart == nil; time.Sleep(10 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatal("the waiter never waited in pg_locks with its waitstart")
		}
		if err := obs.QueryRow(ctx, "SELECT l.waitstart, a.query_start FROM pg_locks l JOIN pg_stat_activity a USING (pid) "+
			"WHERE l.pid = $1 AND l.locktype = 'advisory' AND NOT l.granted", pid).Scan(&waitstart, &during); err != nil && !errors.Is(err, pgx.ErrNoRows) {
			t.Fatal(err)
		}
	}
	// The waiter's and the holder's locks alone: other tests' sessions come and go meanwhile, and a reading with one
	// gone is read again anyway.
	tag, err := obs.Exec(ctx, "CREATE TEMP TABLE locks_then AS SELECT * FROM pg_catalog.pg_locks WHERE pid IN ($1, $2) "+
		"AND locktype = 'advisory'", pid, holder.PgConn().PID())
	if err != nil {
		t.Fatal(err)
	}
	var copied int
	if err := obs.QueryRow(ctx, "SELECT count(*) FROM locks_then WHERE pid = $1 AND NOT granted", pid).Scan(&copied); err != nil {
		t.Fatal(err)
	}
	if tag.RowsAffected() != 2 || copied != 1 {
		t.Fatalf("the copy of pg_locks holds %d rows, %d of them the wait: the wait ended before the copy", tag.RowsAffected(), copied)
	}
	if !during.Before(*waitstart) {
		t.Errorf("the waiting statement began at %v, after its wait (%v)", during, waitstart)
	}
	var next *time.Time
	for deadline := time.Now().Add(5 * time.Second); ; time.Sleep(10 * time.Millisecond) {
		var query string
		if err := obs.QueryRow(ctx, "SELECT query, query_start FROM pg_stat_activity WHERE pid = $1", pid).Scan(&query, &next); err != nil {
			t.Fatal(err)
		}
		if strings.Contains(query, "pg_sleep(30)") {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("the waiter's next statement never showed: %q", query)
		}
	}
	if !next.After(*waitstart) {
		t.Errorf("the statement after the wait began at %v, not after the wait (%v)", next, waitstart)
	}
	q := &locksThen{Querier: obs}
	rows, err := Inspect(ctx, q)
	if err != nil {
		t.Fatal(err)
	}
	for _, r := range rows {
		if r.Key.Equal(k) && !r.Granted {
			t.Errorf("a wait that had ended listed, waiting since %v (its slice began at %v)", r.WaitStart, waitstart)
		}
	}
	if q.reads < 2 {
		t.Errorf("pg_locks read %d times: the reading of a wait that had ended was not read again", q.reads)
	}
	var still int
	if err := obs.QueryRow(ctx, "SELECT count(*) FROM pg_stat_activity WHERE pid = $1 AND state = 'active' AND query_start = $2",
		pid, next).Scan(&still); err != nil || still != 1 {
		t.Fatalf("the waiter no longer in its next statement after Inspect (%d, %v): the reading proves nothing", still, err)
	}
	if _, err := holder.Exec(ctx, "SELECT pg_cancel_backend($1)", pid); err != nil {
		t.Fatal(err)
	}
	if err := <-ended; err != nil {
		t.Fatal(err)
	}

	// Through a transaction that read pg_stat_activity while the waiter waited for k in a statement that said it had
	// waited a minute: its next wait, for k2, which says 100 ms, is listed as waiting since 100 ms before its
	// statement began, not a minute before the first one did.
	tx, err := obs.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer tx.Rollback(ctx)
	go func() {
		_, err := waiter.Exec(ctx, "/*advlock q=60000*/ SELECT pg_advisory_lock("+strconv.FormatInt(k.id.V, 10)+")")
		ended <- err
	}()
	for deadline := time.Now().Add(5 * time.Second); ; time.Sleep(10 * time.Millisecond) {
		var n int
		if err := tx.QueryRow(ctx, "SELECT count(*) FROM pg_stat_activity WHERE pid = $1 AND query LIKE '/*advlock q=60000*/%'", pid).Scan(&n); err != nil {
			t.Fatal(err)
		}
		if n == 1 {
			break // the transaction's view of pg_stat_activity, from now on
		}
		if err := tx.QueryRow(ctx, "SELECT pg_stat_clear_snapshot()::text").Scan(new(string)); err != nil {
			t.Fatal(err)
		}
		if time.Now().After(deadline) {
			t.Fatal("the first wait never showed")
		}
	}
	if err := <-ended; err == nil || !strings.Contains(err.Error(), "55P03") {
		t.Fatalf("the first wait ended with %v, want 55P03", err)
	}
	k2 := key(t)
	if _, err := holder.Exec(ctx, "SELECT pg_advisory_lock($1)", k2.id.V); err != nil {
		t.Fatal(err)
	}
	go func() {
		_, err := waiter.Exec(ctx, "/*advlock q=100*/ SET lock_timeout = 0; SELECT pg_advisory_lock("+strconv.FormatInt(k2.id.V, 10)+")")
		ended <- err
	}()
	var since time.Time
	for deadline := time.Now().Add(5 * time.Second); since.IsZero(); time.Sleep(10 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatal("the second wait never showed in pg_locks")
		}
		if err := holder.QueryRow(ctx, "SELECT a.query_start FROM pg_locks l JOIN pg_stat_activity a USING (pid) "+
			"WHERE l.pid = $1 AND l.locktype = 'advisory' AND NOT l.granted AND l.waitstart IS NOT NULL", pid).Scan(&since); err != nil && !errors.Is(err, pgx.ErrNoRows) {
			t.Fatal(err)
		}
	}
	rows, err = Inspect(ctx, tx)
	if err != nil {
		t.Fatal(err)
	}
	listed := false
	for _, r := range rows {
		if r.Key.Equal(k2) && !r.Granted {
			listed = true
			if want := since.Add(-100 * time.Millisecond); r.State != "active" || r.WaitStart == nil || !r.WaitStart.Equal(want) {
				t.Errorf("the wait listed %q, waiting since %v, want active since %v (100 ms before its statement began)", r.State, r.WaitStart, want)
			}
		}
	}
	if !listed {
		t.Error("the second wait not listed")
	}
	if _, err := holder.Exec(ctx, "SELECT pg_advisory_unlock($1)", k2.id.V); err != nil {
		t.Fatal(err)
	}
	if err := <-ended; err != nil {
		t.Fatal(err)
	}
}

// locksThen serves Inspect's first read of pg_locks from locks_then, a copy taken earlier on the same connection.
type locksThen struct {
	Querier
	reads int
}

func (q *locksThen) Query(ctx context.Context, sql string, args ...any) (pgx.Rows, error) {
	if strings.Contains(sql, "FROM pg_locks") {
		q.reads++
		if q.reads == 1 {
			sql = strings.Replace(sql, "FROM pg_locks", "FROM pg_temp.locks_then", 1)
		}
	}
	return q.Querier.Query(ctx, sql, args...)
}

// The Locker's Inspect, Leader and LockTable read through its own pool (over a pool given to New, and Open's) and
// see what the package functions see through another connection: a shared holder and a waiter blocked by it, an
// exclusive holder as leader, the lock table's use. A Locker without a pool says ErrNoPool, a closed one ErrClosed.
func TestLockerInspect(t *testing.T) {
	url := pgtest.URL(t)
	ctx := ctxT(t, 30*time.Second)
	obs := pgtest.Conn(t, url)
	opened, err := Open(ctx, url)
	if err != nil {
		t.Fatal(err)
	}
	defer opened.Close()
	for name, l := range map[string]*Locker{"New": New(pgtest.Pool(t, url, nil)), "Open": opened} {
		t.Run(name, func(t *testing.T) {
			defer l.Close()
			waiter := New(pgtest.Pool(t, url, nil))
			defer waiter.Close()
			k := key(t)
			lk, err := l.RLock(ctx, k)
			if err != nil {
				t.Fatal(err)
			}
			got := make(chan error, 1)
			go func() {
				w, err := waiter.Lock(ctx, k)
				if err == nil {
					err = w.Unlock(ctx)
				}
				got <- err
			}()
			var mine []LockInfo
			for deadline := time.Now().Add(10 * time.Second); len(mine) < 2; time.Sleep(5 * time.Millisecond) {
				mine = rowsOf(t, l.Inspect, ctx, k)
				if time.Now().After(deadline) {
					t.Fatalf("Locker.Inspect: want a holder and a waiter, got %+v", mine)
				}
			}
			h, w := mine[0], mine[1]
			if !h.Granted || !h.Shared || w.Granted || !slices.Equal(w.BlockedBy, []int32{h.PID}) || w.WaitStart == nil {
				t.Errorf("Locker.Inspect: holder %+v, waiter %+v", h, w)
			}
			v, _ := k.Int64()
			if pids, err := pgtest.Holders(ctx, obs, v); err != nil || len(pids) != 1 || int32(pids[0]) != h.PID {
				t.Errorf("pg_locks shows holders %v (%v), Locker.Inspect %d", pids, err, h.PID)
			}
			theirs := rowsOf(t, func(ctx context.Context) ([]LockInfo, error) { return Inspect(ctx, obs) }, ctx, k)
			sameRows(t, mine, theirs)

			use, err := l.LockTable(ctx)
			if err != nil || use.Advisory < 2 || use.Capacity < 64*100 {
				t.Errorf("Locker.LockTable = %+v, %v; want at least this test's 2 advisory locks", use, err)
			}
			if err := lk.Unlock(ctx); err != nil {
				t.Fatal(err)
			}
			if err := <-got; err != nil {
				t.Fatal(err)
			}

			led := key(t)
			if _, ok, err := l.Leader(ctx, led); ok || err != nil {
				t.Errorf("Locker.Leader of a free key: %v, %v", ok, err)
			}
			lk, err = l.Lock(ctx, led)
			if err != nil {
				t.Fatal(err)
			}
			who, ok, err := l.Leader(ctx, led)
			lv, _ := led.Int64()
			pids, perr := pgtest.Holders(ctx, obs, lv)
			if err != nil || !ok || perr != nil || len(pids) != 1 || int32(pids[0]) != who.PID || !who.Key.Equal(led) ||
				who.Observed.IsZero() {
				t.Errorf("Locker.Leader = %+v, %v, %v; pg_locks shows %v (%v)", who, ok, err, pids, perr)
			}
			if err := lk.Unlock(ctx); err != nil {
				t.Fatal(err)
			}
			l.Close()
			if _, err := l.Inspect(ctx); !errors.Is(err, ErrClosed) {
				t.Errorf("Inspect after Close: %v, want ErrClosed", err)
			}
			if _, _, err := l.Leader(ctx, led); !errors.Is(err, ErrClosed) {
				t.Errorf("Leader after Close: %v, want ErrClosed", err)
			}
			if _, err := l.LockTable(ctx); !errors.Is(err, ErrClosed) {
				t.Errorf("LockTable after Close: %v, want ErrClosed", err)
			}
		})
	}
	var nilLocker *Locker
	for name, l := range map[string]*Locker{"New(nil)": New(nil), "nil": nilLocker} {
		if _, err := l.Inspect(ctx); !errors.Is(err, ErrNoPool) {
			t.Errorf("Inspect of %s: %v, want ErrNoPool", name, err)
		}
		if _, _, err := l.Leader(ctx, key(t)); !errors.Is(err, ErrNoPool) {
			t.Errorf("Leader of %s: %v, want ErrNoPool", name, err)
		}
		if _, err := l.LockTable(ctx); !errors.Is(err, ErrNoPool) {
			t.Errorf("LockTable of %s: %v, want ErrNoPool", name, err)
		}
	}
	pool := pgtest.Pool(t, url, nil)
	l := New(pool)
	defer l.Close()
	pool.Close()
	if _, err := l.Inspect(ctx); !errors.Is(err, ErrNoPool) {
		t.Errorf("Inspect over a closed pool: %v, want ErrNoPool", err)
	}
	live := New(pgtest.Pool(t, url, nil))
	defer live.Close()
	cctx, cancel := context.WithCancel(ctx)
	cancel()
	if _, err := live.Inspect(cctx); !errors.Is(err, context.Canceled) {
		t.Errorf("Inspect with a cancelled ctx: %v, want context.Canceled", err)
	}
}

// rowsOf returns the rows of k that inspect reports.
func rowsOf(t *testing.T, inspect func(context.Context) ([]LockInfo, error), ctx context.Context, k Key) []LockInfo {
	t.Helper()
	rows, err := inspect(ctx)
	if err != nil {
		t.Fatal(err)
	}
	var out []LockInfo
	for _, r := range rows {
		if r.Key.Equal(k) {
			out = append(out, r)
		}
	}
	return out
}

// sameRows compares two reads of the same locks, field by field (times with Equal: drivers differ in location).
func sameRows(t *testing.T, a, b []LockInfo) {
	t.Helper()
	if len(a) != len(b) {
		t.Fatalf("%d rows, and %d through another connection", len(a), len(b))
	}
	for i := range a {
		x, y := a[i], b[i]
		sameWait := x.WaitStart == nil && y.WaitStart == nil || x.WaitStart != nil && y.WaitStart != nil && x.WaitStart.Equal(*y.WaitStart)
		if !x.Key.Equal(y.Key) || x.Shared != y.Shared || x.Granted != y.Granted || !sameWait ||
			!slices.Equal(x.BlockedBy, y.BlockedBy) || x.PID != y.PID || x.ApplicationName != y.ApplicationName ||
			x.ClientAddr != y.ClientAddr || !x.BackendStart.Equal(y.BackendStart) || x.State != y.State {
			t.Errorf("row %d: %+v, and through another connection %+v", i, x, y)
		}
	}
}

// markCycles marks the waits of a cycle (through what each waiting caller holds) and nothing else: not a chain that
// ends at a holder who waits for nothing, not a wait on shared holders it does not conflict with, not a wait
// whose caller holds a key nobody waits for.
func TestMarkCycles(t *testing.T) {
	ka, kb, kc, kd := Int64Key(1), Int64Key(2), PairKey(3, 4), Int64Key(5)
	held := func(pid int32, k Key, shared bool) LockInfo {
		return LockInfo{Key: k, Granted: true, PID: pid, Shared: shared}
	}
	wait := func(pid int32, k Key, shared bool, holds ...HeldLock) LockInfo {
		return LockInfo{Key: k, PID: pid, Shared: shared, CallerHolds: holds}
	}
	for _, tc := range []struct {
		name string
		rows []LockInfo
		want []bool // InCycle, by row
	}{
		{"two callers, opposite orders", []LockInfo{
			held(10, ka, false), held(20, kb, false),
			wait(11, kb, false, HeldLock{10, ka, false}), wait(21, ka, false, HeldLock{20, kb, false}),
		}, []bool{false, false, true, true}},
		{"three callers in a ring, pair key", []LockInfo{
			held(10, ka, false), held(20, kb, false), held(30, kc, false),
			wait(11, kb, false, HeldLock{10, ka, false}), wait(21, kc, false, HeldLock{20, kb, false}),
			wait(31, ka, false, HeldLock{30, kc, false}),
		}, []bool{false, false, false, true, true, true}},
		{"a chain to a holder that waits for nothing", []LockInfo{
			held(10, ka, false), held(20, kb, false),
			wait(11, kb, false, HeldLock{10, ka, false}),
		}, []bool{false, false, false}},
		{"a chain ending in an unpublished wait", []LockInfo{
			held(10, ka, false), held(20, kb, false),
			wait(11, kb, false, HeldLock{10, ka, false}), wait(21, ka, false), // 21's caller says nothing
		}, []bool{false, false, false, false}},
		{"shared waits on shared holders", []LockInfo{
			held(10, ka, true), held(20, kb, true),
			wait(11, kb, true, HeldLock{10, ka, true}), wait(21, ka, true, HeldLock{20, kb, true}),
		}, []bool{false, false, false, false}},
		{"an exclusive wait on a shared holder closes it", []LockInfo{
			held(10, ka, true), held(20, kb, false),
			wait(11, kb, true, HeldLock{10, ka, true}), wait(21, ka, false, HeldLock{20, kb, false}),
		}, []bool{false, false, true, true}},
		// X holds ka and waits to write kb (holding kb's intent: foldIntents marked its wait), which Y reads; Y holds
		// kb and waits for kc; Z holds kc and waits to read kb, held back by X's intent. Before, Z's wait had no
		// edge (Y's shared hold does not conflict with it) and no row was marked.
		{"through a writer's intent", []LockInfo{
			held(10, ka, false), held(20, kb, true), held(30, kc, false),
			{Key: kb, PID: 11, Intent: true, CallerHolds: []HeldLock{{10, ka, false}}},
			wait(21, kc, false, HeldLock{20, kb, true}), wait(31, kb, true, HeldLock{30, kc, false}),
		}, []bool{false, false, false, true, true, true}},
		{"a cycle beside a bystander", []LockInfo{
			held(10, ka, false), held(20, kb, false), held(40, kd, false),
			wait(11, kb, false, HeldLock{10, ka, false}), wait(21, ka, false, HeldLock{20, kb, false}),
			wait(41, ka, false, HeldLock{40, kd, false}),
		}, []bool{false, false, false, true, true, false}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			markCycles(tc.rows)
			for i, r := range tc.rows {
				if r.InCycle != tc.want[i] {
					t.Errorf("row %d (pid %d, %s): InCycle %v, want %v", i, r.PID, r.Key, r.InCycle, tc.want[i])
				}
			}
		})
	}
}

// A role that may not read other roles' statements (no pg_read_all_stats) sees no comment on a wait: Inspect still
// folds a waiting writer's intent into its wait (as it did before it read the comment), instead of listing it as
// a lock of its own on an odd key.
func TestInspectIntentHiddenStatements(t *testing.T) {
	b := setup(t)
	ctx := ctxT(t, 30*time.Second)
	if _, err := b.obs.Exec(ctx, `DO $$ BEGIN CREATE ROLE advlock_inspect_plain LOGIN;
		EXCEPTION WHEN duplicate_object OR unique_violation THEN NULL; END $$`); err != nil {
		t.Fatal(err)
	}
	u, err := url.Parse(b.url)
	if err != nil {
		t.Fatal(err)
	}
	u.User = url.User("advlock_inspect_plain")
	plain := pgtest.Conn(t, u.String())
	k := key(t)
	reader := New(b.pool, WithSharedSessions(0))
	defer reader.Close()
	r, err := reader.RLock(ctx, k)
	if err != nil {
		t.Fatal(err)
	}
	writer := New(b.pool, WithSharedSessions(0))
	defer writer.Close()
	wctx, cancel := context.WithCancel(ctx)
	done := make(chan struct{})
	go func() { defer close(done); _, _ = writer.Lock(wctx, k) }()
	defer func() { cancel(); <-done; _ = r.Unlock(ctx) }()
	iv := k.id.Intent().V
	var wpid uint32
	for deadline := time.Now().Add(10 * time.Second); ; time.Sleep(10 * time.Millisecond) {
		if pids, err := pgtest.Holders(ctx, b.obs, iv); err != nil {
			t.Fatal(err)
		} else if len(pids) == 1 {
			wpid = pids[0]
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("the writer never took the key's intent")
		}
	}
	var hidden string
	if err := plain.QueryRow(ctx, "SELECT coalesce(query, '') FROM pg_stat_activity WHERE pid = $1", int32(wpid)).Scan(&hidden); err != nil {
		t.Fatal(err)
	}
	if hidden != "<insufficient privilege>" {
		t.Fatalf("the plain role reads the writer's statement (%q): the test proves nothing", hidden)
	}
	for try := 0; ; try++ {
		rows, err := Inspect(ctx, plain)
		if err != nil {
			t.Fatal(err)
		}
		var writerRow *LockInfo
		for i, row := range rows {
			if row.Key.Equal(Int64Key(iv)) {
				t.Fatalf("Inspect lists the writer's intent as a lock of its own: %+v", row)
			}
			if row.Key.Equal(k) && !row.Granted && !row.Shared {
				writerRow = &rows[i]
			}
		}
		if writerRow != nil {
			if !writerRow.Intent {
				t.Errorf("the waiting writer's row is not marked Intent: %+v", writerRow)
			}
			return
		}
		if try == 50 {
			t.Fatal("Inspect never showed the writer waiting")
		}
		time.Sleep(10 * time.Millisecond) // between two slices
	}
}
