package advlock

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/advlock/advlock/internal/testkit/pgtest"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
)

// slotHolders counts the sessions holding a slot of semaphore sem, from pg_locks.
func slotHolders(t *testing.T, b *bundle, sem *Semaphore) int {
	t.Helper()
	held := heldBy(t, b)
	n := 0
	for _, k := range sem.keys {
		v, _ := k.Int64()
		if _, ok := held[v]; ok {
			n++
		}
	}
	return n
}

// A semaphore of 3 slots used by 12 goroutines over 3 Lockers (3 processes): never more than 3 in the critical
// section nor in pg_locks, and every acquisition completes. A holder whose session is terminated frees its slot
// for a waiter.
func TestSemaphore(t *testing.T) {
	b := setup(t)
	name := fmt.Sprintf("test-%d", time.Now().UnixNano())
	var sems []*Semaphore
	for i := range 3 {
		l := New(pgtest.Pool(t, b.url, func(c *pgxpool.Config) { c.MaxConns = 8 }), WithSharedSessions([]int{4, 0, 4}[i]))
		t.Cleanup(l.Close)
		sems = append(sems, l.Semaphore(name, 3))
	}
	ctx := ctxT(t, 60*time.Second)
	var inside, most, done atomic.Int32
	var wg sync.WaitGroup
	stopSampling := make(chan struct{})
	sampled := make(chan int, 1)
	go func() { // pg_locks never shows more than 3 slots held
		worst := 0
		for {
			select {
			case <-stopSampling:
				sampled <- worst
				return
			case <-time.After(5 * time.Millisecond):
			}
			worst = max(worst, slotHolders(t, b, sems[0]))
		}
	}()
	for g := range 12 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			sem := sems[g%3]
			for range 8 {
				lk, err := sem.Acquire(ctx)
				if err != nil {
					t.Error(err)
					return
				}
				n := inside.Add(1)
				for m := most.Load(); n > m && !most.CompareAndSwap(m, n); m = most.Load() {
				}
				time.Sleep(time.Duration(1+g%4) * time.Millisecond)
				inside.Add(-1)
				if err := lk.Unlock(ctx); err != nil {
					t.Error(err)
					return
				}
				done.Add(1)
			}
		}()
	}
	wg.Wait()
	close(stopSampling)
	if worst := <-sampled; worst > 3 {
		t.Errorf("pg_locks showed %d slots held at once, want at most 3", worst)
	}
	if most.Load() > 3 || most.Load() < 2 {
		t.Errorf("at most %d holders were inside at once, want 3 at most (and more than 1)", most.Load())
	}
	if done.Load() != 96 {
		t.Errorf("%d of 96 acquisitions completed", done.Load())
	}

	// All 3 slots held, one per Locker; a waiter; one holder's session terminated: the waiter gets its slot.
	var held []*Lock
	for _, sem := range sems {
		lk, err := sem.TryAcquire(ctx)
		if err != nil {
			t.Fatal(err)
		}
		held = append(held, lk)
	}
	if _, err := sems[0].TryAcquire(ctx); !errors.Is(err, ErrNotAcquired) {
		t.Fatalf("TryAcquire with every slot taken: %v, want ErrNotAcquired", err)
	}
	if _, err := sems[1].Acquire(ctx, Wait(300*time.Millisecond)); !errors.Is(err, ErrNotAcquired) {
		t.Fatalf("Acquire with Wait(300ms) and every slot taken: %v, want ErrNotAcquired", err)
	}
	got := make(chan *Lock, 1)
	go func() {
		lk, err := sems[1].Acquire(ctx)
		if err != nil {
			t.Error(err)
		}
		got <- lk
	}()
	time.Sleep(100 * time.Millisecond)
	killed := time.Now()
	pgtest.Terminate(t, b.obs, b.pidOf(t, held[2]))
	select {
	case lk := <-got:
		t.Logf("a waiter got the slot of a terminated holder %v after pg_terminate_backend", time.Since(killed))
		if lk != nil {
			_ = lk.Unlock(ctx)
		}
	case <-time.After(5 * time.Second):
		t.Fatal("the slot of a terminated holder was not taken by the waiter")
	}
	for _, lk := range held[:2] {
		if err := lk.Unlock(ctx); err != nil {
			t.Fatal(err)
		}
	}
}

// A waiting Acquire waits for a connection as well as for a slot: with a pool of 2 that has no connection free
// (a session per lock holding 2 of 3 slots; or a shared session and the application holding the other), another
// process frees the last slot after 500 ms and a connection is free after 1 s. With a session per lock the waiter
// takes a slot once it has a connection; on the shared session, as soon as the slot is free. Acquire returned
// ErrPoolExhausted in microseconds.
func TestSemaphorePoolPressure(t *testing.T) {
	for _, mode := range []string{"session per lock", "shared sessions"} {
		t.Run(mode, func(t *testing.T) {
			b := setup(t)
			ctx := ctxT(t, 30*time.Second)
			name := fmt.Sprintf("pressure-%d", time.Now().UnixNano())
			pool := pgtest.Pool(t, b.url, func(c *pgxpool.Config) { c.MaxConns = 2 })
			var l *Locker
			var free func()
			if mode == "session per lock" {
				l = New(pool, WithSharedSessions(0))
			} else {
				l = New(pool)
			}
			t.Cleanup(l.Close)
			sem, elsewhere := l.Semaphore(name, 3), b.l.Semaphore(name, 3)
			var mine []*Lock
			for range 2 {
				lk, err := sem.TryAcquire(ctx)
				if err != nil {
					t.Fatal(err)
				}
				mine = append(mine, lk)
			}
			if mode == "shared sessions" { // the application's own query holds the pool's other connection
				c, err := pool.Acquire(ctx)
				if err != nil {
					t.Fatal(err)
				}
				free = c.Release
			} else {
				free = func() { _ = mine[0].Unlock(ctx) }
			}
			other, err := elsewhere.TryAcquire(ctx)
			if err != nil {
				t.Fatal(err)
			}
			if _, err := sem.TryAcquire(ctx); !errors.Is(err, ErrPoolExhausted) && !errors.Is(err, ErrNotAcquired) {
				t.Errorf("TryAcquire with the pool exhausted: %v, want ErrPoolExhausted or ErrNotAcquired", err)
			}
			start := time.Now()
			time.AfterFunc(500*time.Millisecond, func() { _ = other.Unlock(context.Background()) })
			time.AfterFunc(time.Second, free)
			lk, err := sem.Acquire(ctx)
			took := time.Since(start)
			if err != nil {
				t.Fatalf("Acquire under pool pressure after %v: %v, want a slot once a connection is free", took, err)
			}
			t.Logf("Acquire took a slot after %v", took.Round(time.Millisecond))
			// With a session per lock a slot needs a connection of its own (free after 1 s); a shared session
			// already open takes the slot freed after 500 ms without one, while each wait on a slot in between
			// waits for a connection in vain.
			if want := map[string]time.Duration{"session per lock": 900 * time.Millisecond, "shared sessions": 450 * time.Millisecond}[mode]; took < want {
				t.Errorf("Acquire returned after %v, before a slot it could take was free", took)
			}
			if n := slotHolders(t, b, sem); n > 3 {
				t.Errorf("pg_locks shows %d slots held", n)
			}
			_ = lk.Unlock(ctx)
			for _, lk := range mine {
				_ = lk.Unlock(ctx)
			}
		})
	}
}

// Holders terminated under load: 3 Lockers (shared sessions, a session per lock, and shared sessions again), 9
// goroutines taking and releasing slots of a 2-slot semaphore while slot holders' backends are terminated every
// 40 ms for 2 s: pg_locks never shows more than 2 slots held, and every goroutine keeps getting slots (a holder
// leaves as soon as it is told its slot was lost).
func TestSemaphoreTerminatedUnderLoad(t *testing.T) {
	b := setup(t)
	name := fmt.Sprintf("load-%d", time.Now().UnixNano())
	var sems []*Semaphore
	for i := range 3 {
		l := New(pgtest.Pool(t, b.url, func(c *pgxpool.Config) { c.MaxConns = 6 }), WithSharedSessions([]int{4, 0, 4}[i]))
		t.Cleanup(l.Close)
		sems = append(sems, l.Semaphore(name, 2))
	}
	ctx := ctxT(t, 60*time.Second)
	stop := make(chan struct{})
	var inside, worst, sampledWorst atomic.Int32
	var got [9]atomic.Int32
	var wg sync.WaitGroup
	for g := range 9 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for {
				select {
				case <-stop:
					return
				default:
				}
				actx, cancel := context.WithTimeout(ctx, 5*time.Second)
				lk, err := sems[g%3].Acquire(actx)
				cancel()
				if err != nil {
					continue // its waiting session was terminated, or it waited 5 s: try again
				}
				got[g].Add(1)
				n := inside.Add(1)
				for w := worst.Load(); n > w && !worst.CompareAndSwap(w, n); w = worst.Load() {
				}
				select {
				case <-lk.Done():
				case <-time.After(time.Duration(1+g%3) * time.Millisecond):
				}
				inside.Add(-1)
				_ = lk.Unlock(ctx)
			}
		}()
	}
	var kills int
	end := time.Now().Add(2 * time.Second)
	for time.Now().Before(end) {
		time.Sleep(40 * time.Millisecond)
		held := heldBy(t, b)
		n := 0
		for _, k := range sems[0].keys {
			v, _ := k.Int64()
			if pid, ok := held[v]; ok {
				n++
				if kills%2 == 0 || n == 1 {
					_, _ = b.obs.Exec(ctx, "SELECT pg_terminate_backend($1)", int32(pid))
					kills++
				}
			}
		}
		for w := sampledWorst.Load(); int32(n) > w && !sampledWorst.CompareAndSwap(w, int32(n)); w = sampledWorst.Load() {
		}
	}
	close(stop)
	wg.Wait()
	if sampledWorst.Load() > 2 {
		t.Errorf("pg_locks showed %d slots of 2 held at once", sampledWorst.Load())
	}
	for g := range got {
		if got[g].Load() == 0 {
			t.Errorf("goroutine %d never got a slot", g)
		}
	}
	t.Logf("%d terminations; most inside at once (a terminated holder counts until it notices): %d", kills, worst.Load())
}

// statements is how many statements the server ran (pg_stat_statements, every statement of every client) since
// the last call, not counting its own.
func statements(t *testing.T, obs *pgx.Conn) int64 {
	t.Helper()
	var n int64
	if err := obs.QueryRow(context.Background(), `SELECT coalesce(sum(calls), 0)::int8 FROM pg_stat_statements
		WHERE query NOT LIKE '%pg_stat_statements%'`).Scan(&n); err != nil {
		t.Fatal(err)
	}
	if _, err := obs.Exec(context.Background(), `SELECT pg_stat_statements_reset()`); err != nil {
		t.Fatal(err)
	}
	return n
}

// A waiting Semaphore.Acquire costs the server about what a waiting Lock does: with every slot of a semaphore of 10
// held, an Acquire that waits 3 s runs about as many statements as a Lock that waits 3 s for a held key (counted by
// the server, pg_stat_statements on a private cluster), not one for every slot every 200 ms (190 for 3 s before).
func TestSemaphoreWaitCost(t *testing.T) {
	if testing.Short() {
		t.Skip("starts a private PostgreSQL cluster")
	}
	c := pgtest.StartCluster(t, "shared_preload_libraries = 'pg_stat_statements'", "pg_stat_statements.track = all")
	obs := pgtest.Conn(t, c.URL)
	if _, err := obs.Exec(context.Background(), "CREATE EXTENSION pg_stat_statements"); err != nil {
		t.Fatal(err)
	}
	ctx := ctxT(t, 30*time.Second)
	holder := New(pgtest.Pool(t, c.URL, nil))
	defer holder.Close()
	sem := holder.Semaphore("cost", 10)
	for range 10 {
		if _, err := sem.TryAcquire(ctx); err != nil {
			t.Fatal(err)
		}
	}
	k := key(t)
	if _, err := holder.TryLock(ctx, k); err != nil {
		t.Fatal(err)
	}
	cost := func(wait func(l *Locker) error) int64 {
		l := New(pgtest.Pool(t, c.URL, nil))
		defer l.Close()
		if lk, err := l.TryLock(ctx, key(t)); err != nil { // its shared session open and proved
			t.Fatal(err)
		} else {
			_ = lk.Unlock(ctx)
		}
		if _, err := l.Lock(ctx, k, Wait(50*time.Millisecond)); !errors.Is(err, ErrNotAcquired) { // a session of its own too
			t.Fatal(err)
		}
		statements(t, obs)
		if err := wait(l); !errors.Is(err, ErrNotAcquired) {
			t.Fatalf("a wait for what is held: %v", err)
		}
		return statements(t, obs)
	}
	lock := cost(func(l *Locker) error { _, err := l.Lock(ctx, k, Wait(3*time.Second)); return err })
	acquire := cost(func(l *Locker) error { _, err := l.Semaphore("cost", 10).Acquire(ctx, Wait(3*time.Second)); return err })
	t.Logf("statements for a 3 s wait: Lock %d, Semaphore(10).Acquire %d", lock, acquire)
	if acquire > 2*lock+10 { // the slots tried once first: 10 tries
		t.Errorf("a waiting Acquire cost %d statements, a waiting Lock %d", acquire, lock)
	}
}
