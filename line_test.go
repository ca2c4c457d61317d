package advlock

import (
	"context"
	"errors"
	"slices"
	"testing"
	"time"

	"github.com/advlock/advlock/internal/session"
	"github.com/advlock/advlock/internal/testkit/pgtest"
)

// waitsListed polls Inspect until it lists n waits for k, and returns its rows of k.
func waitsListed(t *testing.T, b *bundle, k Key, n int) []LockInfo {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for {
		rows, err := Inspect(context.Background(), b.obs)
		if err != nil {
			t.Fatal(err)
		}
		var of []LockInfo
		waits := 0
		for _, r := range rows {
			if r.Key.Equal(k) && r.Lease == nil {
				of = append(of, r)
				if !r.Granted {
					waits++
				}
			}
		}
		if waits == n {
			return of
		}
		if time.Now().After(deadline) {
			t.Fatalf("Inspect lists %d waits for %s, want %d: %+v", waits, k, n, rows)
		}
		time.Sleep(5 * time.Millisecond)
	}
}

// Inspect lists the waits of a key's line as waits for the key, in the order they came, each blocked by the key's
// holder and the conflicting waits in front of it (as pg_blocking_pids does in PostgreSQL's queue), and lists no
// ticket; a lock on
// a ticket's number that advlock did not take is listed as the lock it is.
func TestInspectLine(t *testing.T) {
	b := setup(t)
	ctx := ctxT(t, 30*time.Second)
	k := key(t)
	hold, err := b.l.Lock(ctx, k)
	if err != nil {
		t.Fatal(err)
	}
	type member struct {
		l      *Locker
		shared bool
	}
	ms := []member{{New(b.pool), false}, {New(b.pool), false}, {New(b.pool), true}}
	done := make(chan error, len(ms))
	for i, m := range ms {
		defer m.l.Close()
		go func() {
			take := m.l.Lock
			if m.shared {
				take = m.l.RLock
			}
			lk, err := take(ctx, k)
			if err == nil {
				err = lk.Unlock(ctx)
			}
			done <- err
		}()
		waitsListed(t, b, k, i+1)
	}
	v, _ := k.Int64()
	other := pgtest.Conn(t, b.url) // a lock on a ticket's number, not advlock's
	stranger := session.ID{V: v}.Ticket(100)
	if _, err := other.Exec(ctx, "SELECT pg_advisory_lock($1)", stranger.V); err != nil {
		t.Fatal(err)
	}
	rows, err := Inspect(ctx, b.obs)
	if err != nil {
		t.Fatal(err)
	}
	var of []LockInfo
	pids := map[int32]bool{}
	for _, r := range rows {
		if r.Key.Equal(k) {
			of = append(of, r)
			pids[r.PID] = true
		}
	}
	if len(of) != 4 || !of[0].Granted || of[1].Granted || of[1].Shared || of[2].Shared || !of[3].Shared {
		t.Fatalf("Inspect's rows of the key: %+v, want the holder, two writers and a reader, in that order", of)
	}
	holder, w1, w2 := of[0].PID, of[1].PID, of[2].PID
	// As pg_blocking_pids has it in PostgreSQL's own queue: the holder, and the conflicting waits in front.
	for i, want := range [][]int32{{holder}, {holder, w1}, {holder, w1, w2}} {
		got := of[i+1].BlockedBy
		want = slices.Clone(want)
		slices.Sort(want)
		if !slices.Equal(got, want) {
			t.Errorf("wait %d is blocked by %v, want %v", i, got, want)
		}
	}
	strangerListed := false
	for _, r := range rows {
		if pids[r.PID] && !r.Key.Equal(k) {
			t.Errorf("a row of a session of the key's line that is not the key: %+v", r)
		}
		if id := r.Key.id; id == stranger {
			strangerListed = true
		}
	}
	if !strangerListed {
		t.Errorf("the lock on a ticket's number that advlock did not take is not listed: %+v", rows)
	}
	if _, err := other.Exec(ctx, "SELECT pg_advisory_unlock_all()"); err != nil {
		t.Fatal(err)
	}
	if err := hold.Unlock(ctx); err != nil {
		t.Fatal(err)
	}
	for range ms {
		if err := <-done; err != nil {
			t.Error(err)
		}
	}
}

// A cycle through a key's line: X holds K1 and waits for K2 behind Y, a wait whose caller holds nothing; Z holds K2
// and waits for K1. In pg_locks X waits for Y's ticket, not for K2; the detection counts X's wait as a wait for K2
// all the same, and ends exactly one of X and Z (never Y, which no Locker watches); Y is granted K2 after.
func TestDeadlockThroughLine(t *testing.T) {
	b := setup(t)
	ctx := ctxT(t, 30*time.Second)
	lx, ly, lz := New(b.pool), New(b.pool), New(b.pool)
	defer lx.Close()
	defer ly.Close()
	defer lz.Close()
	k1, k2 := key(t), key(t)
	z2, err := lz.Lock(ctx, k2)
	if err != nil {
		t.Fatal(err)
	}
	x1, err := lx.Lock(ctx, k1)
	if err != nil {
		t.Fatal(err)
	}
	yDone := make(chan error, 1)
	go func() {
		lk, err := ly.Lock(ctx, k2)
		if err == nil {
			err = lk.Unlock(ctx)
		}
		yDone <- err
	}()
	waitsListed(t, b, k2, 1)
	errs := make(chan error, 2)
	go func() { errs <- takeNext(ctx, t, lx, x1, k2) }()
	waitsListed(t, b, k2, 2)
	formed := time.Now()
	go func() { errs <- takeNext(ctx, t, lz, z2, k1) }()
	var victims int
	for range 2 {
		err := <-errs
		switch {
		case errors.Is(err, ErrDeadlock):
			victims++
			t.Logf("ended after %v: %v", time.Since(formed).Round(time.Millisecond), err)
			if d := time.Since(formed); d > 10*time.Second { // about 1 s; its bound only against a hang
				t.Errorf("the cycle ended %v after it formed", d)
			}
		case err != nil:
			t.Errorf("a wait of the cycle: %v", err)
		}
	}
	if victims != 1 {
		t.Errorf("%d waits ended with ErrDeadlock, want exactly 1", victims)
	}
	if err := <-yDone; err != nil {
		t.Errorf("the wait in front, whose caller holds nothing: %v", err)
	}
}
