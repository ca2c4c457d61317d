package advlock

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/advlock/advlock/internal/session"
	"github.com/advlock/advlock/internal/testkit/pgtest"
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
	c := pgtest.StartCluster(t)
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
		l := New(pgtest.Pool(t, c.URL, nil), opts...)
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
	// Every waiter queued in the server: seen waiting within the last second (a wait leaves the queue for a moment
	// at each slice, and the semaphore's every 200 ms, so on a busy machine all five may never show at once).
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
			if now.Sub(at) < time.Second {
				n++
			}
		}
		if n >= 5 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("%d waiters in the server within a second, want at least 5", n)
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
				res, err := conn.PgConn().Exec(ctx, session.WaitSQL(tc.target, 200, fenced, true)).ReadAll()
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
				res, err = conn.PgConn().Exec(ctx, session.WaitSQL(tc.target, 200, fenced, true)).ReadAll()
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
