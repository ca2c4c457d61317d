package conformance

import (
	"context"
	"fmt"
	"slices"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/advlock/advlock"
	"github.com/advlock/advlock/internal/config"
	"github.com/advlock/advlock/internal/testkit/pgtest"
	"github.com/jackc/pgx/v5"
)

// The waits of a key keep the order PostgreSQL's own queue would give them, although each is sent again every
// slice. The tests run with slices of 300 ms (a test knob) and holds scaled to them, so that every wait crosses
// several slices as a wait of 0.9 s slices does behind holds of 100 to 400 ms; PostgreSQL's own queue (plain
// connections, one pg_advisory_lock statement per wait) runs the same load side by side, as the reference.
const (
	orderSlice = 300 * time.Millisecond
	// A writer's hold in the fairness runs: 12 of them take 1.6 slices a round. Long enough that the next writer
	// queues for the key while the one before holds it, also on a loaded machine (every package's tests at once).
	orderHold  = 40 * time.Millisecond
	orderTurns = 6 // grants each writer gets in a fairness run
)

// queueRefs keeps what PostgreSQL's own queue measured for a backend, the reference of the order checks: it does
// not depend on the session mode (plain connections, the same pooler or none), so the second mode's checks are
// judged against the first's measurement instead of measuring it again.
type queueRefs struct {
	mu     sync.Mutex
	turns  map[int]turns
	reader *readerRun
}

// writers returns the reference for n writers, measured by measure the first time (and kept if it passed).
func (q *queueRefs) writers(t *testing.T, n int, measure func(t *testing.T) turns) turns {
	q.mu.Lock()
	r, ok := q.turns[n]
	q.mu.Unlock()
	if ok {
		t.Logf("PostgreSQL's queue as measured for the other session mode")
		return r
	}
	r = measure(t)
	if !t.Failed() {
		q.mu.Lock()
		if q.turns == nil {
			q.turns = map[int]turns{}
		}
		q.turns[n] = r
		q.mu.Unlock()
	}
	return r
}

func orderSliceOpt() advlock.Option {
	return option(func(o *config.Options) { o.WaitSlice = orderSlice })
}

// waitOrder runs the order checks: arrival order, fairness of many writers, a reader in its turn.
func (s *suite) waitOrder(t *testing.T) {
	// 20 writers take 20 to 40 connections, and PostgreSQL's queue as many: one package's runs at a time.
	pgtest.Alone(t, s.be.ObsURL, "WaitOrder")
	t.Run("arrival order", s.arrivalOrder)
	for _, n := range []int{12, 20} {
		t.Run(fmt.Sprintf("%d writers", n), func(t *testing.T) { s.writersFair(t, n) })
	}
	t.Run("reader in its turn", s.readerInTurn)
}

// plain is a plain connection for PostgreSQL's own queue: to the server, or through the pooler in front of it
// (in session mode, a server session of its own too), where the pooler keeps the server connections that the
// Lockers before it used: the server's connections are shared by every test package at once.
func (s *suite) plain(t *testing.T) *pgx.Conn {
	if s.be.Pooled {
		return pgtest.Conn(t, s.be.URL)
	}
	return s.observer(t)
}

// waitsFor polls Inspect until it lists n waits for k (a wait in its key's line is listed as a wait for the key),
// and fails the test after 10 s.
func waitsFor(t *testing.T, obs *pgx.Conn, k advlock.Key, n int) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for {
		rows, err := advlock.Inspect(context.Background(), obs)
		if err != nil {
			t.Fatal(err)
		}
		got := 0
		for _, r := range rows {
			if !r.Granted && r.Key.Equal(k) && r.Lease == nil {
				got++
			}
		}
		if got == n {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("Inspect lists %d waits for %s, want %d: %+v", got, k, n, rows)
		}
		time.Sleep(5 * time.Millisecond)
	}
}

// warm makes a Locker's first calls (its pool's connections, its checks) before anything is timed.
func warm(ctx context.Context, t *testing.T, l *advlock.Locker) {
	t.Helper()
	lk, err := l.Lock(ctx, Key(t))
	if err != nil {
		t.Fatal(err)
	}
	if err := lk.Unlock(ctx); err != nil {
		t.Fatal(err)
	}
}

// arrivalOrder: ten writers, each its own Locker, that begin to wait 50 ms apart (each once the one before it is
// listed as waiting) are granted in the order they came, although the key stays held for several slices after the
// last of them came.
func (s *suite) arrivalOrder(t *testing.T) {
	obs := s.observer(t)
	ctx := ctxT(t, 60*time.Second)
	k := Key(t)
	holder := s.open(t).L
	hold, err := holder.Lock(ctx, k)
	if err != nil {
		t.Fatal(err)
	}
	const n = 10
	order := make(chan int, n)
	var wg sync.WaitGroup
	for i := range n {
		l := s.open(t, orderSliceOpt()).L
		warm(ctx, t, l)
		wg.Add(1)
		go func() {
			defer wg.Done()
			lk, err := l.Lock(ctx, k)
			if err != nil {
				t.Error(err)
				return
			}
			order <- i
			time.Sleep(10 * time.Millisecond)
			if err := lk.Unlock(ctx); err != nil {
				t.Error(err)
			}
		}()
		time.Sleep(50 * time.Millisecond)
		waitsFor(t, obs, k, i+1)
	}
	time.Sleep(3 * orderSlice) // every wait ends slices at its own phase
	if err := hold.Unlock(ctx); err != nil {
		t.Fatal(err)
	}
	wg.Wait()
	close(order)
	var got []int
	for i := range order {
		got = append(got, i)
	}
	if !slices.Equal(got, []int{0, 1, 2, 3, 4, 5, 6, 7, 8, 9}) {
		t.Errorf("granted in the order %v, want the order they came", got)
	}
}

// turns is what one run of writers taking one key in turn measured: each writer's grants, and its longest wait
// counted in the grants to others made while it waited (passed) and in time (each writer's first wait, behind the
// start, is not counted). In a queue served in order a wait is passed by the writers that came before it, at most
// n-1; a wait sent to the back at each slice's end is passed by them again and again. The count is the measure
// judged: it does not grow when a loaded machine makes every handoff slower, as the time does (which the bench
// reports side by side with PostgreSQL's queue).
type turns struct {
	grants  []int
	passed  int64
	longest time.Duration
	order   []int // the writer of each grant counted, in the order granted: what a failure logs
}

func (r turns) spread() float64 {
	return float64(slices.Max(r.grants)) / float64(max(slices.Min(r.grants), 1))
}

// again is how many grants went to the writer of the grant before: in a queue served in order never, while the
// others wait in it; a writer that lets go and takes the key again at once, past the next in line, makes one.
func (r turns) again() int {
	n := 0
	for i := 1; i < len(r.order); i++ {
		if r.order[i] == r.order[i-1] {
			n++
		}
	}
	return n
}

// spreadBound is the most max/min of grants per writer a queue served in order gives when writers are late to
// queue again: each late writer queues behind one that came after it, and the grants of a fixed count (orderTurns
// each) can end one short of a turn for one writer and one past it for another (7 and 5), as the line shifts.
// Writers that pass others make more.
const spreadBound = float64(orderTurns+1) / float64(orderTurns-1)

// takeTurns runs n writers that each take one key, hold it for hold and let go, again and again, until they were
// granted orderTurns*n times in all. lock takes the key for writer i and returns its unlock. They all wait behind
// a hold of the key (taken by hold, given back by the function it returns) until queued reports n of them waiting.
func takeTurns(t *testing.T, n int, hold time.Duration, lock func(i int) (func() error, error), start func() func() error, queued func(n int)) turns {
	t.Helper()
	release := start()
	var total atomic.Int64
	target := int64(orderTurns * n)
	grants := make([]int, n)
	passed := make([]int64, n)
	longest := make([]time.Duration, n)
	order := make([]int, target)
	var wg sync.WaitGroup
	for i := range n {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for first := true; ; first = false {
				began, before := time.Now(), total.Load()
				unlock, err := lock(i)
				if err != nil {
					t.Errorf("writer %d: %v", i, err)
					return
				}
				waited := time.Since(began)
				g := total.Add(1)
				if g <= target {
					order[g-1] = i
					grants[i]++
					if !first {
						passed[i] = max(passed[i], g-1-before)
						longest[i] = max(longest[i], waited)
					}
				}
				time.Sleep(hold)
				if err := unlock(); err != nil {
					t.Errorf("writer %d: unlock: %v", i, err)
					return
				}
				if g >= target {
					return
				}
			}
		}()
	}
	queued(n)
	if err := release(); err != nil {
		t.Fatal(err)
	}
	wg.Wait()
	return turns{grants: grants, passed: slices.Max(passed), longest: slices.Max(longest), order: order}
}

// rawTurns runs takeTurns on plain connections to the server: PostgreSQL's own queue.
func (s *suite) rawTurns(t *testing.T, n int, hold time.Duration) turns {
	obs := s.observer(t)
	v, _ := Key(t).Int64()
	conns := make([]*pgx.Conn, n+1)
	for i := range conns {
		conns[i] = s.plain(t)
	}
	ctx := ctxT(t, 60*time.Second)
	lock := func(c *pgx.Conn, sql string) (func() error, error) {
		if _, err := c.Exec(ctx, sql, v); err != nil {
			return nil, err
		}
		return func() error {
			_, err := c.Exec(ctx, "SELECT pg_advisory_unlock_all()")
			return err
		}, nil
	}
	return takeTurns(t, n, hold,
		func(i int) (func() error, error) { return lock(conns[i], "SELECT pg_advisory_lock($1)") },
		func() func() error {
			unlock, err := lock(conns[n], "SELECT pg_advisory_lock($1)")
			if err != nil {
				t.Fatal(err)
			}
			return unlock
		},
		func(n int) {
			awaitCount(t, obs, v, n)
		})
}

// awaitCount polls pg_locks until n sessions wait for int8 key v.
func awaitCount(t *testing.T, obs *pgx.Conn, v int64, n int) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for {
		var got int
		if err := obs.QueryRow(context.Background(), `SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND NOT granted
			AND objsubid = 1 AND classid = (($1::int8 >> 32) & 4294967295)::text::oid AND objid = ($1::int8 & 4294967295)::text::oid`, v).Scan(&got); err != nil {
			t.Fatal(err)
		}
		if got == n {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("%d waits in pg_locks, want %d", got, n)
		}
		time.Sleep(5 * time.Millisecond)
	}
}

// writersFair: n writers (each its own Locker) taking one key in turn are granted about as often as each other
// (max/min <= spreadBound), none is granted twice in a row (a writer that let go does not pass the next in line),
// and none waits longer than 1.5 times the longest wait of PostgreSQL's own queue under the same load, measured
// side by side in grants to others made during the wait.
func (s *suite) writersFair(t *testing.T, n int) {
	var got, raw turns
	// Each in a test of its own, whose connections close as it ends: both at once would take 3n of them.
	t.Run("advlock", func(t *testing.T) { got = s.advlockTurns(t, n) })
	t.Run("PostgreSQL's queue", func(t *testing.T) {
		raw = s.refs.writers(t, n, func(t *testing.T) turns { return s.rawTurns(t, n, orderHold) })
	})
	if t.Failed() {
		return
	}
	s.reportTurns(t, n, got, raw)
}

// advlockTurns runs takeTurns with n writers, each its own Locker.
func (s *suite) advlockTurns(t *testing.T, n int) turns {
	obs := s.observer(t)
	ctx := ctxT(t, 60*time.Second)
	k := Key(t)
	ls := make([]*advlock.Locker, n+1)
	for i := range ls {
		ls[i] = s.open(t, orderSliceOpt()).L
		warm(ctx, t, ls[i])
	}
	return takeTurns(t, n, orderHold,
		func(i int) (func() error, error) {
			lk, err := ls[i].Lock(ctx, k)
			if err != nil {
				return nil, err
			}
			return func() error { return lk.Unlock(ctx) }, nil
		},
		func() func() error {
			lk, err := ls[n].Lock(ctx, k)
			if err != nil {
				t.Fatal(err)
			}
			return func() error { return lk.Unlock(ctx) }
		},
		func(m int) { waitsFor(t, obs, k, m) })
}

func (s *suite) reportTurns(t *testing.T, n int, got, raw turns) {
	t.Logf("%d writers x %v: grants %v (max/min %.2f), longest wait passed by %d grants, %v; PostgreSQL's queue: %v (%.2f), %d, %v",
		n, orderHold, got.grants, got.spread(), got.passed, got.longest.Round(time.Millisecond),
		raw.grants, raw.spread(), raw.passed, raw.longest.Round(time.Millisecond))
	if got.spread() > spreadBound || got.again() > 0 {
		t.Errorf("grants per writer %v: max/min %.2f, want <= %.2f (PostgreSQL's queue: %.2f); %d grants to the writer of "+
			"the grant before, want none; writers in the order granted: %v", got.grants, got.spread(), spreadBound, raw.spread(),
			got.again(), got.order)
	}
	// PostgreSQL's queue passes a wait by at most the n-1 others; its count is taken as at least that, so that a
	// run in which some writer was slow to queue again does not lower the bound.
	if bound := max(raw.passed, int64(n-1)) * 3 / 2; got.passed > bound {
		t.Errorf("a wait was passed by %d grants to others, want <= %d (1.5 x PostgreSQL's queue's %d, or of n-1)", got.passed, bound, raw.passed)
	}
}

// readerInTurn: a reader that comes while 4 writers (each its own Locker) take the key in turn, each holding it
// for 100 ms (together 1.3 slices a round), is granted once the writers that came before it were: passed by no
// more than twice the writers' grants that PostgreSQL's own queue lets pass it under the same load (the most of
// three readers each, and at least a round of the writers), not never. The times are logged beside the counts.
func (s *suite) readerInTurn(t *testing.T) {
	const writers, hold, readers = 4, 100 * time.Millisecond, 3 // a round of the writers: 1.3 slices
	measure := func(lock func(i int) (func() error, error), rlock func() (func() error, error)) (r readerRun) {
		var stop atomic.Bool
		var granted atomic.Int64
		var wg sync.WaitGroup
		for i := range writers {
			wg.Add(1)
			go func() {
				defer wg.Done()
				for !stop.Load() {
					unlock, err := lock(i)
					if err != nil {
						t.Errorf("writer %d: %v", i, err)
						return
					}
					granted.Add(1)
					time.Sleep(hold)
					if err := unlock(); err != nil {
						t.Errorf("writer %d: unlock: %v", i, err)
						return
					}
				}
			}()
		}
		defer wg.Wait()
		defer stop.Store(true)
		for range readers {
			time.Sleep(2 * writers * hold) // the writers' line has formed, and its waits have crossed slices
			began, before := time.Now(), granted.Load()
			unlock, err := rlock()
			if err != nil {
				t.Errorf("reader: %v", err)
				return r
			}
			r.longest = max(r.longest, time.Since(began))
			r.passed = max(r.passed, granted.Load()-before)
			if err := unlock(); err != nil {
				t.Error(err)
			}
		}
		return r
	}
	ctx := ctxT(t, 90*time.Second)
	k := Key(t)
	ls := make([]*advlock.Locker, writers+1)
	for i := range ls {
		ls[i] = s.open(t, orderSliceOpt()).L
		warm(ctx, t, ls[i])
	}
	got := measure(func(i int) (func() error, error) {
		lk, err := ls[i].Lock(ctx, k)
		if err != nil {
			return nil, err
		}
		return func() error { return lk.Unlock(ctx) }, nil
	}, func() (func() error, error) {
		lk, err := ls[writers].RLock(ctx, k, advlock.Wait(30*time.Second))
		if err != nil {
			return nil, err
		}
		return func() error { return lk.Unlock(ctx) }, nil
	})
	s.refs.mu.Lock()
	known := s.refs.reader
	s.refs.mu.Unlock()
	var ref readerRun
	if known != nil {
		ref = *known
		t.Logf("PostgreSQL's queue as measured for the other session mode")
	} else {
		v, _ := Key(t).Int64()
		conns := make([]*pgx.Conn, writers+1)
		for i := range conns {
			conns[i] = s.plain(t)
		}
		raw := func(c *pgx.Conn, fn string) (func() error, error) {
			if _, err := c.Exec(ctx, "SELECT "+fn+"($1)", v); err != nil {
				return nil, err
			}
			return func() error { _, err := c.Exec(ctx, "SELECT pg_advisory_unlock_all()"); return err }, nil
		}
		ref = measure(func(i int) (func() error, error) { return raw(conns[i], "pg_advisory_lock") },
			func() (func() error, error) { return raw(conns[writers], "pg_advisory_lock_shared") })
		if !t.Failed() {
			s.refs.mu.Lock()
			s.refs.reader = &ref
			s.refs.mu.Unlock()
		}
	}
	t.Logf("a reader behind %d writers x %v: passed by %d writers' grants, granted within %v; PostgreSQL's queue: %d, %v",
		writers, hold, got.passed, got.longest.Round(time.Millisecond), ref.passed, ref.longest.Round(time.Millisecond))
	if bound := 2 * max(ref.passed, writers); got.passed > bound {
		t.Errorf("a reader behind %d writers x %v was passed by %d writers' grants, want <= %d (twice PostgreSQL's queue's %d, or of the writers' round)",
			writers, hold, got.passed, bound, ref.passed)
	}
}

// readerRun is what readerInTurn measured of its readers: the most writers' grants made while a reader waited, and
// its longest wait.
type readerRun struct {
	passed  int64
	longest time.Duration
}
