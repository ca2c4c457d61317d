package advlock

import (
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/advlock/advlock/internal/pgtest"
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
