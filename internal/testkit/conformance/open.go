package conformance

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/advlock/advlock"
	"github.com/advlock/advlock/internal/config"
	"github.com/advlock/advlock/internal/session"
	"github.com/advlock/advlock/internal/testkit/pgtest"
)

// withOpenBound shortens the bound on opening a shared session (VerifyBound, 10 s, by default).
func withOpenBound(d time.Duration) advlock.Option {
	return option(func(o *config.Options) { o.OpenBound = d })
}

// sharedOpenBounded: opening a shared session is bounded whatever the caller's ctx says, and Close ends an open in
// progress. A try whose shared session was lost to a network that drops everything, and whose replacement must be
// opened through it (on a pooled connection idle long enough to be pinged first), fails within the bound under a
// context without a deadline; it hung before. Close, while a try and a Lock wait for a shared session being
// opened into a blackhole, returns within about a second, and both calls fail with ErrClosed.
func (s *suite) sharedOpenBounded(t *testing.T) {
	if !s.shared {
		t.Skip("a session per lock opens no shared session")
	}
	t.Run("try", func(t *testing.T) {
		const bound = time.Second
		h, p := s.proxied(t, withOpenBound(bound), advlock.WithKeepalive(200*time.Millisecond))
		holder := s.open(t)
		ctx := ctxT(t, 30*time.Second)
		lk, err := h.L.TryLock(ctx, Key(t)) // the shared session
		if err != nil {
			t.Fatal(err)
		}
		if err := lk.Unlock(ctx); err != nil {
			t.Fatal(err)
		}
		k := Key(t)
		hl, err := holder.L.TryLock(ctx, k)
		if err != nil {
			t.Fatal(err)
		}
		// A timed wait on a session of its own, which then goes back to the pool: an idle pooled connection.
		if _, err := h.L.Lock(ctx, k, advlock.Wait(50*time.Millisecond)); !errors.Is(err, advlock.ErrNotAcquired) {
			t.Fatalf("Lock with Wait(50ms) on a held key: %v", err)
		}
		if err := hl.Unlock(ctx); err != nil {
			t.Fatal(err)
		}
		p.Blackhole(true)
		for deadline := time.Now().Add(5 * time.Second); h.L.Stats().SharedSessions > 0; time.Sleep(10 * time.Millisecond) {
			if time.Now().After(deadline) {
				t.Fatal("the shared session was not found lost in the blackhole")
			}
		}
		time.Sleep(1200 * time.Millisecond) // the idle connection is now pinged before it is handed out
		start := time.Now()
		done := make(chan error, 1)
		go func() {
			lk, err := h.L.TryLock(context.Background(), Key(t))
			if err == nil {
				_ = lk.Unlock(ctxT(t, time.Second))
			}
			done <- err
		}()
		select {
		case err := <-done:
			took := time.Since(start)
			t.Logf("TryLock failed after %v: %v", took.Round(time.Millisecond), err)
			if err == nil {
				t.Error("TryLock through a blackhole succeeded")
			}
			if took > bound+3*time.Second {
				t.Errorf("TryLock took %v, bound %v", took, bound)
			}
		case <-time.After(bound + 10*time.Second):
			p.Blackhole(false)
			p.Cut()
			<-done
			t.Fatal("TryLock under a context without a deadline hung opening a shared session in a blackhole")
		}
		p.Cut() // the pool's connections end now, not after a close that waits on the blackhole
		p.Blackhole(false)
	})
	t.Run("close", func(t *testing.T) {
		// Every statement of the open goes unanswered (as into a network that drops everything), after the
		// connection was had: the checks of the new connection wait for their context.
		h := s.openURL(t, s.be.URL, WithWrap(func(c session.Conn) session.Conn { return unanswered{c} }))
		t.Cleanup(h.L.Close)
		errc := make(chan error, 3)
		go func() { _, err := h.L.TryLock(context.Background(), Key(t)); errc <- err }()
		go func() { _, err := h.L.Lock(context.Background(), Key(t)); errc <- err }()
		go func() { _, err := h.L.TryRLock(context.Background(), Key(t)); errc <- err }()
		time.Sleep(300 * time.Millisecond) // all three wait for the shared session being opened
		start := time.Now()
		closed := make(chan struct{})
		go func() { h.L.Close(); close(closed) }()
		pgtest.WaitClosed(t, closed, 3*time.Second, "Close during the open of a shared session returned")
		for range 3 {
			select {
			case err := <-errc:
				if !errors.Is(err, advlock.ErrClosed) {
					t.Errorf("a call waiting for a shared session to open, after Close: %v, want ErrClosed", err)
				}
			case <-time.After(3 * time.Second):
				t.Fatal("a call waiting for a shared session to open did not return after Close")
			}
		}
		t.Logf("Close and the waiting calls returned %v after Close was called", time.Since(start).Round(time.Millisecond))
	})
}

// unanswered is a connection whose statements are never answered: each waits for its context to end.
type unanswered struct{ session.Conn }

func (u unanswered) QueryInt(ctx context.Context, _ string, _ ...any) (int64, error) {
	<-ctx.Done()
	return 0, ctx.Err()
}

// unlockBound: on a shared session an Unlock goes out whatever its ctx says and is answered within twice the
// round-trip bound (min(WithKeepalive, WithReleaseTimeout)) or the session is closed: queued behind a round trip
// already on the wire, it waits for that one (up to one bound), then for its own (up to one more). Over a link
// with 120 ms each way and a 300 ms bound, an Unlock queued behind a try takes more than one bound and returns nil;
// when the network drops everything once the try is answered, it returns ErrLockLost, within two bounds.
func (s *suite) unlockBound(t *testing.T) {
	if !s.shared {
		t.Skip("a session of its own unlocks under its ctx (ReleaseExact)")
	}
	const bound = 300 * time.Millisecond
	for _, drop := range []bool{false, true} {
		h, p := s.proxied(t, advlock.WithKeepalive(bound))
		ctx := ctxT(t, 30*time.Second)
		lk, err := h.L.TryLock(ctx, Key(t))
		if err != nil {
			t.Fatal(err)
		}
		p.Latency(120 * time.Millisecond)
		tried := make(chan error, 1)
		go func() {
			lk, err := h.L.TryLock(ctx, Key(t)) // the round trip on the wire
			if drop {
				p.Blackhole(true) // the unlock's round trip, sent as the try's answer is read, is dropped
			}
			if err == nil {
				go func() { _ = lk.Unlock(ctx) }()
			}
			tried <- err
		}()
		time.Sleep(30 * time.Millisecond)
		start := time.Now()
		err = lk.Unlock(context.Background())
		took := time.Since(start)
		if terr := <-tried; terr != nil {
			t.Fatalf("the try on the wire: %v", terr)
		}
		t.Logf("drop %v: Unlock returned %v after %v (bound %v): %v", drop, err != nil, took.Round(time.Millisecond), bound, err)
		switch {
		case !drop && err != nil:
			t.Errorf("Unlock over a slow link: %v, want nil", err)
		case !drop && took <= bound:
			t.Errorf("Unlock queued behind a round trip took %v, expected more than one bound (%v) here", took, bound)
		case drop && !errors.Is(err, advlock.ErrLockLost):
			t.Errorf("Unlock whose round trip is dropped: %v, want ErrLockLost", err)
		}
		if took > 2*bound+time.Second {
			t.Errorf("Unlock took %v, more than twice the bound (%v)", took, bound)
		}
		p.Blackhole(false)
		p.Latency(0)
	}
}

// cancelLeavesQueue: when a Lock whose ctx was cancelled while it waited in the server returns, its waiter has
// left the server's queue, on every driver: pg_locks, read at once, shows no waiter for the key, and none comes
// back later to be granted the key (a process that exits right after leaves nothing behind). With lib/pq the call
// returned before the driver's own cancel reached the server.
func (s *suite) cancelLeavesQueue(t *testing.T) {
	if s.be.Pooled && s.be.EventDriven {
		// pgx through PgBouncer: a cancel request would have to go through the pooler (which 1.18 to 1.20 can crash
		// on), and a pg_cancel_backend from another client can reach a later client's statement once PgBouncer has
		// handed the server session on. PgBouncer closes the server connection of the client closed mid-statement,
		// and its backend waits on until granted or its slice ends, then exits, which releases the key. lib/pq
		// sends its cancel through the pooler itself.
		t.Skip("through a pooler with pgx, the waiter stays queued until granted or its slice ends, then its backend exits")
	}
	holder, h, obs := s.open(t), s.open(t), s.observer(t)
	ctx := ctxT(t, 60*time.Second)
	k := Key(t)
	v, _ := k.Int64()
	hl, err := holder.L.TryLock(ctx, k)
	if err != nil {
		t.Fatal(err)
	}
	waiting := func() []pgtest.Row {
		t.Helper()
		rows, err := pgtest.Locks(context.Background(), obs)
		if err != nil {
			t.Fatal(err)
		}
		var out []pgtest.Row
		for _, r := range rows {
			if r.Int64Key(v) && !r.Granted {
				out = append(out, r)
			}
		}
		return out
	}
	for i := range 10 {
		cctx, cancel := context.WithCancel(context.Background())
		res := make(chan error, 1)
		go func() { _, err := h.L.Lock(cctx, k); res <- err }()
		waitQueued(t, obs, k)
		cancel()
		if err := <-res; !errors.Is(err, context.Canceled) {
			t.Fatalf("iteration %d: Lock whose ctx was cancelled: %v", i, err)
		}
		if w := waiting(); len(w) != 0 {
			t.Fatalf("iteration %d: the cancelled Lock has returned, but pg_locks still shows its waiter: %v", i, w)
		}
	}
	time.Sleep(200 * time.Millisecond)
	if w := waiting(); len(w) != 0 {
		t.Errorf("a cancelled waiter came back: %v", w)
	}
	if err := hl.Unlock(ctx); err != nil {
		t.Fatal(err)
	}
	waitFree(t, obs, k)
}
