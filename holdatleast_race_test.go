package advlock

import (
	"context"
	"errors"
	"math/rand/v2"
	"runtime"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/advlock/advlock/internal/testkit/pgtest"
)

// Races of HoldAtLeast (a lock that lingers past an early Unlock), each forced at its moment where the code lets a
// test do so: the test holds the Locker's mutex and waits until the goroutines it wants queued are blocked on it.

// haEnds records every LockEnd, per key.
type haEnds struct {
	mu   sync.Mutex
	ends map[string][]LockEnd
}

func newHaEnds() *haEnds { return &haEnds{ends: map[string][]LockEnd{}} }

func (r *haEnds) observer() Observer {
	return endObserver(func(e LockEnd) {
		r.mu.Lock()
		defer r.mu.Unlock()
		r.ends[e.Key.String()] = append(r.ends[e.Key.String()], e)
	})
}

func (r *haEnds) of(k Key) []LockEnd {
	r.mu.Lock()
	defer r.mu.Unlock()
	return append([]LockEnd(nil), r.ends[k.String()]...)
}

// once checks that k's lock was told ended exactly once, with cause.
func (r *haEnds) once(t *testing.T, k Key, cause string) {
	t.Helper()
	ends := r.of(k)
	if len(ends) != 1 {
		t.Errorf("LockEnd told %d times for %s, want once: %+v", len(ends), k, ends)
		return
	}
	if ends[0].Cause != cause {
		t.Errorf("LockEnd cause %q (err %v), want %q", ends[0].Cause, ends[0].Err, cause)
	}
}

// haGoroutineIn waits until some goroutine's stack shows fn (such as "(*Locker).forget"), or within passes.
func haGoroutineIn(fn string, within time.Duration) bool {
	deadline := time.Now().Add(within)
	buf := make([]byte, 1<<20)
	for {
		n := runtime.Stack(buf, true)
		if n == len(buf) {
			buf = make([]byte, 2*len(buf))
			continue
		}
		if strings.Contains(string(buf[:n]), fn) {
			return true
		}
		if time.Now().After(deadline) {
			return false
		}
		time.Sleep(time.Millisecond)
	}
}

// haClose closes l, failing the test if Close has not returned within 30 s (a hang, not a slow machine: every hold
// in these tests is an hour). rescue then undoes what keeps Close waiting, so that the test ends.
func haClose(t *testing.T, l *Locker, rescue func()) {
	t.Helper()
	done := make(chan struct{})
	go func() { l.Close(); close(done) }()
	select {
	case <-done:
		return
	case <-time.After(30 * time.Second):
		t.Errorf("Close has not returned 30 s later (the holds are an hour long)")
	}
	if rescue != nil {
		rescue()
	}
	<-done
}

// haRescue stops lk's hold timer as Close should have, so that a Close stuck on it returns.
func haRescue(l *Locker, lk *Lock) func() {
	return func() {
		l.mu.Lock()
		defer l.mu.Unlock()
		if lk.stopLinger() {
			l.inflight.Done()
		}
	}
}

// errClass names an outcome for the logs of the free-running races (without the key).
func errClass(err error) string {
	switch {
	case err == nil:
		return "nil"
	case errors.Is(err, ErrClosed):
		return "closed"
	case errors.Is(err, context.Canceled) && strings.Contains(err.Error(), "after the context ended"):
		return "canceled after the grant"
	case errors.Is(err, context.Canceled):
		return "canceled"
	}
	return err.Error()
}

func haModes() []struct {
	name string
	opts []Option
} {
	return []struct {
		name string
		opts []Option
	}{{"dedicated", []Option{WithSharedSessions(0)}}, {"shared", nil}}
}

// The loss is told to the Locker (forget, under l.mu) a moment before the handle's Err says so. An Unlock in that
// moment sees no loss, lingers, and arms the hold's timer after forget looked for one to stop. The test forces that
// order: it holds l.mu while the loss is queued in forget and Unlock in lingerFor, behind it. A lost lock must not
// keep its hold's timer (nor Close waiting for it).
func TestHoldAtLeastLostAsUnlocked(t *testing.T) {
	b := setup(t)
	for _, mode := range haModes() {
		t.Run(mode.name, func(t *testing.T) {
			ctx := ctxT(t, 2*time.Minute)
			ends := newHaEnds()
			l := New(pgtest.Pool(t, b.url, nil), append(mode.opts, WithObserver(ends.observer()))...)
			k := key(t)
			lk, err := l.TryLock(ctx, k, HoldAtLeast(time.Hour))
			if err != nil {
				l.Close()
				t.Fatal(err)
			}
			closed := false
			defer func() {
				if !closed {
					haClose(t, l, haRescue(l, lk))
				}
			}()
			l.mu.Lock()
			locked := true
			unlockMu := func() {
				if locked {
					locked = false
					l.mu.Unlock()
				}
			}
			defer unlockMu()
			pgtest.Terminate(t, b.obs, lk.PID())
			if !haGoroutineIn("(*Locker).forget(", 30*time.Second) {
				unlockMu()
				t.Fatal("setup: the loss did not reach forget within 30 s")
			}
			unlocked := make(chan error, 1)
			go func() { unlocked <- lk.Unlock(ctx) }()
			queued := make(chan bool, 1)
			go func() { queued <- haGoroutineIn("(*Locker).lingerFor(", 30*time.Second) }()
			select {
			case q := <-queued:
				if !q {
					unlockMu()
					t.Fatal("setup: Unlock neither returned nor reached lingerFor")
				}
			case err := <-unlocked:
				unlockMu()
				<-queued
				t.Skipf("Unlock saw the loss and did not linger (%v): the window was not hit", err)
			}
			unlockMu()
			var uerr error
			select {
			case uerr = <-unlocked:
			case <-time.After(30 * time.Second):
				t.Fatal("Unlock has not returned 30 s later")
			}
			waitDone(t, lk, 30*time.Second)
			if !errors.Is(lk.Err(), ErrLockLost) {
				t.Errorf("Err after the loss: %v, want ErrLockLost", lk.Err())
			}
			l.mu.Lock()
			armed := lk.hold != nil && lk.hold.linger != nil && lk.forgotten
			l.mu.Unlock()
			if armed {
				t.Logf("Unlock returned %v and armed the hold's timer after the Locker had forgotten the lost lock", uerr)
			}
			closed = true
			haClose(t, l, haRescue(l, lk))
			ends.once(t, k, CauseLost)
			if st := l.Stats(); st.Held != 0 {
				t.Errorf("Stats().Held = %d after Close", st.Held)
			}
		})
	}
}

// A loss during the hold (timer armed): every lingering lock on the session is told lost once, its timer stops, a
// second Unlock says ErrNotHeld, and Close does not wait for the hour-long holds. Shared: three locks on shared
// sessions, lost together.
func TestHoldAtLeastLostDuringHold(t *testing.T) {
	b := setup(t)
	for _, mode := range haModes() {
		t.Run(mode.name, func(t *testing.T) {
			ctx := ctxT(t, 2*time.Minute)
			ends := newHaEnds()
			l := New(pgtest.Pool(t, b.url, nil), append(mode.opts, WithObserver(ends.observer()))...)
			n := 1
			if mode.opts == nil {
				n = 3
			}
			var lks []*Lock
			for range n {
				lk, err := l.TryLock(ctx, key(t), HoldAtLeast(time.Hour))
				if err != nil {
					l.Close()
					t.Fatal(err)
				}
				lks = append(lks, lk)
			}
			rescue := func() {
				for _, lk := range lks {
					haRescue(l, lk)()
				}
			}
			pids := map[uint32]bool{}
			for _, lk := range lks {
				pids[lk.PID()] = true
				if err := lk.Unlock(ctx); err != nil {
					t.Fatalf("early Unlock: %v", err)
				}
			}
			if st := l.Stats(); st.Held != n {
				t.Errorf("Stats().Held during the holds = %d, want %d", st.Held, n)
			}
			for pid := range pids {
				pgtest.Terminate(t, b.obs, pid)
			}
			for _, lk := range lks {
				waitDone(t, lk, 30*time.Second)
				if !errors.Is(lk.Err(), ErrLockLost) {
					t.Errorf("Err: %v, want ErrLockLost", lk.Err())
				}
				if err := lk.Unlock(ctx); !errors.Is(err, ErrNotHeld) {
					t.Errorf("Unlock after the loss of a lingering lock: %v, want ErrNotHeld", err)
				}
			}
			if st := l.Stats(); st.Held != 0 {
				t.Errorf("Stats().Held after the loss = %d, want 0", st.Held)
			}
			haClose(t, l, rescue)
			for _, lk := range lks {
				ends.once(t, lk.Key(), CauseLost)
			}
		})
	}
}

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

// An Unlock of a lock whose loss was already told does not linger: it says the loss, as without HoldAtLeast.
func TestHoldAtLeastUnlockAfterLoss(t *testing.T) {
	b := setup(t)
	ctx := ctxT(t, time.Minute)
	ends := newHaEnds()
	l := New(pgtest.Pool(t, b.url, nil), WithSharedSessions(0), WithObserver(ends.observer()))
	k := key(t)
	lk, err := l.TryLock(ctx, k, HoldAtLeast(time.Hour))
	if err != nil {
		l.Close()
		t.Fatal(err)
	}
	pgtest.Terminate(t, b.obs, lk.PID())
	waitDone(t, lk, 30*time.Second)
	if err := lk.Unlock(ctx); !errors.Is(err, ErrLockLost) {
		t.Errorf("Unlock of a lost lock with a hold: %v, want ErrLockLost", err)
	}
	haClose(t, l, haRescue(l, lk))
	ends.once(t, k, CauseLost)
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

// Do promises that a lock lost at any point makes its result non-nil (the Unlock confirms the lock was still held
// when fn returned): a session lost silently during fn (here: the network blackholed, the backend terminated,
// another Locker granted the key while fn runs) makes Do return an error (the unlock is not confirmed). With
// HoldAtLeast the early Unlock asks the session whether it is still there, which gets no answer either.
func TestHoldAtLeastDoLostSilently(t *testing.T) {
	b := setup(t)
	for _, mode := range haModes() {
		for _, hold := range []bool{false, true} {
			name := mode.name + "/without HoldAtLeast"
			var opts []CallOption
			if hold {
				name = mode.name + "/with HoldAtLeast"
				opts = append(opts, HoldAtLeast(time.Hour))
			}
			t.Run(name, func(t *testing.T) {
				ctx := ctxT(t, 2*time.Minute)
				p, pool := proxiedPool(t, b.url, 4)
				l := New(pool, append(mode.opts, WithReleaseTimeout(time.Second))...)
				k := key(t)
				overlapped := false
				err := l.Do(ctx, k, func(fctx context.Context) error {
					pids := b.holders(t, k)
					if len(pids) != 1 {
						t.Errorf("holders %v", pids)
						return nil
					}
					p.Blackhole(true)
					pgtest.Terminate(t, b.obs, pids[0])
					o, err := b.l.Lock(ctx, k, Wait(10*time.Second))
					if err != nil {
						t.Errorf("another Locker during fn: %v", err)
						return nil
					}
					overlapped = true
					_ = o.Unlock(ctx)
					return nil
				}, opts...)
				t.Logf("Do: %v", err)
				if overlapped && err == nil {
					t.Errorf("Do returned nil, though another Locker held the key while fn ran")
				}
				p.Blackhole(false)
				haClose(t, l, nil)
			})
		}
	}
}

// The session terminated around the moment the hold's timer fires (holds of a few ms, the terminate at a random
// moment near their end): the lock ends once, released or lost, Err and the observers agree, Stats forgets it by
// the time Done closes, and Close does not wait.
func TestHoldAtLeastLostAsTimerFires(t *testing.T) {
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
		// A pool of its own: the terminate may hit the connection after it went back to the pool.
		pool := pgtest.Pool(t, b.url, nil)
		l := New(pool, opts...)
		k := key(t)
		hold := time.Duration(5+rand.IntN(10)) * time.Millisecond
		lk, err := l.TryLock(ctx, k, HoldAtLeast(hold))
		if err != nil {
			l.Close()
			t.Fatal(err)
		}
		pid := lk.PID()
		if err := lk.Unlock(ctx); err != nil {
			t.Fatalf("round %d: Unlock: %v", i, err)
		}
		time.Sleep(time.Duration(rand.IntN(15)) * time.Millisecond)
		var ok bool
		if err := b.obs.QueryRow(ctx, "SELECT pg_terminate_backend($1)", int32(pid)).Scan(&ok); err != nil {
			t.Fatal(err)
		}
		waitDone(t, lk, 30*time.Second)
		if st := l.Stats(); st.Held != 0 {
			t.Errorf("round %d: Stats().Held = %d once Done closed", i, st.Held)
		}
		var cause string
		switch {
		case errors.Is(lk.Err(), ErrNotHeld):
			outcomes["released"]++
			cause = CauseReleased
		case errors.Is(lk.Err(), ErrLockLost):
			outcomes["lost"]++
			cause = CauseLost
		default:
			t.Errorf("round %d: Err %v", i, lk.Err())
		}
		if err := lk.Unlock(ctx); !errors.Is(err, ErrNotHeld) {
			t.Errorf("round %d: a second Unlock: %v, want ErrNotHeld", i, err)
		}
		haClose(t, l, haRescue(l, lk))
		pool.Close()
		// The observers are told once Done has closed, not by then: judged once Close has waited for them.
		if cause != "" {
			ends.once(t, k, cause)
		}
	}
}

// Do with HoldAtLeast whose lock is lost (and told) while fn runs: Do says the loss, nothing lingers, Close does
// not wait for the hold.
func TestHoldAtLeastDoLostDuringFn(t *testing.T) {
	b := setup(t)
	for _, mode := range haModes() {
		t.Run(mode.name, func(t *testing.T) {
			ctx := ctxT(t, time.Minute)
			ends := newHaEnds()
			l := New(pgtest.Pool(t, b.url, nil), append(mode.opts, WithObserver(ends.observer()))...)
			k := key(t)
			err := l.Do(ctx, k, func(fctx context.Context) error {
				pids := b.holders(t, k)
				if len(pids) != 1 {
					t.Errorf("holders %v", pids)
					return nil
				}
				pgtest.Terminate(t, b.obs, pids[0])
				select {
				case <-fctx.Done():
				case <-time.After(30 * time.Second):
					t.Error("fn's context not cancelled 30 s after the loss")
				}
				return fctx.Err()
			}, HoldAtLeast(time.Hour))
			if !errors.Is(err, ErrLockLost) {
				t.Errorf("Do: %v, want ErrLockLost", err)
			}
			if st := l.Stats(); st.Held != 0 {
				t.Errorf("Stats().Held = %d after Do", st.Held)
			}
			haClose(t, l, nil)
			ends.once(t, k, CauseLost)
		})
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
