package conformance

import (
	"errors"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/advlock/advlock"
	"github.com/advlock/advlock/internal/testkit/pgtest"
)

// sessions: with a session per lock, each held lock pins its own connection; with shared sessions, locks taken
// one after another share one session and pin one connection for the Locker. Either way a clean unlock leaves
// nothing held and no pooled connection holding anything.
func (s *suite) sessions(t *testing.T) {
	h, obs := s.open(t), s.observer(t)
	ctx := ctxT(t, 10*time.Second)
	var locks []*advlock.Lock
	pids := map[uint32]bool{}
	for range 3 {
		lk, err := h.L.TryLock(ctx, Key(t))
		if err != nil {
			t.Fatal(err)
		}
		locks = append(locks, lk)
		pids[pidOf(t, obs, lk.Key())] = true
	}
	want := 3
	if s.shared {
		want = 1
	}
	if len(pids) != want {
		t.Errorf("3 locks on %d server sessions, want %d", len(pids), want)
	}
	if n := h.InUse(); n != want {
		t.Errorf("%d connections in use while 3 locks are held, want %d", n, want)
	}
	for _, lk := range locks {
		if err := lk.Unlock(ctx); err != nil {
			t.Fatal(err)
		}
		if p := holders(t, obs, lk.Key()); len(p) != 0 {
			t.Errorf("after Unlock, pg_locks shows %v holding %s", p, lk.Key())
		}
	}
	if s.shared {
		if n := h.InUse(); n != 1 {
			t.Errorf("%d connections in use after every Unlock, want the shared session's 1", n)
		}
	} else {
		if n := h.InUse(); n != 0 {
			t.Errorf("%d connections still in use after every Unlock", n)
		}
		if len(h.Idle(t)) == 0 {
			t.Error("no idle connection after clean unlocks: sessions were closed instead of pooled")
		}
	}
	noIdleLocks(t, h, obs)
}

func (s *suite) tryLockExclusion(t *testing.T) {
	h, other, obs := s.open(t), s.open(t), s.observer(t)
	ctx := ctxT(t, 30*time.Second)
	for _, lockers := range [][]*advlock.Locker{{h.L}, {h.L, other.L}} {
		k := Key(t)
		var wg sync.WaitGroup
		var won atomic.Int32
		var mu sync.Mutex
		var held []*advlock.Lock
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
				if !errors.Is(err, advlock.ErrNotAcquired) {
					t.Errorf("TryLock: %v, want ErrNotAcquired", err)
				}
			}()
		}
		close(start)
		wg.Wait()
		if won.Load() != 1 {
			t.Errorf("%d of 20 TryLock calls succeeded, want exactly 1", won.Load())
		}
		if p := holders(t, obs, k); len(p) != 1 {
			t.Errorf("pg_locks shows %d holders, want 1", len(p))
		}
		for _, lk := range held {
			if err := lk.Unlock(ctx); err != nil {
				t.Error(err)
			}
		}
	}
	noIdleLocks(t, h, obs)
}

func (s *suite) lockWaits(t *testing.T) {
	h, obs := s.open(t), s.observer(t)
	ctx := ctxT(t, 30*time.Second)
	k := Key(t)
	first, err := h.L.Lock(ctx, k)
	if err != nil {
		t.Fatal(err)
	}
	got := make(chan *advlock.Lock)
	go func() {
		lk, err := h.L.Lock(ctx, k)
		if err != nil {
			t.Error(err)
		}
		got <- lk
	}()
	time.Sleep(100 * time.Millisecond)
	if n := h.InUse(); n != 1 {
		t.Errorf("in-process waiter took a connection: %d in use, want 1", n)
	}
	if err := first.Unlock(ctx); err != nil {
		t.Fatal(err)
	}
	second := <-got
	if second == nil {
		t.FailNow()
	}
	pidOf(t, obs, k)

	other := s.open(t)
	go func() {
		lk, err := other.L.Lock(ctx, k)
		if err != nil {
			t.Error(err)
		}
		got <- lk
	}()
	v, _ := k.Int64()
	deadline := time.Now().Add(10 * time.Second)
	for waiting := false; !waiting; {
		rows, err := pgtest.Locks(ctx, obs)
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
	pidOf(t, obs, k)
	if err := third.Unlock(ctx); err != nil {
		t.Fatal(err)
	}
	noIdleLocks(t, h, obs)
}

func (s *suite) sharedMode(t *testing.T) {
	h, other, obs := s.open(t), s.open(t), s.observer(t)
	ctx := ctxT(t, 30*time.Second)
	k := Key(t)
	r1, err := h.L.RLock(ctx, k)
	if err != nil {
		t.Fatal(err)
	}
	r2, err := h.L.TryRLock(ctx, k)
	if err != nil {
		t.Fatal(err)
	}
	r3, err := other.L.TryRLock(ctx, k)
	if err != nil {
		t.Fatal(err)
	}
	// One row per session: three sessions of their own, or two shared sessions (the first Locker's two holders
	// stack on one session, PostgreSQL counting them).
	if p := holders(t, obs, k); !s.shared && len(p) != 3 || s.shared && len(p) != 2 {
		t.Errorf("3 shared holders (shared sessions: %v), pg_locks shows %v", s.shared, p)
	}
	if _, err := other.L.TryLock(ctx, k); !errors.Is(err, advlock.ErrNotAcquired) {
		t.Errorf("TryLock against shared holders: %v, want ErrNotAcquired", err)
	}
	done := make(chan error, 1)
	go func() {
		lk, err := other.L.Lock(ctx, k)
		if err == nil {
			err = lk.Unlock(ctx)
		}
		done <- err
	}()
	for _, r := range []*advlock.Lock{r1, r2, r3} {
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
	noIdleLocks(t, h, obs)
}

func (s *suite) misuse(t *testing.T) {
	h, obs := s.open(t), s.observer(t)
	ctx := ctxT(t, 10*time.Second)
	if _, err := h.L.Lock(ctx, advlock.Key{}); !errors.Is(err, advlock.ErrInvalidKey) {
		t.Errorf("zero Key: %v, want ErrInvalidKey", err)
	}
	lk, err := h.L.TryLock(ctx, Key(t))
	if err != nil {
		t.Fatal(err)
	}
	if err := lk.Unlock(ctx); err != nil {
		t.Fatal(err)
	}
	if err := lk.Unlock(ctx); !errors.Is(err, advlock.ErrNotHeld) {
		t.Errorf("second Unlock: %v, want ErrNotHeld", err)
	}
	h2 := s.openURL(t, s.be.URL)
	held, err := h2.L.TryLock(ctx, Key(t))
	if err != nil {
		t.Fatal(err)
	}
	h2.L.Close()
	h2.L.Close()
	if !errors.Is(held.Err(), advlock.ErrClosed) {
		t.Errorf("Err after Close: %v, want ErrClosed", held.Err())
	}
	if p := holders(t, obs, held.Key()); len(p) != 0 {
		t.Errorf("Close left %s held by %v", held.Key(), p)
	}
	if err := held.Unlock(ctx); !errors.Is(err, advlock.ErrClosed) {
		t.Errorf("Unlock after Close: %v, want ErrClosed", err)
	}
	if _, err := h2.L.Lock(ctx, Key(t)); !errors.Is(err, advlock.ErrClosed) {
		t.Errorf("Lock after Close: %v, want ErrClosed", err)
	}
	noIdleLocks(t, h, obs)
	noIdleLocks(t, h2, obs)
}
