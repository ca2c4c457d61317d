package session

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"time"

	"github.com/advlock/advlock/internal/mutant"
)

// DefaultWaitSlice is the longest a wait statement runs. A statement waiting in the server holds a snapshot for as
// long as it waits, and a snapshot pins the database's xmin horizon (VACUUM removes no row deleted since it was
// taken) and holds up CREATE INDEX CONCURRENTLY, REINDEX CONCURRENTLY and their kin, which wait for every older
// snapshot; so a wait ends at each slice (the server's lock_timeout) and is sent again at once on the same session.
//
// It is shorter than the server's default deadlock_timeout (1 s), so that the server never runs its deadlock check
// for a wait (nor logs it, with log_lock_waits), once per slice: the check could find nothing, since the session
// that waits holds nothing that anyone waits for (at most the key's intent, which nobody waits for).
const DefaultWaitSlice = 900 * time.Millisecond

// serverWait is one wait in the server on a session of its own, from its first statement to its grant or end. What
// PostgreSQL's own queue gave a single long wait for free, the slices must keep (see docs/locks.md):
//
//   - A grant that raced a slice's end is taken, never taken twice (WaitSQL's requeue).
//   - A writer is not starved by readers that come and go: a writer that finds the key held in shared mode, or that
//     has waited a whole slice, takes the key's intent (see Intent) and holds it across its slices until it is
//     granted; readers do not pass it (a reader's try fails, a reader granted between two of the writer's slices
//     gives the key back at once).
//   - A slow or stalling link does not end a wait: each slice may take its measured round trip and the keepalive
//     bound past its end before the server counts as gone.
//   - The wait publishes when it began (a comment in front of each statement, which pg_stat_activity shows), so
//     that Inspect and advlock ls report the whole wait, not the current slice.
type serverWait struct {
	ctx    context.Context
	conn   Conn
	t      Target
	cfg    Config
	tag    string    // a published wait's comment body for deadlock detection ("w=... h=..."), or ""
	start  time.Time // when the wait began
	intent bool      // the session holds t's intent
	seq    int64     // the wait's place in its key's line (see line.go), or 0
	// timedOut: a statement of this wait ended at a slice's end (55P03). Such an error can surface after the rest
	// of its statement ran (a lock_timeout that fired as a lock was granted is raised at the statement's next check
	// for interrupts), so from then on what the session holds of the line and the intent is read from pg_locks by
	// the statements that give it back or take it (leaveHeldCond, lineSQL's again), not taken from the answers.
	timedOut bool
	idle     bool // taking it gave the session an idle_session_timeout (intentIdle), to be restored
	slack    time.Duration
	rtt      time.Duration   // the longest answer delay seen past a statement's expected answer
	bounces  int             // shared waits given back in a row because a writer's intent stood
	yield    func() bool     // asked after each whole slice: give the session up for another wait (WithYield)
	alts     []ID            // keys any of which will do instead of t, tried in each statement (WithAlternatives)
	known    map[string]bool // statements this wait prepared on its session (see execPrepared)
}

// bounceBackoff is how long a shared wait that was given back (a writer's intent stood) waits before it is sent
// again: at once the first time (the writer is between two slices and queues again within a round trip), then
// longer while it goes on (the writer holds its intent but is not in the server's queue: its link stalls, or its
// process froze), at most bounceMax.
func bounceBackoff(n int) time.Duration {
	if n <= 1 {
		return 0
	}
	return min(bounceMax, time.Millisecond<<min(n-2, 10))
}

const bounceMax = 100 * time.Millisecond

// run waits until granted (a result >= 1), the server ends the wait (55P03 at ctx's deadline), ctx is cancelled,
// or the session fails. first sends the prepared try first (one round trip for a free key); else the wait starts
// with JoinSQL, whose statements publish when the wait began. A wait for one key (no alternatives) joins the key's
// line (see line.go) and waits in it until it is the head; the head waits for the key itself.
func (w *serverWait) run(first bool) (int64, error) {
	if first {
		sql, args := TrySQL(w.t, w.cfg.Fencing)
		r, err := w.between("try", sql, args...)
		if err != nil || r != resultNotHeld {
			return r, err
		}
	}
	if len(w.alts) == 0 && !mutant.On(mutant.WaitRequeueBack) {
		if r, err, done := w.queue(); done {
			return r, err
		}
	}
	requeue := w.timedOut // a statement in the line ended at a slice's end: its key's wait may have been granted as it did
	for {
		if d := bounceBackoff(w.bounces); d > 0 {
			if err := w.pause(d); err != nil {
				return 0, err
			}
		}
		if end, last, _ := slice(w.ctx, w.cfg); last && !time.Now().Before(end) && w.bounces > 0 {
			return 0, errBouncedAtDeadline // given back to a writer, and the deadline has come
		}
		r, err, last := w.waitStatement(requeue)
		requeue = false
		w.timedOut = w.timedOut || SQLState(err) == "55P03"
		switch {
		case SQLState(err) == "55P03" && !last && w.ctx.Err() == nil:
			requeue, w.bounces = true, 0 // a whole slice waited in the queue
			if yielded, err := w.yielded(); yielded || err != nil {
				return 0, err
			}
		case err == nil && (r == resultIntentNow || r == resultIntentIdle):
			w.intent, w.idle = true, w.idle || r == resultIntentIdle
		case err == nil && r == resultBounced:
			w.bounces++ // also in the last slice: it waits again, until the deadline (pause)
		default:
			if err == nil && r >= resultAcquired {
				w.intent, w.idle, w.seq = false, false, 0 // given back with the grant (leaveCond)
			}
			return r, err
		}
	}
}

// waitStatement sends the wait's next statement for the key itself (WaitSQL, or WaitAnySQL with alternatives), one
// slice. Its grant gives back what the wait holds of the key's line and the intent: what the answers said, until a
// statement of the wait ended at a slice's end; from then on what pg_locks says (see timedOut).
func (w *serverWait) waitStatement(requeue bool) (int64, error, bool) {
	if len(w.alts) > 0 {
		end, last, ms := slice(w.ctx, w.cfg)
		r, err := w.statement(end, w.comment()+WaitAnySQL(w.t, w.alts, ms, requeue, w.intent))
		return r, err, last
	}
	return w.sliced(func(n nums, ms int64) stmt { return w.waitText(ms, requeue, n) }, !requeue && !w.timedOut)
}

// waitText is the wait's next WaitSQL with its numbers n.
func (w *serverWait) waitText(ms int64, requeue bool, n nums) stmt {
	leave := leaveCond(w.t, n, w.seq > 0, w.intent, w.idle)
	if w.timedOut && leave != "" {
		leave = leaveHeldCond(n, w.idle)
	}
	return waitStmt(w.t, n, nil, ms, w.cfg.Fencing, requeue, w.intent, leave)
}

// sliced sends one slice of the wait: build's statement for a slice of ms, bounded by the slice's end; last says
// that the slice ends at the deadline. With prepare, the statement is prepared on the session (see
// execPrepared). Only the statements of a wait that has not had a slice's end are prepared: they are the ones a
// contended key sends at every turn; those after a slice's end, sent once a slice, differ from wait to wait in what
// they give back (each prepared text costs its session about 0.25 MB).
func (w *serverWait) sliced(build func(n nums, ms int64) stmt, prepare bool) (r int64, err error, last bool) {
	for prepare {
		end, last, ms := slice(w.ctx, w.cfg)
		run, def, name := build(params(w.t.ID), ms).prepared(numValues(w.t.ID, w.seq, ms, w.idleMS()))
		r, how, err := w.execPrepared(run, def, name, func(sql string) (int64, error) { return w.statement(end, sql) })
		switch how {
		case answered:
			return r, err, last
		case lost:
			prepare = false // as it is, this once
		} // prepared already: sent again, for a slice of its own
	}
	end, last, ms := slice(w.ctx, w.cfg)
	r, err = w.statement(end, w.comment()+build(literalNums(w.t.ID, w.seq, ms, w.idleMS()), ms).String())
	return r, err, last
}

// What became of a statement sent prepared (execPrepared).
const (
	answered   = iota // the statement ran: its answer is the statement's
	preparedOK        // it was prepared already (42P05): nothing ran; send it again
	lost              // the session lost it (26000): nothing ran; send it as it is
)

// execPrepared sends run, a statement prepared on the wait's session under name, with send: on a session that has
// not prepared it (as far as the connection's record and the wait say), def in front of it in the same query (one
// round trip: a PREPARE stands whatever the rest of its query does).
func (w *serverWait) execPrepared(run, def, name string, send func(string) (int64, error)) (r int64, how int, err error) {
	if !w.conn.Prepared(name) && !w.known[name] {
		r, err := send(w.comment() + def + "; " + run)
		w.conn.MarkPrepared(name, true)
		if w.known == nil {
			w.known = map[string]bool{}
		}
		w.known[name] = true // also for a connection that keeps no record (advsql's, its mark trimmed)
		if SQLState(err) == "42P05" {
			return 0, preparedOK, nil // a connection whose record went, a server session a pooler handed on
		}
		return r, answered, err
	}
	r, err = send(w.comment() + run)
	if SQLState(err) == "26000" {
		w.conn.MarkPrepared(name, false)
		delete(w.known, name)
		return 0, lost, nil
	}
	return r, answered, err
}

// prepared sends s, whose body names the wait's numbers as numParams, prepared on the wait's session (see
// execPrepared), or literal, s with its numbers as literals, when the session lost it. For a statement that does
// not wait (the join); see sliced for those that do.
func (w *serverWait) prepared(s stmt, literal func() stmt, send func(string) (int64, error)) (int64, error) {
	run, def, name := s.prepared(numValues(w.t.ID, w.seq, 0, w.idleMS()))
	for range 2 {
		switch r, how, err := w.execPrepared(run, def, name, send); how {
		case answered:
			return r, err
		case lost:
			return send(w.comment() + literal().String())
		}
	}
	return send(w.comment() + literal().String())
}

// joinTries bounds how often a wait tries to join its key's line when other waits take the same ticket at the
// same moment each time (or, past any real use, every number of the ring is held); past it, it waits as the head
// does.
const joinTries = 50

// queue joins t's line and waits in it (LineSQL) until no member is in front of it; done reports that the wait
// ended there (granted by the join's try, failed, or not granted by its deadline), with run's result.
func (w *serverWait) queue() (r int64, err error, done bool) {
	for range joinTries {
		literal := func() stmt { return joinStmt(w.t, literalNums(w.t.ID, 0, 0, w.idleMS()), w.cfg.Fencing) }
		r, err := w.prepared(joinStmt(w.t, params(w.t.ID), w.cfg.Fencing), literal, func(sql string) (int64, error) {
			return w.between("join the key's line", sql)
		})
		switch {
		case err != nil || r > resultJoined && r != resultNotHeld:
			return r, err, true // granted, or standby, or in doubt
		case r <= resultJoined:
			seq, head, intent, idle := joined(r)
			w.seq, w.intent, w.idle = seq, intent, w.idle || idle
			if head {
				return 0, nil, false
			}
			return w.inLine()
		}
	}
	return 0, nil, false
}

// inLine waits in the line, one slice at a time, until the wait is its head, and then for the key in the same
// statement (LineWaitSQL): done with a grant, or when the wait ended; not done when the wait goes on with WaitSQL
// (a head writer that could not take the key's intent, a reader that gave the key back to a writer's intent).
func (w *serverWait) inLine() (int64, error, bool) {
	for {
		again := w.timedOut
		r, err, last := w.sliced(func(n nums, ms int64) stmt {
			return lineStmt(w.t, n, ms, again, &lineWait{w.cfg.Fencing, w.idle})
		}, !again)
		w.timedOut = w.timedOut || SQLState(err) == "55P03"
		switch {
		case SQLState(err) == "55P03" && !last && w.ctx.Err() == nil:
			if yielded, err := w.yielded(); yielded || err != nil {
				return 0, err, true
			}
		case err == nil && r == resultAdvanced:
		case err == nil && r == resultHead:
			w.intent = false // a head writer that could not take it (nor held it: lineStmt's again)
			return 0, nil, false
		case err == nil && r == resultBounced:
			w.bounces++ // the head reader keeps its place, and waits again with WaitSQL
			return 0, nil, false
		default:
			if err == nil && r >= resultAcquired {
				w.intent, w.idle, w.seq = false, false, 0 // given back with the grant
			}
			return r, err, true
		}
	}
}

// yielded reports whether the wait gives its session up after a whole slice, with ErrYielded, because its caller's
// yield asks it to (WithYield). A writer that holds the key's intent while readers hold the key keeps its session,
// and its intent: given back, the intent would let the readers that come while the writer queues for a session in,
// and at its next turn it would wait for them again, for ever (one round trip to ask, only when a yield is asked).
func (w *serverWait) yielded() (bool, error) {
	if w.yield == nil || !w.yield() {
		return false, nil
	}
	sql := SharedNowSQL(w.t)
	if !w.intent {
		if w.t.Shared || w.seq == 0 || !w.timedOut {
			return true, ErrYielded
		}
		// A writer in the line whose statement ended at a slice's end may have found itself the head and taken
		// the intent in it (the error said nothing of that): pg_locks says.
		sql = heldIntentSharedNowSQL(w.t)
	}
	r, err := w.between("ask whether readers hold the key", sql)
	if err != nil {
		return false, err
	}
	if r == 1 {
		return false, nil // readers hold it (or nobody): the writer keeps its place in front of new readers
	}
	return true, ErrYielded
}

// ErrYielded is what Acquire returns for a wait that gave its session up after a whole slice because its
// caller's yield said another wait needs a session more (see WithYield): nothing is held, the session went back
// to its pool, and the caller may wait again.
var ErrYielded = errors.New("advlock: the wait gave its session up for another wait")

type yieldKey struct{}

type contendedKey struct{}

// WithContended returns ctx whose wait skips the prepared try it would begin with (its first statement, JoinSQL,
// tries the key first anyway): its caller found the key held a moment ago.
func WithContended(ctx context.Context) context.Context {
	return context.WithValue(ctx, contendedKey{}, true)
}

type altsKey struct{}

// WithAlternatives returns ctx whose wait (exclusive, on a session of its own) takes any of alts instead of its key
// when one is free: each of its statements tries them in order first (a semaphore's other slots), so that a wait
// for one of several keys costs the server one statement a slice. The Session it returns holds the key it got
// (Session.Target).
func WithAlternatives(ctx context.Context, alts []ID) context.Context {
	return context.WithValue(ctx, altsKey{}, alts)
}

// WithYield returns ctx whose wait in the server, each time it has waited a whole slice without a grant, asks
// yield whether to give its session up (Acquire then returns ErrYielded): a Locker whose sessions of their own
// are all taken shares them out among its waits this way, one slice at a time.
func WithYield(ctx context.Context, yield func() bool) context.Context {
	return context.WithValue(ctx, yieldKey{}, yield)
}

// errBouncedAtDeadline ends a timed wait that was granted past a writer's intent and gave the key back, and whose
// deadline has come since: the session holds nothing (the statement said so), and the wait was not granted in
// time.
var errBouncedAtDeadline = errors.New("not granted before the deadline: a writer waits for the key, and the wait gave it back to that writer")

// pause waits d before a shared wait is sent again; nothing is on the wire, and the session holds nothing. A
// deadline that passes meanwhile ends the wait as the server would (not granted); a cancel ends it too.
func (w *serverWait) pause(d time.Duration) error {
	if dl, ok := w.ctx.Deadline(); ok && time.Until(dl) < d {
		d = max(time.Until(dl), 0)
	}
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-t.C:
	case <-w.ctx.Done():
		if errors.Is(w.ctx.Err(), context.DeadlineExceeded) {
			return errBouncedAtDeadline // the deadline, not a cancel, ended the pause
		}
		return WithContext(w.ctx, errPausedCancelled)
	}
	if dl, ok := w.ctx.Deadline(); ok && !time.Now().Before(dl) {
		return errBouncedAtDeadline
	}
	return nil
}

var errPausedCancelled = errors.New("the wait stood behind a writer that waits for the key")

// comment is what a slice's statement carries in front of it: how long the wait has waited so far (the server's
// query_start less this is when the wait began, on the server's clock) and, for a published wait, what its caller
// holds. pg_stat_activity.query shows it while the statement runs.
func (w *serverWait) comment() string {
	s := "/*advlock q=" + strconv.FormatInt(time.Since(w.start).Milliseconds(), 10)
	if w.tag != "" {
		s += " " + w.tag
	} else {
		s += " k=" + Ref{ID: w.t.ID, Shared: w.t.Shared}.Lock() // which key's line its tickets are (Inspect)
	}
	return s + "*/ "
}

// statement runs one wait statement that the server bounds at end (its lock_timeout), allowing the measured round
// trip and the slack past it (see serverBound), and notes how late the answer came.
func (w *serverWait) statement(end time.Time, sql string, args ...any) (int64, error) {
	r, err := serverBound(w.ctx, w.conn, end.Add(w.rtt+w.slack), sql, args...)
	if late := time.Since(end); SQLState(err) == "55P03" && late > w.rtt {
		w.rtt = min(late, w.slack) // a timeout is answered as the slice ends: what came later is the link's
	}
	return r, err
}

// between sends a statement that never waits, between two slices (what names it in its error): bounded by the
// measured round trip and the keepalive bound, and cut by a cancel of the wait's ctx (not by its deadline, which the
// slices bound).
func (w *serverWait) between(what, sql string, args ...any) (int64, error) {
	ctx, cancel := context.WithTimeout(context.WithoutCancel(w.ctx), w.slack+w.rtt)
	defer cancel()
	stop := context.AfterFunc(w.ctx, func() {
		if !errors.Is(w.ctx.Err(), context.DeadlineExceeded) {
			cancel()
		}
	})
	defer stop()
	r, err := w.conn.QueryInt(ctx, sql, args...)
	if err != nil {
		if w.ctx.Err() == nil && ctx.Err() != nil {
			return 0, fmt.Errorf("%s: no answer within %v; session closed", what, w.slack+w.rtt)
		}
		return 0, fmt.Errorf("%s: %w", what, err)
	}
	return r, nil
}

// idleMS is the idle_session_timeout a session that takes an intent gets when it has none (intentIdle): what Open
// sets on every lock session, FrozenAfter the keepalive interval, which a session that holds an intent (sent again
// at once after each slice) never reaches while its client lives.
func (w *serverWait) idleMS() int64 {
	k := w.cfg.Keepalive
	if k <= 0 {
		k = DefaultKeepalive
	}
	return FrozenAfter(k).Milliseconds()
}

// slice returns when the next slice of a wait ends (at most the wait slice away, at most ctx's deadline), whether
// that is the deadline, and its length in whole milliseconds (at least 1: lock_timeout 0 would mean none).
func slice(ctx context.Context, cfg Config) (end time.Time, last bool, ms int64) {
	s := cfg.WaitSlice
	if s <= 0 {
		s = DefaultWaitSlice
	}
	end = time.Now().Add(s)
	if deadline, timed := ctx.Deadline(); timed && !deadline.After(end) {
		end, last = deadline, true
	}
	d := max(time.Until(end), time.Millisecond)
	return end, last, int64((d + time.Millisecond - 1) / time.Millisecond)
}

// serverBound runs a statement that the server itself bounds (a try, or a wait under lock_timeout): ctx's deadline
// does not cut it (which would cost the session, and could send a cancel request that reaches a later statement);
// only a server that does not answer by until, or a cancellation of ctx other than its deadline, interrupts it. A
// server that does not answer in time is an error of its own, which says so and matches no context error: the
// caller's context did not end.
func serverBound(ctx context.Context, conn Conn, until time.Time, sql string, args ...any) (int64, error) {
	qctx, cancel := context.WithDeadline(context.WithoutCancel(ctx), until)
	defer cancel()
	stop := context.AfterFunc(ctx, func() {
		if !errors.Is(ctx.Err(), context.DeadlineExceeded) {
			cancel()
		}
	})
	defer stop()
	start := time.Now()
	r, err := conn.QueryInt(qctx, sql, args...)
	if err != nil && ctx.Err() == nil && errors.Is(qctx.Err(), context.DeadlineExceeded) {
		err = fmt.Errorf("%w: no answer from the server within %v of sending the statement (its slice, the "+
			"measured round trip and the keepalive bound); session closed", errNoAnswer, until.Sub(start).Round(time.Millisecond))
	}
	return r, err
}

// errNoAnswer marks a statement the server did not answer within its bound.
var errNoAnswer = errors.New("the server stopped answering")

// settle leaves conn, whose wait for t was not granted (the server ended it at the deadline, or it was given
// back), holding nothing: a grant can race the wait's end (the lock then survives the error), so the key is
// settled on the session (SettleSQL, which also gives the intent and the place in the key's line back), which then goes back to its pool. Any doubt
// costs the session instead. It reports whether the session was kept.
func settle(ctx context.Context, conn Conn, w *serverWait) bool {
	uctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 5*time.Second)
	defer cancel()
	if r, err := conn.QueryInt(uctx, w.comment()+SettleSQL(w.t, w.intent, w.seq > 0, w.idle)); err != nil || r != 1 {
		because(conn, "settling a wait that was not granted failed")
		conn.Destroy()
		return false
	}
	conn.Release()
	return true
}

// abandoned makes sure the server has dropped the wait on conn (already destroyed) that was given up: a backend
// blocked in a lock wait notices its closed socket only when granted or at its next
// client_connection_check_interval, and until then pg_locks shows a waiter nobody waits for, which is then granted
// the key for a moment. It is bounded (1 s) and synchronous, so that when Lock returns the server has dropped the
// waiter (a process that exits right after, such as advlock run, leaves no waiter behind). See Conn.Cancel. A
// cancel request is answered once the server has signalled the backend, which leaves the queue a moment later: on
// a direct connection with a pid, abandoned then reads pg_locks through another connection of the pool (when one
// is free at once) until the backend holds and waits for no advisory lock (its intent included).
func abandoned(pool Pool, conn Conn) {
	ctx, cancel := context.WithTimeout(context.Background(), time.Second)
	defer cancel()
	conn.Cancel(ctx)
	pid := conn.ClientPID()
	if _, direct := conn.Verified(); !direct || pid == 0 || pool.Stats().Exhausted() {
		return
	}
	other, err := pool.Acquire(ctx)
	if err != nil {
		return
	}
	for {
		// Any advisory row: a grant that raced the cancel is held until the backend exits.
		n, err := other.QueryInt(ctx, "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND pid = $1::int4", int64(pid))
		if err != nil {
			other.Destroy()
			return
		}
		if n == 0 || ctx.Err() != nil {
			other.Release()
			return
		}
		time.Sleep(time.Millisecond)
	}
}
