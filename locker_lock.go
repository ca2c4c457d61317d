package advlock

import (
	"context"
	"errors"
	"sync"
	"time"

	"github.com/advlock/advlock/internal/lease"
	"github.com/advlock/advlock/internal/session"
)

// TryLock takes key exclusively if no other session holds it, or fails at once with ErrNotAcquired. It never waits
// for a connection: with shared sessions it needs none once one is open, and with a session per lock it fails with
// ErrPoolExhausted when the pool has no free connection (with [Open], when its sessions of their own are all in
// use). Of the call options, [HoldAtLeast] applies ([Wait] does not: a try never waits). Like [Locker.Lock], it
// may return later than ctx's end on a shared session or with leases, when the link stalls with its statement in
// the server.
func (l *Locker) TryLock(ctx context.Context, key Key, opts ...CallOption) (*Lock, error) {
	return l.lock(ctx, key, false, false, opts)
}

// Lock takes key exclusively, waiting inside PostgreSQL (no polling) until it is granted or ctx ends. When ctx
// ends first the error wraps ctx.Err(), and the key is not held: if the server granted it as the wait was
// cancelled, the session is closed so that the server drops it. [Wait] bounds the wait apart from ctx: when it
// elapses Lock returns ErrNotAcquired. When ctx says its caller holds locks (Do's fn, Lead's fn, [Holding]) and
// the wait closes a cycle of waits that the server cannot see, one wait of the cycle ends with ErrDeadlock. With a
// Locker from [Open], a Lock that must wait in the server while all of its sessions of their own are in use waits
// in this process for one (trying its key meanwhile), never failing for want of a connection.
//
// On a shared session or with leases, a call whose statement is in the server when the link stalls may return
// later than its ctx ends: an answer may still come and grant the key, which the call must then give back. It
// returns when the answer comes (not granted: ErrNotAcquired) or when the server counts as gone: on a shared
// session at the keepalive bound (WithKeepalive, 5 s by default), with an error that says the server did not
// answer and matches no context error (it is the server's silence, not the wait, that ended the call); with leases
// at the grant's bound (5 s, or the lease's trust window if shorter), with an error that matches ctx's end and says
// the server did not answer. With a session per lock it returns at ctx's end (the session is closed). On a healthy
// link every call returns at ctx's end.
func (l *Locker) Lock(ctx context.Context, key Key, opts ...CallOption) (*Lock, error) {
	return l.lock(ctx, key, false, true, opts)
}

// TryRLock is TryLock in shared mode: any number of shared holders, no exclusive one.
func (l *Locker) TryRLock(ctx context.Context, key Key, opts ...CallOption) (*Lock, error) {
	return l.lock(ctx, key, true, false, opts)
}

// RLock is Lock in shared mode.
func (l *Locker) RLock(ctx context.Context, key Key, opts ...CallOption) (*Lock, error) {
	return l.lock(ctx, key, true, true, opts)
}

func (l *Locker) lock(ctx context.Context, key Key, shared, wait bool, opts []CallOption) (lk *Lock, err error) {
	co := callOptions(opts)
	ctx, observed := l.startCall(ctx, key, shared, wait && !(co.waitSet && co.wait <= 0))
	defer func() { observed(lk, err) }()
	switch {
	case wait && co.waitSet && co.wait <= 0:
		wait = false
		lk, err = l.lock1(ctx, key, shared, false, co.hold > 0)
	case wait && co.waitSet:
		// The bound is a deadline of its own: the server's lock_timeout honours it and the session survives it.
		wctx, cancel := context.WithTimeoutCause(ctx, co.wait, errWaitElapsed)
		lk, err = l.lock1(wctx, key, shared, true, co.hold > 0)
		cancel()
		if err != nil && ctx.Err() == nil && errors.Is(err, context.DeadlineExceeded) && ownDeadline(ctx, co.wait) {
			err = &notAcquiredError{why: "not granted within " + co.wait.String()}
		}
	default:
		lk, err = l.lock1(ctx, key, shared, wait, co.hold > 0)
	}
	if err != nil {
		verb := "lock"
		switch {
		case shared && wait:
			verb = "rlock"
		case shared:
			verb = "try rlock"
		case !wait:
			verb = "try lock"
		}
		return nil, &keyError{op: verb, key: key, err: err}
	}
	if co.hold > 0 {
		lk.hold.until = time.Now().Add(co.hold) // the grant came before now: held at least co.hold past it (read by Unlock alone)
	}
	return lk, nil
}

// ownDeadline reports whether a wait bound d, started just now, ends before ctx's own deadline (so that a deadline
// error is the bound's, not ctx's).
func ownDeadline(ctx context.Context, d time.Duration) bool {
	dl, ok := ctx.Deadline()
	return !ok || time.Until(dl) > 0
}

var errWaitElapsed = errors.New("advlock: the Wait bound elapsed")

func (l *Locker) lock1(ctx context.Context, key Key, shared, wait, hold bool) (lk *Lock, err error) {
	if l == nil || l.pool == nil {
		return nil, ErrNoPool
	}
	if err := key.valid(); err != nil {
		return nil, err
	}
	// Close aborts waits itself (in-process gates are woken, server waits have their sockets closed), so the
	// caller's ctx goes to the statement as it is.
	_, done, err := l.begin(ctx, false)
	if err != nil {
		return nil, err
	}
	defer done()
	if l.leases != nil {
		if err := l.leaseCall(ctx, shared, wait); err != nil {
			return nil, err
		}
	}
	if l.opts.Fencing || l.leases != nil {
		if err := l.ensureFence(ctx, !wait); err != nil {
			return nil, err
		}
	}
	t := session.Target{ID: key.id, Shared: shared}
	start := time.Now()
	var w *waiter
	if wait && ctx.Value(noDetectKey{}) == nil && l.leases == nil {
		if held := heldRefs(ctx); len(held) > 0 {
			parent := ctx
			w, ctx = l.watchWait(ctx, key, t, held)
			defer l.endWait(w)
			defer func() {
				if derr := deadlockErr(parent, ctx); derr != nil && err != nil {
					lk, err = nil, derr
					l.deadlocks.Add(1)
				}
			}()
		}
	}
	// A wait for any of several keys (a semaphore's slots) passes too: the slot it waits for may be held in this
	// process for long while another frees, which only its wait in the server would see.
	_, anyOf := ctx.Value(alternativesKey{}).([]Key)
	passed, err := l.enter(ctx, t, wait, w != nil || anyOf && !shared)
	if err != nil {
		return nil, err
	}
	// nlk, not the result lk: the handle's end may run on another goroutine at any moment (the session dies),
	// while a return below writes lk.
	nlk := &Lock{l: l, key: key, shared: shared}
	if hold { // made before the Lock is shared (l.held, its end): forget and Close read hold under l.mu
		nlk.hold = &minHold{}
	}
	// The in-process slot is given back when the lock ends, however it ends, before Done closes: a lost lock's
	// session is gone, so nothing can be shared, and a holder that re-acquires as soon as it is told of the loss,
	// without calling Unlock on the lost handle, must find the key free in this Locker. The observers are told once
	// Done has closed, so that what watches Done (Do's fn) hears of a loss first, whatever the observers do.
	h, err := l.take(ctx, t, wait, passed, w, start, l.ended(nlk))
	if err != nil {
		// forget, not leave: a handle that existed for a moment (granted, then handed back because ctx ended)
		// may have ended already and freed the slot; freeing it twice would free another holder's. Errors from a
		// Close that aborted this call match ErrClosed (session.Waits).
		if l.forget(nlk) { // never: it was not held yet
			l.heldWG.Done()
		}
		return nil, err
	}
	nlk.h = h
	if s, ok := h.(interface{ Target() session.Target }); ok && s.Target().ID != t.ID {
		l.granted1(ctx, nlk, t, s.Target().ID)
	}
	l.mu.Lock()
	if l.closed {
		l.mu.Unlock()
		// Close is already releasing; this lock was not in its list.
		_ = l.release(nlk, ErrClosed)
		return nil, ErrClosed
	}
	if !nlk.forgotten {
		l.held[nlk] = struct{}{}
		l.heldWG.Add(1) // under mu and before closed: happens before Close's Wait
	}
	l.mu.Unlock()
	l.granted(nlk)
	return nlk, nil
}

// granted1 moves lk, granted one of its call's alternatives (id) instead of its key, to that key: its in-process
// slot moves from t's gate to id's (taken whatever that gate says: the server granted the key, so no holder of
// this Locker holds it), unless the lock has ended already (its end gave t's slot back).
func (l *Locker) granted1(ctx context.Context, lk *Lock, t session.Target, id session.ID) {
	alts, _ := ctx.Value(alternativesKey{}).([]Key)
	l.mu.Lock()
	defer l.mu.Unlock()
	if lk.forgotten {
		return
	}
	for _, k := range alts {
		if k.id == id {
			lk.key = k
		}
	}
	l.leaveLocked(t)
	g := l.gates[id]
	if g == nil {
		g = &gate{}
		l.gates[id] = g
	}
	g.take(false)
}

// ensureFence checks (once per Locker, until it succeeds) that the fencing sequence exists and may be used. One
// check runs at a time; the others wait for it (or for their ctx) and then look again. A try does not wait for a
// connection for it. A wait for a lease rides out what passes (a connection the server ended, the network, a
// server restarting) here as in its polls: it checks again, until ctx ends; only what an operator must fix (or
// Close) ends it.
func (l *Locker) ensureFence(ctx context.Context, try bool) error {
	if l.fenceOK.Load() {
		return nil
	}
	select {
	case l.fenceSem <- struct{}{}:
	case <-ctx.Done():
		return session.WithContext(ctx, errors.New("waiting for the check of the fencing sequence"))
	}
	defer func() { <-l.fenceSem }()
	if l.fenceOK.Load() {
		return nil
	}
	cctx, cancel := context.WithCancelCause(ctx) // Close ends the check
	defer cancel(nil)
	stop := context.AfterFunc(l.closeCtx, func() { cancel(ErrClosed) })
	defer stop()
	for pause := 50 * time.Millisecond; ; pause = min(2*pause, time.Second) {
		err := session.EnsureFence(cctx, l.pool, try)
		if err == nil && l.leases != nil {
			err = l.leases.Ensure(cctx)
		}
		if err == nil {
			l.fenceOK.Store(true)
			return nil
		}
		if ctx.Err() == nil && errors.Is(context.Cause(cctx), ErrClosed) {
			return ErrClosed
		}
		if try || l.leases == nil || cctx.Err() != nil || errors.Is(err, ErrFencing) || lease.Permanent(err) {
			return err
		}
		t := time.NewTimer(pause)
		select {
		case <-t.C:
		case <-cctx.Done():
			t.Stop()
			if ctx.Err() == nil && errors.Is(context.Cause(cctx), ErrClosed) {
				return ErrClosed
			}
			return session.WithContext(ctx, err)
		}
	}
}

// take holds t: on a shared session if it can be granted at once, else (when wait) on a session of its own that
// waits in the server. A caller that passed by its gate (another caller of this Locker holds the key, maybe on a
// shared session) takes a session of its own at once, and never tries on a shared session. w is the wait's
// deadlock watch, if any.
func (l *Locker) take(ctx context.Context, t session.Target, wait, passed bool, w *waiter, start time.Time, onEnd session.OnEnd) (handle, error) {
	if l.leases != nil {
		return l.takeLease(ctx, t, wait, onEnd)
	}
	if l.shared != nil && !passed && !(wait && l.contended.recent(t.ID)) {
		for attempt := 0; ; attempt++ {
			m, err := l.shared.Get(ctx, wait)
			if errors.Is(err, session.ErrNoShared) {
				break
			}
			if err != nil && wait && !errors.Is(err, ErrClosed) {
				// No shared session now (no connection free for one, or its open failed): a wait takes a session
				// of its own, waiting for a connection as long as ctx allows; one whose ctx ended meanwhile says
				// so (never ErrPoolExhausted, which is a try's answer).
				if ctx.Err() == nil {
					break
				}
				return nil, session.WithContext(ctx, errors.New("waiting for a shared session"))
			}
			if err != nil {
				return nil, err
			}
			h, err := m.Try(ctx, t, onEnd)
			switch {
			case err == nil:
				return h, nil
			case errors.Is(err, session.ErrMuxGone) && attempt < 3:
				continue // never sent: try another session
			case wait && session.Ended(err) && ctx.Err() == nil && attempt < 3:
				// The shared session died with the try on the wire: a grant, if any, ended with it, so nothing is
				// held, and a wait goes on (on another shared session, or one of its own) until granted or ctx ends.
				continue
			case errors.Is(err, ErrNotAcquired) && wait:
				l.contended.mark(t.ID)
			default:
				return nil, err
			}
			break
		}
	}
	if w != nil { // from now on detection counts it as a wait for the key's holders until it waits in the server
		l.mu.Lock()
		w.ownPath = true
		l.mu.Unlock()
	}
	if wait {
		ctx = session.WithWaitStart(ctx, start) // what the wait publishes: when the call began
		if l.contended.recent(t.ID) {
			ctx = session.WithContended(ctx)
		}
		if alts, _ := ctx.Value(alternativesKey{}).([]Key); len(alts) > 0 && !t.Shared {
			ids := make([]session.ID, len(alts))
			for i, k := range alts {
				ids[i] = k.id
			}
			ctx = session.WithAlternatives(ctx, ids)
		}
		if l.slots != nil {
			// Sessions of their own are shared out among the waits, one slice at a time, when some queue for one;
			// not by a watched wait in a cycle the last reading found (see waiter.cyclic).
			yield := l.slots.queued
			if w != nil {
				yield = func() bool { return !w.inCycle() && l.slots.queued() }
			}
			ctx = session.WithYield(ctx, yield)
		}
	}
	for {
		// A nested wait, one that passed its gate and a semaphore's wait for any slot are not held to a share of the
		// application's pool: each could wait for ever behind the locks its own Locker holds there.
		_, anyOf := ctx.Value(alternativesKey{}).([]Key)
		h, give, err := l.ownSession(ctx, t, wait, passed, w != nil || passed || anyOf, onEnd)
		if h != nil || err != nil {
			return h, err
		}
		end := onEnd
		if give != nil {
			end = func(err error) func() {
				after := onEnd(err)
				give() // after the session went back to the pool or was destroyed
				return after
			}
		}
		s, err := session.Acquire(ctx, l.pool, t, wait, l.cfg, end)
		if err != nil && give != nil && !session.AfterSetUp(err, give) {
			give() // to the first wait queued for a session, if any (once the connection left behind is back)
		}
		if errors.Is(err, session.ErrYielded) {
			l.yields.Add(1)
			continue // its session went to another wait: queue for one again, at the back
		}
		if err != nil {
			return nil, err
		}
		return s, nil
	}
}

// contention remembers, per key, when a wait of this Locker last found it held elsewhere. For contendedFor after
// that, a wait for the key goes straight to a session of its own, whose first statement tries and then queues in
// the server in one round trip, instead of trying on a shared session first: under contention that try fails
// every time, and the round trip it costs before queueing is a window in which the server's queue may be empty, so
// that a caller arriving later takes the key ahead of callers that came before it (one key contended by 8
// processes: 1.2 to 1.5x between the process served most and least, against 1.02x for a session per lock).
type contention struct {
	mu sync.Mutex
	at map[session.ID]time.Time
}

const contendedFor = time.Second

// recent reports whether a wait found id held less than contendedFor ago; a wait that goes on as contended counts
// as finding it held again, so that a key stays contended while its waits keep coming (each of them would find it
// held: the shared try that would say so is what is skipped).
func (c *contention) recent(id session.ID) bool {
	c.mu.Lock()
	defer c.mu.Unlock()
	at, ok := c.at[id]
	if !ok {
		return false
	}
	now := time.Now()
	if now.Sub(at) >= contendedFor {
		delete(c.at, id)
		return false
	}
	c.at[id] = now
	return true
}

func (c *contention) mark(id session.ID) {
	c.mu.Lock()
	defer c.mu.Unlock()
	now := time.Now()
	if c.at == nil {
		c.at = map[session.ID]time.Time{}
	}
	if len(c.at) >= 1024 { // forget keys no longer contended, so that the map does not grow with every key
		for k, at := range c.at {
			if now.Sub(at) >= contendedFor {
				delete(c.at, k)
			}
		}
	}
	c.at[id] = now
}
