package advlock

import (
	"context"
	"sync"
	"sync/atomic"

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
