package conformance

import (
	"context"
	"errors"
	"fmt"
	mrand "math/rand/v2"
	"net/url"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/advlock/advlock"
	"github.com/advlock/advlock/internal/session"
	"github.com/advlock/advlock/internal/testkit/faults"
	"github.com/advlock/advlock/internal/testkit/pgtest"
	"github.com/jackc/pgx/v5"
)

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

// timedWaitsKeepSessions: a Lock whose bound passes while the key is held elsewhere, a ctx deadline or a Wait(d),
// is ended by the server (lock_timeout), so its session goes back to the pool: 30 such calls use at most 3 server
// sessions, each returns soon after its bound (an error matching context.DeadlineExceeded for a ctx deadline,
// ErrNotAcquired for Wait), and nothing is left waiting or held.
func (s *suite) timedWaitsKeepSessions(t *testing.T) {
	for _, bound := range []string{"deadline", "wait"} {
		t.Run(bound, func(t *testing.T) { s.timedWaitsKeepSessions1(t, bound == "wait", false) })
	}
	if s.shared { // the sessions of their own are made as in the other mode; the shared session's open is not
		t.Run("slow setup", func(t *testing.T) { s.timedWaitsKeepSessions1(t, true, true) })
	} else {
		t.Run("checked connections", s.checkedConnections)
	}
}

// checkedConnections: the check of a new connection behind a pooler takes a second connection from the pool (see
// session.verify) and leaves it checked too, so that the next call uses it as it is, with no third connection
// made to check it. Two locks held at once make 2 connections on every backend; left unchecked, the second
// connection made a third behind a pooler, and with database/sql's default of 2 idle connections one of the
// three was closed when given back, so that under load every other call made a connection.
func (s *suite) checkedConnections(t *testing.T) {
	url, p := s.proxyURL(t)
	h := s.openURL(t, url)
	t.Cleanup(h.L.Close)
	ctx := ctxT(t, 20*time.Second)
	for i := range 2 {
		lk, err := h.L.TryLock(ctx, Key(t))
		if err != nil {
			t.Fatal(err)
		}
		defer func() {
			if err := lk.Unlock(ctx); err != nil {
				t.Error(err)
			}
		}()
		if n := p.Dials(); n > 2 {
			t.Errorf("after lock %d of 2 held at once: %d connections made, want at most 2", i+1, n)
		}
	}
}

// timedWaitsKeepSessions1 makes 30 waits of 100 ms for a held key, bounded by Wait or by ctx, and checks that they
// use 1 to 3 server sessions. With slow, every new connection takes 150 ms to make (the server's first answer is
// late) and 120 ms more to check (advlock's first round trip on it): the first calls end before any of their
// connections is ready, and the connections they began must still serve the later calls (made once, not once per
// call). The count of those first calls is the machine's: what is bounded is the connections made by the calls
// that waited in the server (none).
func (s *suite) timedWaitsKeepSessions1(t *testing.T, waitOpt, slow bool) {
	holder, obs := s.open(t), s.observer(t)
	var h Harness
	var p *faults.Proxy
	if slow {
		var url string
		url, p = s.proxyURL(t)
		p.SetupLatency(150 * time.Millisecond)
		var seen sync.Map // the connections already checked once, by client pid
		h = s.openURL(t, url, WithWrap(func(c session.Conn) session.Conn { return &slowCheck{Conn: c, seen: &seen} }))
		t.Cleanup(h.L.Close)
	} else {
		h = s.open(t)
	}
	k := Key(t)
	hl, err := holder.L.TryLock(ctxT(t, 10*time.Second), k)
	if err != nil {
		t.Fatal(err)
	}
	v, _ := k.Int64()
	pids := map[uint32]bool{}
	var calls []string // each call's time and error, for a failure's message
	waited := 0        // calls seen waiting in the server
	// 30 calls; with slow, on until 10 have waited in the server (at most 100 calls): on a loaded machine a
	// connection may take far longer than 270 ms to be ready, and the calls before that cannot wait in the server.
	for i := 0; i < 30 || slow && waited < 10 && i < 100; i++ {
		ctx, cancel := context.WithTimeout(context.Background(), 100*time.Millisecond)
		var opts []advlock.CallOption
		if waitOpt { // the bound is Wait's
			opts = []advlock.CallOption{advlock.Wait(100 * time.Millisecond)}
		}
		done, stop := make(chan struct{}), make(chan struct{})
		seen := false
		go func() { // the waiter's server pid, from pg_locks, while the call runs
			defer close(done)
			for {
				select {
				case <-stop:
					return
				default:
				}
				// This key's rows alone: on a loaded machine, with other tests' thousands of locks in pg_locks, a
				// read of the whole table could take the call's 100 ms, and see none of its wait.
				rows, err := obs.Query(context.Background(), `SELECT pid FROM pg_locks WHERE locktype = 'advisory'
					AND NOT granted AND objsubid = 1 AND classid::text::int8 = $1 AND objid::text::int8 = $2`,
					int64(uint64(v)>>32), int64(uint32(v)))
				if err != nil {
					t.Error(err)
					return
				}
				got, err := pgx.CollectRows(rows, pgx.RowTo[int32])
				if err != nil {
					t.Error(err)
					return
				}
				for _, pid := range got {
					pids[uint32(pid)] = true
					seen = true
				}
				time.Sleep(2 * time.Millisecond)
			}
		}()
		start := time.Now()
		lctx := ctx
		if waitOpt {
			lctx = context.Background()
		}
		_, err := h.L.Lock(lctx, k, opts...)
		took := time.Since(start)
		cancel()
		close(stop)
		<-done
		calls = append(calls, fmt.Sprintf("%d: %v waited in the server: %v; %v", i, took.Round(time.Millisecond), seen, err))
		if seen {
			waited++
		}
		switch {
		case waitOpt && (!errors.Is(err, advlock.ErrNotAcquired) || errors.Is(err, context.DeadlineExceeded)):
			t.Fatalf("call %d: Lock with Wait(100ms) on a held key: %v, want ErrNotAcquired", i, err)
		case !waitOpt && !errors.Is(err, context.DeadlineExceeded):
			t.Fatalf("call %d: Lock with a 100ms deadline on a held key: %v, want DeadlineExceeded", i, err)
		}
		if took > 3*time.Second {
			t.Errorf("call %d returned %v after it began (deadline 100ms)", i, took)
		}
	}
	n := len(calls) // calls made
	switch {
	case len(pids) == 0 || len(pids) > 3 && !slow:
		t.Errorf("%d timed-out waits used %d server sessions %v, want 1 to 3; the calls:\n%s", n, len(pids), pids,
			strings.Join(calls, "\n"))
	case slow && (waited < 10 || p.Dials() > n-waited+2):
		// Each call that ends before a connection is ready begins one (about 3 in 270 ms, more on a loaded
		// machine), and cannot wait in the server: no connection is ready within its 100 ms. A call that waited
		// there took a connection an earlier call began. So the connections made are at most the calls that did not
		// wait, and the shared session's, and one more as slack (an open tried again on a loaded machine); made once
		// per call, none would be ready for a call.
		t.Errorf("with each connection taking 270 ms to make and check, %d of %d calls of 100 ms waited in the server "+
			"(want 10 or more) and %d connections were made (want at most %d); the calls:\n%s", waited, n, p.Dials(),
			n-waited+2, strings.Join(calls, "\n"))
	}
	if n := h.L.Stats().SharedSessions; slow && n != 1 {
		// The first calls waited for the shared session's open, one after another: one open serves them all.
		t.Errorf("%d shared sessions open after calls one at a time, want 1", n)
	}
	t.Logf("%d timed-out waits used %d server session(s); %d of them waited in the server", n, len(pids), waited)
	if slow {
		t.Logf("%d connections were made", p.Dials())
	}
	if err := hl.Unlock(ctxT(t, 10*time.Second)); err != nil {
		t.Fatal(err)
	}
	waitFree(t, obs, k)
	noIdleLocks(t, h, obs)
}

// slowCheck answers a new connection's first query, advlock's check of it, 120 ms late. A connection is wrapped
// anew each time it is taken from the pool: it is known by its client pid (with none, every taking counts as new).
type slowCheck struct {
	session.Conn
	seen    *sync.Map
	checked bool
}

func (c *slowCheck) QueryInt(ctx context.Context, sql string, args ...any) (int64, error) {
	if !c.checked {
		c.checked = true
		if pid := c.Conn.ClientPID(); pid == 0 {
			time.Sleep(120 * time.Millisecond)
		} else if _, old := c.seen.LoadOrStore(pid, true); !old {
			time.Sleep(120 * time.Millisecond)
		}
	}
	return c.Conn.QueryInt(ctx, sql, args...)
}

// waitBound: Wait(d) bounds a wait apart from ctx (ErrNotAcquired when d elapses, ctx errors when ctx ends first,
// Wait(0) tries once), Do's fn is not cut when d elapses, TryDo never waits, in-process contention says so, and
// Do reports fn's error and the unlock's on one line.
func (s *suite) waitBound(t *testing.T) {
	holder, h, obs := s.open(t), s.open(t), s.observer(t)
	ctx := ctxT(t, 30*time.Second)
	k := Key(t)
	hl, err := holder.L.TryLock(ctx, k)
	if err != nil {
		t.Fatal(err)
	}
	start := time.Now()
	_, err = h.L.Lock(context.Background(), k, advlock.Wait(100*time.Millisecond))
	took := time.Since(start)
	if !errors.Is(err, advlock.ErrNotAcquired) || errors.Is(err, context.DeadlineExceeded) {
		t.Errorf("Lock with Wait(100ms) on a held key: %v, want ErrNotAcquired and no context error", err)
	}
	if took < 90*time.Millisecond || took > 5*time.Second {
		t.Errorf("Lock with Wait(100ms) returned after %v", took)
	}
	short, cancel := context.WithTimeout(context.Background(), 50*time.Millisecond)
	_, err = h.L.RLock(short, k, advlock.Wait(5*time.Second))
	cancel()
	if !errors.Is(err, context.DeadlineExceeded) || errors.Is(err, advlock.ErrNotAcquired) {
		t.Errorf("RLock whose ctx ends before its Wait: %v, want DeadlineExceeded", err)
	}
	if _, err := h.L.Lock(ctx, k, advlock.Wait(0)); !errors.Is(err, advlock.ErrNotAcquired) {
		t.Errorf("Lock with Wait(0) on a held key: %v, want ErrNotAcquired", err)
	}
	ran := false
	if err := h.L.TryDo(ctx, k, func(context.Context) error { ran = true; return nil }); !errors.Is(err, advlock.ErrNotAcquired) || ran {
		t.Errorf("TryDo on a held key: %v (fn ran: %v), want ErrNotAcquired without running fn", err, ran)
	}
	if err := hl.Unlock(ctx); err != nil {
		t.Fatal(err)
	}
	waitFree(t, obs, k)

	// Do with a Wait bound: the bound is for the wait only; fn's ctx lives on after it.
	err = h.L.Do(ctx, k, func(fctx context.Context) error {
		time.Sleep(250 * time.Millisecond)
		if len(holders(t, obs, k)) != 1 {
			t.Error("Do's fn runs without the key held")
		}
		return fctx.Err()
	}, advlock.Wait(100*time.Millisecond))
	if err != nil {
		t.Errorf("Do with Wait(100ms) whose fn ran 250ms: %v, want nil (the bound is for the wait only)", err)
	}
	err = h.L.TryDo(ctx, k, func(context.Context) error {
		if len(holders(t, obs, k)) != 1 {
			t.Error("TryDo's fn runs without the key held")
		}
		// Another holder in the same Locker: the message says so.
		_, err := h.L.TryLock(ctx, k)
		if !errors.Is(err, advlock.ErrNotAcquired) || !strings.Contains(err.Error(), "in this process") {
			t.Errorf("TryLock of a key this Locker holds: %v, want ErrNotAcquired naming in-process contention", err)
		}
		return nil
	})
	if err != nil {
		t.Errorf("TryDo on a free key: %v", err)
	}

	// fn's error and the unlock's, on one line, each matchable.
	bad := s.open(t, wrongUnlock())
	errFn := errors.New("fn failed")
	err = bad.L.Do(ctx, Key(t), func(context.Context) error { return errFn })
	if !errors.Is(err, errFn) || !errors.Is(err, advlock.ErrLockLost) || strings.Contains(err.Error(), "\n") {
		t.Errorf("Do whose fn and unlock both fail: %q, want one line matching both", err)
	}
	waitFree(t, obs, k)
	noIdleLocks(t, h, obs)
}

// noPoolSurprises: a try never waits for a connection (ErrPoolExhausted at once when the pool has none free), and
// Stats tells what the Locker holds and waits for.
func (s *suite) noPoolSurprises(t *testing.T) {
	h, holder, obs := s.open(t), s.open(t), s.observer(t)
	ctx := ctxT(t, 30*time.Second)
	giveBack := h.Exhaust(t)
	start := time.Now()
	_, err := h.L.TryLock(context.Background(), Key(t))
	if !errors.Is(err, advlock.ErrPoolExhausted) {
		t.Errorf("TryLock with every pool connection taken: %v, want ErrPoolExhausted", err)
	}
	if d := time.Since(start); d > 2*time.Second {
		t.Errorf("TryLock with every pool connection taken returned after %v: it waited", d)
	}
	if err := h.L.TryDo(context.Background(), Key(t), func(context.Context) error { return nil }); !errors.Is(err, advlock.ErrPoolExhausted) {
		t.Errorf("TryDo with every pool connection taken: %v, want ErrPoolExhausted", err)
	}
	giveBack()

	var held []*advlock.Lock
	for range 3 {
		lk, err := h.L.TryLock(ctx, Key(t))
		if err != nil {
			t.Fatal(err)
		}
		held = append(held, lk)
	}
	k := Key(t)
	hl, err := holder.L.TryLock(ctx, k)
	if err != nil {
		t.Fatal(err)
	}
	errc := make(chan error, 2)
	lockUnlock := func() {
		lk, err := h.L.Lock(ctx, k, advlock.Wait(10*time.Second))
		if err == nil {
			err = lk.Unlock(ctx)
		}
		errc <- err
	}
	go lockUnlock()
	waitQueued(t, obs, k)
	go lockUnlock()
	var st advlock.Stats
	for deadline := time.Now().Add(5 * time.Second); ; time.Sleep(5 * time.Millisecond) {
		if st = h.L.Stats(); st.WaitingInProcess == 1 || time.Now().After(deadline) {
			break
		}
	}
	wantShared, wantSessions := 0, 1 // a session of its own per held lock, plus the waiting one
	if s.shared {
		wantShared = 3
		if st.SharedSessions < 1 {
			t.Errorf("Stats: %d shared sessions open, want at least 1", st.SharedSessions)
		}
	} else {
		wantSessions = 4
	}
	if st.Held != 3 || st.HeldShared != wantShared || st.WaitingInServer != 1 || st.WaitingInProcess != 1 ||
		st.OwnSessions != wantSessions || st.Pool.InUse < st.OwnSessions+st.SharedSessions {
		t.Errorf("Stats = %+v, want 3 held (%d shared), 1 waiting in the server, 1 in-process, %d sessions of their own", st, wantShared, wantSessions)
	}
	if err := hl.Unlock(ctx); err != nil {
		t.Fatal(err)
	}
	for range 2 { // the first waiter gets it and lets it go; the second, waiting behind it in-process, then too
		select {
		case err := <-errc:
			if err != nil {
				t.Error(err)
			}
		case <-time.After(15 * time.Second):
			t.Fatal("a waiting Lock did not return")
		}
	}
	for _, lk := range held {
		_ = lk.Unlock(ctx)
	}
}

// fencing: with WithFencing every grant carries a token greater than every token before it, whichever Locker,
// session kind or call took it; without it Token is 0. A resource that checks the token refuses the write of a
// holder whose lock was lost (terminated, but still running) once a later holder has written.
func (s *suite) fencing(t *testing.T) {
	a, b := s.open(t, advlock.WithFencing()), s.open(t, advlock.WithFencing())
	plain, obs := s.open(t), s.observer(t)
	ctx := ctxT(t, 30*time.Second)
	k := Key(t)
	var last int64
	next := func(what string, tok int64) {
		t.Helper()
		if tok <= last {
			t.Fatalf("%s: token %d after %d, want it greater", what, tok, last)
		}
		last = tok
	}
	for i := range 12 {
		l := []*advlock.Locker{a.L, b.L}[i%2]
		var lk *advlock.Lock
		var err error
		switch i % 4 {
		case 0:
			lk, err = l.TryLock(ctx, k)
		case 1:
			lk, err = l.Lock(ctx, k)
		case 2:
			lk, err = l.RLock(ctx, k, advlock.Wait(time.Second))
		case 3:
			err = l.Do(ctx, k, func(fctx context.Context) error {
				next("Do", advlock.FenceToken(fctx))
				return nil
			})
		}
		if err != nil {
			t.Fatal(err)
		}
		if lk != nil {
			next(fmt.Sprintf("grant %d", i), lk.Token())
			if err := lk.Unlock(ctx); err != nil {
				t.Fatal(err)
			}
		}
	}
	if lk, err := plain.L.TryLock(ctx, k); err != nil || lk.Token() != 0 {
		t.Errorf("without fencing: %v, token %v, want 0", err, lk)
	} else {
		_ = lk.Unlock(ctx)
	}

	// The resource side.
	table := fmt.Sprintf("advlock_fence_demo_%d", time.Now().UnixNano())
	if _, err := obs.Exec(ctx, "CREATE TABLE "+table+" (id int PRIMARY KEY, fence bigint NOT NULL, value text)"); err != nil {
		t.Fatal(err)
	}
	defer obs.Exec(context.Background(), "DROP TABLE "+table)
	if _, err := obs.Exec(ctx, "INSERT INTO "+table+" VALUES (1, 0, 'none')"); err != nil {
		t.Fatal(err)
	}
	write := func(token int64, value string) int64 {
		tag, err := obs.Exec(ctx, "UPDATE "+table+" SET fence = $1, value = $2 WHERE id = 1 AND fence < $1", token, value)
		if err != nil {
			t.Fatal(err)
		}
		return tag.RowsAffected()
	}
	stale, err := a.L.TryLock(ctx, k)
	if err != nil {
		t.Fatal(err)
	}
	if write(stale.Token(), "first holder") != 1 {
		t.Fatal("the first holder's write was refused")
	}
	pgtest.Terminate(t, obs, pidOf(t, obs, k)) // the holder goes on running, unaware for a moment
	fresh, err := b.L.Lock(ctx, k, advlock.Wait(10*time.Second))
	if err != nil {
		t.Fatal(err)
	}
	if write(fresh.Token(), "second holder") != 1 {
		t.Fatal("the second holder's write was refused")
	}
	if write(stale.Token(), "stale write") != 0 {
		t.Error("the stale holder's write was accepted after a later holder wrote")
	}
	var value string
	if err := obs.QueryRow(ctx, "SELECT value FROM "+table+" WHERE id = 1").Scan(&value); err != nil || value != "second holder" {
		t.Errorf("the resource holds %q (%v), want the second holder's write", value, err)
	}
	_ = stale.Unlock(ctx)
	if err := fresh.Unlock(ctx); err != nil {
		t.Fatal(err)
	}
}

// fencingFirstUse: a database that has never seen advlock (no sequence yet) and a fleet whose Lockers take their
// first fenced lock at once, through every call. Every one is granted, with distinct tokens: a concurrent CREATE
// SEQUENCE that loses the race (a duplicate in pg_class, 23505, or 42P07) means the sequence exists now.
func (s *suite) fencingFirstUse(t *testing.T) {
	obs := pgtest.Conn(t, pgtest.FreshDB(t, s.be.ObsURL))
	db := obs.Config().Database
	u, err := url.Parse(s.be.URL)
	if err != nil {
		t.Fatal(err)
	}
	u.Path = "/" + db // a pooler in front routes any database name (its [databases] has a wildcard)
	ctx := ctxT(t, 60*time.Second)
	const lockers, rounds = 6, 3
	failed := 0
	for round := range rounds { // a subtest each, whose end closes its Lockers' pools (a pooler's pool is small)
		t.Run(fmt.Sprintf("round %d", round), func(t *testing.T) { s.firstUses(t, ctx, obs, u.String(), lockers, &failed) })
	}
	if failed > 0 {
		t.Logf("%d of %d first uses failed", failed, lockers*rounds)
	}
}

func (s *suite) firstUses(t *testing.T, ctx context.Context, obs *pgx.Conn, url string, lockers int, failed *int) {
	{
		if _, err := obs.Exec(ctx, "DROP SEQUENCE IF EXISTS public.advlock_fence"); err != nil {
			t.Fatal(err)
		}
		var hs []Harness
		for range lockers {
			h := s.openURL(t, url, advlock.WithFencing())
			hs = append(hs, h)
		}
		start := make(chan struct{})
		tokens, errs := make([]int64, lockers), make([]error, lockers)
		var wg sync.WaitGroup
		for i, h := range hs {
			wg.Add(1)
			go func() {
				defer wg.Done()
				k := Key(t)
				<-start
				var lk *advlock.Lock
				var err error
				switch i % 3 {
				case 0:
					lk, err = h.L.TryLock(ctx, k)
				case 1:
					lk, err = h.L.Lock(ctx, k)
				case 2:
					err = h.L.Do(ctx, k, func(fctx context.Context) error {
						tokens[i] = advlock.FenceToken(fctx)
						return nil
					})
				}
				if lk != nil {
					tokens[i] = lk.Token()
					err = lk.Unlock(ctx)
				}
				errs[i] = err
			}()
		}
		close(start)
		wg.Wait()
		seen := map[int64]bool{}
		for i, err := range errs {
			if err != nil {
				*failed++
				t.Errorf("Locker %d: first fenced lock on a fresh database: %v", i, err)
			} else if tokens[i] <= 0 || seen[tokens[i]] {
				t.Errorf("Locker %d: token %d (tokens so far %v)", i, tokens[i], seen)
			}
			seen[tokens[i]] = true
		}
		for _, h := range hs {
			h.L.Close()
		}
	}
}
