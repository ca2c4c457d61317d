package advlock

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/advlock/advlock/internal/testkit/pgtest"
)

// Unlock after the hold has passed releases at once, as without HoldAtLeast: Done is closed when it returns.
func TestHoldAtLeastUnlockAfterHold(t *testing.T) {
	b := setup(t)
	for _, mode := range haModes() {
		t.Run(mode.name, func(t *testing.T) {
			ctx := ctxT(t, time.Minute)
			ends := newHaEnds()
			l := New(b.pool, append(mode.opts, WithObserver(ends.observer()))...)
			defer l.Close()
			k := key(t)
			const hold = 100 * time.Millisecond
			lk, err := l.TryLock(ctx, k, HoldAtLeast(hold))
			if err != nil {
				t.Fatal(err)
			}
			granted := time.Now()
			time.Sleep(hold + 20*time.Millisecond)
			if time.Since(granted) <= hold {
				t.Fatal("slept less than asked")
			}
			if err := lk.Unlock(ctx); err != nil {
				t.Fatalf("Unlock after the hold: %v", err)
			}
			select {
			case <-lk.Done():
			default:
				t.Fatal("Unlock after the hold returned with the lock still held (it lingered)")
			}
			if pids := b.holders(t, k); len(pids) != 0 {
				t.Errorf("after Unlock the server shows holders %v", pids)
			}
			if !errors.Is(lk.Err(), ErrNotHeld) {
				t.Errorf("Err %v, want ErrNotHeld", lk.Err())
			}
			if err := lk.Unlock(ctx); !errors.Is(err, ErrNotHeld) {
				t.Errorf("a second Unlock: %v, want ErrNotHeld", err)
			}
			if st := l.Stats(); st.Held != 0 {
				t.Errorf("Stats().Held = %d", st.Held)
			}
			l.Close() // the observers are told once Done has closed: Close waits for them
			ends.once(t, k, CauseReleased)
		})
	}
}

// Do with HoldAtLeast whose fn panics: the panic goes on, and the key stays held for the hold, then is released
// once.
func TestHoldAtLeastDoPanics(t *testing.T) {
	b := setup(t)
	for _, mode := range haModes() {
		t.Run(mode.name, func(t *testing.T) {
			ctx := ctxT(t, time.Minute)
			ends := newHaEnds()
			l := New(b.pool, append(mode.opts, WithObserver(ends.observer()))...)
			defer l.Close()
			k := key(t)
			v, _ := k.Int64()
			const hold = time.Second
			var granted time.Time
			func() {
				defer func() {
					if r := recover(); r != "boom" {
						t.Errorf("recovered %v, want the panic of fn", r)
					}
				}()
				_ = l.Do(ctx, k, func(context.Context) error {
					granted = time.Now()
					panic("boom")
				}, HoldAtLeast(hold))
			}()
			if pids := b.holders(t, k); len(pids) != 1 {
				t.Errorf("after fn panicked the server shows holders %v, want one for the hold", pids)
			}
			if st := l.Stats(); st.Held != 1 {
				t.Errorf("Stats().Held during the hold = %d, want 1", st.Held)
			}
			pgtest.WaitFree(t, b.obs, v, 30*time.Second)
			if d := time.Since(granted); d < hold {
				t.Errorf("free %v after fn began, before the hold of %v", d, hold)
			}
			deadline := time.Now().Add(30 * time.Second)
			for len(ends.of(k)) == 0 && time.Now().Before(deadline) {
				time.Sleep(time.Millisecond)
			}
			ends.once(t, k, CauseReleased)
			if e := ends.of(k); len(e) == 1 && e[0].Held < hold {
				t.Errorf("LockEnd.Held %v, less than the hold %v", e[0].Held, hold)
			}
		})
	}
}

// Shared holders with holds (TryRLock): both linger, an exclusive try elsewhere fails meanwhile, Stats counts both.
func TestHoldAtLeastShared(t *testing.T) {
	b := setup(t)
	ctx := ctxT(t, time.Minute)
	other := New(b.pool)
	defer other.Close()
	ends := newHaEnds()
	l := New(b.pool, WithObserver(ends.observer()))
	k := key(t)
	var lks []*Lock
	for range 2 {
		lk, err := l.TryRLock(ctx, k, HoldAtLeast(time.Hour))
		if err != nil {
			l.Close()
			t.Fatal(err)
		}
		lks = append(lks, lk)
	}
	for _, lk := range lks {
		if err := lk.Unlock(ctx); err != nil {
			t.Errorf("early Unlock of a shared holder: %v", err)
		}
	}
	if st := l.Stats(); st.Held != 2 {
		t.Errorf("Stats().Held = %d, want 2", st.Held)
	}
	if _, err := other.TryLock(ctx, k); !errors.Is(err, ErrNotAcquired) {
		t.Errorf("exclusive try during the shared holds: %v, want ErrNotAcquired", err)
	}
	haClose(t, l, func() {
		for _, lk := range lks {
			haRescue(l, lk)()
		}
	})
	if o, err := other.TryLock(ctx, k); err != nil {
		t.Errorf("exclusive try after Close: %v", err)
	} else {
		_ = o.Unlock(ctx)
	}
	if n := len(ends.of(k)); n != 2 {
		t.Errorf("%d LockEnd for two shared holders", n)
	}
}

// Leases: a lingering lease is counted, Close deletes it at once (another lease Locker takes the key right after).
func TestHoldAtLeastLeasesClose(t *testing.T) {
	b := setup(t)
	ctx := ctxT(t, time.Minute)
	lo := New(b.pool, WithLeases())
	defer lo.Close()
	ends := newHaEnds()
	l := New(b.pool, WithLeases(), WithObserver(ends.observer()))
	k := key(t)
	lk, err := l.TryLock(ctx, k, HoldAtLeast(time.Hour))
	if err != nil {
		l.Close()
		t.Fatal(err)
	}
	if err := lk.Unlock(ctx); err != nil {
		t.Fatal(err)
	}
	if err := lk.Unlock(ctx); !errors.Is(err, ErrNotHeld) {
		t.Errorf("a second Unlock: %v, want ErrNotHeld", err)
	}
	if st := l.Stats(); st.HeldLeases != 1 || st.Held != 1 {
		t.Errorf("Stats during the hold: Held %d HeldLeases %d, want 1 and 1", st.Held, st.HeldLeases)
	}
	if _, err := lo.TryLock(ctx, k); !errors.Is(err, ErrNotAcquired) {
		t.Errorf("another lease Locker during the hold: %v, want ErrNotAcquired", err)
	}
	haClose(t, l, haRescue(l, lk))
	if !errors.Is(lk.Err(), ErrNotHeld) {
		t.Errorf("Err after Close: %v, want ErrNotHeld", lk.Err())
	}
	o, err := lo.TryLock(ctx, k)
	if err != nil {
		t.Fatalf("another lease Locker right after Close: %v", err)
	}
	_ = o.Unlock(ctx)
	ends.once(t, k, CauseReleased)
}
