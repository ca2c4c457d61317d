package advlock

import (
	"context"
	"errors"
	"fmt"
	mrand "math/rand/v2"
	"os"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/advlock/advlock/internal/config"
	"github.com/advlock/advlock/internal/session"
	"github.com/advlock/advlock/internal/testkit/pgtest"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
)

// A wait in the server never holds a snapshot for long: the holder's own CREATE INDEX CONCURRENTLY and REINDEX
// CONCURRENTLY (on another connection, as migration tools run them) finish while other Lockers wait for its lock
// and campaign for its leadership, VACUUM removes rows deleted while they wait, and no waiting session's
// transaction (whose snapshot pins the xmin horizon) is older than one slice. On a private cluster: another test's
// transaction on a shared server would hold these up as well.
func TestWaitsHoldNoSnapshot(t *testing.T) {
	if testing.Short() {
		t.Skip("starts a private PostgreSQL cluster")
	}
	c := pgtest.StartCluster(t, "log_lock_waits = on")
	app := pgtest.Conn(t, c.URL) // the holder's application connection
	ctx := ctxT(t, 3*time.Minute)
	if _, err := app.Exec(ctx, `CREATE TABLE w (id int PRIMARY KEY, v int);
		INSERT INTO w SELECT g, g FROM generate_series(1, 5000) g`); err != nil {
		t.Fatal(err)
	}
	holder := New(pgtest.Pool(t, c.URL, nil))
	defer holder.Close()
	k, lead := key(t), key(t)
	hl, err := holder.Lock(ctx, k)
	if err != nil {
		t.Fatal(err)
	}
	leading := make(chan struct{})
	lctx, stopLeading := context.WithCancel(ctx)
	var bg sync.WaitGroup
	bg.Add(1)
	go func() {
		defer bg.Done()
		_ = holder.Lead(lctx, lead, func(ctx context.Context) error { close(leading); <-ctx.Done(); return nil })
	}()
	<-leading

	// The waiters: Lock (a session per lock, and with shared sessions), RLock, Lead campaigns, a Semaphore slot.
	wctx, stopWaiting := context.WithCancel(ctx)
	got := make(chan string, 8)
	for i, opts := range [][]Option{nil, {WithSharedSessions(2)}} {
		// Enough connections for its shared sessions (2 may open on a busy machine), its three waits, each on a
		// session of its own, and its readings of the lock graph: pgxpool's default of 4 on a small machine left one
		// wait queued for a connection, and 8 under CI's load once left one away from the server for 20 s.
		l := New(pgtest.Pool(t, c.URL, func(c *pgxpool.Config) { c.MaxConns = 16 }), opts...)
		defer l.Close()
		bg.Add(3)
		go func() {
			defer bg.Done()
			if lk, err := l.Lock(wctx, k); err == nil {
				got <- "lock"
				_ = lk.Unlock(context.Background())
			}
		}()
		go func() {
			defer bg.Done()
			if i == 0 {
				if lk, err := l.RLock(wctx, k); err == nil {
					got <- "rlock"
					_ = lk.Unlock(context.Background())
				}
				return
			}
			if lk, err := l.Semaphore("w", 1).Acquire(wctx); err == nil {
				got <- "semaphore"
				_ = lk.Unlock(context.Background())
			}
		}()
		go func() {
			defer bg.Done()
			_ = l.Lead(wctx, lead, func(context.Context) error { got <- "lead"; return nil })
		}()
	}
	semHolder, err := holder.Semaphore("w", 1).Acquire(ctx)
	if err != nil {
		t.Fatal(err)
	}
	// Every waiter queued in the server: seen waiting within the last 5 s (a wait leaves the queue for a moment at
	// each slice, so on a busy machine all five may never show at once; under CI's load one was away from every
	// 1-s window for 20 s once, and from every 2-s window for 20 s another time).
	queued := map[uint32]time.Time{}
	for deadline := time.Now().Add(20 * time.Second); ; time.Sleep(50 * time.Millisecond) {
		rows, err := pgtest.Locks(ctx, app)
		if err != nil {
			t.Fatal(err)
		}
		now := time.Now()
		for _, r := range rows {
			if !r.Granted {
				queued[r.PID] = now
			}
		}
		n := 0
		for _, at := range queued {
			if now.Sub(at) < 5*time.Second {
				n++
			}
		}
		if n >= 5 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("%d waiters in the server within 5 s, want at least 5", n)
		}
	}

	t.Run("CREATE INDEX CONCURRENTLY", func(t *testing.T) {
		app := pgtest.Conn(t, c.URL) // its own: a statement cut by its timeout closes the connection
		for _, sql := range []string{"CREATE INDEX CONCURRENTLY w_v ON w (v)", "REINDEX INDEX CONCURRENTLY w_v"} {
			start := time.Now()
			qctx, cancel := context.WithTimeout(ctx, 30*time.Second)
			_, err := app.Exec(qctx, sql)
			cancel()
			if err != nil {
				t.Fatalf("%s while others wait for the holder: %v after %v", sql, err, time.Since(start))
			}
			t.Logf("%s while the others wait: %v", sql, time.Since(start).Round(time.Millisecond))
		}
	})
	t.Run("VACUUM", func(t *testing.T) {
		app := pgtest.Conn(t, c.URL) // its own: a statement cut by its timeout closes the connection
		if _, err := app.Exec(ctx, "DELETE FROM w"); err != nil {
			t.Fatal(err)
		}
		time.Sleep(2500 * time.Millisecond) // every waiter's snapshot since is newer than the delete
		if _, err := app.Exec(ctx, "VACUUM w"); err != nil {
			t.Fatal(err)
		}
		var pages int64
		if err := app.QueryRow(ctx, "SELECT pg_relation_size('w') / current_setting('block_size')::int").Scan(&pages); err != nil {
			t.Fatal(err)
		}
		if pages != 0 {
			t.Errorf("VACUUM left %d pages of 5,000 rows deleted 2.5 s before (dead rows it could not remove)", pages)
		}
	})
	t.Run("no deadlock checks", func(t *testing.T) {
		// The waiters have waited for seconds by now; each slice ends before deadlock_timeout (1 s), so the server
		// never checked them for deadlocks, which with log_lock_waits logs "still waiting" each time.
		log, err := os.ReadFile(c.LogFile())
		if err != nil {
			t.Fatal(err)
		}
		if n := strings.Count(string(log), "still waiting for"); n > 0 {
			t.Errorf("the server logged %d lock waits past deadlock_timeout (log_lock_waits): a slice outlasted it", n)
		}
	})
	t.Run("no old transaction", func(t *testing.T) {
		app := pgtest.Conn(t, c.URL) // its own: a statement cut by its timeout closes the connection
		var oldest time.Duration
		var samples int
		for end := time.Now().Add(3 * time.Second); time.Now().Before(end); time.Sleep(20 * time.Millisecond) {
			var age float64
			var n int
			err := app.QueryRow(ctx, `SELECT count(*), coalesce(max(extract(epoch FROM clock_timestamp() - xact_start)), 0)
				FROM pg_stat_activity WHERE wait_event_type = 'Lock' AND wait_event = 'advisory' AND backend_xmin IS NOT NULL`).Scan(&n, &age)
			if err != nil {
				t.Fatal(err)
			}
			if n > 0 {
				samples++
			}
			oldest = max(oldest, time.Duration(age*float64(time.Second)))
		}
		if samples == 0 {
			t.Fatal("no waiting session with a snapshot seen")
		}
		if oldest > session.DefaultWaitSlice+500*time.Millisecond {
			t.Errorf("a waiting session's transaction (and snapshot) was %v old, want at most about %v", oldest, session.DefaultWaitSlice)
		}
		t.Logf("oldest waiting transaction over %d samples: %v", samples, oldest.Round(time.Millisecond))
	})

	// Nothing lost in the queue: once the holder lets go, every waiter is granted in turn.
	if err := hl.Unlock(ctx); err != nil {
		t.Fatal(err)
	}
	if err := semHolder.Unlock(ctx); err != nil {
		t.Fatal(err)
	}
	stopLeading()
	seen := map[string]int{}
	for timeout := time.After(30 * time.Second); len(seen) < 4 || seen["lock"] < 2 || seen["lead"] < 1; {
		select {
		case g := <-got:
			seen[g]++
		case <-timeout:
			t.Fatalf("after the holder let go, only %v were granted", seen)
		}
	}
	stopWaiting()
	bg.Wait()
	if err := context.Cause(wctx); !errors.Is(err, context.Canceled) {
		t.Fatal(err)
	}
}

// A wait sent again after lock_timeout first looks whether its session already holds the key (a grant that raced
// the timeout survives the error): it then takes that grant, and does not queue for the key a second time, which
// would leave the key held twice and still held after one unlock. Each kind of key and mode, fenced or not.
func TestWaitRequeueTakesARacedGrant(t *testing.T) {
	b := setup(t)
	ctx := ctxT(t, 30*time.Second)
	for _, tc := range []struct {
		name   string
		target session.Target
		lock   string
		unlock string
	}{
		{"int8", session.Target{ID: session.ID{V: 0x1234_5678_9abc_def0 ^ int64(time.Now().UnixNano())}}, "pg_advisory_lock($1::int8)", "pg_advisory_unlock($1::int8)"},
		{"int8 shared", session.Target{ID: session.ID{V: -42 ^ int64(time.Now().UnixNano())}, Shared: true}, "pg_advisory_lock_shared($1::int8)", "pg_advisory_unlock_shared($1::int8)"},
		{"pair", session.Target{ID: session.ID{Pair: true, V: int64(-7)<<32 | int64(uint32(time.Now().UnixNano()))}}, "pg_advisory_lock($1::int4, $2::int4)", "pg_advisory_unlock($1::int4, $2::int4)"},
	} {
		for _, fenced := range []bool{false, true} {
			t.Run(fmt.Sprintf("%s fenced=%v", tc.name, fenced), func(t *testing.T) {
				if fenced { // the sequence exists once a fenced Locker granted something
					l := New(b.pool, WithFencing())
					lk, err := l.TryLock(ctx, key(t))
					if err != nil {
						t.Fatal(err)
					}
					_ = lk.Unlock(ctx)
					l.Close()
				}
				conn := pgtest.Conn(t, b.url)
				args := []any{tc.target.ID.V}
				if tc.target.ID.Pair {
					args = []any{int32(tc.target.ID.V >> 32), int32(tc.target.ID.V)}
				}
				if _, err := conn.Exec(ctx, "SELECT "+tc.lock, args...); err != nil {
					t.Fatal(err)
				}
				res, err := conn.PgConn().Exec(ctx, session.WaitSQL(tc.target, 200, fenced, true, false, 0, 0, false)).ReadAll()
				if err != nil {
					t.Fatalf("the requeued wait on a session that holds the key: %v", err)
				}
				last := res[len(res)-1]
				if len(last.Rows) != 1 || string(last.Rows[0][0]) == "-1" || string(last.Rows[0][0]) == "0" {
					t.Fatalf("the requeued wait yielded %q, want a grant", last.Rows)
				}
				var ok bool
				if err := conn.QueryRow(ctx, "SELECT "+tc.unlock, args...).Scan(&ok); err != nil || !ok {
					t.Fatalf("first unlock: %v %v", ok, err)
				}
				if err := conn.QueryRow(ctx, "SELECT "+tc.unlock, args...).Scan(&ok); err != nil || ok {
					t.Fatalf("second unlock: %v %v: the requeued wait took the key a second time", ok, err)
				}
				// And without the lock, it waits (the key is free: granted at once) and takes it once.
				res, err = conn.PgConn().Exec(ctx, session.WaitSQL(tc.target, 200, fenced, true, false, 0, 0, false)).ReadAll()
				if err != nil || string(res[len(res)-1].Rows[0][0]) == "0" {
					t.Fatalf("the requeued wait on a free key: %v %v", res, err)
				}
				if err := conn.QueryRow(ctx, "SELECT "+tc.unlock, args...).Scan(&ok); err != nil || !ok {
					t.Fatalf("unlock after the wait: %v %v", ok, err)
				}
			})
		}
	}
}

// slowEnd is an Observer whose LockEnd takes a while: what runs with it must not keep the key's slot from the
// holder that was told of the loss.
type slowEnd struct{}

func (slowEnd) LockStart(ctx context.Context, _ LockCall) (context.Context, func(LockOutcome)) {
	return ctx, func(LockOutcome) {}
}
func (slowEnd) LockEnd(LockEnd)      { time.Sleep(100 * time.Millisecond) }
func (slowEnd) Session(SessionEvent) {}

// When Done closes for a loss, the key is already free to the same Locker: a holder that takes the key again as
// soon as it is told (without Unlock) is not refused as "held by another holder in this process", whatever runs
// as the lock ends (an observer told of its end takes 100 ms here). Both session kinds.
func TestLossFreesKeyBeforeDone(t *testing.T) {
	b := setup(t)
	for _, shared := range []bool{true, false} {
		t.Run(fmt.Sprintf("shared=%v", shared), func(t *testing.T) {
			opts := []Option{WithObserver(slowEnd{})}
			if !shared {
				opts = append(opts, WithSharedSessions(0))
			}
			l := New(b.pool, opts...)
			defer l.Close()
			ctx := ctxT(t, 20*time.Second)
			k := key(t)
			lk, err := l.TryLock(ctx, k)
			if err != nil {
				t.Fatal(err)
			}
			time.Sleep(10 * time.Millisecond) // watched
			pgtest.Terminate(t, b.obs, lk.PID())
			<-lk.Done()
			for deadline := time.Now().Add(5 * time.Second); ; time.Sleep(time.Millisecond) {
				again, err := l.TryLock(ctx, k)
				if err == nil {
					_ = again.Unlock(ctx)
					break
				}
				if errors.Is(err, errHeldInProcess) {
					t.Fatalf("right after Done closed for the loss: %v", err)
				}
				if !errors.Is(err, ErrNotAcquired) || time.Now().After(deadline) {
					t.Fatal(err) // the terminated backend drops its locks as it exits, a moment after its FATAL
				}
			}
		})
	}
}

// WaitStart is when the wait began, not the current slice's start: a wait sent again every 100 ms that has waited
// 800 ms shows a start at least 600 ms ago in Inspect (pg_locks.waitstart says at most 100 ms), on the server's
// clock, for a plain wait and for a watched one (its caller holds a lock).
func TestInspectWaitStartAcrossSlices(t *testing.T) {
	b := setup(t)
	ctx := ctxT(t, 30*time.Second)
	for _, watched := range []bool{false, true} {
		t.Run(fmt.Sprintf("watched=%v", watched), func(t *testing.T) {
			holder := New(b.pool)
			defer holder.Close()
			l := New(b.pool, withSlice(100*time.Millisecond))
			defer l.Close()
			k := key(t)
			hl, err := holder.TryLock(ctx, k)
			if err != nil {
				t.Fatal(err)
			}
			defer func() { _ = hl.Unlock(ctx) }()
			wctx := ctx
			if watched {
				mine, err := l.TryLock(ctx, key(t))
				if err != nil {
					t.Fatal(err)
				}
				defer func() { _ = mine.Unlock(ctx) }()
				wctx = Holding(ctx, mine)
			}
			wctx, cancel := context.WithCancel(wctx)
			done := make(chan struct{})
			go func() {
				defer close(done)
				_, _ = l.Lock(wctx, k)
			}()
			defer func() { cancel(); <-done }()
			time.Sleep(800 * time.Millisecond)
			var rows []LockInfo
			for try := 0; try < 20; try++ { // a reading between two slices (one round trip each) shows no wait
				var err error
				if rows, err = Inspect(ctx, b.obs); err != nil {
					t.Fatal(err)
				}
				if slices.ContainsFunc(rows, func(r LockInfo) bool { return r.Key.Equal(k) && !r.Granted }) {
					break
				}
				time.Sleep(5 * time.Millisecond)
			}
			var now time.Time
			if err := b.obs.QueryRow(ctx, "SELECT clock_timestamp()").Scan(&now); err != nil {
				t.Fatal(err)
			}
			found := false
			for _, r := range rows {
				if r.Key.Equal(k) && !r.Granted {
					found = true
					if r.WaitStart == nil || now.Sub(*r.WaitStart) < 600*time.Millisecond {
						t.Errorf("after 800 ms of waiting WaitStart is %v, %v before now", r.WaitStart, now.Sub(*r.WaitStart))
					}
					if watched != (len(r.CallerHolds) == 1) {
						t.Errorf("CallerHolds = %v", r.CallerHolds)
					}
				}
			}
			if !found {
				t.Fatal("the wait is not listed")
			}
		})
	}
}

// withSlice shortens how long each statement of a wait in the server runs (1 s by default).
func withSlice(d time.Duration) Option { return option(func(o *config.Options) { o.WaitSlice = d }) }

// intentRows returns the pids that pg_locks shows holding k's intent.
func intentRows(t *testing.T, obs *pgx.Conn, k Key) []uint32 {
	t.Helper()
	pids, err := pgtest.Holders(context.Background(), obs, k.id.Intent().V)
	if err != nil {
		t.Fatal(err)
	}
	return pids
}

// A writer that waits for a key that readers hold takes the key's intent, and readers respect it: a shared try
// fails (on a shared session that holds the key shared too, which PostgreSQL would grant again past any waiter,
// and on a session of its own), a reader that waits waits behind the writer; the writer gives the intent back as
// it is granted. A writer that gives up (its Wait bound, its ctx) leaves no intent behind: a timed-out one's
// session goes back to the pool holding nothing, a cancelled one's is closed. Inspect shows the writer's rows
// marked, not the intent's own row. Server truth from pg_locks throughout.
func TestWriterIntent(t *testing.T) {
	b := setup(t)
	ctx := ctxT(t, 30*time.Second)
	reader, other, own := New(b.pool), New(b.pool), New(b.pool, WithSharedSessions(0))
	defer reader.Close()
	defer other.Close()
	defer own.Close()
	wpool := pgtest.Pool(t, b.url, nil)
	writer := New(wpool)
	defer writer.Close()
	k := key(t)
	rl, err := reader.RLock(ctx, k)
	if err != nil {
		t.Fatal(err)
	}
	type res struct {
		lk  *Lock
		err error
	}
	wgot := make(chan res, 1)
	go func() {
		lk, err := writer.Lock(ctx, k)
		wgot <- res{lk, err}
	}()
	for deadline := time.Now().Add(10 * time.Second); len(intentRows(t, b.obs, k)) == 0; time.Sleep(2 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatal("the writer took no intent")
		}
	}
	wpid := intentRows(t, b.obs, k)[0]
	for _, tc := range []struct {
		name string
		l    *Locker
	}{{"the Locker whose shared session holds it shared", reader}, {"another Locker", other}, {"a session of its own", own}} {
		if lk, err := tc.l.TryRLock(ctx, k); !errors.Is(err, ErrNotAcquired) {
			_ = lk.Unlock(ctx)
			t.Fatalf("TryRLock on %s while a writer waits: %v, want ErrNotAcquired", tc.name, err)
		}
	}
	rgot := make(chan res, 1)
	go func() {
		lk, err := other.RLock(ctx, k)
		rgot <- res{lk, err}
	}()
	waitRows := func(want int) []LockInfo {
		t.Helper()
		for deadline := time.Now().Add(10 * time.Second); ; time.Sleep(5 * time.Millisecond) {
			rows, err := Inspect(ctx, b.obs)
			if err != nil {
				t.Fatal(err)
			}
			var mine []LockInfo
			for _, r := range rows {
				if r.Key.Equal(k) {
					mine = append(mine, r)
				}
				if r.Key.Equal(Int64Key(k.id.Intent().V)) {
					t.Fatalf("Inspect lists the intent: %+v", r)
				}
			}
			if len(mine) == want || time.Now().After(deadline) {
				return mine
			}
		}
	}
	rows := waitRows(3) // the reader holding, the writer waiting, the reader waiting behind it
	for _, r := range rows {
		switch {
		case r.Granted:
		case !r.Shared && (!r.Intent || uint32(r.PID) != wpid):
			t.Errorf("the writer's row: %+v", r)
		case r.Shared && (r.Intent || !slices.Contains(r.BlockedBy, int32(wpid))):
			t.Errorf("the waiting reader's row (it waits for the writer, pid %d): %+v", wpid, r)
		}
	}
	if err := rl.Unlock(ctx); err != nil {
		t.Fatal(err)
	}
	w := <-wgot
	if w.err != nil {
		t.Fatal(w.err)
	}
	if got := intentRows(t, b.obs, k); len(got) != 0 {
		t.Fatalf("the writer holds the key; the intent is still held by %v: it goes back with the grant", got)
	}

	select {
	case r := <-rgot:
		t.Fatalf("a reader was granted while the writer holds the key: %v", r.err)
	default:
	}
	if err := w.lk.Unlock(ctx); err != nil {
		t.Fatal(err)
	}
	r := <-rgot
	if r.err != nil {
		t.Fatal(r.err)
	}
	if got := intentRows(t, b.obs, k); len(got) != 0 {
		t.Fatalf("after the writer's unlock, %v hold the intent", got)
	}
	pgtest.NoIdleLocks(t, wpool, b.obs)
	// While it held the intent its session had an idle_session_timeout (the server's default is none); it is
	// restored once the intent is given back, before the session goes back to the pool.
	for _, c := range wpool.AcquireAllIdle(ctx) {
		var v string
		err := c.QueryRow(ctx, "SHOW idle_session_timeout").Scan(&v)
		c.Release()
		if err != nil || v != "0" {
			t.Fatalf("a pooled connection of the writer has idle_session_timeout %q (%v), want 0", v, err)
		}
	}

	// Writers that give up behind the reader: a Wait bound, then a cancelled ctx.
	if _, err := writer.Lock(ctx, k, Wait(300*time.Millisecond)); !errors.Is(err, ErrNotAcquired) {
		t.Fatalf("a timed writer behind a reader: %v", err)
	}
	if got := intentRows(t, b.obs, k); len(got) != 0 {
		t.Fatalf("after a timed writer gave up, %v hold the intent", got)
	}
	pgtest.NoIdleLocks(t, wpool, b.obs)
	cctx, cancel := context.WithCancel(ctx)
	go func() {
		for len(intentRows(t, b.obs, k)) == 0 && cctx.Err() == nil {
			time.Sleep(2 * time.Millisecond)
		}
		cancel()
	}()
	if _, err := writer.Lock(cctx, k); !errors.Is(err, context.Canceled) {
		t.Fatalf("a cancelled writer behind a reader: %v", err)
	}
	if got := intentRows(t, b.obs, k); len(got) != 0 {
		t.Fatalf("after a cancelled writer gave up, %v hold the intent", got)
	}
	_ = r.lk.Unlock(ctx)
	pgtest.NoIdleLocks(t, wpool, b.obs)
}

// A timed wait that the server ends (lock_timeout at its Wait bound) as the holder lets go may have been granted
// in the same instant: the lock then survives the error. The wait's session is settled before it goes back to the
// pool: 150 waits whose bound ends within a millisecond of the holder's unlock, each either granted (and unlocked)
// or not acquired, and after each no pooled connection of the waiter holds anything (pg_locks) and the key is free.
func TestTimedWaitRaceSettles(t *testing.T) {
	b := setup(t)
	ctx := ctxT(t, 2*time.Minute)
	for _, shared := range []bool{true, false} {
		t.Run(fmt.Sprintf("shared=%v", shared), func(t *testing.T) {
			var opts []Option
			if !shared {
				opts = append(opts, WithSharedSessions(0))
			}
			pool := pgtest.Pool(t, b.url, nil)
			waiter := New(pool, opts...)
			defer waiter.Close()
			k := key(t)
			granted, notAcquired := 0, 0
			for i := range 150 {
				hl, err := b.l.TryLock(ctx, k)
				if err != nil {
					t.Fatal(err)
				}
				bound := 20 * time.Millisecond
				release := time.AfterFunc(bound+time.Duration(mrand.IntN(2000)-1200)*time.Microsecond, func() { _ = hl.Unlock(ctx) })
				lk, err := waiter.Lock(ctx, k, Wait(bound))
				switch {
				case err == nil:
					granted++
					if err := lk.Unlock(ctx); err != nil {
						t.Fatalf("iteration %d: %v", i, err)
					}
				case errors.Is(err, ErrNotAcquired):
					notAcquired++
				default:
					t.Fatalf("iteration %d: %v", i, err)
				}
				for !release.Stop() && hl.Err() == nil {
					time.Sleep(100 * time.Microsecond) // the unlock is on its way
				}
				_ = hl.Unlock(ctx)
				pgtest.NoIdleLocks(t, pool, b.obs)
				if t.Failed() {
					t.Fatalf("iteration %d: a pooled connection holds a lock after a timed wait", i)
				}
			}
			pgtest.WaitFree(t, b.obs, k.id.V, 5*time.Second)
			t.Logf("%d granted, %d not acquired", granted, notAcquired)
			if granted == 0 || notAcquired == 0 {
				t.Errorf("the bound and the unlock never raced: %d granted, %d not acquired", granted, notAcquired)
			}
		})
	}
}

// A wait given up by its caller (ctx cancelled, not a deadline) has left the server's queue when Lock returns: the
// session is closed and a cancel request sent, and Lock returns once pg_locks shows its backend neither waiting nor
// holding anything (a writer's intent included). A closed socket alone is noticed by a backend blocked in a lock
// wait only when its slice ends, up to 0.9 s later, meanwhile a waiter nobody waits for. Cancelled at several
// moments of a slice, plain and as a writer behind readers (which holds the key's intent).
func TestCancelledWaitLeavesTheQueue(t *testing.T) {
	b := setup(t)
	ctx := ctxT(t, 60*time.Second)
	for _, readers := range []bool{false, true} {
		for i, after := range []time.Duration{150 * time.Millisecond, 350 * time.Millisecond, 550 * time.Millisecond} {
			k := key(t)
			v, _ := k.Int64()
			lock := b.l.Lock
			if readers {
				lock = b.l.RLock
			}
			other := New(pgtest.Pool(t, b.url, nil), WithSharedSessions(0))
			defer other.Close()
			held, err := lock(ctx, k)
			if err != nil {
				t.Fatal(err)
			}
			wctx, cancel := context.WithCancel(ctx)
			res := make(chan error, 1)
			go func() {
				lk, err := other.Lock(wctx, k)
				if err == nil {
					_ = lk.Unlock(ctx)
				}
				res <- err
			}()
			var pid uint32
			for deadline := time.Now().Add(10 * time.Second); pid == 0; time.Sleep(2 * time.Millisecond) {
				rows, err := pgtest.Locks(ctx, b.obs)
				if err != nil {
					t.Fatal(err)
				}
				for _, r := range rows {
					if r.Int64Key(v) && !r.Granted {
						pid = r.PID
					}
				}
				if time.Now().After(deadline) {
					t.Fatal("the wait never queued in the server")
				}
			}
			time.Sleep(after)
			cancel()
			if err := <-res; !errors.Is(err, context.Canceled) {
				t.Fatalf("Lock whose ctx was cancelled: %v", err)
			}
			rows, err := pgtest.Locks(ctx, b.obs)
			if err != nil {
				t.Fatal(err)
			}
			for _, r := range rows {
				if r.PID == pid {
					t.Errorf("readers=%v, cancel %d: as Lock returned, the given-up wait's backend %d still has %v", readers, i, pid, r)
				}
			}
			if err := held.Unlock(ctx); err != nil {
				t.Fatal(err)
			}
			pgtest.WaitFree(t, b.obs, v, 10*time.Second)
		}
	}
}
