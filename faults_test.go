package advlock

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"net"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/advlock/advlock/internal/faults"
	"github.com/advlock/advlock/internal/pgtest"
	"github.com/advlock/advlock/internal/session"
	"github.com/jackc/pgx/v5/pgxpool"
)

// proxied returns a bundle whose pool reaches the server through a fault-injecting proxy.
func proxied(t *testing.T, opts ...Option) (*bundle, *faults.Proxy) {
	t.Helper()
	url := pgtest.URL(t)
	cfg, err := pgxpool.ParseConfig(url)
	if err != nil {
		t.Fatal(err)
	}
	p := faults.Start(t, net.JoinHostPort(cfg.ConnConfig.Host, fmt.Sprint(cfg.ConnConfig.Port)))
	pool := pgtest.Pool(t, url, func(c *pgxpool.Config) {
		c.ConnConfig.Host = "127.0.0.1"
		c.ConnConfig.Port = uint16(p.Port())
		c.ConnConfig.ConnectTimeout = 2 * time.Second
	})
	l := New(pool, opts...)
	t.Cleanup(l.Close)
	return &bundle{url: url, pool: pool, l: l, obs: pgtest.Conn(t, url)}, p
}

// wrongUnlock makes the unlock statement release a different key, so the server really answers false.
type wrongUnlock struct{ session.Conn }

func (w wrongUnlock) QueryInt(ctx context.Context, sql string, args ...any) (int64, error) {
	if strings.Contains(sql, "unlock") {
		args = []any{int64(-42)}
	}
	return w.Conn.QueryInt(ctx, sql, args...)
}

// Release is exact: only a confirmed unlock pools the session. False, a cancelled ctx or a timeout destroy it,
// Unlock says so, and the server drops the lock.
func TestReleaseExact(t *testing.T) {
	t.Run("unlock returns false", func(t *testing.T) {
		b := setup(t, func(o *options) { o.wrap = func(c session.Conn) session.Conn { return wrongUnlock{c} } })
		ctx := ctxT(t, 10*time.Second)
		lk, err := b.l.TryLock(ctx, key(t))
		if err != nil {
			t.Fatal(err)
		}
		pid := b.pidOf(t, lk)
		err = lk.Unlock(ctx)
		if !errors.Is(err, ErrLockLost) || !strings.Contains(err.Error(), "session closed") {
			t.Errorf("Unlock when the server says false: %v, want ErrLockLost saying the session was closed", err)
		}
		b.waitGone(t, pid)
		b.waitFree(t, lk.Key())
		pgtest.NoIdleLocks(t, b.pool, b.obs)
	})
	t.Run("cancelled ctx", func(t *testing.T) {
		b := setup(t)
		lk, err := b.l.TryLock(ctxT(t, 10*time.Second), key(t))
		if err != nil {
			t.Fatal(err)
		}
		pid := b.pidOf(t, lk)
		ctx, cancel := context.WithCancel(context.Background())
		cancel()
		err = lk.Unlock(ctx)
		if !errors.Is(err, ErrUnlockFailed) || !errors.Is(err, context.Canceled) {
			t.Errorf("Unlock with a cancelled ctx: %v, want ErrUnlockFailed and context.Canceled", err)
		}
		b.waitGone(t, pid)
		b.waitFree(t, lk.Key())
		pgtest.NoIdleLocks(t, b.pool, b.obs)
	})
	t.Run("timeout", func(t *testing.T) {
		b, p := proxied(t)
		lk, err := b.l.TryLock(ctxT(t, 10*time.Second), key(t))
		if err != nil {
			t.Fatal(err)
		}
		pid := b.pidOf(t, lk)
		p.Latency(300 * time.Millisecond)
		ctx, cancel := context.WithTimeout(context.Background(), 50*time.Millisecond)
		defer cancel()
		err = lk.Unlock(ctx)
		p.Latency(0)
		if !errors.Is(err, ErrUnlockFailed) || !errors.Is(err, context.DeadlineExceeded) {
			t.Errorf("Unlock that timed out: %v, want ErrUnlockFailed and DeadlineExceeded", err)
		}
		b.waitGone(t, pid)
		b.waitFree(t, lk.Key())
		pgtest.NoIdleLocks(t, b.pool, b.obs)
	})
}

// The grant can race the cancel: the server grants the lock, then reports the cancel. Whatever Lock returns, no
// session may hold the key afterwards unless Lock returned it, and no idle pooled session may hold anything.
func TestCancelRace(t *testing.T) {
	iterations := 1000
	if testing.Short() {
		iterations = 100
	}
	b := setup(t)
	holder := New(pgtest.Pool(t, b.url, nil))
	defer holder.Close()
	bg := context.Background()
	var won, cancelled int
	for i := range iterations {
		k := key(t)
		h, err := holder.TryLock(bg, k)
		if err != nil {
			t.Fatal(err)
		}
		ctx, cancel := context.WithCancel(bg)
		res := make(chan error, 1)
		var lk *Lock
		go func() {
			var err error
			lk, err = b.l.Lock(ctx, k)
			res <- err
		}()
		// Let the waiter reach the server most of the time, then race release against cancel.
		time.Sleep(time.Duration(rand.IntN(1500)) * time.Microsecond)
		var wg sync.WaitGroup
		wg.Add(2)
		go func() {
			defer wg.Done()
			if err := h.Unlock(bg); err != nil {
				t.Error(err)
			}
		}()
		go func() {
			defer wg.Done()
			time.Sleep(time.Duration(rand.IntN(300)) * time.Microsecond)
			cancel()
		}()
		wg.Wait()
		err = <-res
		if err == nil {
			won++
			// No false success: the server says this Locker's session holds it.
			if pids := b.holders(t, k); len(pids) != 1 {
				t.Fatalf("iteration %d: Lock succeeded but pg_locks shows holders %v", i, pids)
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
		b.waitFree(t, k) // no leak: whoever was granted, the key is free again
	}
	pgtest.NoIdleLocks(t, b.pool, b.obs)
	t.Logf("%d iterations: %d granted, %d cancelled", iterations, won, cancelled)
	if won == 0 || cancelled == 0 {
		t.Errorf("the race was never exercised both ways (granted %d, cancelled %d)", won, cancelled)
	}
}

// A terminated backend is noticed from the FATAL the server sends, not from a keepalive (set to a minute here).
func TestLostOnTerminate(t *testing.T) {
	b := setup(t, WithKeepalive(time.Minute))
	ctx := ctxT(t, 10*time.Second)
	lk, err := b.l.TryLock(ctx, key(t))
	if err != nil {
		t.Fatal(err)
	}
	if lk.Err() != nil {
		t.Fatalf("Err while held: %v", lk.Err())
	}
	pgtest.Terminate(t, b.obs, b.pidOf(t, lk))
	d := waitDone(t, lk, 5*time.Second)
	t.Logf("loss noticed %v after pg_terminate_backend returned", d)
	if !errors.Is(lk.Err(), ErrLockLost) || errCode(lk.Err()) != "57P01" {
		t.Errorf("Err = %v, want ErrLockLost wrapping SQLSTATE 57P01", lk.Err())
	}
	if err := lk.Unlock(ctx); !errors.Is(err, ErrLockLost) {
		t.Errorf("Unlock of a lost lock: %v, want ErrLockLost", err)
	}
	if err := lk.Unlock(ctx); !errors.Is(err, ErrNotHeld) {
		t.Errorf("second Unlock of a lost lock: %v, want ErrNotHeld", err)
	}
	// The key can be taken again.
	again, err := b.l.TryLock(ctx, lk.Key())
	if err != nil {
		t.Fatal(err)
	}
	if err := again.Unlock(ctx); err != nil {
		t.Fatal(err)
	}
	pgtest.NoIdleLocks(t, b.pool, b.obs)
}

// Do cancels fn's context when the lock is lost, and reports ErrLockLost.
func TestDoCancelsOnLoss(t *testing.T) {
	b := setup(t, WithKeepalive(time.Minute))
	ctx := ctxT(t, 10*time.Second)
	k := key(t)
	err := b.l.Do(ctx, k, func(fctx context.Context) error {
		pgtest.Terminate(t, b.obs, b.holders(t, k)[0])
		select {
		case <-fctx.Done():
		case <-time.After(5 * time.Second):
			t.Error("fn's ctx not cancelled after the lock was lost")
		}
		if !errors.Is(context.Cause(fctx), ErrLockLost) {
			t.Errorf("cause = %v, want ErrLockLost", context.Cause(fctx))
		}
		return fctx.Err()
	})
	if !errors.Is(err, ErrLockLost) || !errors.Is(err, context.Canceled) {
		t.Errorf("Do = %v, want ErrLockLost joined with fn's context.Canceled", err)
	}
}

// A connection reset is noticed at once; a silent blackhole within about twice the keepalive interval.
func TestLostOnNetworkFault(t *testing.T) {
	t.Run("cut", func(t *testing.T) {
		b, p := proxied(t, WithKeepalive(time.Minute))
		lk, err := b.l.TryLock(ctxT(t, 10*time.Second), key(t))
		if err != nil {
			t.Fatal(err)
		}
		p.Cut()
		waitDone(t, lk, 5*time.Second)
		if !errors.Is(lk.Err(), ErrLockLost) {
			t.Errorf("Err = %v, want ErrLockLost", lk.Err())
		}
		b.waitFree(t, lk.Key())
	})
	t.Run("blackhole", func(t *testing.T) {
		const keepalive = 200 * time.Millisecond
		b, p := proxied(t, WithKeepalive(keepalive))
		lk, err := b.l.TryLock(ctxT(t, 10*time.Second), key(t))
		if err != nil {
			t.Fatal(err)
		}
		pid := b.pidOf(t, lk)
		p.Blackhole(true)
		d := waitDone(t, lk, 20*keepalive)
		t.Logf("blackhole noticed after %v (keepalive %v)", d, keepalive)
		if !errors.Is(lk.Err(), ErrLockLost) || !strings.Contains(lk.Err().Error(), "keepalive") {
			t.Errorf("Err = %v, want ErrLockLost from the keepalive", lk.Err())
		}
		// The server still believes in the session until it notices; the proxy going away is that moment here.
		p.Close()
		b.waitGone(t, pid)
	})
}

// A database that is down or unreachable fails within the caller's ctx, with no hang.
func TestDatabaseDown(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	port := ln.Addr().(*net.TCPAddr).Port
	ln.Close() // nothing listens there now
	down := fmt.Sprintf("postgres://postgres@127.0.0.1:%d/test?sslmode=disable&connect_timeout=30", port)

	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
	defer cancel()
	if l, err := Open(ctx, down); err == nil {
		l.Close()
		t.Error("Open of a database that is down succeeded")
	}
	pool, err := pgxpool.New(context.Background(), down)
	if err != nil {
		t.Fatal(err)
	}
	defer pool.Close()
	l := New(pool)
	defer l.Close()
	if _, err := l.Lock(ctx, key(t)); err == nil {
		t.Error("Lock on a database that is down succeeded")
	}

	// Unreachable without an answer: the proxy swallows everything.
	b, p := proxied(t)
	p.Blackhole(true)
	b.pool.Reset()
	start := time.Now()
	ctx2, cancel2 := context.WithTimeout(context.Background(), 500*time.Millisecond)
	defer cancel2()
	_, err = b.l.Lock(ctx2, key(t))
	if !errors.Is(err, context.DeadlineExceeded) {
		t.Errorf("Lock through a blackhole: %v, want DeadlineExceeded", err)
	}
	if d := time.Since(start); d > 5*time.Second {
		t.Errorf("Lock through a blackhole took %v with a 500ms ctx", d)
	}
}
