package session

import (
	"context"
	"errors"
	"fmt"
	"net"
	"sync"
	"sync/atomic"
	"time"

	"github.com/advlock/advlock/internal/mutant"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgproto3"
)

// A Mux is a shared session: one server session holding many locks, for many callers at once.
//
//	callers --> queue --> one round trip at a time: everything queued while the previous one was on the wire
//	                      goes out together, as one Bind/Execute of a prepared statement over arrays (no timer:
//	                      a lone caller goes out at once, from its own goroutine)
//	socket  <-- one reader at a time: a lone caller reads its own answer (no goroutine hand-off); when others
//	            wait behind it, a background reader takes the busy socket and keeps it while the session is busy
//	            (callers then write and wait); a quiet socket nobody reads gets the background reader, so a
//	            FATAL or EOF is seen at once and a keepalive bounds silent loss, and after WatchDelay of quiet a
//	            caller's round trip goes out at once and the reader, having read its answer, gives the socket
//	            back. A FATAL, EOF or a round trip not answered within the bound ends every lock on the session at
//	            once.
//
// Only statements that never wait go on a Mux: tries and unlocks. A wait for a key held elsewhere happens on a
// session of its own ([Acquire]). Errors in a round trip: rows answered before the failing one are applied (the
// server sends rows as it produces them), a row that failed for lack of lock-table space (53200) fails that caller
// alone with ErrLockTableFull, rows after it go out again; with fencing, a round trip that ended with an error
// (that one, or one after its last row) aborted its tokens' transaction, so its granted tries are undone and sent
// again, and the refused try is undone (an unlock of its key in its mode, first in the next round trip), as is a
// gated try refused after its key was granted; a refused try that is undone is answered with its undo (or by die),
// so that it holds nothing when its caller returns; any other error before a row's answer leaves the session in
// doubt, so it is destroyed and its locks are reported lost.
type Mux struct {
	conn      Conn
	pid       uint32 // the server session's
	nc        net.Conn
	fe        *pgproto3.Frontend
	bound     time.Duration // how long a round trip may stay unanswered, and how long the session may stay silent
	ready     chan error    // setup's result
	stop      chan struct{} // closed by die: the connection is given up
	exit      chan struct{} // closed when the connection is destroyed and every goroutine of the Mux has returned
	gone      func(*Mux)    // tells the owner the Mux died (called once)
	unlockKey func(ID) ID   // tests only
	fenced    bool          // grants draw tokens from FenceSeq
	bg        sync.WaitGroup
	wb        atomic.Pointer[wireBuf] // the encoding buffers, between two round trips (see send)

	mu        sync.Mutex
	queue     []*req // not yet sent
	wire      []*req // on the wire, in order (nil for a keepalive)
	busy      bool   // a round trip is on the wire
	sentAt    time.Time
	token     int         // who reads the socket: tokenFree, tokenCaller or tokenBG
	idleSince time.Time   // when the last round trip was answered
	handBack  bool        // the background reader gives the socket up once nothing waits (see do)
	timer     *time.Timer // starts the background reader after a quiet moment
	dead      error       // once set, the Mux takes nothing more
	closing   bool
	held      map[*Held]struct{}
	results   []int64
	batchErr  error
}

// ErrMuxGone is what a request that never reached the server gets when its Mux died first: the caller may try
// another.
var ErrMuxGone = fmt.Errorf("advlock: shared session ended before the request was sent (%w)", errSessionEnded)

// OpenMux pins conn (already verified, with settings applied) as a shared session. bound limits how long a round
// trip may stay unanswered and the session silent (the keepalive interval). gone is called once when it dies.
// unlockKey is a test hook (see Config.UnlockKey).
func OpenMux(ctx context.Context, conn Conn, bound time.Duration, gone func(*Mux), unlockKey func(ID) ID, fenced bool) (*Mux, error) {
	// The connection is the caller's until the Mux takes it: on any error here it is ours to end.
	if r, err := conn.QueryInt(ctx, "SELECT pg_is_in_recovery()::int"); err != nil {
		becauseErr(conn, "checking a new connection failed", err)
		conn.Destroy()
		return nil, fmt.Errorf("check server: %w", err)
	} else if r == 1 {
		conn.Release() // nothing was taken on it
		return nil, ErrStandby
	}
	m := &Mux{conn: conn, pid: conn.ServerPID(), bound: bound, ready: make(chan error, 1), stop: make(chan struct{}),
		exit: make(chan struct{}), gone: gone, held: map[*Held]struct{}{}, unlockKey: unlockKey, fenced: fenced}
	go func() {
		// The connection stays pinned (inside Wire) for the Mux's life; readers use it from their goroutines.
		called := false
		werr := conn.Wire(func(pc *pgconn.PgConn) error {
			called = true
			if err := m.setup(ctx, pc); err != nil {
				m.ready <- err
				return err
			}
			m.ready <- nil
			<-m.stop
			return nil
		})
		if !called { // the adapter could not give the connection (database/sql's Raw on a closed *sql.Conn)
			if werr == nil {
				werr = errors.New("the driver gave no access to the connection")
			}
			werr = fmt.Errorf("open shared session: %w", werr)
			m.ready <- werr
		}
		m.mu.Lock()
		dead := m.dead
		m.mu.Unlock()
		if dead == nil {
			dead = werr
		}
		if dead == nil || errors.Is(dead, ErrClosed) {
			because(m.conn, "") // an ordinary close
		} else {
			becauseErr(m.conn, "shared session lost", dead)
		}
		m.conn.Destroy() // never pooled: it held many locks, and its prepared statements are ours
		m.bg.Wait()
		close(m.exit)
	}()
	if err := <-m.ready; err != nil {
		<-m.exit
		return nil, err
	}
	m.mu.Lock()
	m.armLocked()
	m.mu.Unlock()
	return m, nil
}

// kill ends the Mux from any goroutine: the socket is closed, so whoever reads finds the error and settles
// everything; if nobody reads, kill settles it itself.
func (m *Mux) kill(cause error) {
	m.mu.Lock()
	if m.dead == nil {
		m.dead = cause
	}
	free := m.token == tokenFree && !m.busy
	if free {
		m.token = tokenCaller // ours now: nobody else will settle
	}
	m.mu.Unlock()
	if m.nc != nil {
		_ = m.nc.Close()
	}
	if free {
		m.die(cause)
	}
}

// die settles a dead Mux; only the one reading (or kill, when nobody was) calls it. Requests on the wire fail
// (their effect ended with the session), queued ones fail with ErrMuxGone (never sent), a refused try whose undo
// is among them is answered (its key ends with the session), every lock held on it is lost, and the connection is
// given up.
func (m *Mux) die(cause error) {
	_ = m.nc.Close()
	if m.gone != nil {
		m.gone(m) // first: no new request should come here
	}
	m.mu.Lock()
	if m.dead != nil && !errors.Is(cause, ErrClosed) {
		cause = m.dead // a kill's reason comes first
	} else if m.dead == nil {
		m.dead = cause
	}
	if m.timer != nil {
		m.timer.Stop()
	}
	wire, queue := m.wire, m.queue
	m.wire, m.queue, m.busy = nil, nil, false
	held := make([]*Held, 0, len(m.held))
	for h := range m.held {
		held = append(held, h)
	}
	clear(m.held)
	for _, r := range wire { // a try's grant, if any, ended with the session
		r.err = cause
		if !isTry(r.op) {
			r.err = fmt.Errorf("%w: %w", ErrLockLost, cause)
		}
		r.answered = true
	}
	for _, r := range queue {
		r.err = ErrMuxGone
		if !isTry(r.op) {
			r.err = fmt.Errorf("%w: %w", ErrLockLost, cause)
		}
		r.answered = true
	}
	settled := append(wire, queue...)
	for _, r := range settled[:len(settled):len(settled)] {
		if r.after != nil && !r.after.answered { // a refused try whose undo never came back: its key ended with the session
			r.after.answered = true
			settled = append(settled, r.after)
		}
	}
	m.mu.Unlock()
	for _, r := range settled {
		if r.sig != nil {
			select {
			case r.sig <- struct{}{}:
			default:
			}
		}
	}
	lost := fmt.Errorf("%w: %w", ErrLockLost, cause)
	if errors.Is(cause, ErrClosed) {
		lost = ErrClosed
	}
	for _, h := range held {
		if mutant.On(mutant.SilentLossShared) {
			break // nobody is told; Unlock finds the session gone
		}
		h.finish(lost)
	}
	select {
	case <-m.stop:
	default:
		close(m.stop)
	}
}

// Try takes t on the Mux if no other session holds it. ctx is looked at before the request goes out; once out, the
// answer comes within one round trip (or the Mux dies), and if ctx ended meanwhile a grant is undone. onEnd is
// called once when the returned lock ends, however it ends.
func (m *Mux) Try(ctx context.Context, t Target, onEnd OnEnd) (*Held, error) {
	if err := ctx.Err(); err != nil {
		return nil, WithContext(ctx, err)
	}
	op := int16(opTry)
	if t.Shared {
		op = opTryShared
	}
	if t.ID.Pair {
		op += opPair
	}
	h := &Held{mux: m, target: t, onEnd: onEnd}
	r := &req{op: op, key: t.ID.V, hook: func(r *req) {
		if r.err == nil && r.res >= 1 {
			m.mu.Lock()
			if m.dead == nil {
				m.held[h] = struct{}{}
			} else {
				m.mu.Unlock()
				h.finish(fmt.Errorf("%w: %w", ErrLockLost, m.dead)) // granted on a session that died since
				return
			}
			m.mu.Unlock()
		}
	}}
	m.do(r)
	switch {
	case r.err != nil:
		return nil, r.err
	case r.res < 1:
		return nil, ErrNotAcquired
	}
	if m.fenced {
		h.token = r.res
	}
	if ctx.Err() != nil && mutant.On(mutant.CancelGrantDropped) { // reported not acquired, left on the session
		m.mu.Lock()
		delete(m.held, h)
		m.mu.Unlock()
		return nil, WithContext(ctx, ctx.Err())
	}
	if ctx.Err() != nil { // granted after the caller gave up: give it back (the caller frees its slot)
		h.mu.Lock()
		h.onEnd = nil
		h.mu.Unlock()
		_ = h.Release(context.WithoutCancel(ctx), ErrNotHeld)
		return nil, WithContext(ctx, errors.New("try finished after the context ended; released"))
	}
	return h, nil
}

// Close ends the Mux once its last round trip is answered; its locks are reported ErrClosed. It waits until the
// connection is given up and every goroutine of the Mux has returned.
func (m *Mux) Close() {
	m.mu.Lock()
	m.closing = true
	idle := !m.busy
	m.mu.Unlock()
	if idle {
		m.kill(ErrClosed)
	}
	<-m.exit
}

// Load is the number of locks held on the Mux.
func (m *Mux) Load() int {
	m.mu.Lock()
	defer m.mu.Unlock()
	return len(m.held)
}

// state reports whether a round trip is on the wire, how many locks are held, and whether the Mux is dead.
func (m *Mux) state() (busy bool, load int, dead bool) {
	m.mu.Lock()
	defer m.mu.Unlock()
	return m.busy, len(m.held), m.dead != nil
}

// Held is one lock held on a Mux.
type Held struct {
	token  int64 // the grant's fencing token (0 without fencing)
	mux    *Mux
	target Target
	end    End
	onEnd  OnEnd
	mu     sync.Mutex
	rel    bool
	marked bool // Confirm took the lock's marker (guarded by mu)
}

// Done is closed when the lock is released or lost.
func (h *Held) Done() <-chan struct{} { return h.end.Done() }

// Token is the grant's fencing token: 0 without fencing.
func (h *Held) Token() int64 { return h.token }

// Err is nil while held; afterwards it says why it ended.
func (h *Held) Err() error { return h.end.Err() }

// PID is the pid of the server session that holds the lock (0 when the driver does not tell).
func (h *Held) PID() uint32 { return h.mux.pid }

// AfterEnd arranges for f to run once the lock ends (at once if it has); stop cancels that.
func (h *Held) AfterEnd(f func()) (stop func() bool) { return h.end.AfterEnd(f) }

// finish ends the lock with err, once: the owner is told first (OnEnd, which gives the key's in-process slot back),
// then Done closes, what AfterEnd arranged runs, and what OnEnd asked to run after.
func (h *Held) finish(err error) {
	h.end.Finish(err, func(err error) func() {
		h.mu.Lock()
		onEnd := h.onEnd
		h.mu.Unlock()
		if onEnd == nil {
			return nil
		}
		return onEnd(err)
	})
}

// Confirm asks the server whether the session is still there, and so still holds the lock: a round trip sent after
// this call, which also takes the lock's marker (ID.Linger; the release gives it back). It returns nil once
// answered; the lock's end (the loss, or the release that came first) when it has ended or ends meanwhile. Like
// Release it does not look at ctx: the answer comes within one round trip, or the session dies within its bound.
func (h *Held) Confirm(context.Context) error {
	if err := h.Err(); err != nil {
		return err
	}
	r := &req{op: lingerOp(h.target.ID.Pair), key: h.target.ID.Linger().V}
	h.mux.do(r)
	if r.err == nil && r.res == 1 {
		h.mu.Lock()
		late := h.rel // Release read marked before this answer: the marker is this call's to give back
		h.marked = !late
		h.mu.Unlock()
		if late {
			h.mux.do(&req{op: unlockSharedOp(h.target.ID.Pair), key: r.key})
		}
	}
	if err := h.Err(); err != nil {
		return err
	}
	if r.err == nil || errors.Is(r.err, ErrLockTableFull) { // answered (the marker may have found no room)
		return nil
	}
	return r.err // the Mux died as r went out: ErrLockLost, as every lock on it is being told
}

// Release unlocks. The unlock goes out whatever ctx says (a shared session is never left in doubt for a caller's
// deadline) and is answered within one round trip or the session dies. true -> only this lock ends (Err reports
// after); false or an error -> the session is in doubt and is destroyed, every lock on it lost. A second call
// returns ErrNotHeld.
func (h *Held) Release(ctx context.Context, after error) error {
	h.mu.Lock()
	if h.rel {
		h.mu.Unlock()
		return ErrNotHeld
	}
	h.rel = true
	marked := h.marked
	h.mu.Unlock()
	if err := h.Err(); err != nil {
		return err
	}
	if marked { // first the marker, so that the key is never shown held past its work once released
		h.mux.do(&req{op: unlockSharedOp(h.target.ID.Pair), key: h.target.ID.Linger().V})
	}
	if mutant.On(mutant.UnlockSkippedShared) { // the lock stays on the shared session, which the caller no longer knows
		m := h.mux
		m.mu.Lock()
		delete(m.held, h)
		m.mu.Unlock()
		h.finish(after)
		return nil
	}
	op := int16(opUnlock)
	if h.target.Shared {
		op = opUnlockShared
	}
	if h.target.ID.Pair {
		op += opPair
	}
	m := h.mux
	id := h.target.ID
	if m.unlockKey != nil {
		id = m.unlockKey(id)
	}
	r := &req{op: op, key: id.V, h: h, hook: func(r *req) {
		if r.err == nil && r.res == 1 {
			m.mu.Lock()
			delete(m.held, h)
			m.mu.Unlock()
			h.finish(after)
		}
	}}
	m.do(r)
	switch {
	case r.err != nil:
		if err := h.Err(); err != nil {
			return err // the session died and reported the loss
		}
		h.finish(r.err)
		return r.err
	case r.res != 1:
		err := fmt.Errorf("%w: pg_advisory_unlock returned false on a shared session: it no longer held the key; session closed, its locks lost", ErrLockLost)
		m.kill(err)
		<-h.Done()
		return h.Err()
	}
	return nil
}
