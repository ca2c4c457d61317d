package conformance

import (
	"context"
	"errors"
	mrand "math/rand/v2"
	"net"
	"net/url"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/advlock/advlock"
	"github.com/advlock/advlock/internal/session"
	"github.com/advlock/advlock/internal/testkit/pgtest"
)

// keepalive is what the loss tests use: long when the server's message must be what reveals the loss.
func (s *suite) keepalive() time.Duration {
	if s.be.EventDriven {
		return time.Minute
	}
	return 200 * time.Millisecond
}

func (s *suite) lostOnTerminate(t *testing.T) {
	h, obs := s.open(t, advlock.WithKeepalive(s.keepalive())), s.observer(t)
	ctx := ctxT(t, 10*time.Second)
	lk, err := h.L.TryLock(ctx, Key(t))
	if err != nil {
		t.Fatal(err)
	}
	if lk.Err() != nil {
		t.Fatalf("Err while held: %v", lk.Err())
	}
	time.Sleep(10 * time.Millisecond) // the watcher starts within 2ms of the grant
	pgtest.Terminate(t, obs, pidOf(t, obs, lk.Key()))
	d := waitDone(t, lk, 5*time.Second)
	t.Logf("loss noticed %v after pg_terminate_backend returned", d)
	if !errors.Is(lk.Err(), advlock.ErrLockLost) {
		t.Errorf("Err = %v, want ErrLockLost", lk.Err())
	}
	if s.be.EventDriven && !strings.Contains(lk.Err().Error(), "57P01") && !strings.Contains(lk.Err().Error(), "server") {
		t.Errorf("Err = %v, want the server's reason", lk.Err())
	}
	if err := lk.Unlock(ctx); !errors.Is(err, advlock.ErrLockLost) {
		t.Errorf("Unlock of a lost lock: %v, want ErrLockLost", err)
	}
	waitFree(t, obs, lk.Key())               // the backend sends FATAL before it exits and drops its locks
	again, err := h.L.TryLock(ctx, lk.Key()) // the in-process slot is free again
	if err != nil {
		t.Fatal(err)
	}
	if err := again.Unlock(ctx); err != nil {
		t.Fatal(err)
	}
	noIdleLocks(t, h, obs)
}

// heldPastWork: an Unlock before the lock's HoldAtLeast has passed asks the server whether the lock is still held
// and marks it held past its work (Inspect's Lingering; the marker goes with the key, nothing is pooled holding
// it); the holder's session terminated just before such an Unlock makes it say ErrLockLost.
func (s *suite) heldPastWork(t *testing.T) {
	h, obs := s.open(t, advlock.WithKeepalive(s.keepalive())), s.observer(t)
	ctx := ctxT(t, 30*time.Second)
	k := Key(t)
	lk, err := h.L.TryLock(ctx, k, advlock.HoldAtLeast(500*time.Millisecond))
	if err != nil {
		t.Fatal(err)
	}
	if err := lk.Unlock(ctx); err != nil {
		t.Fatalf("Unlock during the hold: %v", err)
	}
	pid := pidOf(t, obs, k)
	rows, err := advlock.Inspect(ctx, obs)
	if err != nil {
		t.Fatal(err)
	}
	var mine []advlock.LockInfo
	for _, r := range rows {
		if uint32(r.PID) == pid {
			mine = append(mine, r)
		}
	}
	if len(mine) != 1 || !mine[0].Key.Equal(k) || !mine[0].Lingering {
		t.Errorf("Inspect of the lingering lock's session: %+v, want its key alone, Lingering", mine)
	}
	waitDone(t, lk, 10*time.Second)
	if !errors.Is(lk.Err(), advlock.ErrNotHeld) {
		t.Errorf("Err after the hold: %v, want ErrNotHeld", lk.Err())
	}
	locks, err := pgtest.Locks(ctx, obs)
	if err != nil {
		t.Fatal(err)
	}
	for _, r := range locks {
		if r.PID == pid {
			t.Errorf("once released, the lock's session %d still holds %v (its marker?)", pid, r)
		}
	}
	noIdleLocks(t, h, obs)

	for range 3 {
		lk, err := h.L.TryLock(ctx, Key(t), advlock.HoldAtLeast(time.Hour))
		if err != nil {
			t.Fatal(err)
		}
		pgtest.Terminate(t, obs, pidOf(t, obs, lk.Key()))
		if err := lk.Unlock(ctx); !errors.Is(err, advlock.ErrLockLost) {
			t.Errorf("Unlock during the hold, right after the holder's session was terminated: %v, want ErrLockLost", err)
		}
	}
	noIdleLocks(t, h, obs)
}

func (s *suite) doCancelsOnLoss(t *testing.T) {
	h, obs := s.open(t, advlock.WithKeepalive(s.keepalive())), s.observer(t)
	ctx := ctxT(t, 10*time.Second)
	k := Key(t)
	err := h.L.Do(ctx, k, func(fctx context.Context) error {
		time.Sleep(10 * time.Millisecond)
		pgtest.Terminate(t, obs, pidOf(t, obs, k))
		select {
		case <-fctx.Done():
		case <-time.After(5 * time.Second):
			t.Error("fn's ctx not cancelled after the lock was lost")
		}
		if !errors.Is(context.Cause(fctx), advlock.ErrLockLost) {
			t.Errorf("cause = %v, want ErrLockLost", context.Cause(fctx))
		}
		return fctx.Err()
	})
	// The loss cancelled fn's context: the result is a loss, not the caller's cancellation, and still shows what
	// fn returned.
	if !errors.Is(err, advlock.ErrLockLost) || errors.Is(err, context.Canceled) ||
		!strings.Contains(err.Error(), "fn returned: context canceled") {
		t.Errorf("Do = %v, want ErrLockLost, not context.Canceled, showing fn's error", err)
	}
}

func (s *suite) lostOnNetworkFault(t *testing.T) {
	t.Run("cut", func(t *testing.T) {
		h, p := s.proxied(t, advlock.WithKeepalive(s.keepalive()))
		obs := s.observer(t)
		lk, err := h.L.TryLock(ctxT(t, 10*time.Second), Key(t))
		if err != nil {
			t.Fatal(err)
		}
		time.Sleep(10 * time.Millisecond)
		p.Cut()
		waitDone(t, lk, 5*time.Second)
		if !errors.Is(lk.Err(), advlock.ErrLockLost) {
			t.Errorf("Err = %v, want ErrLockLost", lk.Err())
		}
		waitFree(t, obs, lk.Key())
	})
	t.Run("blackhole", func(t *testing.T) {
		const keepalive = 200 * time.Millisecond
		h, p := s.proxied(t, advlock.WithKeepalive(keepalive))
		obs := s.observer(t)
		lk, err := h.L.TryLock(ctxT(t, 10*time.Second), Key(t))
		if err != nil {
			t.Fatal(err)
		}
		p.Blackhole(true)
		d := waitDone(t, lk, 20*keepalive)
		t.Logf("blackhole noticed after %v (keepalive %v)", d, keepalive)
		if !errors.Is(lk.Err(), advlock.ErrLockLost) || !strings.Contains(lk.Err().Error(), "keepalive: no answer within") {
			t.Errorf("Err = %v, want ErrLockLost from the keepalive (\"keepalive: no answer within\", on both session kinds)", lk.Err())
		}
		p.Close() // the server (or pooler) learns now; until then it still holds the session
		waitFree(t, obs, lk.Key())
	})
	// A try is one round trip: under a context without a deadline it still fails when the network drops
	// everything, within the keepalive interval (at least a second on a session of its own), or
	// session.VerifyBound when taking a connection needs a round trip too (database/sql pings a connection idle
	// for a second), instead of hanging (found by the chaos campaign).
	t.Run("try into a blackhole", func(t *testing.T) {
		const keepalive = 200 * time.Millisecond
		h, p := s.proxied(t, advlock.WithKeepalive(keepalive))
		lk, err := h.L.TryLock(ctxT(t, 10*time.Second), Key(t)) // a verified connection (or shared session) exists
		if err != nil {
			t.Fatal(err)
		}
		if err := lk.Unlock(ctxT(t, 10*time.Second)); err != nil {
			t.Fatal(err)
		}
		p.Blackhole(true)
		done := make(chan error, 1)
		start := time.Now()
		k := Key(t)
		go func() {
			lk, err := h.L.TryLock(context.Background(), k)
			if err == nil {
				lk.Unlock(ctxT(t, time.Second))
			}
			done <- err
		}()
		select {
		case err := <-done:
			if err == nil {
				t.Fatal("TryLock through a blackhole succeeded")
			}
			t.Logf("TryLock failed after %v: %v", time.Since(start).Round(time.Millisecond), err)
		case <-time.After(20*keepalive + session.VerifyBound + 5*time.Second):
			p.Blackhole(false)
			p.Cut()
			<-done
			t.Fatal("TryLock under a context without a deadline hung in a blackhole")
		}
		p.Close()
		waitFree(t, s.observer(t), k) // the session given up on holds nothing once the network lets the close through
	})
}

func (s *suite) databaseDown(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := ln.Addr().String()
	ln.Close() // nothing listens there now
	u, err := url.Parse(s.be.URL)
	if err != nil {
		t.Fatal(err)
	}
	u.Host = addr
	h := s.openURL(t, u.String())
	defer h.L.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
	defer cancel()
	start := time.Now()
	if _, err := h.L.Lock(ctx, Key(t)); err == nil {
		t.Error("Lock on a database that is down succeeded")
	}
	if d := time.Since(start); d > 5*time.Second {
		t.Errorf("Lock on a database that is down took %v with a 2s ctx", d)
	}

	hp, p := s.proxied(t)
	p.Blackhole(true)
	defer func() { p.Cut(); p.Blackhole(false) }() // the pool's close does not wait on the blackhole
	start = time.Now()
	ctx2, cancel2 := context.WithTimeout(context.Background(), 500*time.Millisecond)
	defer cancel2()
	if _, err := hp.L.Lock(ctx2, Key(t)); err == nil {
		t.Error("Lock through a blackhole succeeded")
	}
	if d := time.Since(start); d > 5*time.Second {
		t.Errorf("Lock through a blackhole took %v with a 500ms ctx", d)
	}
}

// blindWatch is a connection whose watcher never reads the socket: Wait only sleeps until its deadline or an
// Interrupt. With it a loss can only be found by the unlock itself, which is the moment before the real watcher
// starts (it starts within 2 ms of the grant), held open for as long as the test needs.
type blindWatch struct {
	session.Conn
	mu   sync.Mutex
	intr chan struct{}
}

func newBlindWatch(c session.Conn) session.Conn {
	return &blindWatch{Conn: c, intr: make(chan struct{})}
}

func (b *blindWatch) Wait(deadline time.Time) error {
	b.mu.Lock()
	intr := b.intr
	b.mu.Unlock()
	t := time.NewTimer(time.Until(deadline))
	defer t.Stop()
	select {
	case <-t.C:
	case <-intr:
	}
	return session.ErrWaitTimeout
}

func (b *blindWatch) Interrupt() {
	b.mu.Lock()
	defer b.mu.Unlock()
	select {
	case <-b.intr:
	default:
		close(b.intr)
	}
}

func (b *blindWatch) ClearDeadline() {
	b.mu.Lock()
	select {
	case <-b.intr:
		b.intr = make(chan struct{})
	default:
	}
	b.mu.Unlock()
	b.Conn.ClearDeadline()
}

// lossIsLoss: a holder whose backend is terminated learns ErrLockLost from Unlock and from Do, every time, whether
// the session died before its watcher started or while it ran; Do's ctx is cancelled with cause ErrLockLost.
func (s *suite) lossIsLoss(t *testing.T) {
	obs := s.observer(t)
	ctx := ctxT(t, 60*time.Second)
	terminate := func(t *testing.T, k advlock.Key) {
		pid := pidOf(t, obs, k)
		pgtest.Terminate(t, obs, pid)
		s.waitClosed(t, obs, pid)
	}
	t.Run("before the watcher", func(t *testing.T) {
		if s.shared {
			t.Skip("a shared session is read from the moment it opens: there is no watcher to start")
		}
		wrap := WithWrap(newBlindWatch)
		h := s.open(t, wrap, advlock.WithKeepalive(time.Hour))
		for i := range 10 {
			lk, err := h.L.TryLock(ctx, Key(t))
			if err != nil {
				t.Fatal(err)
			}
			terminate(t, lk.Key())
			if err := lk.Unlock(ctx); !errors.Is(err, advlock.ErrLockLost) {
				t.Fatalf("iteration %d: Unlock after the holder's backend was terminated: %v, want ErrLockLost", i, err)
			}
			if !errors.Is(lk.Err(), advlock.ErrLockLost) {
				t.Fatalf("iteration %d: Err = %v, want ErrLockLost", i, lk.Err())
			}
			k := Key(t)
			err = h.L.Do(ctx, k, func(context.Context) error {
				terminate(t, k)
				return nil
			})
			if !errors.Is(err, advlock.ErrLockLost) {
				t.Fatalf("iteration %d: Do whose backend was terminated: %v, want ErrLockLost", i, err)
			}
		}
		noIdleLocks(t, h, obs)
	})
	t.Run("racing the watcher", func(t *testing.T) {
		h := s.open(t, advlock.WithKeepalive(s.keepalive()))
		const n = 40
		for i := range n {
			lk, err := h.L.TryLock(ctx, Key(t))
			if err != nil {
				t.Fatal(err)
			}
			time.Sleep(time.Duration(mrand.IntN(3000)) * time.Microsecond) // before, while and after the watcher starts
			pid := pidOf(t, obs, lk.Key())
			pgtest.Terminate(t, obs, pid)
			if i%2 == 0 { // half the time the backend is surely gone before Unlock, half it may still be going
				s.waitClosed(t, obs, pid)
			}
			if err := lk.Unlock(ctx); !errors.Is(err, advlock.ErrLockLost) {
				t.Fatalf("iteration %d: Unlock after the holder's backend was terminated: %v, want ErrLockLost", i, err)
			}
		}
		m := n
		if !s.be.EventDriven {
			m = n / 4 // each loss there waits for a keepalive round trip
		}
		for i := range m {
			k := Key(t)
			delay := time.Duration(mrand.IntN(3000)) * time.Microsecond
			err := h.L.Do(ctx, k, func(fctx context.Context) error {
				time.Sleep(delay)
				pgtest.Terminate(t, obs, pidOf(t, obs, k))
				select {
				case <-fctx.Done():
				case <-time.After(10 * time.Second):
					t.Errorf("iteration %d: fn's ctx not cancelled after the lock was lost", i)
				}
				if !errors.Is(context.Cause(fctx), advlock.ErrLockLost) {
					t.Errorf("iteration %d: fn's ctx cause = %v, want ErrLockLost", i, context.Cause(fctx))
				}
				return nil
			})
			if !errors.Is(err, advlock.ErrLockLost) {
				t.Fatalf("iteration %d: Do whose backend was terminated: %v, want ErrLockLost", i, err)
			}
		}
		noIdleLocks(t, h, obs)
	})
}
