package advlock

import (
	"container/list"
	"context"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"time"

	"github.com/advlock/advlock/internal/session"
)

// A Locker whose pool is its own ([Open], advsql.Open) shares the pool's connections out once, when it is made:
//
//   - shared sessions: WithSharedSessions, else a quarter of the pool (ownPoolShared), and at most half of it (see
//     session.Shared), pinned for the Locker's life once opened;
//   - one connection kept for what the Locker reads for itself (deadlock detection's readings, Ping, Inspect,
//     Leader, LockTable, the pg_locks check after an abandoned wait, the second connection that proves a new one
//     is not behind a transaction-mode pooler), when the pool has at least 3 connections;
//   - the rest for sessions of their own: Lock calls waiting in the server, each of which keeps its session while
//     the lock it got is held (and, without shared sessions, every held lock).
//
// A Lock that needs a session of its own when all of them are in use waits in this process, in the order it came,
// until one is given back or its ctx ends (it never fails for want of a connection); meanwhile it tries its key
// again on a shared session every 20 ms (see slotRetry), and takes it there if it is free. The sessions are shared
// out among the waits one slice at a time: while a wait queues for a session, each wait in the server that has
// waited a whole slice without a grant gives its session up (settled: it holds nothing, its intent included) to
// the first in the queue and queues again at the back. So a wait queued here is not overtaken for ever by waits
// in the server's queue (the server hands a busy key from each holder straight to its next waiter, which a try
// every 20 ms would never be), and waits that last (a Lead campaign for a key led elsewhere, a semaphore slot)
// do not hold the sessions hostage. A try fails at once with
// ErrPoolExhausted instead. Deadlock detection counts such a wait as a wait for the key's holders (see
// deadlock.go), and its readings take the kept connection, so a cycle that holds every session of its own is
// still found.
//
// A Locker from [New] (or advsql.New) shares the application's pool. When that pool has a limit and the Locker
// has shared sessions (the default), it takes for sessions of their own (waits in the server, and the locks they
// got) at most half of the connections its shared sessions leave (appShare: none over a pool of 2), shared out as
// above; the rest stays the application's, so that a holder whose fn queries the same pool always finds a
// connection (ten holders and waiters of one key on a pool of ten, each querying the pool in fn, would otherwise
// wait for each other for ever). A wait whose caller holds locks (nested), one that passed its gate (another
// caller of this Locker holds the key) and a semaphore's wait for any slot pass this share by and wait for the
// pool's connections, with the application's queries: held to the share, each could wait for ever behind locks
// its own Locker holds there (its caller's, a leader's). With WithSharedSessions(0), or a driver whose
// connection cannot carry a shared session, every held lock is on a session of its own, and the Locker takes what
// the pool gives (size the pool for the locks held at once).

// appShare is how many sessions of their own a Locker over the application's pool (of conns connections, shared of
// them for shared sessions at most) takes: half of what the shared sessions leave. Over a pool of 2 that is none:
// waits then take their key on the shared session once it is free (tried every 20 ms), and the application keeps
// the other connection.
func appShare(conns, shared int) int { return (conns - shared) / 2 }

// ownPoolShared is how many shared sessions a Locker whose pool (of conns connections) is its own opens unless
// WithSharedSessions says: a quarter of the pool, at least 1 and at most 4 (1 for DefaultOpenConns). One shared
// session carries every lock that is free when asked for, batching the requests of all goroutines into its round
// trips; the connections are worth more to waits, each of which needs one.
func ownPoolShared(conns int) int {
	if conns <= 0 {
		return 4
	}
	return min(4, max(1, conns/4))
}

// share is how a pool is shared out: at most shared shared sessions (as session.Shared's limit
// computes it), spare connections kept for the Locker's reads, and own sessions of their own, from a pool of
// conns connections.
func share(conns, sharedSessions int) (shared, spare, own int) {
	shared = min(sharedSessions, conns/2)
	if conns-shared >= 2 {
		spare = 1
	}
	return shared, spare, conns - shared - spare
}

// ownSlots limits the sessions of their own of a Locker whose pool is its own: used of max are taken, and callers
// that found none free queue, first come first served. A released slot goes to the first in the queue.
type ownSlots struct {
	max int

	mu      sync.Mutex
	used    int
	waiters list.List // of chan struct{}, closed when a slot is handed to it
}

// tryTake takes a free slot if nobody queues for one.
func (s *ownSlots) tryTake() bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.used < s.max && s.waiters.Len() == 0 {
		s.used++
		return true
	}
	return false
}

// queue takes a free slot (ok) or puts the caller in the queue: the slot is its once got is closed; cancel takes
// it out of the queue (and gives back a slot handed to it meanwhile).
func (s *ownSlots) queue() (got <-chan struct{}, cancel func(), ok bool) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.used < s.max && s.waiters.Len() == 0 {
		s.used++
		return nil, nil, true
	}
	ch := make(chan struct{})
	e := s.waiters.PushBack(ch)
	return ch, func() {
		s.mu.Lock()
		select {
		case <-ch: // handed a slot as the caller gave up
			s.mu.Unlock()
			s.give()
			return
		default:
		}
		s.waiters.Remove(e)
		s.mu.Unlock()
	}, false
}

// queued reports whether a caller queues for a slot: a wait that holds one gives it up at the end of a slice then
// (session.WithYield), so that every wait gets its turn in the server.
func (s *ownSlots) queued() bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.waiters.Len() > 0
}

// give returns a slot: to the first caller in the queue, else to the free ones.
func (s *ownSlots) give() {
	s.mu.Lock()
	defer s.mu.Unlock()
	if f := s.waiters.Front(); f != nil {
		s.waiters.Remove(f)
		close(f.Value.(chan struct{}))
		return
	}
	s.used--
}

// ownSession makes sure a wait (or a try, without shared sessions) may take a session of its own: it takes a slot,
// waiting for one if it must (a try does not: ErrPoolExhausted). A wait that queues tries t on a shared session
// again every slotRetry or so, and returns the lock it got there (h) instead of a slot. give, when not nil, hands
// the slot back; it must be called once the session is given up, or at once when no session is made.
// A wait that passed by its gate never tries on a shared session, which may hold the key for the caller it passed.
func (l *Locker) ownSession(ctx context.Context, t session.Target, wait, passed, nested bool, onEnd session.OnEnd) (h handle, give func(), err error) {
	if l.slots == nil || l.appSlots && (nested || l.shared.Unusable()) {
		return nil, nil, nil
	}
	if !wait {
		if !l.slots.tryTake() {
			return nil, nil, fmt.Errorf("%w: all %d sessions of their own in use", ErrPoolExhausted, l.slots.max)
		}
		return nil, l.slots.give, nil
	}
	got, cancel, ok := l.slots.queue()
	if ok {
		return nil, l.slots.give, nil
	}
	l.waitingSlot.Add(1)
	defer l.waitingSlot.Add(-1)
	slice := l.cfg.WaitSlice
	if slice <= 0 {
		slice = session.DefaultWaitSlice
	}
	for {
		// The tries of all the queued waits together stay near one a millisecond.
		t0 := time.NewTimer(min(slice, max(slotRetry, time.Duration(l.waitingSlot.Load())*time.Millisecond)))
		select {
		case <-got:
			t0.Stop()
			return nil, l.slots.give, nil
		case <-ctx.Done():
			t0.Stop()
			cancel()
			return nil, nil, session.WithContext(ctx, fmt.Errorf("waiting for a session of its own (all %d in use)", l.slots.max))
		case <-l.closeCtx.Done():
			t0.Stop()
			cancel()
			return nil, nil, ErrClosed
		case <-t0.C:
		}
		// A slice passed with every session of its own in use: the key may be free by now, and a shared session
		// takes it without one.
		if l.shared == nil || passed {
			continue
		}
		m, err := l.shared.Get(ctx, false)
		if err != nil {
			continue
		}
		h, err := m.Try(ctx, t, onEnd)
		switch {
		case err == nil:
			cancel()
			return h, nil, nil
		case errors.Is(err, ErrNotAcquired), errors.Is(err, session.ErrMuxGone), session.Ended(err):
			// Held elsewhere, or the shared session died (with the try's grant, if any): go on waiting.
		default:
			cancel()
			return nil, nil, err
		}
	}
}

// slotRetry is how often a wait queued for a session of its own tries its key again on a shared session, while
// fewer than 20 queue (with more, each tries less often: all of them together about once a millisecond, and at
// least once a wait slice). A try costs the server a few microseconds and goes out with the others in the shared
// session's round trips.
const slotRetry = 20 * time.Millisecond

// countingPool counts the connections a Locker has taken from its pool, and the most at once.
type countingPool struct {
	session.Pool
	now, peak *atomic.Int64
}

// Dial is the pool's, when it has one (session.Dialer): deadlock detection's reading when the pool has no free
// connection. The connection, outside the pool, is counted like the pool's until it is closed: it is one more
// than the pool's Max (see Stats.Conns).
func (p countingPool) Dial(ctx context.Context) (session.TextConn, error) {
	d, ok := p.Pool.(session.Dialer)
	if !ok {
		return nil, errors.New("advlock: this pool cannot open a connection outside itself")
	}
	c, err := d.Dial(ctx)
	if err != nil {
		return nil, err
	}
	p.add(1)
	return &countedText{TextConn: c, pool: p}, nil
}

// countedText gives its count back once, when it is closed.
type countedText struct {
	session.TextConn
	pool countingPool
	gone atomic.Bool
}

func (c *countedText) Close() {
	c.TextConn.Close()
	if c.gone.CompareAndSwap(false, true) {
		c.pool.add(-1)
	}
}

// countConn counts a connection the Locker took from its pool without session.Pool (DoTx's, from pgxpool).
func (l *Locker) countConn(d int64) {
	if cp, ok := l.pool.(countingPool); ok {
		cp.add(d)
	}
}

func (p countingPool) Acquire(ctx context.Context) (session.Conn, error) {
	c, err := p.Pool.Acquire(ctx)
	if err != nil {
		return nil, err
	}
	p.add(1)
	return &countedConn{Conn: c, now: p.now}, nil
}

func (p countingPool) add(d int64) {
	n := p.now.Add(d)
	for {
		pk := p.peak.Load()
		if n <= pk || p.peak.CompareAndSwap(pk, n) {
			return
		}
	}
}

// countedConn gives its count back once, when it is released or destroyed.
type countedConn struct {
	session.Conn
	now  *atomic.Int64
	gone atomic.Bool
}

func (c *countedConn) Release() {
	c.Conn.Release()
	c.done()
}

func (c *countedConn) Destroy() {
	c.Conn.Destroy()
	c.done()
}

func (c *countedConn) done() {
	if c.gone.CompareAndSwap(false, true) {
		c.now.Add(-1)
	}
}

// QueryTextUntil is the backend's, by the connection's deadline where it offers one (session.QueryTextUntil).
func (c *countedConn) QueryTextUntil(ctx context.Context, deadline time.Time, sql string) (string, error) {
	return session.QueryTextUntil(ctx, c.Conn, deadline, sql)
}

// QueryText is the backend's, for deadlock detection's readings.
func (c *countedConn) QueryText(ctx context.Context, sql string) (string, error) {
	q, ok := c.Conn.(textQuerier)
	if !ok {
		return "", errors.New("advlock: this backend cannot read the lock graph")
	}
	return q.QueryText(ctx, sql)
}
