package session

import (
	"context"
	"errors"
	"fmt"
	"net"
	"strconv"
	"strings"
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
//	            (callers then write and wait); after WatchDelay of quiet a caller takes the socket back, and a
//	            quiet socket nobody reads gets the background reader, so a FATAL or EOF is seen at once and a
//	            keepalive bounds silent loss. A FATAL, EOF or a round trip not answered within the bound ends every
//	            lock on the session at once.
//
// Only statements that never wait go on a Mux: tries and unlocks. A wait for a key held elsewhere happens on a
// session of its own ([Acquire]). Errors in a round trip: rows answered before the failing one are applied (the
// server sends rows as it produces them), a row that failed for lack of lock-table space (53200) fails that caller
// alone with ErrLockTableFull, rows after it go out again; with fencing, a round trip that ended with an error
// (that one, or one after its last row) aborted its tokens' transaction, so its granted tries are undone and sent
// again, and the refused try is undone (an unlock of its key in its mode, first in the next round trip); any
// other error before a row's answer leaves the session in doubt, so it is destroyed and its locks are reported
// lost.
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

	mu        sync.Mutex
	queue     []*req // not yet sent
	wire      []*req // on the wire, in order (nil for a keepalive)
	busy      bool   // a round trip is on the wire
	sentAt    time.Time
	token     int           // who reads the socket: tokenFree, tokenCaller or tokenBG
	idleSince time.Time     // when the last round trip was answered
	wantToken chan struct{} // a caller asked the background reader to yield; closed when it has
	timer     *time.Timer   // starts the background reader after a quiet moment
	dead      error         // once set, the Mux takes nothing more
	closing   bool
	held      map[*Held]struct{}
	results   []int64
	batchErr  error
}

// Who reads the socket.
const (
	tokenFree   = iota // nobody: the next caller to send reads, or the background reader after WatchDelay
	tokenCaller        // a caller, until its own request is answered
	tokenBG            // the background reader, while the session is quiet
)

// Operations of the mux statement. The pair variants add 4.
const (
	opTry = iota + 1
	opTryShared
	opUnlock
	opUnlockShared
	opPair = 4
)

// isTry reports whether op takes a lock (the others release one).
func isTry(op int16) bool { return (op-1)%opPair < opUnlock-1 }

// The statements of a shared session, [fenced]: the array statement for a round trip of several requests, and for a
// round trip that carries one request (the usual case for a lone caller) a plain call, which costs the server
// about 20 µs less. muxSQL answers each (op, key) with its position and 1 or 0 (with fencing, a granted try
// answers its token instead of 1: the token is drawn in the branch that granted, after the grant). Pairs travel
// as one int8: high 32 bits, low 32 bits, each a signed int4 (the shifts are arithmetic).
var (
	muxStmt    = [2]string{"advlock_mux_1", "advlock_muxf_1"}
	muxSQL     [2]string
	singleSQL  [2][8]string // by op-1
	singleStmt [2][8]string
)

func init() {
	keys := [2]string{"t.k", "(t.k >> 32)::int4, (t.k << 32 >> 32)::int4"}
	single := [2]string{"$1::int8", "($1::int8 >> 32)::int4, ($1::int8 << 32 >> 32)::int4"}
	for f := range 2 {
		fenced := f == 1
		var cases strings.Builder
		for op := int16(1); op <= 8; op++ {
			pair, kind := (op-1)/opPair, (op-1)%opPair // kind: try, try shared, unlock, unlock shared
			shared, try := kind%2 == 1, kind < 2
			call := func(args string) string {
				if !try {
					return unlockFn(shared, args) + "::int"
				}
				return "CASE WHEN " + lockFn(true, shared, args) + " THEN " + grant(fenced) + " ELSE 0 END"
			}
			fmt.Fprintf(&cases, " WHEN %d THEN %s\n", op, call(keys[pair]))
			singleSQL[f][op-1] = "SELECT " + call(single[pair])
			singleStmt[f][op-1] = fmt.Sprintf("%s_%d", muxStmt[f], op)
		}
		muxSQL[f] = "SELECT t.i, CASE t.op\n" + cases.String() +
			" END FROM unnest($1::int2[], $2::int8[]) WITH ORDINALITY AS t(op, k, i)"
	}
}

func unlockFn(shared bool, args string) string {
	if shared {
		return "pg_advisory_unlock_shared(" + args + ")"
	}
	return "pg_advisory_unlock(" + args + ")"
}

type req struct {
	op       int16
	key      int64
	res      int64
	err      error
	answered bool          // guarded by Mux.mu
	sig      chan struct{} // for a waiting caller: answered (buffered)
	h        *Held
	hook     func(r *req)
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

// setup prepares the statements.
func (m *Mux) setup(ctx context.Context, pc *pgconn.PgConn) error {
	f := b2i(m.fenced)
	if _, err := pc.Prepare(ctx, muxStmt[f], muxSQL[f], nil); err != nil {
		return fmt.Errorf("prepare shared session: %w", TranslateErr(err))
	}
	for i, sql := range singleSQL[f] {
		if _, err := pc.Prepare(ctx, singleStmt[f][i], sql, nil); err != nil {
			return fmt.Errorf("prepare shared session: %w", TranslateErr(err))
		}
	}
	m.nc, m.fe = pc.Conn(), pc.Frontend()
	return nil
}

// do queues r and waits for its answer. If no round trip is on the wire it sends r at once and reads the answer
// itself; else r goes out in the next round trip, and the caller waits (or reads, when its turn comes).
func (m *Mux) do(r *req) {
	m.mu.Lock()
	// Take the socket back from a background reader that has been quiet for a while (a sporadic caller reads its
	// own answer); one that was busy a moment ago goes on reading (under load the socket stays with it).
	for m.dead == nil && !m.busy && m.token == tokenBG && time.Since(m.idleSince) >= WatchDelay {
		if m.wantToken == nil {
			m.wantToken = make(chan struct{})
			_ = m.nc.SetReadDeadline(time.Unix(1, 0))
		}
		ch := m.wantToken
		m.mu.Unlock()
		<-ch
		m.mu.Lock()
	}
	if m.dead != nil {
		cause := m.dead
		m.mu.Unlock()
		r.err = ErrMuxGone
		if !isTry(r.op) { // the session holding the lock is gone
			r.err = fmt.Errorf("%w: %w", ErrLockLost, cause)
		}
		return
	}
	m.queue = append(m.queue, r)
	if m.busy { // whoever reads now sends it in the next round trip
		r.sig = make(chan struct{}, 1)
		m.mu.Unlock()
		m.wait(r)
		return
	}
	batch := m.takeLocked()
	if m.token == tokenBG { // send it; the background reader reads the answer
		r.sig = make(chan struct{}, 1)
		m.mu.Unlock()
		if err := m.send(batch); err != nil {
			m.kill(err) // the reader finds the closed socket and settles everything
		}
		m.wait(r)
		return
	}
	m.token = tokenCaller
	m.mu.Unlock()
	if err := m.send(batch); err != nil {
		m.die(err)
		return
	}
	m.read(r)
}

// wait blocks a caller whose request is queued or on the wire until it is answered.
func (m *Mux) wait(r *req) {
	for {
		<-r.sig
		m.mu.Lock()
		answered := r.answered
		m.mu.Unlock()
		if answered {
			return
		}
	}
}

// read is the reading role: it reads answers until me is answered (me nil: the background reader, until it
// yields or the Mux dies), sending what queued meanwhile.
func (m *Mux) read(me *req) {
	for {
		msg, err := m.fe.Receive()
		if err != nil {
			var ne net.Error
			if errors.As(err, &ne) && ne.Timeout() {
				yield, err := m.onTimeout(me)
				if err != nil {
					m.die(err)
					return
				}
				if yield {
					return
				}
				continue
			}
			m.die(fmt.Errorf("session ended: %w", err))
			return
		}
		switch msg := msg.(type) {
		case *pgproto3.DataRow:
			// (position, result) from the array statement; (result) from a single request's statement.
			i, err1 := int64(1), error(nil)
			if len(msg.Values) == 2 {
				i, err1 = strconv.ParseInt(string(msg.Values[0]), 10, 64)
			} else if len(msg.Values) != 1 || len(m.results) != 1 {
				m.die(errors.New("shared session: unexpected row"))
				return
			}
			r, err2 := strconv.ParseInt(string(msg.Values[len(msg.Values)-1]), 10, 64)
			if err1 != nil || err2 != nil || i < 1 || int(i) > len(m.results) {
				m.die(errors.New("shared session: unexpected row"))
				return
			}
			m.results[i-1] = r
		case *pgproto3.ErrorResponse:
			pgErr := pgconn.ErrorResponseToPgError(msg)
			if msg.Severity == "FATAL" || msg.Severity == "PANIC" {
				m.die(fmt.Errorf("session ended: %w", TranslateErr(pgErr)))
				return
			}
			m.batchErr = TranslateErr(pgErr)
		case *pgproto3.ReadyForQuery:
			done, err := m.complete(me)
			if err != nil {
				m.die(err)
				return
			}
			if done {
				return
			}
		case *pgproto3.BindComplete, *pgproto3.CommandComplete, *pgproto3.NoticeResponse,
			*pgproto3.ParameterStatus, *pgproto3.NotificationResponse:
		default:
			m.die(fmt.Errorf("shared session: unexpected %T", msg))
			return
		}
	}
}

// onTimeout handles a read deadline: a caller wants the quiet socket (the background reader yields), a silent
// idle session gets a keepalive round trip, a round trip unanswered past the bound ends the session.
func (m *Mux) onTimeout(me *req) (yield bool, err error) {
	if h := testHookSettle.Load(); h != nil {
		(*h)(m, "timeout")
	}
	m.mu.Lock()
	if m.dead != nil {
		// kill closed the socket while this reader held it (its deadline may have fired first): the reader is the one
		// to settle the Mux, never to hand a dead socket over.
		cause := m.dead
		m.mu.Unlock()
		return false, cause
	}
	if m.busy {
		left := m.bound - time.Since(m.sentAt)
		m.mu.Unlock()
		if left > 0 {
			_ = m.nc.SetReadDeadline(time.Now().Add(left))
			return false, nil
		}
		return false, fmt.Errorf("keepalive: no answer within %v", m.bound)
	}
	if me == nil && m.wantToken != nil { // the background reader gives the socket to a caller
		m.token = tokenFree
		close(m.wantToken)
		m.wantToken = nil
		m.mu.Unlock()
		return true, nil
	}
	m.busy, m.wire, m.results, m.sentAt = true, nil, m.results[:0], time.Now()
	m.mu.Unlock()
	buf, _ := (&pgproto3.Sync{}).Encode(nil) // a keepalive: the server answers ReadyForQuery
	_ = m.nc.SetReadDeadline(time.Now().Add(m.bound))
	if _, err := m.nc.Write(buf); err != nil {
		return false, fmt.Errorf("keepalive: %w", err)
	}
	return false, nil
}

// complete settles the round trip on the wire, sends whatever queued meanwhile, and decides who reads next. It
// reports done when the reader me may stop reading: its own request is answered (and the role has passed on or
// the socket is free), or the background reader must yield.
func (m *Mux) complete(me *req) (done bool, err error) {
	if h := testHookSettle.Load(); h != nil {
		(*h)(m, "complete")
	}
	m.mu.Lock()
	wire, results, batchErr := m.wire, m.results, m.batchErr
	m.wire, m.batchErr = nil, nil
	failed := -1 // the request whose row failed; those after it never ran
	var retry []*req
	for i, r := range wire {
		switch {
		case results[i] >= 0:
			r.res = results[i]
		case failed >= 0:
			retry = append(retry, r)
		case batchErr != nil && errors.Is(batchErr, ErrLockTableFull) && isTry(r.op):
			r.err, failed = batchErr, i // no lock-table space for this try
		default:
			m.wire = wire // die settles them: the session is in doubt
			m.mu.Unlock()
			if batchErr == nil {
				batchErr = errors.New("a request got no answer")
			}
			return false, fmt.Errorf("shared session in doubt: %w", batchErr)
		}
	}
	answered := wire
	if failed >= 0 {
		answered = wire[:failed+1]
	}
	if m.fenced && batchErr != nil {
		// The round trip ended with an error: the statement's transaction aborted, with every answer it sent (a
		// row refused for lack of lock-table space, or an error after the last row, such as a statement_timeout
		// or a cancel request landing then). Its session locks survive, but its tokens were drawn in a
		// transaction that flushed nothing (the WAL covering a token is flushed by the commit of the grant's
		// transaction): a crash could hand them out again. So every try granted in it is undone, first in the next
		// round trip, and sent again, to draw a token whose commit flushes; the refused try is undone too. Its
		// grant's token (nextval, which may take a transaction id, whose lock needs lock-table space) comes after
		// the lock, whose session lock survives the error. An unlock in the same mode is exact: the lock function
		// needs new space only when this session does not hold the key in that mode already, and then the unlock
		// answers false and changes nothing; space that failed after the grant means it was granted, and the
		// unlock gives back exactly that grant.
		var undo, again []*req
		kept := answered[:0:0]
		for j, r := range answered {
			granted := j != failed && isTry(r.op) && r.res >= 1
			if j == failed || granted {
				undo = append(undo, &req{op: r.op + opUnlock - opTry, key: r.key})
			}
			if granted {
				r.res = 0
				again = append(again, r)
				continue
			}
			kept = append(kept, r)
		}
		answered = kept
		retry = append(append(undo, again...), retry...)
	}
	if len(retry) > 0 {
		m.queue = append(retry, m.queue...)
	}
	for _, r := range answered {
		r.answered = true
	}
	next := m.takeLocked()
	mine := me != nil && me.answered
	switch {
	case next == nil && m.closing:
		m.mu.Unlock()
		m.settle(answered)
		return false, ErrClosed
	case next == nil && me != nil && m.dead != nil:
		// kill closed the socket while this caller read (it counted on the reader to settle the Mux): settle it.
		cause := m.dead
		m.mu.Unlock()
		m.settle(answered)
		return false, cause
	case next == nil && me != nil: // a caller's reading ends; the background reader takes over after a quiet moment
		m.token = tokenFree
		m.armLocked()
	case next != nil && mine: // my answer is in and others wait: the background reader takes the busy socket
		m.token = tokenBG
		m.bg.Add(1)
		go func() {
			defer m.bg.Done()
			m.read(nil)
		}()
	}
	m.mu.Unlock()
	m.settle(answered)
	if next != nil {
		if err := m.send(next); err != nil {
			if mine {
				m.kill(err) // the background reader finds the closed socket and settles everything
				return true, nil
			}
			return false, err
		}
	}
	return mine, nil
}

// settle runs the hooks of answered requests (which record grants and releases) and wakes their callers.
func (m *Mux) settle(answered []*req) {
	for _, r := range answered {
		if r.hook != nil {
			r.hook(r)
		}
		if r.sig != nil {
			select {
			case r.sig <- struct{}{}:
			default:
			}
		}
	}
}

// armLocked schedules the background reader for when the socket has been quiet for WatchDelay.
func (m *Mux) armLocked() {
	if m.dead != nil {
		return
	}
	if m.timer == nil {
		m.timer = time.AfterFunc(WatchDelay, m.startBG)
		return
	}
	m.timer.Reset(WatchDelay)
}

// startBG starts the background reader if the socket is still free and quiet.
func (m *Mux) startBG() {
	m.mu.Lock()
	if m.dead != nil || m.busy || m.token != tokenFree {
		m.mu.Unlock()
		return
	}
	m.token = tokenBG
	m.bg.Add(1)
	// Under the lock: a caller that wants the socket back sets a past deadline (see do), which must not be
	// overwritten by this one, or the reader would sleep through it until the bound (a stall of a keepalive).
	_ = m.nc.SetReadDeadline(time.Now().Add(m.bound))
	m.mu.Unlock()
	if h := testHookReaderStarting.Load(); h != nil {
		(*h)(func() bool { m.mu.Lock(); defer m.mu.Unlock(); return m.wantToken != nil })
	}
	go func() {
		defer m.bg.Done()
		m.read(nil)
	}()
}

var testHookReaderStarting atomic.Pointer[func(asked func() bool)]

// testHookSettle, in tests only, is called by a reader as it handles a read deadline ("timeout") and as it
// settles an answered round trip ("complete"), before it takes the Mux's lock: the moments where a kill from
// another goroutine must still be settled by someone.
var testHookSettle atomic.Pointer[func(m *Mux, at string)]

// SetTestHookReaderStarting makes every background reader that starts on a quiet socket call f first, outside the
// Mux's lock; asked reports whether a caller has asked for the socket back. nil removes it. Tests only.
func SetTestHookReaderStarting(f func(asked func() bool)) {
	if f == nil {
		testHookReaderStarting.Store(nil)
		return
	}
	testHookReaderStarting.Store(&f)
}

// takeLocked takes everything queued as the next round trip, marking the Mux busy; nil when nothing is queued.
func (m *Mux) takeLocked() []*req {
	if len(m.queue) == 0 {
		m.busy, m.idleSince = false, time.Now()
		return nil
	}
	batch := m.queue
	m.queue = nil
	m.busy, m.wire, m.sentAt = true, batch, time.Now()
	if cap(m.results) < len(batch) {
		m.results = make([]int64, len(batch))
	}
	m.results = m.results[:len(batch)]
	for i := range m.results {
		m.results[i] = -1
	}
	return batch
}

// send writes one round trip. Only the reader writes.
func (m *Mux) send(batch []*req) error {
	if len(batch) == 1 {
		buf, err := (&pgproto3.Bind{PreparedStatement: singleStmt[b2i(m.fenced)][batch[0].op-1],
			Parameters: [][]byte{strconv.AppendInt(nil, batch[0].key, 10)}}).Encode(nil)
		return m.write(buf, err)
	}
	ops, keys := make([]byte, 1, 4*len(batch)+2), make([]byte, 1, 21*len(batch)+2)
	ops[0], keys[0] = '{', '{'
	for i, r := range batch {
		if i > 0 {
			ops, keys = append(ops, ','), append(keys, ',')
		}
		ops = strconv.AppendInt(ops, int64(r.op), 10)
		keys = strconv.AppendInt(keys, r.key, 10)
	}
	ops, keys = append(ops, '}'), append(keys, '}')
	buf, err := (&pgproto3.Bind{PreparedStatement: muxStmt[b2i(m.fenced)], Parameters: [][]byte{ops, keys}}).Encode(nil)
	return m.write(buf, err)
}

// write sends a Bind (already in buf) with its Execute and Sync.
func (m *Mux) write(buf []byte, err error) error {
	if err == nil {
		buf, err = (&pgproto3.Execute{}).Encode(buf)
	}
	if err == nil {
		buf, err = (&pgproto3.Sync{}).Encode(buf)
	}
	if err != nil {
		return err
	}
	_ = m.nc.SetReadDeadline(time.Now().Add(m.bound))
	if _, err := m.nc.Write(buf); err != nil {
		return fmt.Errorf("session ended: %w", err)
	}
	return nil
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
// (their effect ended with the session), queued ones fail with ErrMuxGone (never sent), every lock held on it is
// lost, and the connection is given up.
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
	if m.wantToken != nil {
		close(m.wantToken)
		m.wantToken = nil
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
	m.mu.Unlock()
	for _, r := range append(wire, queue...) {
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
func (m *Mux) Try(ctx context.Context, t Target, onEnd func()) (*Held, error) {
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
	h := &Held{mux: m, target: t, done: make(chan struct{}), onEnd: onEnd}
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
	once   sync.Once
	done   chan struct{}
	err    error // set before done is closed
	onEnd  func()
	mu     sync.Mutex
	after  []func()
	rel    bool
}

// Done is closed when the lock is released or lost.
func (h *Held) Done() <-chan struct{} { return h.done }

// Token is the grant's fencing token: 0 without fencing.
func (h *Held) Token() int64 { return h.token }

// Err is nil while held; afterwards it says why it ended.
func (h *Held) Err() error {
	select {
	case <-h.done:
		return h.err
	default:
		return nil
	}
}

// PID is the pid of the server session that holds the lock (0 when the driver does not tell).
func (h *Held) PID() uint32 { return h.mux.pid }

// AfterEnd arranges for f to run once the lock ends (at once if it has); stop cancels that.
func (h *Held) AfterEnd(f func()) (stop func() bool) {
	h.mu.Lock()
	select {
	case <-h.done:
		h.mu.Unlock()
		go f()
		return func() bool { return false }
	default:
	}
	h.after = append(h.after, f)
	i := len(h.after) - 1
	h.mu.Unlock()
	return func() bool {
		h.mu.Lock()
		defer h.mu.Unlock()
		if i < len(h.after) && h.after[i] != nil {
			h.after[i] = nil
			return true
		}
		return false
	}
}

func (h *Held) finish(err error) {
	h.once.Do(func() {
		h.err = err
		h.mu.Lock()
		close(h.done)
		after, onEnd := h.after, h.onEnd
		h.after = nil
		h.mu.Unlock()
		for _, f := range after {
			if f != nil {
				f()
			}
		}
		if onEnd != nil {
			onEnd()
		}
	})
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
	h.mu.Unlock()
	if err := h.Err(); err != nil {
		return err
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
		<-h.done
		return h.Err()
	}
	return nil
}
