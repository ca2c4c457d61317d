package conformance

import (
	"context"
	"errors"
	mrand "math/rand/v2"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/advlock/advlock"
)

func (s *suite) releaseExact(t *testing.T) {
	t.Run("unlock returns false", func(t *testing.T) {
		h, obs := s.open(t, wrongUnlock()), s.observer(t)
		ctx := ctxT(t, 10*time.Second)
		lk, err := h.L.TryLock(ctx, Key(t))
		if err != nil {
			t.Fatal(err)
		}
		pid := pidOf(t, obs, lk.Key())
		err = lk.Unlock(ctx)
		if !errors.Is(err, advlock.ErrLockLost) || !strings.Contains(err.Error(), "session closed") {
			t.Errorf("Unlock when the server says false: %v, want ErrLockLost saying the session was closed", err)
		}
		s.waitClosed(t, obs, pid)
		waitFree(t, obs, lk.Key())
		noIdleLocks(t, h, obs)
	})
	// An unlock whose ctx has ended (or ends while it is on the wire): with a session per lock the session is
	// closed (ErrUnlockFailed), which releases the key; a shared session is never destroyed for a caller's ctx: the
	// unlock goes out anyway and is answered, the key is freed and the session's other locks stay held.
	for _, tc := range []struct {
		name    string
		latency time.Duration
		ctx     func() (context.Context, context.CancelFunc)
		want    error
	}{
		{"cancelled ctx", 0, func() (context.Context, context.CancelFunc) {
			ctx, cancel := context.WithCancel(context.Background())
			cancel()
			return ctx, cancel
		}, context.Canceled},
		{"timeout", 300 * time.Millisecond, func() (context.Context, context.CancelFunc) {
			return context.WithTimeout(context.Background(), 50*time.Millisecond)
		}, context.DeadlineExceeded},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if s.be.NoCancel {
				// The ctx has ended or ends while the answer is on its way: lib/pq then sends a cancel request, on
				// which PgBouncer 1.18 to 1.20 can crash (pgbouncer#822). Covered on the other backends.
				t.Skip("PgBouncer before 1.21 crashes on lib/pq's cancel requests (pgbouncer#822)")
			}
			h, p := s.proxied(t)
			obs := s.observer(t)
			lk, err := h.L.TryLock(ctxT(t, 10*time.Second), Key(t))
			if err != nil {
				t.Fatal(err)
			}
			other, err := h.L.TryLock(ctxT(t, 10*time.Second), Key(t))
			if err != nil {
				t.Fatal(err)
			}
			pid := pidOf(t, obs, lk.Key())
			p.Latency(tc.latency)
			ctx, cancel := tc.ctx()
			defer cancel()
			err = lk.Unlock(ctx)
			p.Latency(0)
			if s.shared {
				if err != nil {
					t.Errorf("Unlock on a shared session with an ended ctx: %v, want nil (the unlock is sent and answered)", err)
				}
				waitFree(t, obs, lk.Key())
				if pidOf(t, obs, other.Key()) != pid || other.Err() != nil {
					t.Errorf("the shared session's other lock was disturbed: Err %v", other.Err())
				}
			} else {
				if !errors.Is(err, advlock.ErrUnlockFailed) || !errors.Is(err, tc.want) {
					t.Errorf("Unlock with an ended ctx: %v, want ErrUnlockFailed and %v", err, tc.want)
				}
				s.waitClosed(t, obs, pid)
				waitFree(t, obs, lk.Key())
			}
			if err := other.Unlock(ctxT(t, 10*time.Second)); err != nil {
				t.Fatal(err)
			}
			noIdleLocks(t, h, obs)
		})
	}
}

func (s *suite) cancelRace(t *testing.T) {
	iterations := s.be.CancelIterations
	if testing.Short() {
		iterations = 100
	}
	h, holder, obs := s.open(t), s.open(t), s.observer(t)
	bg := context.Background()
	var won, cancelled int
	for i := range iterations {
		k := Key(t)
		hl, err := holder.L.TryLock(bg, k)
		if err != nil {
			t.Fatal(err)
		}
		ctx, cancel := context.WithCancel(bg)
		res := make(chan error, 1)
		var lk *advlock.Lock
		go func() {
			var err error
			lk, err = h.L.Lock(ctx, k)
			res <- err
		}()
		// Most iterations race the cancel against the grant itself (fact 11): wait until the waiter is queued in
		// the server. The others cancel at a random point on the way there.
		if i%4 != 0 {
			waitQueued(t, obs, k)
		}
		time.Sleep(time.Duration(mrand.IntN(500)) * time.Microsecond)
		var wg sync.WaitGroup
		wg.Add(2)
		go func() {
			defer wg.Done()
			if err := hl.Unlock(bg); err != nil {
				t.Error(err)
			}
		}()
		go func() {
			defer wg.Done()
			time.Sleep(time.Duration(mrand.IntN(2000)) * time.Microsecond)
			cancel()
		}()
		wg.Wait()
		err = <-res
		if err == nil {
			won++
			if p := holders(t, obs, k); len(p) != 1 { // no false success
				t.Fatalf("iteration %d: Lock succeeded but pg_locks shows holders %v", i, p)
			}
			if err := lk.Unlock(bg); err != nil {
				t.Fatal(err)
			}
		} else {
			cancelled++
			if !errors.Is(err, context.Canceled) {
				t.Fatalf("iteration %d: %v, want an error wrapping context.Canceled", i, err)
			}
		}
		waitFree(t, obs, k) // no leak, whoever was granted
	}
	noIdleLocks(t, h, obs)
	t.Logf("%d iterations: %d granted, %d cancelled", iterations, won, cancelled)
	if won == 0 || cancelled == 0 {
		t.Errorf("the race was never exercised both ways (granted %d, cancelled %d)", won, cancelled)
	}
}

// unlockDuringKeepalive: an Unlock that arrives while the watcher's keepalive round trip is in flight (a slow link,
// a short keepalive) returns nil, every time, and the session goes back to the pool.
func (s *suite) unlockDuringKeepalive(t *testing.T) {
	// A round trip takes at least 20 ms (10 ms each way) of every 120 ms or so; the ping may take 100 ms before it
	// counts as a real timeout, far more than it needs on a quiet machine. On a loaded one (the race detector, two
	// cores, every package's tests at once) a round trip does miss it now and then: the session is then judged
	// dead, and the lock lost, which is right. Such an iteration is done again (at most 15 of them); the unlock
	// this test is about is one that lands during a keepalive that is answered in time.
	const keepalive = 100 * time.Millisecond
	h, p := s.proxied(t, advlock.WithKeepalive(keepalive))
	obs := s.observer(t)
	ctx := ctxT(t, 90*time.Second)
	p.Latency(10 * time.Millisecond)
	defer p.Latency(0)
	timedOut := 0
	for i := 0; i < 30; i++ {
		lk, err := h.L.TryLock(ctx, Key(t))
		for try := 0; err != nil && strings.Contains(err.Error(), "no answer within") && try < 3; try++ {
			// A shared session's round trip is bounded by the keepalive too: on a loaded machine a try may
			// miss 50 ms. The unlock is what this test is about.
			t.Logf("iteration %d: %v; trying again", i, err)
			lk, err = h.L.TryLock(ctx, Key(t))
		}
		if err != nil {
			t.Fatal(err)
		}
		time.Sleep(time.Duration(mrand.IntN(240)) * time.Millisecond)
		if err := lk.Unlock(ctx); err != nil {
			if errors.Is(err, advlock.ErrLockLost) && strings.Contains(err.Error(), "no answer within") && timedOut < 15 {
				t.Logf("iteration %d: a round trip really missed the bound (%v); again", i, err)
				timedOut++
				i--
				continue
			}
			t.Fatalf("iteration %d: Unlock of a healthy lock over a slow link: %v, want nil", i, err)
		}
		if len(holders(t, obs, lk.Key())) != 0 {
			t.Fatalf("iteration %d: %s still held after Unlock", i, lk.Key())
		}
	}
	p.Latency(0)
	noIdleLocks(t, h, obs)
}
