package advlock

import (
	"encoding/json"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/advlock/advlock/internal/pgtest"
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
		"client_addr", "backend_start", "state"} {
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
	for range 200 {
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
