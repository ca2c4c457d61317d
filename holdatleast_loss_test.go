package advlock

import (
	"context"
	"errors"
	"math/rand/v2"
	"testing"
	"time"

	"github.com/advlock/advlock/internal/testkit/pgtest"
)

// Races of HoldAtLeast (a lock that lingers past an early Unlock), each forced at its moment where the code lets a
// test do so: the test holds the Locker's mutex and waits until the goroutines it wants queued are blocked on it.

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
