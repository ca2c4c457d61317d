package lease

import (
	"context"
	crand "crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"math"
	"math/rand/v2"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/advlock/advlock/internal/mutant"
	"github.com/advlock/advlock/internal/session"
)

// Client takes and keeps the leases of one Locker. Besides its pool and configuration it remembers what time has
// told it: the server's clock as of the last answer (for the latest moment a statement may still act, which it
// carries), the records it has seen holding keys and since when on its own monotonic clock (a takeover needs a
// record unchanged for a whole lease length), and the statements in doubt it still has to undo (retire). Close
// stops those.
type Client struct {
	pool  session.Pool
	cfg   Config
	clock serverClock
	id    string // 16 hex digits, random: the start of its owners and waiters, by which its sweep knows its own rows

	mu      sync.Mutex
	seen    map[session.ID]sighting
	closed  bool
	bg      sync.WaitGroup // retire jobs
	closing chan struct{}  // closed by Close: each retire job makes one last attempt at once
	bgConns chan struct{}  // a token for each connection the retire jobs hold (bgConns at most)
	bgCtx   context.Context
	bgStop  context.CancelFunc

	r renewers // the renewals of its leases (renewer.go)

	sweeping  bool               // the sweep has started (sweep.go)
	sweepStop context.CancelFunc // stops it (Close)
	sweepDone chan struct{}      // closed when it has returned
	sweepSt   struct {           // what the sweep has done (SweepStats)
		turn         atomic.Int32
		reads, taken atomic.Int64
	}
}

// NewClient makes the Client of a Locker's leases.
func NewClient(pool session.Pool, cfg Config) *Client {
	var id [16]byte
	c := &Client{pool: pool, cfg: cfg, id: string(appendRandom(id[:0], 8)), seen: map[session.ID]sighting{},
		closing: make(chan struct{}), bgConns: make(chan struct{}, bgConns)}
	c.bgCtx, c.bgStop = context.WithCancel(context.Background())
	c.r.init(c)
	return c
}

// Config is the Client's configuration.
func (c *Client) Config() Config { return c.cfg }

// CloseGrace is how long Close lets the retire jobs make their last attempt.
const CloseGrace = time.Second

// Close stops the sweep (a statement of its on the wire is cut), has each retire job make one last attempt at once,
// stops them after CloseGrace (a statement of theirs on the wire is cut), and waits for them; then it waits for the
// renewal loop, which returns once every lease has ended (for at most CloseGrace). What the retire jobs had not
// deleted is taken over by another Locker once it has seen it unchanged for a lease length.
func (c *Client) Close() {
	c.mu.Lock()
	if !c.closed {
		c.closed = true
		close(c.closing)
	}
	sweepDone := c.sweepDone
	if c.sweepStop != nil {
		c.sweepStop() // a statement of its on the wire is cut
	}
	c.mu.Unlock()
	if sweepDone != nil {
		<-sweepDone
	}
	done := make(chan struct{})
	go func() { c.bg.Wait(); close(done) }()
	t := time.NewTimer(CloseGrace)
	select {
	case <-done:
	case <-t.C:
	}
	t.Stop()
	c.bgStop()
	<-done
	// The renewal loop, once every lease has ended: the statements it still has on the wire are of use to no
	// lease, and cut. A lease nobody ended would keep it running: Close does not wait past its grace for that.
	t = time.NewTimer(CloseGrace)
	select {
	case <-c.r.stopped():
	case <-t.C:
	}
	t.Stop()
}

// grantBound bounds a grant's statement: never longer than the lease can be trusted once granted (Length less
// Margin, counted from the send), since an answer that comes later is of no use.
func (c *Client) grantBound() time.Duration {
	if mutant.On(mutant.LeaseLateGrantKept) {
		return c.cfg.Bound
	}
	return min(c.cfg.Bound, c.cfg.Length-c.cfg.Margin)
}

// answer is a grant's answer (see grantDDL).
type answer struct {
	kind      byte // 'g' granted, 'h' held, 'w' waiters first (or raced), 'r' quiet (after a crash or a promotion), 'l' too late, 's' standby
	term      int64
	rec       record        // 'h': the row seen
	holderLen time.Duration // 'h': the holder's lease length (0: not said)
	left      time.Duration // 'h': until the row's expiry on the server's clock
	now       int64         // the server's clock, microseconds
}

func parseAnswer(s string) (answer, error) {
	bad := func() (answer, error) { return answer{}, fmt.Errorf("advlock: unexpected lease answer %q", s) }
	kind, rest, _ := strings.Cut(strings.TrimSpace(s), " ")
	if len(kind) != 1 {
		return bad()
	}
	var nums [5]int64
	n := nums[:0]
	for f := range strings.FieldsSeq(rest) {
		v, err := strconv.ParseInt(f, 10, 64)
		if err != nil || len(n) == len(nums) {
			return bad()
		}
		n = append(n, v)
	}
	if len(n) == 0 {
		return bad()
	}
	a := answer{kind: kind[0], now: n[len(n)-1]}
	switch {
	case a.kind == 'g' && len(n) == 2 && n[0] > 0:
		a.term = n[0]
	case a.kind == 'h' && len(n) == 5:
		a.rec = record{n[0], n[1]}
		// The time left within what a time.Duration holds (the server's function bounds it too).
		a.holderLen, a.left = time.Duration(n[2])*time.Millisecond, time.Duration(min(max(n[3], -maxLeft), maxLeft))*time.Millisecond
	case strings.IndexByte("wrls", a.kind) >= 0 && len(n) == 1:
	default:
		return bad()
	}
	return a, nil
}

// maxLeft is the longest time.Duration in whole milliseconds (maxLeftMS).
const maxLeft = math.MaxInt64 / int64(time.Millisecond)

// notGranted is the error of a grant answered other than 'g'.
func (a answer) notGranted() error {
	switch a.kind {
	case 'r':
		return fmt.Errorf("%w: %w", session.ErrNotAcquired, errRestartQuiet)
	case 'l':
		return errLateArrival
	case 's':
		return session.ErrStandby
	}
	return session.ErrNotAcquired
}

// errRestartQuiet is a grant refused because the server started after a crash (or a promotion, or from a backup)
// less than the longest lease length granted before it was first asked for a grant (see restartCheck).
var errRestartQuiet = errors.New("the server started after a crash (or was promoted) less than the longest lease length " +
	"ever granted ago: a crash may have taken back the last grants and renewals, so no lease is granted until then")

// lateError is a grant that could not be trusted: it matches ErrNotAcquired.
type lateError struct{ why string }

func (e *lateError) Error() string        { return "advlock: not acquired: " + e.why }
func (e *lateError) Is(target error) bool { return target == session.ErrNotAcquired }

var (
	// errLateAnswer: the grant's answer came after the lease could no longer be trusted; it was given back.
	errLateAnswer error = &lateError{"the lease's grant was answered after its holder could no longer trust it " +
		"(a lease is trusted for its length less a margin from the grant's send): given back"}
	// errLateArrival: the grant reached the server after its caller had given up on it, and granted nothing.
	errLateArrival error = &lateError{"the grant reached the server after its caller had given up on it (a link or " +
		"pooler that held it back); it granted nothing"}
)

// grant sends one grant of id for owner (waiter: the wait's id, "" for a try) and reads its answer. ctx bounds the
// wait for a connection only: the statement, once sent, runs to its answer or its bound (see exec), so that its
// outcome is known wherever it can be. out reports whether it went out, and until is the latest moment on the
// server's clock at which it may still grant (0: no limit, when the server's clock is not known yet).
func (c *Client) grant(ctx context.Context, id session.ID, owner, waiter string) (a answer, sent time.Time, until int64, out bool, err error) {
	bound := c.grantBound()
	seen := c.matured(id, time.Now())
	sent = time.Now()
	if !mutant.On(mutant.LeaseGrantNoDeadline) {
		until = c.clock.estimate(sent.Add(bound))
	}
	txt, out, err := exec(ctx, c.pool, bound, GrantSQL(id, owner, c.cfg.Holder, c.cfg.Length, waiter, seen, until), true)
	switch session.SQLState(err) {
	case "25006": // the function checks for recovery first: a primary that refuses writes
		err = session.ReadOnly(err)
	case errLateGrant: // it ran past until, and rolled back: nothing granted, as a grant refused as too late
		return answer{kind: 'l'}, sent, until, true, nil
	}
	if err != nil {
		return a, sent, until, out, err
	}
	recv := time.Now()
	if a, err = parseAnswer(txt); err != nil {
		return a, sent, until, true, err
	}
	c.clock.sample(recv, a.now)
	switch a.kind {
	case 'h':
		c.observe(id, a, recv)
	case 'g':
		c.forget(id)
	}
	if mutant.On(mutant.LeaseTrustFromReply) {
		sent = recv
	}
	return a, sent, until, true, nil
}

// Take tries once to take id's lease: ErrNotAcquired when another lease holds it. The grant, once sent, is not cut
// by ctx (only by its bound): cut, its outcome would be unknown. A grant that ctx's end raced, or whose answer came
// after the lease could be trusted, is given back, and the call returns ctx's error or ErrNotAcquired. A statement
// whose outcome is unknown all the same (the connection ended, its bound passed) is undone (retire): first in the
// call, unless the server did not answer within the bound (the undo would meet the same silence: a try returns
// within one bound), then apart.
func (c *Client) Take(ctx context.Context, id session.ID, onEnd session.OnEnd) (*Lease, error) {
	owner := c.newOwner()
	a, sent, until, out, err := c.grant(ctx, id, owner, "")
	if err == nil && a.kind == 'l' && ctx.Err() == nil {
		// Refused as too late at once: the server's clock is ahead of what this client knew (it stepped, or the
		// last answer is old); the answer told it. Once more (the refused grant wrote nothing).
		a, sent, until, out, err = c.grant(ctx, id, owner, "")
	}
	if err != nil {
		if out { // its outcome is unknown: undone, first in the call unless the server stopped answering
			var na *noAnswer
			c.retire([]session.ID{id}, owner, until, !errors.As(err, &na))
		}
		return nil, session.WithContext(ctx, err)
	}
	if a.kind != 'g' {
		if ctx.Err() != nil {
			// The call ran out of time, or was cancelled, while its grant ran: it says so, as a try on a session
			// does, whatever the grant's answer.
			return nil, session.WithContext(ctx, ctx.Err())
		}
		return nil, a.notGranted()
	}
	l, err := c.granted(id, owner, a.term, sent, onEnd)
	if err != nil {
		return nil, session.WithContext(ctx, err)
	}
	if ctx.Err() != nil {
		l.giveBack()
		return nil, session.WithContext(ctx, ctx.Err())
	}
	l.start()
	return l, nil
}

// granted makes the Lease of a grant sent at sent (its renewals not started yet), unless its answer came after the
// lease could be trusted: then it is given back (its row deleted, here and, if that fails, by a retire job) and the
// error says so.
func (c *Client) granted(id session.ID, owner string, term int64, sent time.Time, onEnd session.OnEnd) (*Lease, error) {
	l := c.newLease(id, owner, term, sent, onEnd)
	if l.expired(time.Now()) {
		if mutant.On(mutant.LeaseLateGrantKept) { // handed out, trusted as if granted now
			now := time.Now()
			l.trust, l.wall = c.trustFrom(now), c.trustFrom(now).UnixNano()
			return l, nil
		}
		l.giveBack()
		return nil, errLateAnswer
	}
	return l, nil
}

// Wait takes id's lease, or any of alts' (a semaphore's other slots), trying them in turn every Poll or so
// (jittered) while other leases hold them, until one is granted or ctx ends (a deadline is a bound of the wait, as
// a session lock's lock_timeout: the error wraps context.DeadlineExceeded). A try that fails otherwise than by
// finding the key held (a connection ended, a statement unanswered, the server restarting, a late answer) is tried
// again at the next poll: the wait ends only when granted, cancelled or bounded, or on an error no retry can mend
// (Permanent). A statement on the wire is not cut by ctx's deadline, only by its bound; a grant that a cancel raced
// is given back.
func (c *Client) Wait(ctx context.Context, id session.ID, alts []session.ID, onEnd session.OnEnd) (*Lease, error) {
	ids := append([]session.ID{id}, alts...)
	waiter := c.newWaiter()
	owner := c.newOwner()
	queued := false // a try found a key held: the wait may have rows in Waits
	var last error  // why the last poll did not grant
	for {
		for _, id := range ids {
			// ctx bounds the wait for a connection (a cancel, Close, the deadline); once sent, the grant runs to its
			// answer or its bound.
			a, sent, until, out, err := c.grant(ctx, id, owner, waiter)
			if err != nil {
				if out { // its outcome is unknown: undone apart, and this owner grants nothing more
					c.retire([]session.ID{id}, owner, until, false)
					owner = c.newOwner()
				}
				if !out && ctx.Err() != nil {
					break // the wait ended while it waited for a connection
				}
				if Permanent(err) {
					if queued {
						c.leave(waiter)
					}
					return nil, err
				}
				last = err
				break // tried again at the next poll
			}
			if a.kind == 's' {
				if queued {
					c.leave(waiter)
				}
				return nil, session.ErrStandby
			}
			queued = queued || a.kind == 'h' || a.kind == 'w'
			if a.kind != 'g' {
				last = a.notGranted()
				continue
			}
			l, err := c.granted(id, owner, a.term, sent, onEnd)
			if err != nil { // a late answer, given back: that owner grants nothing more
				owner, last = c.newOwner(), err
				continue
			}
			if ctx.Err() != nil && !errors.Is(ctx.Err(), context.DeadlineExceeded) {
				// Cancelled while the grant was on the wire: give it back, the caller has gone.
				l.giveBack()
				return nil, session.WithContext(ctx, ctx.Err())
			}
			l.start()
			return l, nil // a grant deleted the wait's rows
		}
		d := c.cfg.Poll/2 + time.Duration(rand.Int64N(int64(c.cfg.Poll)))
		if dl, ok := ctx.Deadline(); ok && time.Until(dl) < d {
			d = max(time.Until(dl), 0)
		}
		if ctx.Err() != nil {
			d = 0
		}
		t := time.NewTimer(d)
		select {
		case <-t.C:
		case <-ctx.Done():
			t.Stop()
		}
		if ctx.Err() != nil || !beforeDeadline(ctx) {
			if queued {
				c.leave(waiter)
			}
			if last == nil { // no poll was answered: the wait ended before its first (a connection, say)
				return nil, session.WithContext(ctx, errors.New("lease not granted before the wait ended"))
			}
			return nil, session.WithContext(ctx, fmt.Errorf("lease not granted before the wait ended: %w", last))
		}
	}
}

func beforeDeadline(ctx context.Context) bool {
	dl, ok := ctx.Deadline()
	return !ok || time.Now().Before(dl)
}

// Permanent reports whether a lease statement's error is one no retry can mend: what an operator must fix (the
// tables missing, a standby, a server that refuses writes, a privilege, a missing function, a setting), as opposed
// to a connection that ended, a statement unanswered, a server restarting or full of connections, a lock or
// statement timeout, a serialization failure.
func Permanent(err error) bool {
	for _, p := range []error{ErrLeaseTable, session.ErrStandby, session.ErrReadOnly, errors.ErrUnsupported,
		session.ErrNoPool, session.ErrClosed} {
		if errors.Is(err, p) {
			return true
		}
	}
	code := session.SQLState(err)
	if code == "" || session.Ended(err) {
		return false
	}
	switch code[:2] {
	case "08", "53", "57", "58", "40", "XX":
		return false
	}
	return code != "55P03" && code != "55006" && code != "25P03"
}

// retire deletes whatever lease of ids owner may hold, once now and then apart until an answer shows that nothing
// of owner's can be granted any more: for a grant whose outcome is unknown (until: the latest moment on the
// server's clock at which it could still grant; 0 when it cannot grant any more, as for a lease given back, lost or
// not released), whose request may still be on its way (a stopped pooler forwards what it buffered when it
// continues). A delete that found the lease is enough (a grant grants once); otherwise one that ran once the
// server's clock had passed until and the grant's longest run after it (its lock waits, bounded, and its commit:
// retireGrace). With now, the first attempt runs in the caller (so that a try that returns has undone what it
// could), else all of them apart. The attempts go on until Close.
func (c *Client) retire(ids []session.ID, owner string, until int64, now bool) {
	done := func(n, srv int64) bool { return n > 0 || until == 0 || srv > until+retireGrace.Microseconds() }
	attempt := func(ctx context.Context, bound time.Duration) (bool, time.Duration) {
		txt, _, err := exec(ctx, c.pool, bound, RetireSQL(ids, owner), false)
		if err != nil {
			return false, 0
		}
		var n, srv int64
		if _, err := fmt.Sscan(txt, &n, &srv); err != nil {
			return false, 0
		}
		c.clock.sample(time.Now(), srv)
		if done(n, srv) {
			return true, 0
		}
		return false, time.Duration(until+retireGrace.Microseconds()-srv)*time.Microsecond + 50*time.Millisecond
	}
	if now { // bounded as the grant was: a try returns within twice its bound
		if ok, _ := attempt(context.Background(), c.grantBound()); ok || mutant.On(mutant.LeaseUndoOnce) {
			return
		}
	}
	c.mu.Lock()
	if c.closed {
		c.mu.Unlock()
		return
	}
	c.bg.Add(1)
	c.mu.Unlock()
	go func() {
		defer c.bg.Done()
		ctx, cancel := context.WithCancel(c.bgCtx)
		type result struct {
			ok   bool
			wait time.Duration
		}
		results := make(chan result, retireInflight)
		inflight := 0
		defer func() {
			cancel()
			for ; inflight > 0; inflight-- {
				<-results
			}
		}()
		interval, next := 50*time.Millisecond, time.Now()
		closing := c.closing
		last := false // Close was called: the attempt on its way (or one now) is the last
		for {
			if last && inflight == 0 {
				return
			}
			if !last && inflight < retireInflight && !time.Now().Before(next) {
				select {
				case c.bgConns <- struct{}{}:
					inflight++
					go func() {
						ok, wait := attempt(ctx, min(c.cfg.Bound, retireBound))
						<-c.bgConns
						results <- result{ok, wait}
					}()
					next, interval = time.Now().Add(interval), min(2*interval, retireEvery)
				default: // the Client's retire jobs hold as many connections as they may: a little later
					next = time.Now().Add(50 * time.Millisecond)
				}
				continue
			}
			var tick <-chan time.Time
			t := time.NewTimer(time.Until(next))
			if inflight < retireInflight && !last {
				tick = t.C
			}
			select {
			case <-closing:
				closing, last = nil, true
				if inflight == 0 { // one last attempt, now
					inflight++
					go func() {
						ok, wait := attempt(ctx, min(c.cfg.Bound, CloseGrace))
						results <- result{ok, wait}
					}()
				}
			case r := <-results:
				inflight--
				if r.ok {
					t.Stop()
					return
				}
				if r.wait > 0 { // answered, but the server's clock has not passed until yet: nothing to do before
					next = time.Now().Add(min(r.wait, c.cfg.Length))
				}
			case <-tick:
			case <-ctx.Done():
			}
			t.Stop()
			if ctx.Err() != nil {
				return
			}
		}
	}()
}

// A retire job's attempts: one goes out every retireEvery at most (sooner at first), each bounded by retireBound,
// at most retireInflight at once, so that one stuck on a dead connection does not hold the next back: once the
// network is back, the lease is deleted within about retireEvery. All the retire jobs of a Client hold at most
// bgConns connections at once (Client.bgConns), so that a network that swallows statements does not leave the
// pool's connections to them (a pool of 4 served no call for seconds after a blackhole).
const (
	retireEvery    = 500 * time.Millisecond
	retireBound    = 2 * time.Second
	retireInflight = 2
	bgConns        = 2
)

// retireGrace is how long after until a grant may still commit: its waits for row locks are bounded by 1 s (its
// lock_timeout), and then it commits.
const retireGrace = 2 * time.Second

// leave deletes the rows of a wait that ends without a grant, so that it holds back nobody (a row it cannot delete
// stops counting WaitStale after its last poll).
func (c *Client) leave(waiter string) {
	_, _, _ = exec(context.Background(), c.pool, c.cfg.Bound, LeaveSQL(waiter), false)
}

// newOwner is a new grant's owner: the Client's id and 8 random bytes in hex, with the lease length after a '/', so
// that a taker knows how long a holder may trust what it sees (grantDDL).
func (c *Client) newOwner() string {
	var b [64]byte
	return string(strconv.AppendInt(append(appendRandom(append(b[:0], c.id...), 8), '/'), c.cfg.Length.Milliseconds(), 10))
}

// newWaiter is a new wait's waiter: the Client's id and 8 random bytes in hex.
func (c *Client) newWaiter() string {
	var b [32]byte
	return string(appendRandom(append(b[:0], c.id...), 8))
}

// appendRandom appends n (at most 16) random bytes in hex to b.
func appendRandom(b []byte, n int) []byte {
	var r [16]byte
	_, _ = crand.Read(r[:n])
	return hex.AppendEncode(b, r[:n])
}

// exec sends one statement on a connection of pool and gives the connection back (a lease holds nothing on it),
// and returns the text of its answer. The statement is bounded by bound; whole, ctx bounds only the wait for a
// connection, and nothing is sent once it has ended (out says whether the statement went out); else ctx cuts it
// too. A statement its bound cut says so without matching a context error: the caller's ctx did not end.
func exec(ctx context.Context, pool session.Pool, bound time.Duration, sql string, whole bool) (txt string, out bool, err error) {
	own := true // the bound ends before ctx's deadline: a timeout is the bound's
	if dl, ok := ctx.Deadline(); ok && !dl.After(time.Now().Add(bound)) {
		own = false
	}
	actx, cancel := context.WithTimeout(ctx, bound)
	c, err := pool.Acquire(actx)
	timedOut := own && errors.Is(actx.Err(), context.DeadlineExceeded) && ctx.Err() == nil
	cancel()
	if err != nil {
		if timedOut {
			return "", false, &noAnswer{what: "no connection", bound: bound, cause: err}
		}
		return "", false, session.WithContext(ctx, fmt.Errorf("acquire connection: %w", err))
	}
	if err := ctx.Err(); err != nil {
		c.Release()
		return "", false, session.WithContext(ctx, err)
	}
	var cut bool // the statement's bound, or ctx when it cuts, ended before its answer was read
	if whole || ctx.Done() == nil {
		// Nothing but the bound can cut it: bounded by the connection's own deadline where the backend offers one
		// (no context, timer or watch of it to make at every statement).
		deadline := time.Now().Add(bound)
		txt, err = session.QueryTextUntil(ctx, c, deadline, sql)
		cut = !time.Now().Before(deadline)
	} else {
		qctx, cancel := context.WithTimeout(ctx, bound)
		txt, err = c.QueryText(qctx, sql)
		cut = qctx.Err() != nil
		cancel()
	}
	if err != nil && !cut && rolledBack(err) {
		// The server refused the statement: it ran in a transaction of its own, which rolled back, and the
		// connection is idle: kept, and nothing the statement did is left to undo.
		c.Release()
		return "", false, err
	}
	if err != nil || cut {
		c.Destroy()
		switch {
		case ctx.Err() != nil && !whole:
			return "", true, session.WithContext(ctx, errOr(err, ctx.Err()))
		case cut:
			return "", true, &noAnswer{what: "no answer from the server", bound: bound, cause: errOr(err, context.DeadlineExceeded)}
		}
		return "", true, err
	}
	c.Release()
	return txt, true, nil
}

// rolledBack reports whether err is the server's refusal of a statement, which rolled it back: an error the
// server sent with its SQLSTATE, other than those a pooler sends for a server connection that ended under a
// statement (class 08) and the server's own ends of a session (57P01 to 57P05), either of which may come after the
// statement committed.
func rolledBack(err error) bool {
	code := session.SQLState(err)
	if code == "" || session.Ended(err) {
		return false
	}
	return !strings.HasPrefix(code, "08") && !strings.HasPrefix(code, "57P")
}

func errOr(err, alt error) error {
	if err != nil {
		return err
	}
	return alt
}

// noAnswer is a lease statement cut by its own bound: it matches no context error (the caller's ctx did not end).
type noAnswer struct {
	what  string
	bound time.Duration
	cause error
}

func (e *noAnswer) Error() string {
	if e.Unwrap() == nil { // the bound's own timer: nothing more to say
		return fmt.Sprintf("advlock: %s within %v", e.what, e.bound)
	}
	return fmt.Sprintf("advlock: %s within %v (%v)", e.what, e.bound, e.cause)
}

// Unwrap is the cause, unless it is a context's error (the bound's own timer).
func (e *noAnswer) Unwrap() error {
	if errors.Is(e.cause, context.DeadlineExceeded) || errors.Is(e.cause, context.Canceled) {
		return nil
	}
	return e.cause
}

// serverClock is what a Client knows of the server's clock: its reading in the latest answer, and when that
// answer came on the client's monotonic clock. The server read its clock before it answered, so the reading plus
// the time since the answer is a lower estimate of the server's clock now, while the clock runs; a step of the
// server's clock shows in the next answer, which replaces it.
type serverClock struct {
	mu sync.Mutex
	at time.Time // when the answer came (monotonic)
	us int64     // the server's clock in it, microseconds since the Unix epoch
}

func (s *serverClock) sample(at time.Time, us int64) {
	s.mu.Lock()
	s.at, s.us = at, us
	s.mu.Unlock()
}

// estimate is the server's clock at t as of the latest answer (microseconds), 0 before any.
func (s *serverClock) estimate(t time.Time) int64 {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.at.IsZero() {
		return 0
	}
	return s.us + t.Sub(s.at).Microseconds()
}

// sighting is a record a Client has seen holding a key: since when (the answer that first showed it, on the
// monotonic clock), for how long it must stay unchanged before a takeover (the holder's lease length), and how long
// after first it was last seen (0: not seen again). A Client keeps one for each row of the other Clients its sweep
// reads (see sweep.go): the last sighting is a duration after the first (8 bytes) rather than a time.Time of its
// own (24), measured as the first is, 56 bytes a sighting instead of 72.
type sighting struct {
	rec   record
	first time.Time
	need  time.Duration
	again time.Duration
}

// last is when s was last seen.
func (s sighting) last() time.Time { return s.first.Add(s.again) }

// maxSightings bounds the records a Client remembers: past it, those not seen for a minute are forgotten, and if
// that is not enough, one at random for each new one (forgetting only delays a takeover).
const maxSightings = 4096

// observe records that the answer a, which came at recv, showed id held by a.rec. A holder trusts its lease for
// less than its length from the send of the statement that made its record, which ran before recv: once the
// record has stayed the same for that length after recv, its holder has stopped trusting it. The holder's length
// comes from its owner; an owner that does not say (an earlier version's) is given this Client's length or the
// time its row has left on the server's clock, whichever is longer.
func (c *Client) observe(id session.ID, a answer, recv time.Time) {
	need := a.holderLen
	if need == 0 {
		need = max(c.cfg.Length, a.left)
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	s, ok := c.seen[id]
	if ok && s.rec == a.rec {
		s.again = recv.Sub(s.first)
		c.seen[id] = s
		return
	}
	if !ok && len(c.seen) >= maxSightings {
		// Full: forget those not seen for a minute, or else one at random (map order), so that the keys a process
		// keeps trying still get there (forgetting only delays a takeover).
		for k, s := range c.seen {
			if recv.Sub(s.last()) > time.Minute {
				delete(c.seen, k)
			}
		}
		for k := range c.seen {
			if len(c.seen) < maxSightings {
				break
			}
			delete(c.seen, k)
		}
	}
	c.seen[id] = sighting{rec: a.rec, first: recv, need: need}
}

// matured is the record this Client has seen holding id unchanged for the holder's whole lease length by now, or
// the zero record (no takeover).
func (c *Client) matured(id session.ID, now time.Time) record {
	c.mu.Lock()
	defer c.mu.Unlock()
	s, ok := c.seen[id]
	if !ok {
		return record{}
	}
	if mutant.On(mutant.LeaseServerExpiry) {
		return s.rec // taken over once the server's clock says the lease expired (grantDDL's mutant)
	}
	if now.Sub(s.first) < s.need {
		return record{}
	}
	return s.rec
}

func (c *Client) forget(id session.ID) {
	c.mu.Lock()
	delete(c.seen, id)
	c.mu.Unlock()
}
