package session

import (
	"errors"
	"fmt"
	"net"
	"strconv"
	"time"

	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgproto3"
)

// Who reads the socket.
const (
	tokenFree   = iota // nobody: the next caller to send reads, or the background reader after WatchDelay
	tokenCaller        // a caller, until its own request is answered
	tokenBG            // the background reader, while the session is quiet
)

// do queues r and waits for its answer. If no round trip is on the wire it sends r at once and reads the answer
// itself; else r goes out in the next round trip, and the caller waits (or reads, when its turn comes).
func (m *Mux) do(r *req) {
	m.mu.Lock()
	// A sporadic caller on a socket the background reader has read quietly for a while: its round trip goes out at
	// once, the background reader reads the answer and then gives the socket up (complete), so that the caller's
	// next round trip reads its own answer. (Taking the socket back first would cost two wake-ups before the
	// request goes out.) One that was busy a moment ago goes on reading: under load the socket stays with it.
	if m.dead == nil && !m.busy && m.token == tokenBG && time.Since(m.idleSince) >= WatchDelay {
		m.handBack = true
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

// read is the reading role: it reads answers until me is answered (me nil: the background reader, until it gives
// the socket up or the Mux dies), sending what queued meanwhile.
func (m *Mux) read(me *req) {
	for {
		msg, err := m.fe.Receive()
		if h := testHookMessage.Load(); h != nil && err == nil {
			msg = (*h)(m, msg)
		}
		if err != nil {
			var ne net.Error
			if errors.As(err, &ne) && ne.Timeout() {
				if err := m.onTimeout(); err != nil {
					m.die(err)
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

// complete settles the round trip on the wire, sends whatever queued meanwhile, and decides who reads next. It
// reports done when the reader me may stop reading: its own request is answered (and the role has passed on or
// the socket is free), or the background reader answered a sporadic caller and nothing else waits (it gives the
// socket up).
func (m *Mux) complete(me *req) (done bool, err error) {
	if h := testHookSettle.Load(); h != nil {
		(*h)(m, "complete")
	}
	m.mu.Lock()
	wire, results, batchErr := m.wire, m.results, m.batchErr
	m.wire, m.batchErr = nil, nil
	failed := -1 // the request whose row failed; those after it never ran
	var retry []*req
	deferred := false // the failed request is answered with its undo
	for i, r := range wire {
		switch {
		case results[i] >= 0:
			r.res = results[i]
		case failed >= 0:
			retry = append(retry, r)
		case batchErr != nil && errors.Is(batchErr, ErrLockTableFull) && (isTry(r.op) || r.op >= opLinger):
			r.err, failed = batchErr, i // no lock-table space for this try
			if isGatedTry(r.op) && !m.fenced {
				// Its key was granted before its test of the key's intent, or its line's flag, found no space
				// (sharedTry, exclusiveTry): undone first in the next round trip, exactly (the unlock answers false
				// when it was not), and its caller told once the undo is answered, so that a try that failed holds
				// nothing when it returns.
				u := undoOf(r)
				u.after, deferred = r, true
				retry = append(retry, u)
			}
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
		if deferred {
			answered = wire[:failed]
		}
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
				u := undoOf(r)
				if j == failed {
					u.after = r // told once its undo is answered
				}
				undo = append(undo, u)
			}
			if granted {
				r.res = 0
				again = append(again, r)
				continue
			}
			if j != failed {
				kept = append(kept, r)
			}
		}
		answered = kept
		retry = append(append(undo, again...), retry...)
	}
	if len(retry) > 0 {
		m.queue = append(retry, m.queue...)
	}
	for i, n := 0, len(answered); i < n; i++ {
		r := answered[i]
		r.answered = true
		if r.after != nil { // an undo answered: the refused try it undid is answered now
			r.after.answered = true
			answered = append(answered[:len(answered):len(answered)], r.after)
		}
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
	case next == nil && m.handBack && m.dead == nil:
		// The background reader answered a sporadic caller and nothing else waits: it gives the socket up (a kill
		// from now on finds it free and settles the Mux itself; one before this goes on to the reader, which finds
		// the closed socket).
		m.handBack = false
		m.token = tokenFree
		m.armLocked()
		m.mu.Unlock()
		m.settle(answered)
		return true, nil
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
