package advlock

import (
	"context"
	"errors"
	"math/rand/v2"
	"runtime"
	"testing"
	"time"

	"github.com/advlock/advlock/internal/testkit/pgtest"
)

// Races of HoldAtLeast (a lock that lingers past an early Unlock), each forced at its moment where the code lets a
// test do so: the test holds the Locker's mutex and waits until the goroutines it wants queued are blocked on it.

// Unlock has set the lock lingering and waits for l.mu in lingerFor while Close waits for it too, in both orders:
// either way the lock is released once, at once, with Err ErrNotHeld and one LockEnd.
func TestHoldAtLeastUnlockInLingerForRacingClose(t *testing.T) {
	b := setup(t)
	for _, closeFirst := range []bool{false, true} {
		name := "lingerFor first"
		if closeFirst {
			name = "Close first"
		}
		t.Run(name, func(t *testing.T) {
			ctx := ctxT(t, 2*time.Minute)
			ends := newHaEnds()
			l := New(b.pool, WithObserver(ends.observer()))
			k := key(t)
			v, _ := k.Int64()
			lk, err := l.TryLock(ctx, k, HoldAtLeast(time.Hour))
			if err != nil {
				l.Close()
				t.Fatal(err)
			}
			l.mu.Lock()
			unlocked := make(chan error, 1)
			closed := make(chan struct{})
			startUnlock := func() {
				go func() { unlocked <- lk.Unlock(ctx) }()
				if !haGoroutineIn("(*Locker).lingerFor(", 30*time.Second) {
					l.mu.Unlock()
					t.Fatal("setup: Unlock did not reach lingerFor")
				}
			}
			startClose := func() {
				go func() { l.Close(); close(closed) }()
				if !haGoroutineIn("(*Locker).Close(", 30*time.Second) {
					l.mu.Unlock()
					t.Fatal("setup: Close did not start")
				}
				time.Sleep(10 * time.Millisecond) // to be queued on l.mu (the order only, not the outcome)
			}
			if closeFirst {
				startClose()
				// Close waits for l.mu before it reads the state: Unlock's CAS comes first, its lingerFor after Close.
				startUnlock()
			} else {
				startUnlock()
				startClose()
			}
			l.mu.Unlock()
			select {
			case <-closed:
			case <-time.After(30 * time.Second):
				t.Errorf("Close has not returned 30 s later")
				haRescue(l, lk)()
				<-closed
			}
			if err := <-unlocked; err != nil {
				t.Errorf("Unlock: %v, want nil (it had set the lock lingering)", err)
			}
			if pids := b.holders(t, k); len(pids) != 0 {
				t.Errorf("after Close the server shows holders %v", pids)
			}
			pgtest.WaitFree(t, b.obs, v, time.Second)
			select {
			case <-lk.Done():
			default:
				t.Error("Done open after Close returned")
			}
			if !errors.Is(lk.Err(), ErrNotHeld) {
				t.Errorf("Err: %v, want ErrNotHeld", lk.Err())
			}
			if err := lk.Unlock(ctx); !errors.Is(err, ErrNotHeld) {
				t.Errorf("a second Unlock: %v, want ErrNotHeld", err)
			}
			ends.once(t, k, CauseReleased)
		})
	}
}

// Unlock racing Close, free-running, many times: Unlock's answer and Err agree, the observers hear once with the
// matching cause, the key is free when Close returns, and Close never waits for the hour-long hold.
func TestHoldAtLeastUnlockRacingCloseOnce(t *testing.T) {
	b := setup(t)
	ctx := ctxT(t, 2*time.Minute)
	outcomes := map[string]int{}
	defer func() { t.Logf("outcomes: %v", outcomes) }()
	for i := range 30 {
		ends := newHaEnds()
		opts := []Option{WithObserver(ends.observer())}
		if i%2 == 1 {
			opts = append(opts, WithSharedSessions(0))
		}
		l := New(b.pool, opts...)
		k := key(t)
		lk, err := l.TryLock(ctx, k, HoldAtLeast(time.Hour))
		if err != nil {
			l.Close()
			t.Fatal(err)
		}
		unlocked := make(chan error, 1)
		go func() { unlocked <- lk.Unlock(ctx) }()
		if i%3 == 0 {
			runtime.Gosched()
		}
		haClose(t, l, haRescue(l, lk))
		uerr := <-unlocked
		outcomes[errClass(uerr)]++
		if pids := b.holders(t, k); len(pids) != 0 {
			t.Errorf("round %d: after Close the server shows holders %v", i, pids)
		}
		switch {
		case uerr == nil:
			if !errors.Is(lk.Err(), ErrNotHeld) {
				t.Errorf("round %d: Unlock nil, Err %v, want ErrNotHeld", i, lk.Err())
			}
			ends.once(t, k, CauseReleased)
			if err := lk.Unlock(ctx); !errors.Is(err, ErrNotHeld) {
				t.Errorf("round %d: a second Unlock: %v, want ErrNotHeld", i, err)
			}
		case errors.Is(uerr, ErrClosed):
			if !errors.Is(lk.Err(), ErrClosed) {
				t.Errorf("round %d: Unlock ErrClosed, Err %v, want ErrClosed", i, lk.Err())
			}
			ends.once(t, k, CauseClosed)
		default:
			t.Errorf("round %d: Unlock racing Close: %v", i, uerr)
		}
	}
}

// The hold's timer firing while Close runs (holds of a few ms, Close at a random moment around their end): one
// release, one LockEnd, the key free when Close returns.
func TestHoldAtLeastTimerRacingClose(t *testing.T) {
	b := setup(t)
	ctx := ctxT(t, 2*time.Minute)
	for i := range 40 {
		ends := newHaEnds()
		opts := []Option{WithObserver(ends.observer())}
		if i%2 == 1 {
			opts = append(opts, WithSharedSessions(0))
		}
		l := New(b.pool, opts...)
		k := key(t)
		hold := time.Duration(5+rand.IntN(20)) * time.Millisecond
		lk, err := l.TryLock(ctx, k, HoldAtLeast(hold))
		if err != nil {
			l.Close()
			t.Fatal(err)
		}
		if err := lk.Unlock(ctx); err != nil {
			t.Fatalf("round %d: Unlock: %v", i, err)
		}
		time.Sleep(time.Duration(rand.IntN(30)) * time.Millisecond)
		haClose(t, l, haRescue(l, lk))
		if pids := b.holders(t, k); len(pids) != 0 {
			t.Errorf("round %d: after Close the server shows holders %v", i, pids)
		}
		select {
		case <-lk.Done():
		default:
			t.Errorf("round %d: Done open after Close", i)
		}
		if !errors.Is(lk.Err(), ErrNotHeld) {
			t.Errorf("round %d: Err %v, want ErrNotHeld", i, lk.Err())
		}
		if err := lk.Unlock(ctx); !errors.Is(err, ErrNotHeld) {
			t.Errorf("round %d: a second Unlock: %v, want ErrNotHeld", i, err)
		}
		ends.once(t, k, CauseReleased)
	}
}

// A Lock with HoldAtLeast whose ctx is cancelled as the key frees: granted (then it lingers past its Unlock and
// Close releases it at once) or not (then nothing is held); grants and ends balance, Close never waits.
func TestHoldAtLeastGrantRacingCancel(t *testing.T) {
	b := setup(t)
	ctx := ctxT(t, 2*time.Minute)
	holder := New(b.pool)
	defer holder.Close()

	t.Run("cancelled before", func(t *testing.T) {
		l := New(b.pool)
		k := key(t)
		cctx, cancel := context.WithCancel(ctx)
		cancel()
		lk, err := l.Lock(cctx, k, HoldAtLeast(time.Hour))
		if err == nil {
			t.Errorf("Lock with a cancelled ctx granted %v", lk)
			_ = lk.Unlock(ctx)
		} else if !errors.Is(err, context.Canceled) {
			t.Errorf("Lock with a cancelled ctx: %v, want context.Canceled", err)
		}
		if st := l.Stats(); st.Held != 0 {
			t.Errorf("Stats().Held = %d", st.Held)
		}
		haClose(t, l, nil)
	})

	outcomes := map[string]int{}
	defer func() { t.Logf("outcomes: %v", outcomes) }()
	for i := range 20 {
		ends := newHaEnds()
		opts := []Option{WithObserver(ends.observer())}
		if i%2 == 1 {
			opts = append(opts, WithSharedSessions(0))
		}
		l := New(b.pool, opts...)
		k := key(t)
		v, _ := k.Int64()
		h, err := holder.TryLock(ctx, k)
		if err != nil {
			t.Fatal(err)
		}
		wctx, cancel := context.WithCancel(ctx)
		type res struct {
			lk  *Lock
			err error
		}
		got := make(chan res, 1)
		go func() {
			lk, err := l.Lock(wctx, k, HoldAtLeast(time.Hour))
			got <- res{lk, err}
		}()
		deadline := time.Now().Add(30 * time.Second)
		for !b.waiting(t, k) {
			if time.Now().After(deadline) {
				t.Fatal("setup: the waiter never waited in the server")
			}
			time.Sleep(time.Millisecond)
		}
		delay := time.Duration(rand.IntN(3000)) * time.Microsecond
		go func() { time.Sleep(delay); cancel() }()
		_ = h.Unlock(ctx)
		r := <-got
		cancel()
		outcomes[errClass(r.err)]++
		if r.err == nil {
			if err := r.lk.Unlock(ctx); err != nil {
				t.Errorf("round %d: Unlock of the racing grant: %v", i, err)
			}
			if pids := b.holders(t, k); len(pids) != 1 {
				t.Errorf("round %d: a granted lock, unlocked early, shows holders %v", i, pids)
			}
			haClose(t, l, haRescue(l, r.lk))
			pgtest.WaitFree(t, b.obs, v, time.Second) // Close released it
			ends.once(t, k, CauseReleased)
		} else {
			if !errors.Is(r.err, context.Canceled) {
				t.Errorf("round %d: the cancelled wait: %v", i, r.err)
			}
			if st := l.Stats(); st.Held != 0 {
				t.Errorf("round %d: Stats().Held = %d after a refused grant", i, st.Held)
			}
			haClose(t, l, nil)
			pgtest.WaitFree(t, b.obs, v, 10*time.Second)
			if n := len(ends.of(k)); n != 0 {
				t.Errorf("round %d: %d LockEnd for a lock never returned", i, n)
			}
		}
	}
}

// Close as a TryLock with a hold is granted: the Lock's hold is made before the Lock is in the Locker's set, where
// Close (and a loss's forget) read it under the Locker's mutex. It was set after the grant, outside that mutex, and
// -race saw Close read it as TryLock wrote it (3 of 3 runs).
func TestHoldAtLeastGrantRacingClose(t *testing.T) {
	b := setup(t)
	for i := range 20 {
		ctx := ctxT(t, time.Minute)
		l := New(pgtest.Pool(t, b.url, nil))
		if _, err := l.TryLock(ctx, key(t)); err != nil { // the shared session opens first
			t.Fatal(err)
		}
		got := make(chan struct{})
		go func() {
			defer close(got)
			_, _ = l.TryLock(ctx, key(t), HoldAtLeast(time.Hour))
		}()
		time.Sleep(time.Duration(i*20) * time.Microsecond)
		l.Close()
		<-got
	}
}
