package advlock

import (
	"context"
	"errors"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/advlock/advlock/internal/pgtest"
	"github.com/jackc/pgx/v5/pgconn"
)

// Each held lock lives on its own session pinned from the pool; nothing locks through the pool itself.
func TestDedicatedSessions(t *testing.T) {
	b := setup(t)
	ctx := ctxT(t, 10*time.Second)
	var locks []*Lock
	pids := map[uint32]bool{}
	for range 3 {
		lk, err := b.l.TryLock(ctx, key(t))
		if err != nil {
			t.Fatal(err)
		}
		locks = append(locks, lk)
		pids[b.pidOf(t, lk)] = true
	}
	if len(pids) != 3 {
		t.Errorf("3 locks on %d sessions, want 3", len(pids))
	}
	if n := b.pool.Stat().AcquiredConns(); n != 3 {
		t.Errorf("pool has %d acquired connections while 3 locks are held, want 3", n)
	}
	for _, lk := range locks {
		if err := lk.Unlock(ctx); err != nil {
			t.Fatal(err)
		}
		if pids := b.holders(t, lk.Key()); len(pids) != 0 {
			t.Errorf("after Unlock, pg_locks shows %v holding %s", pids, lk.Key())
		}
	}
	if n := b.pool.Stat().AcquiredConns(); n != 0 {
		t.Errorf("%d connections still acquired after every Unlock", n)
	}
	if n := b.pool.Stat().IdleConns(); n == 0 {
		t.Errorf("no idle connection after clean unlocks: sessions were destroyed instead of pooled")
	}
	pgtest.NoIdleLocks(t, b.pool, b.obs)
}

// 20 goroutines in one process TryLock one key: exactly one wins, and the server agrees. Then the same across two
// Lockers on two pools.
func TestTryLockExclusion(t *testing.T) {
	b := setup(t)
	other := New(pgtest.Pool(t, b.url, nil))
	defer other.Close()
	ctx := ctxT(t, 20*time.Second)
	for _, lockers := range [][]*Locker{{b.l}, {b.l, other}} {
		k := key(t)
		var wg sync.WaitGroup
		var won atomic.Int32
		var mu sync.Mutex
		var held []*Lock
		start := make(chan struct{})
		for i := range 20 {
			wg.Add(1)
			go func() {
				defer wg.Done()
				<-start
				lk, err := lockers[i%len(lockers)].TryLock(ctx, k)
				if err == nil {
					won.Add(1)
					mu.Lock()
					held = append(held, lk)
					mu.Unlock()
					return
				}
				if !errors.Is(err, ErrNotAcquired) {
					t.Errorf("TryLock: %v, want ErrNotAcquired", err)
				}
			}()
		}
		close(start)
		wg.Wait()
		if won.Load() != 1 {
			t.Errorf("%d of 20 TryLock calls succeeded, want exactly 1", won.Load())
		}
		if pids := b.holders(t, k); len(pids) != 1 {
			t.Errorf("pg_locks shows %d holders, want 1", len(pids))
		}
		for _, lk := range held {
			if err := lk.Unlock(ctx); err != nil {
				t.Error(err)
			}
		}
	}
	pgtest.NoIdleLocks(t, b.pool, b.obs)
}

// A second Lock of a key this Locker holds waits in-process, without a second session; it gets the key when the
// first is unlocked. A Lock against another process's holder waits in PostgreSQL (a waiting row in pg_locks).
func TestLockWaits(t *testing.T) {
	b := setup(t)
	ctx := ctxT(t, 20*time.Second)
	k := key(t)
	first, err := b.l.Lock(ctx, k)
	if err != nil {
		t.Fatal(err)
	}
	got := make(chan *Lock)
	go func() {
		lk, err := b.l.Lock(ctx, k)
		if err != nil {
			t.Error(err)
		}
		got <- lk
	}()
	time.Sleep(100 * time.Millisecond)
	if n := b.pool.Stat().AcquiredConns(); n != 1 {
		t.Errorf("in-process waiter took a session: %d acquired, want 1", n)
	}
	if err := first.Unlock(ctx); err != nil {
		t.Fatal(err)
	}
	second := <-got
	if second == nil {
		t.FailNow()
	}
	b.pidOf(t, second)

	// Another Locker waits in the server.
	other := New(pgtest.Pool(t, b.url, nil))
	defer other.Close()
	go func() {
		lk, err := other.Lock(ctx, k)
		if err != nil {
			t.Error(err)
		}
		got <- lk
	}()
	v, _ := k.Int64()
	deadline := time.Now().Add(10 * time.Second)
	for waiting := false; !waiting; {
		rows, err := pgtest.Locks(ctx, b.obs)
		if err != nil {
			t.Fatal(err)
		}
		for _, r := range rows {
			waiting = waiting || r.Int64Key(v) && !r.Granted
		}
		if time.Now().After(deadline) {
			t.Fatal("no waiting row in pg_locks: Lock does not wait in the server")
		}
		time.Sleep(5 * time.Millisecond)
	}
	if err := second.Unlock(ctx); err != nil {
		t.Fatal(err)
	}
	third := <-got
	if third == nil {
		t.FailNow()
	}
	b.pidOf(t, third)
	if err := third.Unlock(ctx); err != nil {
		t.Fatal(err)
	}
	pgtest.NoIdleLocks(t, b.pool, b.obs)
}

// Shared holders coexist, each on its own session; an exclusive caller waits for all of them, and TryLock fails.
func TestShared(t *testing.T) {
	b := setup(t)
	other := New(pgtest.Pool(t, b.url, nil))
	defer other.Close()
	ctx := ctxT(t, 20*time.Second)
	k := key(t)
	r1, err := b.l.RLock(ctx, k)
	if err != nil {
		t.Fatal(err)
	}
	r2, err := b.l.TryRLock(ctx, k)
	if err != nil {
		t.Fatal(err)
	}
	r3, err := other.TryRLock(ctx, k)
	if err != nil {
		t.Fatal(err)
	}
	if pids := b.holders(t, k); len(pids) != 3 {
		t.Errorf("3 shared holders, pg_locks shows %v", pids)
	}
	if !r1.Shared() {
		t.Error("RLock handle not Shared")
	}
	if _, err := other.TryLock(ctx, k); !errors.Is(err, ErrNotAcquired) {
		t.Errorf("TryLock against shared holders: %v, want ErrNotAcquired", err)
	}
	if _, err := b.l.TryLock(ctx, k); !errors.Is(err, ErrNotAcquired) {
		t.Errorf("in-process TryLock against shared holders: %v, want ErrNotAcquired", err)
	}
	done := make(chan error, 1)
	go func() {
		lk, err := other.Lock(ctx, k)
		if err == nil {
			err = lk.Unlock(ctx)
		}
		done <- err
	}()
	for _, r := range []*Lock{r1, r2, r3} {
		select {
		case err := <-done:
			t.Fatalf("exclusive Lock returned while shared holders remain: %v", err)
		case <-time.After(20 * time.Millisecond):
		}
		if err := r.Unlock(ctx); err != nil {
			t.Fatal(err)
		}
	}
	if err := <-done; err != nil {
		t.Fatal(err)
	}
	pgtest.NoIdleLocks(t, b.pool, b.obs)
}

func TestMisuse(t *testing.T) {
	b := setup(t)
	ctx := ctxT(t, 10*time.Second)

	if _, err := New(nil).Lock(ctx, key(t)); !errors.Is(err, ErrNoPool) {
		t.Errorf("New(nil).Lock: %v, want ErrNoPool", err)
	}
	New(nil).Close()
	var nilLocker *Locker
	if _, err := nilLocker.TryLock(ctx, key(t)); !errors.Is(err, ErrNoPool) {
		t.Errorf("nil Locker: %v, want ErrNoPool", err)
	}
	if _, err := b.l.Lock(ctx, Key{}); !errors.Is(err, ErrInvalidKey) {
		t.Errorf("zero Key: %v, want ErrInvalidKey", err)
	}

	lk, err := b.l.TryLock(ctx, key(t))
	if err != nil {
		t.Fatal(err)
	}
	if err := lk.Unlock(ctx); err != nil {
		t.Fatal(err)
	}
	if err := lk.Unlock(ctx); !errors.Is(err, ErrNotHeld) {
		t.Errorf("second Unlock: %v, want ErrNotHeld", err)
	}
	if !errors.Is(lk.Err(), ErrNotHeld) {
		t.Errorf("Err after Unlock: %v, want ErrNotHeld", lk.Err())
	}

	// Close releases what is held; later calls say ErrClosed.
	l := New(b.pool)
	held, err := l.TryLock(ctx, key(t))
	if err != nil {
		t.Fatal(err)
	}
	l.Close()
	l.Close()
	select {
	case <-held.Done():
	default:
		t.Error("Done not closed after Close")
	}
	if !errors.Is(held.Err(), ErrClosed) {
		t.Errorf("Err after Close: %v, want ErrClosed", held.Err())
	}
	if pids := b.holders(t, held.Key()); len(pids) != 0 {
		t.Errorf("Close left %s held by %v", held.Key(), pids)
	}
	if err := held.Unlock(ctx); !errors.Is(err, ErrClosed) {
		t.Errorf("Unlock after Close: %v, want ErrClosed", err)
	}
	if _, err := l.Lock(ctx, key(t)); !errors.Is(err, ErrClosed) {
		t.Errorf("Lock after Close: %v, want ErrClosed", err)
	}
	if err := l.Do(ctx, key(t), func(context.Context) error { return nil }); !errors.Is(err, ErrClosed) {
		t.Errorf("Do after Close: %v, want ErrClosed", err)
	}

	// A closed pool: an error, not a panic or a hang.
	p := pgtest.Pool(t, b.url, nil)
	p.Close()
	if _, err := New(p).TryLock(ctx, key(t)); err == nil {
		t.Error("TryLock on a closed pool succeeded")
	}
	pgtest.NoIdleLocks(t, b.pool, b.obs)
}

// Close aborts a Lock that is waiting, with ErrClosed.
func TestCloseAbortsWaiters(t *testing.T) {
	b := setup(t)
	ctx := ctxT(t, 20*time.Second)
	k := key(t)
	holder := pgtest.Conn(t, b.url)
	v, _ := k.Int64()
	if _, err := holder.Exec(ctx, "SELECT pg_advisory_lock($1)", v); err != nil {
		t.Fatal(err)
	}
	l := New(b.pool)
	errc := make(chan error, 2)
	go func() { _, err := l.Lock(ctx, k); errc <- err }() // waits in the server
	go func() { _, err := l.Lock(ctx, k); errc <- err }() // waits in-process
	time.Sleep(100 * time.Millisecond)
	l.Close()
	for range 2 {
		if err := <-errc; !errors.Is(err, ErrClosed) {
			t.Errorf("waiting Lock after Close: %v, want ErrClosed", err)
		}
	}
	if _, err := holder.Exec(ctx, "SELECT pg_advisory_unlock($1)", v); err != nil {
		t.Fatal(err)
	}
	b.waitFree(t, k)
	pgtest.NoIdleLocks(t, b.pool, b.obs)
}

// A Lock whose ctx ends while it waits returns an error wrapping ctx.Err() and holds nothing.
func TestLockContextEnds(t *testing.T) {
	b := setup(t)
	k := key(t)
	holder, err := b.l.TryLock(ctxT(t, 10*time.Second), k)
	if err != nil {
		t.Fatal(err)
	}
	other := New(pgtest.Pool(t, b.url, nil))
	defer other.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 200*time.Millisecond)
	defer cancel()
	_, err = other.Lock(ctx, k)
	if !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("Lock past its deadline: %v, want DeadlineExceeded", err)
	}
	// in-process waiter too
	ctx2, cancel2 := context.WithCancel(context.Background())
	cancel2()
	if _, err := b.l.Lock(ctx2, k); !errors.Is(err, context.Canceled) {
		t.Errorf("in-process wait with cancelled ctx: %v, want Canceled", err)
	}
	if err := holder.Unlock(context.Background()); err != nil {
		t.Fatal(err)
	}
	b.waitFree(t, k)
}

// Do runs fn under the lock and unlocks after; it unlocks and re-panics when fn panics.
func TestDo(t *testing.T) {
	b := setup(t)
	ctx := ctxT(t, 10*time.Second)
	k := key(t)
	var ran bool
	err := b.l.Do(ctx, k, func(ctx context.Context) error {
		ran = true
		if pids := b.holders(t, k); len(pids) != 1 {
			t.Errorf("inside Do, pg_locks shows %v", pids)
		}
		return nil
	})
	if err != nil || !ran {
		t.Fatalf("Do = %v, ran=%v", err, ran)
	}
	boom := errors.New("boom")
	if err := b.l.Do(ctx, k, func(context.Context) error { return boom }); !errors.Is(err, boom) {
		t.Errorf("Do returned %v, want fn's error", err)
	}
	func() {
		defer func() {
			if r := recover(); r != "panic in fn" {
				t.Errorf("recovered %v, want the panic from fn", r)
			}
		}()
		_ = b.l.Do(ctx, k, func(context.Context) error { panic("panic in fn") })
	}()
	if pids := b.holders(t, k); len(pids) != 0 {
		t.Errorf("after Do, pg_locks shows %v", pids)
	}
	pgtest.NoIdleLocks(t, b.pool, b.obs)
}

// errCode returns the SQLSTATE of the server error inside err.
func errCode(err error) string {
	var pgErr *pgconn.PgError
	if errors.As(err, &pgErr) {
		return pgErr.Code
	}
	return ""
}
