// Package session holds the one lifecycle every advisory lock goes through, whatever the driver:
//
//	acquire a connection -> lock -> watch -> unlock -> release, or destroy on any doubt.
//
// Backends (pgxpool, database/sql) implement the small [Pool] and [Conn] interfaces; all decisions about when a
// session may go back to its pool live here.
package session

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/advlock/advlock/internal/mutant"
	"github.com/jackc/pgx/v5/pgconn"
)

// Conn is one database session pinned from a pool for the life of one lock.
type Conn interface {
	// QueryInt runs sql and returns the integer in the first column of the last row. With args, sql is a single
	// statement with $n placeholders; without, it may hold several statements (simple query protocol).
	// Server errors come back translated with [Translate].
	QueryInt(ctx context.Context, sql string, args ...any) (int64, error)
	// QueryText runs sql (no parameters; several statements allowed, over the simple query protocol, which any
	// pooler carries) and returns the text in the first column of the last statement's first row.
	QueryText(ctx context.Context, sql string) (string, error)
	// Wait blocks reading the idle connection until the server sends something, the connection fails, the
	// deadline passes or Interrupt is called. It returns ErrWaitTimeout for the last two (the connection stays
	// usable, with its read deadline still set: the caller clears it with Wait's next call or ClearDeadline),
	// nil for a harmless message such as a notification, and otherwise why the session ended.
	Wait(deadline time.Time) error
	// Interrupt makes a current or next Wait return ErrWaitTimeout at once. It may be called from any goroutine.
	Interrupt()
	// ClearDeadline undoes what Wait and Interrupt left on the connection before it is used for a statement.
	ClearDeadline()
	// Ping makes one round trip.
	Ping(ctx context.Context) error
	// Abort makes a statement that is running now fail at once (closing the socket where the adapter can), from
	// any goroutine. The connection is then destroyed by its owner.
	Abort()
	// Release hands the connection back to its pool. Only called after the server confirmed the unlock.
	Release()
	// ClientPID is the server pid the connection was given at startup (BackendKeyData), or 0 when the driver does
	// not say. A pooler such as PgBouncer hands out its own, so it differs from pg_backend_pid().
	ClientPID() uint32
	// Verified reports whether this physical connection was proved to be a pinned server session, and whether it
	// is a direct one (no pooler between); MarkVerified records it. Adapters keep the mark with the physical
	// connection.
	Verified() (ok, direct bool)
	MarkVerified(direct bool, pid uint32)
	// Prepared reports whether this physical connection's session prepared the statement name, as MarkPrepared
	// recorded (a wait's statements, see stmt.prepared). Adapters keep the record with the physical connection; a
	// record that is wrong costs a round trip (the server says so), never a wrong statement (a name is its text's
	// hash).
	Prepared(name string) bool
	MarkPrepared(name string, ok bool)
	// ServerPID is the server session's pid (pg_backend_pid) recorded by MarkVerified; 0 before. Through a pooler
	// in session mode it is the server's, not the pooler's (ClientPID).
	ServerPID() uint32
	// Cancel makes sure, within ctx, that the server has dropped the statement this session was abandoned in (a
	// wait given up, its connection already destroyed), so that no waiter is left queued in the server that is
	// later granted the key: the server notices a closed socket only when it next writes to it or checks it. pgx
	// adapters send a protocol cancel request on a direct connection (through a pooler the pooler cancels, and
	// PgBouncer 1.18 to 1.20 can crash on extra cancel requests); lib/pq, which sends its own cancel request when
	// the statement's ctx ends, waits for that statement to end (the server answers the cancel).
	Cancel(ctx context.Context)
	// Destroy closes the network connection at once (the server then ends the backend and drops its locks) and
	// makes the pool forget it. It must not block on the network.
	Destroy()
	// Wire runs f with the connection's *pgconn.PgConn for as long as f runs (nothing else uses the connection
	// meanwhile) and returns f's error, where the driver gives that access (pgxpool; database/sql with pgx's
	// driver); elsewhere it returns an error without calling f. Shared sessions drive the protocol through it.
	Wire(f func(pc *pgconn.PgConn) error) error
}

// UntilQuerier is what a Conn offers when it can bound a statement by a deadline on the connection itself (pgx's:
// the socket's deadline) rather than by a context, which costs a context, its timer and the driver's watch of it at
// every statement. ctx is for its values only: its end does not cut the statement. Past the deadline the statement
// fails with an error that matches context.DeadlineExceeded, as a context's deadline would, and the connection is to
// be destroyed.
type UntilQuerier interface {
	QueryTextUntil(ctx context.Context, deadline time.Time, sql string) (string, error)
}

// QueryTextUntil runs sql on c as QueryText does, bounded by deadline and not by ctx's end (ctx: its values): on the
// connection's own deadline where c offers it (UntilQuerier), else with a context that ends at deadline.
func QueryTextUntil(ctx context.Context, c Conn, deadline time.Time, sql string) (string, error) {
	if q, ok := c.(UntilQuerier); ok {
		return q.QueryTextUntil(ctx, deadline, sql)
	}
	ctx, cancel := context.WithDeadline(context.WithoutCancel(ctx), deadline)
	defer cancel()
	return c.QueryText(ctx, sql)
}

// Dialer is what a Pool offers when it can open a connection outside itself: a reading that must not wait for the
// pool's connections (deadlock detection while every one of them waits) takes one.
type Dialer interface {
	Dial(ctx context.Context) (TextConn, error)
}

// TextConn is a connection outside any pool, for readings.
type TextConn interface {
	// QueryText runs sql and returns the text in the first column of its one row.
	QueryText(ctx context.Context, sql string) (string, error)
	Close()
}

// Pool hands out sessions.
type Pool interface {
	Acquire(ctx context.Context) (Conn, error)
	// Wires reports whether its connections' Wire works, which shared sessions need.
	Wires() bool
	// Stats reports the pool's connections.
	Stats() PoolStats
	// DialsInCall reports whether Acquire makes a new connection in the caller's context and drops it half made
	// when that context ends (database/sql does; pgxpool makes it apart): a wait bounded shorter than a
	// connection's making would then make one per call and never reach the server, so advlock lets the making
	// outlive the call (see Waits.setUp).
	DialsInCall() bool
}

// PoolStats are a pool's own figures.
type PoolStats struct {
	Max       int   // the most connections it opens (0: no limit)
	Open      int   // connections open
	InUse     int   // taken out of the pool (by locks, shared sessions, waits, or the application)
	Idle      int   // open and free
	WaitCount int64 // acquisitions so far that had to wait for a connection
}

// Exhausted reports whether every connection the pool may open is taken: an acquisition now would wait.
func (p PoolStats) Exhausted() bool { return p.Max > 0 && p.InUse >= p.Max }

// Config tunes a session.
type Config struct {
	// Keepalive is how long a held session may stay silent before a keepalive round trip, and how long that
	// round trip may take. A silently dropped network is noticed within about twice this.
	Keepalive time.Duration
	// Wrap, when set, wraps each connection (tests use it to inject faults).
	Wrap func(Conn) Conn
	// Starter batches the start of watchers; nil gives each session its own.
	Starter *Starter
	// Waits, when set, lets Close abort lock statements that wait in the server.
	Waits *Waits
	// Fencing: every grant draws a token from FenceSeq (which must exist: EnsureFence).
	Fencing bool
	// UnlockKey, in tests only, changes the key an unlock is sent for, so that the server really answers false.
	UnlockKey func(ID) ID
	// Events, when set, is told when sessions open, close and are destroyed.
	Events Events
	// OpenBound bounds the opening of a shared session (0: VerifyBound). Tests shorten it.
	OpenBound time.Duration
	// WaitSlice bounds each statement of a wait in the server (0: DefaultWaitSlice). Tests shorten it.
	WaitSlice time.Duration
	// Settings are applied (SET, session level) once per physical connection, once it is proved to be a server
	// session of its own (direct, or pinned by a pooler in session mode), never through a transaction-mode
	// pooler, where they would stay on a server session that other clients then use. Names and values are SQL
	// literals chosen by this module, never user input.
	Settings []Setting
}

// Setting is one session setting: SET name = value.
type Setting struct{ Name, Value string }

// settingsSQL renders settings as one multi-statement query that yields 1.
func settingsSQL(settings []Setting) string {
	var b strings.Builder
	for _, st := range settings {
		b.WriteString("SET " + st.Name + " = '" + st.Value + "'; ")
	}
	b.WriteString("SELECT 1")
	return b.String()
}

// OnEnd is what the owner of a lock is told as it ends, however it ends (released, lost, closed), once: with what
// Err then reports, before Done closes (the owner gives the key's in-process slot back then, so that a holder told
// of the loss finds the key free). The func it returns, if not nil, runs once Done has closed (observers: what
// watches Done, such as Do's fn, is told first).
type OnEnd func(err error) (after func())

// Session is one held lock on its own pinned connection.
type Session struct {
	pid       uint32 // the server session's
	conn      Conn
	target    Target
	keepalive time.Duration

	ctx      context.Context // ends when the lock is released or lost; context.Cause says which
	end      context.CancelCauseFunc
	watchMu  sync.Mutex
	stopping bool // guarded by watchMu: Release wants the connection back
	pinging  bool // guarded by watchMu: a keepalive round trip is in flight, which must not be cut short
	// Confirm's round trips, guarded by watchMu: the watcher's pings sent so far, the last that was answered, the
	// one a Confirm waits for, and a channel closed after each answer (made by a Confirm; nil otherwise).
	watching   bool
	pingsSent  uint64
	pingsOK    uint64
	asked      uint64
	pinged     chan struct{}
	markTried  bool // the first round trip sent for a Confirm also takes the lock's marker (ID.Linger)
	marked     bool // it was granted: the release gives it back (read once the watcher has returned)
	starter    *Starter
	pendingIdx int       // index in starter.pending while not yet watched, else -1; guarded by starter.mu
	granted    time.Time // when the lock was granted (set by starter.add)
	watchDone  chan struct{}
	released   atomic.Bool
	onEnd      OnEnd
	endOnce    sync.Once
	unlockKey  func(ID) ID
	token      int64 // the grant's fencing token (0 without fencing)
}

// Token is the grant's fencing token: 0 without fencing.
func (s *Session) Token() int64 { return s.token }

// Target is the key and mode the session holds: the wait's own key, or the alternative it got (WithAlternatives).
func (s *Session) Target() Target { return s.target }

// PID is the pid of the server session that holds the lock (0 when the driver does not tell).
func (s *Session) PID() uint32 { return s.pid }

// Acquire pins a connection from pool and locks t on it. With wait it blocks in the server until granted or ctx
// ends; without, it fails at once with ErrNotAcquired when the key is held elsewhere.
//
// On any error, or when ctx ended while the statement ran, the connection is destroyed, never pooled: a grant can
// race a cancel (the server grants, then reports the cancel), and a late cancel can hit a later statement.
//
// onEnd, if not nil, is called once when the lock ends, however it ends (released, lost, closed): see OnEnd.
func Acquire(ctx context.Context, pool Pool, t Target, wait bool, cfg Config, onEnd OnEnd) (*Session, error) {
	if !wait && pool.Stats().Exhausted() {
		return nil, ErrPoolExhausted // a try does not wait for a connection
	}
	// A try does not wait for the key, nor without end for a connection: taking one may dial, or (database/sql)
	// ping an idle one first; both are bounded like the checks of a new connection.
	actx, acancel := ctx, context.CancelFunc(func() {})
	if !wait {
		actx, acancel = context.WithTimeout(ctx, VerifyBound)
	}
	conn, err := cfg.Waits.acquire(actx, pool)
	acquireBound := ctx.Err() == nil && actx.Err() != nil
	acancel()
	if err != nil {
		if errors.Is(err, ErrClosed) {
			return nil, err
		}
		if acquireBound {
			return nil, &noConnWithin{err}
		}
		return nil, WithContext(ctx, fmt.Errorf("acquire connection: %w", err))
	}
	if cfg.Wrap != nil {
		conn = cfg.Wrap(conn)
	}
	conn = observe(conn, cfg.Events, "dedicated")
	// The round trips before the lock statement, and a try's lock statement, are answered at once by a live
	// server: each is bounded (a context without a deadline must not hang a call in a network that drops
	// packets). Only a wait in the server is as long as ctx says.
	if err := cfg.Waits.check(ctx, pool, conn, cfg.Settings); err != nil {
		return nil, WithContext(ctx, err)
	}
	// A try is one prepared statement; a wait begins with it too (or, to publish its start, with JoinSQL), and a
	// wait that finds the key held joins its line and waits in the server one slice at most per statement, sent
	// again after each (serverWait.run), so that none of its statements holds a snapshot for long.
	if wait && !cfg.Waits.add(conn) {
		conn.Release() // nothing was sent
		return nil, ErrClosed
	}
	deadline, timed := ctx.Deadline()
	timed = timed && wait
	if timed && time.Until(deadline) <= 0 {
		cfg.Waits.remove(conn)
		conn.Release() // nothing was sent
		return nil, WithContext(ctx, context.DeadlineExceeded)
	}
	bound := cfg.Keepalive
	if bound <= 0 {
		bound = DefaultKeepalive
	}
	bound = max(bound, time.Second) // only against a hang: a short keepalive must not fail tries on a busy machine
	var r int64
	w := &serverWait{ctx: ctx, conn: conn, t: t, cfg: cfg, slack: bound}
	if !wait {
		sql, args := TrySQL(t, cfg.Fencing)
		tctx, tcancel := context.WithTimeout(ctx, bound)
		r, err = conn.QueryInt(tctx, sql, args...)
		if err != nil && ctx.Err() == nil && tctx.Err() != nil {
			err = fmt.Errorf("try: no answer within %v (the keepalive interval); session closed", bound)
		}
		tcancel()
	} else {
		w.start = waitStart(ctx)
		w.yield, _ = ctx.Value(yieldKey{}).(func() bool)
		if !t.Shared {
			w.alts, _ = ctx.Value(altsKey{}).([]ID)
		}
		if tag := waitTagFrom(ctx); tag != nil {
			// A published wait: its session and its statements are what other clients' detection reads.
			w.tag = tag.Comment
			tag.enter(conn.ServerPID())
			r, err = w.run(false)
			tag.leave()
		} else {
			// The prepared first statement knows no alternatives, and publishes no start: a wait that began a while
			// ago (it queued for a session, or gave one up to another wait) starts with JoinSQL, which does.
			// A wait for a key found held a moment ago (WithContended) starts with JoinSQL too, whose try comes first:
			// the prepared try would most likely fail, a round trip for nothing.
			contended, _ := ctx.Value(contendedKey{}).(bool)
			r, err = w.run(len(w.alts) == 0 && !contended && time.Since(w.start) < publishAfter)
		}
		if err == nil && len(w.alts) > 0 && r >= resultAcquired {
			if r > resultAcquired && int(r-2) < len(w.alts) {
				t = Target{ID: w.alts[r-2]}
			}
			r = resultAcquired
			if cfg.Fencing { // its statement could not draw the token: it is drawn now, the lock held
				tctx, tcancel := context.WithTimeout(context.WithoutCancel(ctx), bound)
				r, err = conn.QueryInt(tctx, TokenGrantSQL)
				tcancel()
			}
		}
	}
	if wait && !cfg.Waits.remove(conn) && err != nil {
		err = fmt.Errorf("%w: %w", ErrClosed, err) // Close aborted the wait
	}
	switch {
	case errors.Is(err, ErrClosed):
	case errors.Is(err, errBouncedAtDeadline):
		// Given back to a writer as the deadline came: not granted. The session is settled and kept.
		settle(ctx, conn, w)
		return nil, WithContext(ctx, err)
	case timed && SQLState(err) == "55P03":
		// The server ended the wait at its deadline: it was not granted, though a grant may have raced the
		// timeout. The session is settled and kept.
		settle(ctx, conn, w)
		return nil, WithContext(ctx, fmt.Errorf("not granted before the deadline (the server's lock_timeout): %w", err))
	case errors.Is(err, errPausedCancelled):
		settle(ctx, conn, w) // nothing on the wire: the session is kept
		return nil, WithContext(ctx, err)
	case errors.Is(err, ErrYielded):
		// Between two slices: not granted, though a grant may have raced the slice's end (settled: the key then
		// goes to the next waiter), and the intent is given back.
		settle(ctx, conn, w) // kept, or closed on doubt: nothing is held either way
		return nil, ErrYielded
	}
	// A grant that raced the deadline of a timed wait stands (the server answered within its bound); any other
	// statement that finished after ctx ended is in doubt.
	if err == nil && ctx.Err() != nil && mutant.On(mutant.CancelGrantDropped) {
		conn.Release() // granted, reported as not acquired, pooled while held
		return nil, WithContext(ctx, ctx.Err())
	}
	if err != nil || ctx.Err() != nil && !(timed && errors.Is(ctx.Err(), context.DeadlineExceeded)) {
		if err != nil {
			becauseErr(conn, "lock statement failed", err)
		} else {
			because(conn, "lock statement finished after its context ended")
		}
		conn.Destroy()
		if wait && SQLState(err) == "" {
			abandoned(pool, conn)
		}
		if err == nil {
			err = errors.New("lock statement finished after the context ended; session closed")
		}
		return nil, WithContext(ctx, err)
	}
	switch {
	case r >= resultAcquired:
	case r == resultNotHeld:
		conn.Release()
		return nil, ErrNotAcquired
	case r == resultStandby && (w.seq > 0 || w.intent):
		because(conn, "the server is a standby now")
		conn.Destroy() // its place in a line, or an intent, taken on a primary
		return nil, ErrStandby
	case r == resultStandby:
		conn.Release() // the CASE took no lock
		return nil, ErrStandby
	default:
		because(conn, fmt.Sprintf("unexpected lock result: %d", r))
		conn.Destroy()
		return nil, fmt.Errorf("advlock: unexpected lock result %d; session closed", r)
	}
	var token int64
	if cfg.Fencing {
		token = r
	}

	s := &Session{conn: conn, pid: conn.ServerPID(), target: t, keepalive: cfg.Keepalive,
		watchDone: make(chan struct{}), onEnd: onEnd, unlockKey: cfg.UnlockKey, token: token}
	if s.keepalive <= 0 {
		s.keepalive = DefaultKeepalive
	}
	s.ctx, s.end = context.WithCancelCause(context.Background())
	s.starter = cfg.Starter
	if s.starter == nil {
		s.starter = new(Starter)
	}
	s.starter.add(s)
	return s, nil
}

// publishAfter is how long after its start a wait publishes when it began (WaitSQL's comment) from its first
// statement on: a wait that took longer to reach the server would otherwise show the start of its statement.
const publishAfter = 50 * time.Millisecond

// verify proves, once per physical connection, that conn is a server session of its own: either the pid the
// server gave at startup is the session's pid (a direct connection), or a second client connection from the same
// pool does not land on the same server session (which a transaction-mode pooler, reusing the most recently
// released server session, would do). It takes no lock. Once proved, it applies settings, in one more round trip.
func verify(ctx context.Context, pool Pool, conn Conn, settings []Setting) error {
	if ok, _ := conn.Verified(); ok {
		return nil
	}
	p1, err := conn.QueryInt(ctx, "SELECT pg_backend_pid()")
	if err != nil {
		return fmt.Errorf("check session: %w", err)
	}
	direct := false
	if cp := conn.ClientPID(); cp != 0 && int64(cp) == p1 {
		direct = true
	} else if err := notTxPooled(ctx, pool, p1, settings); err != nil {
		return err
	}
	if len(settings) > 0 {
		if _, err := conn.QueryInt(ctx, settingsSQL(settings)); err != nil {
			return fmt.Errorf("apply session settings: %w", err)
		}
	}
	conn.MarkVerified(direct, uint32(p1))
	return nil
}

// notTxPooled asks a second connection of pool for its server pid: a transaction-mode pooler hands it p1 again.
// When it does not, the same answer proves the second connection too (each was a server session apart from the
// other's while both were held): it is marked checked, with settings applied, before it goes back to the pool. So a
// check never leaves an unchecked connection behind it, which the next call would check in turn with one more new
// connection: with database/sql's default of 2 idle connections, each such check's extra connection closed another,
// and every other call made a connection.
func notTxPooled(ctx context.Context, pool Pool, p1 int64, settings []Setting) error {
	pctx, cancel := context.WithTimeout(ctx, 2*time.Second)
	defer cancel()
	other, err := pool.Acquire(pctx)
	if err != nil {
		if ctx.Err() != nil {
			return fmt.Errorf("check session: %w", err)
		}
		return fmt.Errorf("%w: %v", ErrUnverified, err)
	}
	p2, err := other.QueryInt(ctx, "SELECT pg_backend_pid()")
	if err != nil {
		other.Destroy()
		return fmt.Errorf("check session: %w", err)
	}
	if p1 == p2 {
		other.Release()
		return fmt.Errorf("%w (server pid %d)", ErrTxPooling, p1)
	}
	if ok, _ := other.Verified(); !ok {
		if len(settings) > 0 {
			if _, err := other.QueryInt(ctx, settingsSQL(settings)); err != nil {
				other.Destroy() // conn is proven all the same; this one is not, and is not kept unchecked
				return nil
			}
		}
		other.MarkVerified(false, uint32(p2))
	}
	other.Release()
	return nil
}

// OpenSettings are what the Lockers of advlock.Open and advsql.Open set on each lock session (see advlock.Open):
// no statement or lock timeout that would cut a wait, idle_session_timeout of FrozenAfter(keepalive), and server
// keepalives and client_connection_check_interval so that a vanished client's locks are dropped in about 25 s.
func OpenSettings(keepalive time.Duration) []Setting {
	return []Setting{
		{Name: "statement_timeout", Value: "0"},
		{Name: "lock_timeout", Value: "0"},
		{Name: "idle_session_timeout", Value: strconv.FormatInt(FrozenAfter(keepalive).Milliseconds(), 10)},
		{Name: "idle_in_transaction_session_timeout", Value: "0"},
		{Name: "tcp_keepalives_idle", Value: "10"},
		{Name: "tcp_keepalives_interval", Value: "5"},
		{Name: "tcp_keepalives_count", Value: "3"},
		{Name: "client_connection_check_interval", Value: "5s"},
	}
}

// FrozenAfter is the idle_session_timeout that advlock sets on the sessions it controls: a live holder pings its
// session after one keepalive interval of silence, so only a frozen holder's session stays silent this long.
func FrozenAfter(keepalive time.Duration) time.Duration { return 3 * keepalive }

// frozenSQL sets FrozenAfter on a session on servers that have idle_session_timeout (PostgreSQL 14+); the CASE
// evaluates lazily, so older servers are not asked for a setting they do not know.
func frozenSQL(keepalive time.Duration) string {
	return "SELECT CASE WHEN current_setting('server_version_num')::int >= 140000 THEN " +
		"length(set_config('idle_session_timeout', '" + strconv.FormatInt(FrozenAfter(keepalive).Milliseconds(), 10) +
		"', false)) ELSE 0 END"
}

// VerifyBound bounds the round trips that check a new connection before its first lock (its server pid, a second
// connection to rule out transaction pooling, the settings), and a try's wait for a connection.
const VerifyBound = 10 * time.Second

// DefaultKeepalive is used when Config.Keepalive is zero.
const DefaultKeepalive = 5 * time.Second

// Done is closed when the lock is released or lost.
func (s *Session) Done() <-chan struct{} { return s.ctx.Done() }

// Err is nil while the lock is held; afterwards it says why it ended.
func (s *Session) Err() error { return context.Cause(s.ctx) }

// watch owns the idle connection while the lock is held. A FATAL from the server (terminate, idle timeout,
// shutdown) or a closed socket ends Wait at once; a keepalive with a deadline bounds silent network loss.
//
// What Wait read is judged before whether Release asked for the connection back: a session that ended is a lost
// lock even when the unlock is already on its way. A keepalive round trip, once sent, is never cut short (Release
// does not interrupt it; it waits for it, at most one keepalive interval), so a healthy lock is never reported lost.
func (s *Session) watch() {
	defer close(s.watchDone)
	s.watchMu.Lock()
	s.watching = true
	ping := s.asked > s.pingsSent // a Confirm came before the watcher
	s.watchMu.Unlock()
	for {
		err := ErrWaitTimeout
		if !ping {
			err = s.conn.Wait(time.Now().Add(s.keepalive))
		}
		switch {
		case err == nil:
			if s.stopRequested() {
				return
			}
			continue
		case errors.Is(err, ErrWaitTimeout):
			s.watchMu.Lock()
			if s.stopping {
				s.watchMu.Unlock()
				return // Release asked (its Interrupt ended the Wait); the connection is theirs again
			}
			s.pinging = true
			s.pingsSent++
			seq := s.pingsSent
			mark := s.asked >= seq && !s.markTried
			s.markTried = s.markTried || mark
			s.watchMu.Unlock()
			s.conn.ClearDeadline()
			ctx, cancel := context.WithTimeout(context.Background(), s.keepalive)
			marked := false
			if mark {
				var r int64
				r, err = s.conn.QueryInt(ctx, LingerSQL(s.target.ID.Pair), s.target.ID.Linger().V)
				marked = err == nil && r == 1
				if errors.Is(err, ErrLockTableFull) {
					err = nil // answered: the session is there, only the marker found no room
				}
			} else {
				err = s.conn.Ping(ctx)
			}
			if err != nil && ctx.Err() != nil {
				// said as a shared session's keepalive says it, whatever the driver made of the deadline
				err = fmt.Errorf("no answer within %v: %w", s.keepalive, context.DeadlineExceeded)
			}
			cancel()
			s.watchMu.Lock()
			s.pinging = false
			s.marked = s.marked || marked
			if err == nil {
				s.pingsOK = seq
			}
			if s.pinged != nil {
				close(s.pinged)
				s.pinged = nil
			}
			stop := s.stopping
			ping = s.asked > seq // a Confirm that came while this ping was on the wire wants one sent after it
			s.watchMu.Unlock()
			if err == nil {
				if stop {
					return
				}
				continue
			}
			err = fmt.Errorf("keepalive: %w", err)
		}
		if mutant.On(mutant.SilentLossDedicated) {
			return // nobody is told; Unlock finds the session gone
		}
		becauseErr(s.conn, "lock lost", err)
		s.conn.Destroy()
		s.finish(fmt.Errorf("%w: %w", ErrLockLost, err))
		return
	}
}

// Confirm asks the server whether the session is still there, and so still holds the lock: the watcher sends a
// round trip after this call (interrupting its wait on the idle connection, or right after a keepalive already on
// the wire) and Confirm returns nil once it is answered. A session that ended, or ends meanwhile, returns why (Err:
// the loss, or the clean release that came first). When ctx ends first it returns an error matching
// ErrUnlockFailed and ctx's error, and the lock goes on as it was.
func (s *Session) Confirm(ctx context.Context) error {
	s.watchMu.Lock()
	want := s.pingsSent + 1
	s.asked = max(s.asked, want)
	if s.watching && !s.pinging && !s.stopping {
		s.conn.Interrupt() // its Wait returns at once and it pings; a ping on the wire is never cut
	}
	for {
		if s.pingsOK >= want {
			s.watchMu.Unlock()
			return nil
		}
		if s.pinged == nil {
			s.pinged = make(chan struct{})
		}
		ch := s.pinged
		s.watchMu.Unlock()
		select {
		case <-ch:
		case <-s.ctx.Done():
			return s.Err()
		case <-ctx.Done():
			if err := s.Err(); err != nil {
				return err
			}
			return NotConfirmed(ctx, nil)
		}
		s.watchMu.Lock()
	}
}

// NotConfirmed is the error of a Confirm that got no answer: cause, or none when ctx ended first. It matches
// ErrUnlockFailed, cause and, when ctx has ended, ctx's error.
func NotConfirmed(ctx context.Context, cause error) error {
	if cause == nil {
		cause = fmt.Errorf("no answer: %w", context.Cause(ctx))
	}
	return WithContext(ctx, &notConfirmed{cause})
}

type notConfirmed struct{ cause error }

func (e *notConfirmed) Error() string {
	return "advlock: lock not confirmed (" + e.cause.Error() + "); it stays held until its minimum hold has passed"
}

func (*notConfirmed) Is(target error) bool { return target == ErrUnlockFailed }

func (e *notConfirmed) Unwrap() error { return e.cause }

// finish ends the lock with cause, once: the owner is told first (OnEnd), then Done closes, then what OnEnd asked
// to run after.
func (s *Session) finish(cause error) {
	s.endOnce.Do(func() {
		var after func()
		if s.onEnd != nil {
			after = s.onEnd(cause)
		}
		s.end(cause)
		if after != nil {
			after()
		}
	})
}

// AfterEnd arranges for f to run once the lock ends; stop cancels that.
func (s *Session) AfterEnd(f func()) (stop func() bool) { return context.AfterFunc(s.ctx, f) }

func (s *Session) stopRequested() bool {
	s.watchMu.Lock()
	defer s.watchMu.Unlock()
	return s.stopping
}

// stopWatch takes the connection back from a running watcher: it interrupts a Wait, or lets a keepalive round trip
// in flight finish, and returns once the watcher has returned (having reported a loss if it found one).
func (s *Session) stopWatch() {
	s.watchMu.Lock()
	s.stopping = true
	if !s.pinging {
		s.conn.Interrupt()
	}
	s.watchMu.Unlock()
	<-s.watchDone
	s.conn.ClearDeadline()
}

// ErrWaitTimeout is what Conn.Wait returns when its deadline passed or it was interrupted.
var ErrWaitTimeout = errors.New("wait timed out")

// Release unlocks and returns the connection to its pool when the server confirms the unlock. When the unlock
// returns false, fails, times out or ctx has ended, the connection is destroyed instead and the returned error
// says so. after is what Err reports once released cleanly (ErrNotHeld or ErrClosed). A second call returns
// ErrNotHeld.
func (s *Session) Release(ctx context.Context, after error) error {
	if !s.released.CompareAndSwap(false, true) {
		return ErrNotHeld
	}
	if !s.starter.remove(s) { // the watcher has started: stop it and take the connection back
		s.stopWatch()
	}
	if err := s.Err(); err != nil {
		return err // lost; the watcher destroyed the connection
	}
	t := s.target
	if s.unlockKey != nil {
		t.ID = s.unlockKey(t.ID)
	}
	if mutant.On(mutant.UnlockSkippedDedicated) { // back to the pool, still holding the key
		s.conn.Release()
		s.finish(after)
		return nil
	}
	sql, args := UnlockSQL(t)
	if s.marked { // the marker goes with the key (the watcher, which set it, has returned: no lock needed)
		sql, args = UnlockLingeringSQL(t, s.target.ID)
	}
	r, err := s.conn.QueryInt(ctx, sql, args...)
	switch {
	case err == nil && r == resultAcquired && ctx.Err() == nil:
		s.conn.Release()
		s.finish(after)
		return nil
	case err == nil && r == resultNotHeld:
		err = fmt.Errorf("%w: pg_advisory_unlock returned false: this session no longer held the key; session closed", ErrLockLost)
	case err != nil && Ended(err) && (ctx.Err() == nil || SQLState(err) != ""):
		// The session was gone before the unlock could run (it died before the watcher started, or as it was
		// being stopped): the server dropped the lock when the session ended, so it was lost, not unconfirmed.
		err = fmt.Errorf("%w: session ended: %w", ErrLockLost, err)
	default:
		if err == nil {
			err = fmt.Errorf("unexpected unlock result %d", r)
		}
		err = WithContext(ctx, fmt.Errorf("%w: %w", ErrUnlockFailed, err))
	}
	becauseErr(s.conn, "unlock not confirmed", err)
	s.conn.Destroy()
	s.finish(err)
	return err
}

// WithContext makes err match ctx.Err() and the context's cause when ctx has ended. A deadline that has passed
// counts as ended even if the context has not yet noticed (a dial bounded by the same deadline can fail a moment
// before the context's timer fires), so that a call that ran out of time always says so.
func WithContext(ctx context.Context, err error) error {
	cerr, cause := ctx.Err(), context.Cause(ctx)
	if cerr == nil {
		d, ok := ctx.Deadline()
		if !ok || time.Now().Before(d) {
			return err
		}
		cerr, cause = context.DeadlineExceeded, context.DeadlineExceeded
	}
	if errors.Is(err, cerr) && errors.Is(err, cause) {
		return err
	}
	return &ctxError{ctx: cerr, cause: cause, err: err}
}

type ctxError struct{ ctx, cause, err error }

func (e *ctxError) Error() string {
	if e.cause != e.ctx {
		return e.cause.Error() + ": " + e.err.Error()
	}
	return e.ctx.Error() + ": " + e.err.Error()
}

func (e *ctxError) Unwrap() []error { return []error{e.cause, e.ctx, e.err} }
