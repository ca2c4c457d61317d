package conformance

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/advlock/advlock"
	"github.com/advlock/advlock/internal/session"
	"github.com/advlock/advlock/internal/testkit/pgtest"
	"github.com/jackc/pgx/v5"
)

// Close aborts Lock calls that wait, in the server or in-process, with ErrClosed, and leaves nothing held.
func (s *suite) closeAbortsWaiters(t *testing.T) {
	holder, obs := s.open(t), s.observer(t)
	ctx := ctxT(t, 20*time.Second)
	k := Key(t)
	hl, err := holder.L.TryLock(ctx, k)
	if err != nil {
		t.Fatal(err)
	}
	h := s.openURL(t, s.be.URL)
	errc := make(chan error, 2)
	go func() { _, err := h.L.Lock(ctx, k); errc <- err }() // waits in the server
	waitQueued(t, obs, k)
	go func() { _, err := h.L.Lock(ctx, k); errc <- err }() // waits in-process
	time.Sleep(50 * time.Millisecond)
	h.L.Close()
	for range 2 {
		select {
		case err := <-errc:
			if !errors.Is(err, advlock.ErrClosed) {
				t.Errorf("waiting Lock after Close: %v, want ErrClosed", err)
			}
		case <-time.After(10 * time.Second):
			t.Fatal("a waiting Lock did not return after Close")
		}
	}
	if err := hl.Unlock(ctx); err != nil {
		t.Fatal(err)
	}
	waitFree(t, obs, k)
	noIdleLocks(t, h, obs)
}

// closeWhileAcquiring: Close returns promptly while a Lock waits for a connection from an exhausted pool, and that
// Lock fails with ErrClosed, named once.
func (s *suite) closeWhileAcquiring(t *testing.T) {
	h := s.openURL(t, s.be.URL)
	obs := s.observer(t)
	giveBack := h.Exhaust(t)
	defer giveBack()
	errc := make(chan error, 2)
	go func() { _, err := h.L.Lock(context.Background(), Key(t)); errc <- err }()
	go func() { _, err := h.L.RLock(context.Background(), Key(t)); errc <- err }()
	// (A try does not wait for a connection at all: NoPoolSurprises.)
	time.Sleep(100 * time.Millisecond)
	closed := make(chan struct{})
	go func() { h.L.Close(); close(closed) }()
	pgtest.WaitClosed(t, closed, 5*time.Second, "Close with calls waiting for a pool connection returned")
	for range 2 {
		select {
		case err := <-errc:
			if !errors.Is(err, advlock.ErrClosed) {
				t.Errorf("a call waiting for a connection, after Close: %v, want ErrClosed", err)
			} else if n := strings.Count(err.Error(), "closed"); n != 1 {
				t.Errorf("error %q names the close %d times, want once", err, n)
			}
		case <-time.After(5 * time.Second):
			t.Fatal("a call waiting for a connection did not return after Close")
		}
	}
	giveBack()
	noIdleLocks(t, h, obs)
	t.Run("check apart", func(t *testing.T) { s.closeWhileChecking(t, obs) })
}

// closeWhileChecking: a new connection whose check goes on after its call returned (the call's bound passed) is
// ended by Close, which returns promptly and only once that check has ended.
func (s *suite) closeWhileChecking(t *testing.T, obs *pgx.Conn) {
	var entered, returned atomic.Int32
	var ended atomic.Pointer[error] // what ended the first hanging check
	h := s.openURL(t, s.be.URL, WithWrap(func(c session.Conn) session.Conn {
		return &stuckCheck{Conn: c, entered: &entered, returned: &returned, ended: &ended}
	}))
	t.Cleanup(h.L.Close)
	// A new connection is made for up to a second past its call's bound; on a loaded machine making one can take
	// longer (both drivers' suites once saw no check begin within 10 s of one call), and the next call makes another.
	for try := 1; entered.Load() == 0; try++ {
		start := time.Now()
		if _, err := h.L.Lock(context.Background(), Key(t), advlock.Wait(100*time.Millisecond)); !errors.Is(err, advlock.ErrNotAcquired) {
			t.Fatalf("Lock with Wait(100ms) while every new connection's check hangs: %v, want ErrNotAcquired", err)
		}
		if took := time.Since(start); took > 3*time.Second {
			t.Errorf("Lock with Wait(100ms) while every new connection's check hangs returned after %v", took)
		}
		for deadline := time.Now().Add(3 * time.Second); entered.Load() == 0 && time.Now().Before(deadline); {
			time.Sleep(time.Millisecond)
		}
		if entered.Load() == 0 && try == 5 {
			t.Fatal("no connection's check began, after 5 calls")
		}
	}
	closed := make(chan struct{})
	go func() { h.L.Close(); close(closed) }()
	pgtest.WaitClosed(t, closed, 5*time.Second, "Close with a new connection's check hanging after its call returned")
	if e, r := entered.Load(), returned.Load(); e != r {
		t.Errorf("Close returned with %d of %d hanging checks still running", e-r, e)
	}
	// (With shared sessions the check that hangs is the shared session's open, which Close stops as it is.)
	if cause := ended.Load(); !s.shared && (cause == nil || !errors.Is(*cause, advlock.ErrClosed)) {
		what := "nothing"
		if cause != nil {
			what = fmt.Sprint(*cause)
		}
		t.Errorf("a hanging check was ended by %s, want Close (ErrClosed)", what)
	}
	noIdleLocks(t, h, obs)
}

// stuckCheck leaves a connection's first query, advlock's check of it, unanswered until its ctx ends.
type stuckCheck struct {
	session.Conn
	checked           bool
	entered, returned *atomic.Int32
	ended             *atomic.Pointer[error]
}

func (c *stuckCheck) QueryInt(ctx context.Context, sql string, args ...any) (int64, error) {
	if c.checked {
		return c.Conn.QueryInt(ctx, sql, args...)
	}
	c.checked = true
	c.entered.Add(1)
	defer c.returned.Add(1)
	<-ctx.Done()
	cause := context.Cause(ctx)
	c.ended.CompareAndSwap(nil, &cause)
	return 0, ctx.Err()
}

// unlockRacingClose: Unlock concurrent with Close returns nil (it won) or ErrClosed (Close released the lock),
// never ErrNotHeld, and the key ends up free.
func (s *suite) unlockRacingClose(t *testing.T) {
	obs := s.observer(t)
	ctx := ctxT(t, 60*time.Second)
	for i := range 30 {
		t.Run("", func(t *testing.T) { // its pool closes at the end of each
			h := s.openURL(t, s.be.URL)
			lk, err := h.L.TryLock(ctx, Key(t))
			if err != nil {
				t.Fatal(err)
			}
			var wg sync.WaitGroup
			wg.Add(2)
			var uerr error
			go func() { defer wg.Done(); uerr = lk.Unlock(ctx) }()
			go func() { defer wg.Done(); h.L.Close() }()
			wg.Wait()
			if uerr != nil && !errors.Is(uerr, advlock.ErrClosed) {
				t.Fatalf("iteration %d: Unlock racing Close: %v, want nil or ErrClosed", i, uerr)
			}
			waitFree(t, obs, lk.Key())
			noIdleLocks(t, h, obs)
		})
	}
}
