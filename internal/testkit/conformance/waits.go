package conformance

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/advlock/advlock"
	"github.com/advlock/advlock/internal/session"
	"github.com/advlock/advlock/internal/testkit/faults"
	"github.com/jackc/pgx/v5"
)

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
