package advlock

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"time"

	"github.com/advlock/advlock/internal/config"
	"github.com/advlock/advlock/internal/lease"
	"github.com/advlock/advlock/internal/session"
	"github.com/jackc/pgx/v5/pgxpool"
)

// Locker takes PostgreSQL session-level advisory locks on sessions it pins from a pool: shared sessions that each
// hold many locks ([WithSharedSessions]), and a session of its own for a lock that had to wait in the server (or
// for every lock, with WithSharedSessions(0)). A session goes back to the pool only once the server confirmed it
// holds nothing. It is safe for concurrent use.
//
// Within one Locker there is at most one exclusive holder per key, or any number of shared holders, each with a
// hold of its own: a second Lock of a key this Locker holds waits in-process (no second connection) until the
// first is unlocked, and TryLock fails at once with ErrNotAcquired. This is what keeps PostgreSQL's per-session
// re-entrancy from granting one key twice. A Lock whose caller holds locks (inside Do's fn, or with [Holding])
// waits in the server instead, on a session of its own that the server keeps apart from the holder's, so that
// deadlock detection sees it.
type Locker struct {
	pool     session.Pool
	shared   *session.Shared // nil: every lock has a session of its own
	pgxPool  *pgxpool.Pool   // for DoTx; nil for other backends
	ownsPool *pgxpool.Pool
	opts     config.Options
	cfg      session.Config
	obs      []Observer

	closeCtx    context.Context
	closeCancel context.CancelCauseFunc
	inflight    sync.WaitGroup // Lock calls under way
	endOp       func()         // inflight.Done, made once (a method value made at each call is an allocation)
	heldWG      sync.WaitGroup // locks in held

	names           sync.Map     // int8 keys whose names Lead wrote to the names table, or is writing (publishName)
	namesOff        atomic.Bool  // the names table may not be written: no more tries
	namesWarned     atomic.Bool  // a failure to write a name was logged: no more
	campaigning     atomic.Int64 // Lead calls running
	leading         atomic.Int64 // of them, those whose fn runs now
	campaignRetries atomic.Int64 // Lead campaigns that failed and were tried again
	graphReadings   atomic.Int64 // readings of the lock graph (deadlock.go)
	deadlocks       atomic.Int64 // waits ended with ErrDeadlock

	fenceSem chan struct{} // one fence check at a time (a buffered channel of 1: waiting for it honours ctx)
	fenceOK  atomic.Bool   // the fencing sequence exists and may be used (and with leases, the lease tables)
	leases   *lease.Client // WithLeases: locks are leases (leases.go); nil: session locks

	slots       *ownSlots    // sessions of their own, when the pool is the Locker's own or limited (budget.go); nil: no limit
	appSlots    bool         // slots is a share of the application's pool (New), which nested waits pass by
	contended   contention   // keys whose waits found them held a moment ago
	waitingSlot atomic.Int64 // waits queued for a slot
	yields      atomic.Int64 // waits that gave their session up to a wait queued for one
	connsNow    atomic.Int64 // connections taken from the pool now (countingPool)
	connsPeak   atomic.Int64 // the most at once

	mu        sync.Mutex
	closed    bool
	gates     map[session.ID]*gate
	held      map[*Lock]struct{}
	waiters   map[*waiter]struct{} // watched waits (deadlock.go)
	dlSeq     int64
	detecting bool           // a detector goroutine runs
	detectWG  sync.WaitGroup // the detector
	readFails int            // readings of the lock graph that failed in a row (the detector's goroutine only)
}

// New returns a Locker over a pool the caller owns and closes (after [Locker.Close]). A nil pool gives a Locker
// whose every call returns ErrNoPool. The pool's sessions keep whatever settings the application gave them; see
// [Open] for a pool tuned for locking. The Locker takes at most half of the pool's connections for its shared
// sessions, and for its waits in the server (each keeping its session for the lock it gets) at most half of what
// they leave (none over a pool of 2: waits then take their key on a shared session once it is free): more waits
// wait in this process, so that the application (fn's own queries among them) always has the rest. A wait whose
// caller holds locks, one for a key another caller of this Locker holds, and a semaphore's wait for any slot wait
// for the pool's connections with the application's queries instead. With [WithSharedSessions](0) every held lock takes one of the pool's connections.
func New(pool *pgxpool.Pool, opts ...Option) *Locker {
	o := config.Defaults()
	for _, opt := range opts {
		opt.apply(&o)
	}
	switch {
	case o.Backend != nil:
		return newLocker(o.Backend, nil, o)
	case pool == nil:
		return newLocker(nil, nil, o)
	}
	if o.AppName == "" {
		o.AppName = pool.Config().ConnConfig.RuntimeParams["application_name"]
	}
	return newLocker(pgxPool{p: pool}, pool, o)
}

// newLocker makes a Locker over a backend; pgxp is the pgxpool behind it, if any (for DoTx).
func newLocker(pool session.Pool, pgxp *pgxpool.Pool, o config.Options) *Locker {
	l := &Locker{
		opts: o,
		cfg: session.Config{Keepalive: o.Keepalive, Wrap: o.Wrap, Starter: new(session.Starter),
			Waits: new(session.Waits), Settings: o.Settings, UnlockKey: o.UnlockKey, Fencing: o.Fencing,
			OpenBound: o.OpenBound, WaitSlice: o.WaitSlice},
		gates:    make(map[session.ID]*gate),
		held:     make(map[*Lock]struct{}),
		waiters:  make(map[*waiter]struct{}),
		obs:      observers(o),
		fenceSem: make(chan struct{}, 1),
	}
	l.cfg.Events = sessionEvents(l.obs)
	l.endOp = l.inflight.Done
	if pool != nil {
		pool = countingPool{Pool: pool, now: &l.connsNow, peak: &l.connsPeak}
	}
	l.pool, l.pgxPool = pool, pgxp
	if pool != nil && o.OwnPool && !o.SharedSet {
		o.SharedSessions = ownPoolShared(pool.Stats().Max)
		l.opts.SharedSessions = o.SharedSessions
	}
	if pool != nil && o.SharedSessions > 0 && pool.Wires() {
		cfg := l.cfg
		cfg.Keepalive = min(o.Keepalive, o.ReleaseTimeout) // also how long a round trip may stay unanswered
		l.shared = session.NewShared(o.SharedSessions, pool, cfg, o.Keepalive)
	}
	if m := 0; pool != nil {
		if m = pool.Stats().Max; m > 0 && o.OwnPool {
			shared := 0
			if l.shared != nil {
				shared = o.SharedSessions
			}
			_, _, own := share(m, shared)
			l.slots = &ownSlots{max: own}
		} else if m >= 2 && l.shared != nil { // a pool of 1 has no room for a shared session: a session per lock
			l.slots, l.appSlots = &ownSlots{max: appShare(m, min(o.SharedSessions, m/2))}, true
		}
	}
	if o.Leases {
		l.leases = lease.NewClient(pool, leaseConfig(o))
	}
	l.closeCtx, l.closeCancel = context.WithCancelCause(context.Background())
	return l
}

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

// begin registers an operation that Close must wait for. For an operation that may wait, it returns a context
// that also ends, with cause ErrClosed, when Close is called; a Try makes one round trip and is simply waited for.
func (l *Locker) begin(ctx context.Context, wait bool) (context.Context, func(), error) {
	l.mu.Lock()
	if l.closed {
		l.mu.Unlock()
		return nil, nil, ErrClosed
	}
	l.inflight.Add(1)
	l.mu.Unlock()
	if !wait {
		return ctx, l.endOp, nil
	}
	cctx, cancel := context.WithCancelCause(ctx)
	stop := context.AfterFunc(l.closeCtx, func() { cancel(ErrClosed) })
	return cctx, func() {
		stop()
		cancel(nil)
		l.inflight.Done()
	}, nil
}

// release unlocks lk's session and frees its in-process slot; after is what lk.Err reports on a clean release.
func (l *Locker) release(lk *Lock, after error) error {
	ctx, cancel := context.WithTimeout(context.Background(), l.opts.ReleaseTimeout)
	defer cancel()
	return l.releaseCtx(ctx, lk, after)
}

func (l *Locker) releaseCtx(ctx context.Context, lk *Lock, after error) error {
	return lk.h.Release(ctx, after) // the handle's end frees the slot (forget)
}

// forget drops lk from the Locker and gives its in-process slot back, once. It reports whether lk was in the
// Locker's held locks, whose count (heldWG) its caller then gives back, once it is done with the lock's end.
func (l *Locker) forget(lk *Lock) (wasHeld bool) {
	l.mu.Lock()
	defer l.mu.Unlock()
	if lk.forgotten {
		return false
	}
	lk.forgotten = true
	if lk.stopLinger() {
		l.inflight.Done() // ended (lost) during its hold: nothing left to release later
	}
	_, wasHeld = l.held[lk]
	delete(l.held, lk)
	l.leaveLocked(session.Target{ID: lk.key.id, Shared: lk.shared})
	return wasHeld
}

// ended is what a lock's session tells the Locker as the lock ends (session.OnEnd): the slot is given back at once,
// the observers are told once Done has closed, and then Close may count the lock gone.
func (l *Locker) ended(lk *Lock) session.OnEnd {
	return func(err error) func() {
		held := l.forget(lk)
		return func() {
			l.lockEnded(lk, err)
			if held {
				l.heldWG.Done()
			}
		}
	}
}

// Close releases every lock still held (each unlock bounded by WithReleaseTimeout), makes pending and later calls
// fail with ErrClosed, and waits for its goroutines. It closes the pool only if [Open] made it. During a network
// partition, and after one in which calls were cut short, Close returns within WithReleaseTimeout (5 s by default)
// and about a second: the connections it gives up are closed at once, their sockets first, and nothing waits for
// an answer the partition holds. Locks released
// this way report ErrClosed from Err and Unlock. Locks whose caller unlocked them before their [HoldAtLeast] had
// passed are released at once too (Close does not wait for a hold); their Err stays ErrNotHeld. Close is
// idempotent.
func (l *Locker) Close() {
	if l == nil {
		return
	}
	l.mu.Lock()
	wasClosed := l.closed
	l.closed = true
	held := make([]*Lock, 0, len(l.held))
	for lk := range l.held {
		held = append(held, lk)
		if lk.stopLinger() {
			l.inflight.Done() // its release will not run: the loop below releases it
		}
	}
	l.mu.Unlock()
	l.closeCancel(ErrClosed)
	l.cfg.Waits.Close()
	if l.shared != nil {
		l.shared.Stop() // ends shared sessions being opened, and wakes the calls waiting for them
	}
	l.mu.Lock()
	l.closeGates() // in-process waiters see closed and give up
	l.mu.Unlock()
	var wg sync.WaitGroup
	for _, lk := range held {
		after := ErrClosed
		switch {
		case lk.ended.CompareAndSwap(lockHeld, releasedByClose):
		case lk.ended.CompareAndSwap(lingering, unlockedByCaller): // its caller has unlocked it already
			after = ErrNotHeld
		default:
			continue
		}
		wg.Add(1)
		go func() {
			defer wg.Done()
			_ = l.release(lk, after)
		}()
	}
	wg.Wait()
	l.heldWG.Wait() // also those a concurrent Unlock is releasing, or being lost, and their observers told
	l.inflight.Wait()
	l.cfg.Waits.Wait() // connections still being set up for calls that have returned
	l.detectWG.Wait()
	if l.shared != nil {
		l.shared.Close()
	}
	if l.leases != nil {
		l.leases.Close() // after the held leases' releases: a release not confirmed is not tried again
	}
	if !wasClosed && l.ownsPool != nil {
		l.ownsPool.Close()
	}
	if !wasClosed && l.opts.OnClose != nil {
		l.opts.OnClose()
	}
}

// Do takes key exclusively (waiting like Lock; [Wait] bounds that wait apart from ctx), runs fn, and unlocks, also
// when fn panics. The context given to fn is ctx, cancelled with cause ErrLockLost as soon as the lock is lost.
// Do returns fn's error together with the unlock's, on one line, each matchable with errors.Is; when the lock was
// lost at any point the result matches ErrLockLost, since fn may have overlapped with another holder.
//
// When the loss is what cancelled fn's context (judged when fn returns, from the context's cause), the result
// matches ErrLockLost and never context.Canceled, whatever fn returned: a loss does not read as a caller that went
// away. fn's error stays reachable with errors.Is (for anything but context.Canceled) and errors.As, and its text
// shows ("...: lock lost: ...; fn returned: context canceled"). When ctx itself was cancelled first, fn's context
// ended because of it, and the result matches context.Canceled as fn's error does.
//
// fn's context says that its caller holds key: a Lock, Do or Lead inside fn whose wait closes a cycle of waits
// (another caller holds what it waits for and waits for key) may end with ErrDeadlock, having taken nothing; a Do
// that gets ErrDeadlock for its own key does not run fn. fn should return it: Do releases key, and its caller may
// take the keys again.
func (l *Locker) Do(ctx context.Context, key Key, fn func(ctx context.Context) error, opts ...CallOption) (err error) {
	lk, err := l.Lock(ctx, key, opts...)
	if err != nil {
		return err
	}
	fctx, cancel := context.WithCancelCause(Holding(ctx, lk))
	stop := lk.h.AfterEnd(func() { cancel(lk.Err()) })
	var lostCause error // what cancelled fn's context, when it was the loss
	defer func() {
		stop()
		cancel(nil)
		uctx, ucancel := context.WithTimeout(context.WithoutCancel(ctx), l.opts.ReleaseTimeout)
		defer ucancel()
		uerr := lk.Unlock(uctx)
		switch {
		case lostCause != nil:
			loss := uerr
			if !errors.Is(uerr, ErrLockLost) {
				loss = &keyError{op: "do", key: key, err: lostCause}
				if uerr != nil {
					loss = fmt.Errorf("%w; and %w", loss, uerr)
				}
			}
			err = &lostError{fn: err, loss: loss}
		case uerr == nil:
		case err == nil:
			err = uerr
		default:
			err = fmt.Errorf("%w; and %w", err, uerr)
		}
	}()
	err = fn(fctx)
	if fctx.Err() != nil && errors.Is(context.Cause(fctx), ErrLockLost) { // judged now, before anything else moves
		lostCause = context.Cause(fctx)
	}
	return err
}

// TryDo is Do that does not wait: it takes key if no other session holds it (else ErrNotAcquired), runs fn with a
// context cancelled when the lock is lost, and unlocks. It is Do(ctx, key, fn, Wait(0)).
func (l *Locker) TryDo(ctx context.Context, key Key, fn func(ctx context.Context) error, opts ...CallOption) error {
	return l.Do(ctx, key, fn, append(opts[:len(opts):len(opts)], Wait(0))...) // never into the caller's array
}

// lingerFor releases lk, which its caller unlocked before its HoldAtLeast had passed, d from now (or when Close
// comes first). A Locker closed already has released it, or is about to. It reports false, arming nothing, when
// lk has ended already (lost: the Locker forgot it before its Err said so), which Unlock then reports.
func (l *Locker) lingerFor(lk *Lock, d time.Duration) bool {
	l.mu.Lock()
	defer l.mu.Unlock()
	if lk.forgotten {
		// Released already: by Close, which found it lingering and released it as its caller's unlock (the caller
		// then hears what a release would have told, as when Close comes after), or lost.
		return lk.ended.Load() == unlockedByCaller
	}
	if l.closed {
		return true // Close releases every lingering lock it finds
	}
	l.inflight.Add(1)
	lk.hold.linger = time.AfterFunc(d, func() {
		defer l.inflight.Done()
		if lk.ended.CompareAndSwap(lingering, unlockedByCaller) {
			_ = l.release(lk, ErrNotHeld)
		}
	})
	return true
}

// keyError names the operation and key in an error while keeping the cause matchable.
type keyError struct {
	op  string
	key Key
	err error
}

func (e *keyError) Error() string {
	return fmt.Sprintf("advlock: %s %s: %s", e.op, e.key, trimPrefix(e.err.Error()))
}

func (e *keyError) Unwrap() error { return e.err }

func trimPrefix(s string) string {
	const p = "advlock: "
	if len(s) >= len(p) && s[:len(p)] == p {
		return s[len(p):]
	}
	return s
}

// Stats is what a Locker is doing now.
type Stats struct {
	Held             int   // locks held
	HeldShared       int   // of them on shared sessions
	HeldLeases       int   // of them leases (WithLeases), which hold no session
	WaitingInProcess int   // Lock calls waiting behind another holder of the same key in this Locker
	WaitingInServer  int   // Lock calls waiting in PostgreSQL, each on a session of its own
	SharedSessions   int   // shared sessions open
	OwnSessions      int   // sessions of their own in use: holding a lock, or waiting in the server
	Campaigning      int   // Lead calls running (campaigning or leading)
	Leading          int   // of them, those leading now (their fn runs)
	CampaignRetries  int64 // Lead campaigns that failed for a passing reason and were tried again, since New or Open
	// Deadlock detection, since New or Open: readings of the server's lock graph (about one a second while a wait
	// whose caller holds a lock waits; none otherwise), and waits this Locker ended with ErrDeadlock.
	GraphReadings int64
	Deadlocks     int64
	// The connections this Locker takes from the server. Conns is how many it has now: its shared sessions, its
	// sessions of their own, DoTx's transactions, and those it takes for a moment (deadlock detection's readings,
	// Ping, Inspect, Leader, LockTable, the checks of a new connection); PeakConns is the most at once since New or
	// Open. With Open (and advsql.Open) the pool is the Locker's alone and Pool.Max is its budget; Conns exceeds it
	// by one only while deadlock detection reads on a connection it dialed outside the pool because none of the
	// pool's was free (the one kept for reads taken by a concurrent Inspect, Ping or DoTx), kept until no watched
	// wait waits. With New the application's queries share Pool.Max.
	Conns     int
	PeakConns int
	// MaxOwnSessions is how many sessions of their own (Lock calls waiting in the server, and the locks they got)
	// a Locker from Open (or advsql.Open) has at most at once: its pool's connections less the shared sessions and
	// one kept for its own reads (see [DefaultOpenConns]); with New over a limited pool, half of what the shared
	// sessions leave (see [New]); 0 where the pool is the only limit.
	// WaitingForSession counts the Lock calls waiting in this process because all of those are in use: they get
	// the sessions given back in the order they came, and meanwhile try their key again on a shared session
	// every 20 ms (less often when many wait). With New, waits that find the pool empty wait in the pool's own
	// queue instead.
	MaxOwnSessions    int
	WaitingForSession int
	// WaitYields counts, since Open, the waits in the server that gave their session of their own to a wait
	// queued for one (each after a whole slice without a grant), then queued again: with more waits than
	// MaxOwnSessions, each gets its turn in the server, one slice at a time.
	WaitYields int64
	Pool       PoolStats
}

// PoolStats are the figures of the pool a Locker takes sessions from (pgxpool, or database/sql's pool).
type PoolStats struct {
	Max       int   // the most connections it opens (0: no limit)
	Open      int   // connections open
	InUse     int   // taken out of the pool (by locks, shared sessions, waits, or the application)
	Idle      int   // open and free
	WaitCount int64 // acquisitions so far that had to wait for a connection
}

// Exhausted reports whether every connection the pool may open is taken: an acquisition now would wait.
func (p PoolStats) Exhausted() bool { return session.PoolStats(p).Exhausted() }

// Stats reports what the Locker holds and waits for, its sessions, and its pool's own figures. It takes the
// Locker's lock for a moment and reads the pool's counters; it sends nothing to the server.
func (l *Locker) Stats() Stats {
	var st Stats
	if l == nil || l.pool == nil {
		return st
	}
	l.mu.Lock()
	st.Held = len(l.held)
	for lk := range l.held {
		switch lk.h.(type) {
		case *session.Held:
			st.HeldShared++
		case *lease.Lease:
			st.HeldLeases++
		}
	}
	for _, g := range l.gates {
		st.WaitingInProcess += g.queue.Len()
	}
	l.mu.Unlock()
	st.WaitingInServer = l.cfg.Waits.Count()
	if l.shared != nil {
		st.SharedSessions = l.shared.Sessions()
	}
	st.OwnSessions = st.Held - st.HeldShared - st.HeldLeases + st.WaitingInServer
	st.Campaigning, st.Leading = int(l.campaigning.Load()), int(l.leading.Load())
	st.CampaignRetries = l.campaignRetries.Load()
	st.GraphReadings, st.Deadlocks = l.graphReadings.Load(), l.deadlocks.Load()
	st.Conns, st.PeakConns = int(l.connsNow.Load()), int(l.connsPeak.Load())
	if l.slots != nil {
		st.MaxOwnSessions = l.slots.max
		st.WaitingForSession = int(l.waitingSlot.Load())
		st.WaitYields = l.yields.Load()
	}
	st.Pool = PoolStats(l.pool.Stats())
	return st
}

// FenceToken returns the fencing token of the lock that Do (or TryDo) holds while running the fn that got ctx (the
// innermost, when Do runs inside Do or [Holding] adds locks), or 0 (no such lock, or no fencing: [WithFencing]).
func FenceToken(ctx context.Context) int64 {
	if h, ok := ctx.Value(holdingKey{}).(*holding); ok {
		return h.lk.Token()
	}
	return 0
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
