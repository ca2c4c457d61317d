package advlock

import (
	"encoding/json"
	"slices"
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
