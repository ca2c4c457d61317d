package lease

import (
	"container/heap"
	"context"
	"fmt"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/advlock/advlock/internal/mutant"
	"github.com/advlock/advlock/internal/session"
)

// A Client renews all its leases from one goroutine (renewLoop), not one per lease, in few statements: each lease is
// a small state machine that the loop steps at its next moment (a renewal due, one to send again, its trust ending)
// and at each answer. The renewals due at one moment go out in one statement (RenewManySQL: one commit for up to
// maxBatch leases), and so do those of leases whose next renewal was due within half a renewal period: renewed a
// little early, they are due together from then on, so a Locker holding many leases sends about one statement a
// renewal period. Each lease keeps the rules it had alone:
//
// A lease is renewed every Renew (from the send of the last confirmed statement), and ends when the trust window
// closes without a confirmed renewal, or at once when the server says the lease is no longer this owner's. A
// renewal unanswered for a third of the trust left at its send (or three of the last round trips, when longer) is
// sent again in another statement, on another connection, the first still waiting (at most two at once): one stuck
// on a dead connection does not spend the trust, and a link that is only slow is not taken for a dead one. The trust
// is counted from the send of whichever is confirmed. A statement whose leases all have no more use for it (each
// confirmed by another, or ended) is cut.

// maxBatch is the most leases one renewal statement renews: its transaction stays short (about 10 ms for 500 rows
// on a loaded 2-core machine) and its text about 50 KB.
const maxBatch = 500

// renewers hands leases to the renewal loop and tells it of halts; the loop runs while it has leases (or
// statements on the wire, or ends of leases under way), and starts again with the next lease.
//
// A lease is of no concern to the loop before its first renewal is due (a renewal period after its grant, before its
// trust ends): until the loop takes it, it waits in adds, and a halt that finds it there ends its renewals at once,
// with no word to the loop. So a lease held for less than a renewal period (a short job's) costs the loop nothing
// when it is alone: no start of it (its start is set for the first renewal due in adds, later), and no wake of it
// when it is running and will look at adds before that renewal is due anyway (wakeAt).
type renewers struct {
	c       *Client
	mu      sync.Mutex
	running bool
	adds    []*Lease // each knows its place here (addAt)
	halts   []*Lease
	kick    chan struct{} // capacity 1: adds or halts are waiting
	results chan result   // the answers of the statements on the wire, and the ends of lost leases
	idle    chan struct{} // made by a Close that waits for the loop, closed when it returns
	lp      *loop         // the loop's state, kept for its next run (its heap, buffers and timer reused)
	later   *time.Timer   // starts the loop at laterAt (the loop not running, adds waiting); made at its first use
	laterAt time.Time     // zero when later is not set
	wakeAt  time.Time     // the loop, running, looks at adds by then (zero: it may not, adds wake it)
}

// stopped returns a channel closed once the loop is not running.
func (r *renewers) stopped() <-chan struct{} {
	r.mu.Lock()
	defer r.mu.Unlock()
	if !r.running && len(r.adds) > 0 {
		// Leases wait for the loop's later start: it starts now, and returns once they have ended, as it would
		// had it been running.
		r.startLocked()
	}
	if !r.running {
		return closedChan
	}
	if r.idle == nil {
		r.idle = make(chan struct{})
	}
	return r.idle
}

var closedChan = func() chan struct{} { c := make(chan struct{}); close(c); return c }()

func (r *renewers) init(c *Client) {
	r.c = c
	r.kick = make(chan struct{}, 1)
	r.results = make(chan result, 64)
}

// batch is one renewal statement: a renewal of each of its leases.
type batch struct {
	items   []Renewal
	entries []entry
	live    int           // entries whose lease still wants the answer
	bound   time.Duration // how long the statement may go unanswered: the longest any of its leases can use
	sent    time.Time
	cancel  context.CancelFunc // cuts it (set once sent)
}

// entry is one lease's renewal in a batch.
type entry struct {
	l    *Lease
	gone bool // its lease has no more use for the answer (ended, or its period was confirmed by another)
}

// result is a batch's answer, or (b nil) the end of lost lease l having run.
type result struct {
	b    *batch
	l    *Lease
	recv time.Time
	txt  string
	err  error
}

// renewState is a lease's renewals, as the loop keeps them.
type renewState struct {
	next     time.Time  // the next renewal period begins (when none of this one's is on the wire)
	lastSent time.Time  // the latest send
	wake     time.Time  // when the loop steps it next
	wire     [2]wireRef // its renewals of this period on the wire (or about to be sent): a success ends the others
	idx      int        // its place in the loop's heap; -1 once it has left it
	current  int8       // how many of wire are: at most two at once (an earlier period's are dropped as it ends)
	ending   bool       // its renewals have ended: they are said ended (renewalsEnded) once its end has run (ends 0)
	backoff  bool       // next is a try again after a failure: not taken in early with others
	ends     int8       // its end's goroutines not yet done (a loss's finish)
}

// wireRef is where a lease's renewal is: entry i of b.
type wireRef struct {
	b *batch
	i int
}

// add hands l to the loop, by its first renewal or the end of its trust, whichever comes first (l.rs.next is set). A
// lease halted before it was added (l.stopping: a halt that found it nowhere, or queued it to the loop) has its
// renewals ended here (renewalsEnded says so once, whoever says it first).
func (r *renewers) add(l *Lease) {
	due := earliest(l.trustNow(), l.rs.next)
	r.mu.Lock()
	if l.stopping.Load() {
		r.mu.Unlock()
		l.renewalsEnded()
		return
	}
	l.addAt = len(r.adds)
	r.adds = append(r.adds, l)
	switch {
	case r.running && (r.wakeAt.IsZero() || r.wakeAt.After(due)):
		r.poke()
	case !r.running && (r.laterAt.IsZero() || r.laterAt.After(due)):
		// A start set for a lease since halted is not moved later: the loop starts early, and waits.
		r.laterAt = due
		if r.later == nil {
			r.later = time.AfterFunc(time.Until(due), r.fire)
		} else {
			r.later.Reset(time.Until(due))
		}
	}
	r.mu.Unlock()
}

// fire is later's: the loop starts, unless it runs already or no lease waits for it.
func (r *renewers) fire() {
	r.mu.Lock()
	start := !r.running && len(r.adds) > 0
	if start {
		r.running, r.laterAt = true, time.Time{}
	}
	r.mu.Unlock()
	if start {
		r.c.renewLoop()
	}
}

// startLocked starts the loop now (r.mu held, the loop not running).
func (r *renewers) startLocked() {
	r.running = true
	r.unsetLaterLocked()
	go r.c.renewLoop()
}

// unsetLaterLocked stops the loop's later start, if one is set (r.mu held).
func (r *renewers) unsetLaterLocked() {
	if !r.laterAt.IsZero() {
		r.later.Stop()
		r.laterAt = time.Time{}
	}
}

// halt tells the loop that l's renewals are to stop (l.stopping is set). A lease the loop has not taken yet is taken
// out of adds, and its renewals end here; one that it has, the loop ends. A loop that is not running has no lease
// that has not ended but those in adds: l's renewals have ended, and said so, or l is not added yet (add ends it).
func (r *renewers) halt(l *Lease) {
	r.mu.Lock()
	if i := l.addAt; i >= 0 && i < len(r.adds) && r.adds[i] == l {
		last := len(r.adds) - 1
		if i != last {
			r.adds[i] = r.adds[last]
			r.adds[i].addAt = i
		}
		r.adds[last] = nil
		r.adds = r.adds[:last]
		l.addAt = -1
		if len(r.adds) == 0 {
			r.unsetLaterLocked()
		}
		r.mu.Unlock()
		l.renewalsEnded()
		return
	}
	if r.running {
		r.halts = append(r.halts, l)
		r.poke()
	}
	r.mu.Unlock()
}

func (r *renewers) poke() {
	select {
	case r.kick <- struct{}{}:
	default:
	}
}

// loop is the renewal loop's own state.
type loop struct {
	c       *Client
	h       leaseHeap
	timer   *time.Timer // stopped between turns
	adds    []*Lease    // the adds and halts of this turn, their arrays handed back to renewers for the next
	halts   []*Lease
	pending *batch // the renewals stepped so far this turn, sent at its end
	wire    int    // statements on the wire
	ending  int    // leases whose renewals have ended, their end still running
}

// renewLoop steps the Client's leases until none is left.
func (c *Client) renewLoop() {
	r := &c.r
	r.mu.Lock()
	lp := r.lp // one loop runs at a time (running): the last run's state is free
	if lp == nil {
		lp = &loop{c: c, timer: time.NewTimer(time.Hour)}
		lp.timer.Stop()
		r.lp = lp
	}
	r.mu.Unlock()
	timer := lp.timer
	for {
		r.mu.Lock()
		clear(lp.adds)
		clear(lp.halts)
		lp.adds, lp.halts, r.adds, r.halts = r.adds, r.halts, lp.adds[:0], lp.halts[:0]
		adds, halts := lp.adds, lp.halts
		for _, l := range adds {
			l.addAt = -1 // the loop's now: a halt tells it
		}
		r.wakeAt = time.Time{}
		if len(adds) == 0 && len(halts) == 0 && lp.h.Len() == 0 && lp.ending == 0 && lp.wire == 0 {
			r.running = false
			if r.idle != nil {
				close(r.idle)
				r.idle = nil
			}
			r.mu.Unlock()
			return
		}
		r.mu.Unlock()
		for _, l := range adds {
			l.rs.wake = time.Time{} // stepped below
			heap.Push(&lp.h, l)
		}
		for _, l := range halts {
			if !l.rs.ending {
				lp.endRenewals(l)
			}
		}
		now := time.Now()
		for lp.h.Len() > 0 && !lp.h[0].rs.wake.After(now) {
			lp.step(lp.h[0], now)
		}
		lp.send()
		if lp.h.Len() == 0 && lp.ending == 0 && lp.wire == 0 {
			continue // nothing left to wait for: the top ends the loop, unless adds came meanwhile
		}
		if lp.h.Len() > 0 {
			wake := lp.h[0].rs.wake
			timer.Reset(time.Until(wake))
			r.mu.Lock()
			r.wakeAt = wake // adds due later than this need not wake the loop
			r.mu.Unlock()
		}
		select {
		case <-r.kick:
		case res := <-r.results:
			lp.answered(res)
			lp.send()
		case <-timer.C:
		}
		timer.Stop()
	}
}

// step sends what l's renewals need sent now (a period's first renewal once due at early, which is now or later),
// and sets when it is stepped next; or ends them, when l was stopped or its trust has ended.
func (lp *loop) step(l *Lease, early time.Time) {
	if l.stopping.Load() {
		lp.endRenewals(l)
		return
	}
	c := lp.c
	rs := &l.rs
	for {
		l.mu.Lock()
		trust, rtt := l.trust, l.rtt
		l.mu.Unlock()
		now := time.Now()
		if l.expired(now) {
			lp.lost(l, l.errTrustEnded(), true)
			return
		}
		due := early // a renewal tried again after a failure waits for its moment, not taken in early
		if rs.backoff {
			due = now
		}
		send, wake := false, trust
		switch {
		case rs.current == 0 && !due.Before(rs.next):
			send = true
		case rs.current == 0:
			wake = earliest(wake, rs.next)
		case rs.current < 2:
			again := rs.lastSent.Add(max(trust.Sub(rs.lastSent)/3, 3*rtt))
			send, wake = !now.Before(again), earliest(wake, again)
		}
		if !send {
			rs.wake = wake
			heap.Fix(&lp.h, rs.idx)
			return
		}
		if rs.current == 0 { // a new period
			rs.backoff = false
		}
		rs.lastSent = now
		b := lp.pending
		for _, w := range rs.wire[:rs.current] {
			if w.b == b { // already in this statement (sent again before it went out): the next one
				b = nil
			}
		}
		if b == nil || len(b.entries) == maxBatch {
			lp.flush()
			b = &batch{}
			lp.pending = b
		}
		rs.wire[rs.current] = wireRef{b, len(b.entries)}
		rs.current++
		b.entries = append(b.entries, entry{l: l})
		b.items = append(b.items, Renewal{ID: l.id, Owner: l.owner, Term: l.term, Until: c.until(trust)})
		b.live++
		b.bound = max(b.bound, min(trust.Sub(now), c.cfg.Bound))
	}
}

// until is the latest moment, on the server's clock, at which a renewal sent now may still renew: the end of the
// trust, as the Client knows the server's clock.
func (c *Client) until(trust time.Time) int64 {
	if mutant.On(mutant.LeaseRenewNoDeadline) {
		return 0
	}
	return c.clock.estimate(trust)
}

// send sends the pending statement, first taking in the leases whose next period begins within half a renewal
// period: renewed with it, they are due together from then on.
func (lp *loop) send() {
	if lp.pending == nil {
		return
	}
	early := time.Now().Add(lp.c.cfg.Renew / 2)
	var soon []*Lease
	for lp.h.Len() > 0 && !lp.h[0].rs.wake.After(early) {
		soon = append(soon, heap.Pop(&lp.h).(*Lease))
	}
	for _, l := range soon {
		heap.Push(&lp.h, l)
	}
	for _, l := range soon {
		if l.rs.idx >= 0 { // not ended by stepping another
			lp.step(l, early)
		}
	}
	lp.flush()
}

// flush sends the pending statement as it is.
func (lp *loop) flush() {
	b := lp.pending
	lp.pending = nil
	if b == nil || b.live == 0 {
		return
	}
	if b.live < len(b.entries) { // leases that ended, or sent again, since they were stepped in: not sent
		j := 0
		for i, e := range b.entries {
			if e.gone {
				continue
			}
			rs := &e.l.rs
			for k := range rs.current {
				if rs.wire[k].b == b && rs.wire[k].i == i {
					rs.wire[k].i = j
				}
			}
			b.entries[j], b.items[j] = e, b.items[i]
			j++
		}
		clear(b.entries[j:])
		clear(b.items[j:])
		b.entries, b.items = b.entries[:j], b.items[:j]
	}
	c := lp.c
	var ctx context.Context
	ctx, b.cancel = context.WithCancel(context.Background())
	b.sent = time.Now()
	lp.wire++
	stmt := RenewManySQL(b.items, c.cfg.Length)
	if mutant.On(mutant.LeaseRenewUnkeyed) {
		stmt = renewUnkeyedSQL(b.items, c.cfg.Length)
	}
	go func() {
		txt, _, err := exec(ctx, c.pool, b.bound, stmt, false)
		c.r.results <- result{b: b, recv: time.Now(), txt: txt, err: err}
	}()
}

// drop marks l's renewals on the wire as of no more use to it: a statement none of whose leases wants it is cut.
func (lp *loop) drop(l *Lease) {
	rs := &l.rs
	for _, w := range rs.wire[:rs.current] {
		lp.forget(w)
	}
	rs.wire, rs.current = [2]wireRef{}, 0
}

// forget marks the renewal at w as of no more use to its lease.
func (lp *loop) forget(w wireRef) {
	e := &w.b.entries[w.i]
	if e.gone {
		return
	}
	e.gone = true
	if w.b.live--; w.b.live == 0 && w.b.cancel != nil {
		w.b.cancel()
	}
}

// removeWire takes the renewal in b off the lease's list (nothing when it has none there).
func (rs *renewState) removeWire(b *batch) {
	for j := range rs.current {
		if rs.wire[j].b == b {
			copy(rs.wire[j:], rs.wire[j+1:rs.current])
			rs.current--
			rs.wire[rs.current] = wireRef{} // no hold on a statement answered
			return
		}
	}
}

// answered takes a statement's answer to each lease that still wants it, or a lost lease's end.
func (lp *loop) answered(res result) {
	if res.b == nil {
		l := res.l
		if l.rs.ends--; l.rs.ends == 0 && l.rs.ending {
			lp.ending--
			l.renewalsEnded()
		}
		return
	}
	b := res.b
	lp.wire--
	b.cancel()
	c := lp.c
	err := res.err
	var letters string
	if err == nil {
		head, tail, found := strings.Cut(res.txt, " ")
		if srv, perr := strconv.ParseInt(tail, 10, 64); !found || perr != nil || len(head) != len(b.entries) {
			err = fmt.Errorf("advlock: unexpected renewal answer %q", res.txt)
		} else {
			letters = head
			c.clock.sample(res.recv, srv)
		}
	}
	for i := range b.entries {
		e := &b.entries[i]
		if e.gone {
			// Confirmed by another statement since: still, "0" is final (an owner and term never come back).
			if err == nil && letters[i] == '0' && !e.l.rs.ending {
				lp.lost(e.l, fmt.Errorf("%w: %w", session.ErrLockLost, errNotYours), false)
			}
			continue
		}
		e.gone = true
		l := e.l
		l.rs.removeWire(b)
		var ans byte
		if err == nil {
			ans = letters[i]
		}
		lp.answer(l, b.sent, res.recv, ans, err)
	}
}

// answer takes one lease's renewal's answer (ans, when err is nil; the renewal is off its list), then steps the
// lease. Every renewal a lease still waits for is of its current period: a period's end drops the others.
func (lp *loop) answer(l *Lease, sent, recv time.Time, ans byte, err error) {
	c := lp.c
	rs := &l.rs
	cfg := c.cfg
	if mutant.On(mutant.LeaseTrustFromReply) {
		sent = recv
	}
	switch {
	case err == nil && ans == '1' && l.expired(recv):
		// Answered after the trust had ended (the loop ran late, its timer and the answer ready at once): Err has
		// said lost since then, and a late answer is not handed out, as for a grant. The step ends the lease.
	case err == nil && ans == '1':
		l.mu.Lock()
		if t := c.trustFrom(sent); t.After(l.trust) {
			l.trust, l.wall, l.rtt = t, c.trustFrom(sent).UnixNano(), recv.Sub(sent)
		}
		l.mu.Unlock()
		rs.next = sent.Add(cfg.Renew)
		lp.drop(l) // the others of its period are of no use now
	case err == nil && ans == '0':
		lp.lost(l, fmt.Errorf("%w: %w", session.ErrLockLost, errNotYours), false)
		return
	case rs.current > 0:
		// others of its period are still on their way
	case err == nil && ans == 'l': // the server's clock is ahead of what this client knew; the answer told it: at once
		rs.next = time.Now()
	default: // no answer, or "b": the row was busy
		rs.next = time.Now().Add(min(cfg.Renew/5, time.Second, max(time.Until(l.trustNow())/10, time.Millisecond)))
		rs.backoff = true
	}
	lp.step(l, time.Now())
}

// lost ends l with cause, and its renewals. The end runs apart (it calls the Locker's hooks, and its observers,
// which must not hold up other leases' renewals), and its renewals are said ended after it: whoever stops the lease finds it
// ended. With retire, its row, if the server still has it, is deleted apart (a trust that ended: the key is free
// once it is gone).
func (lp *loop) lost(l *Lease, cause error, retire bool) {
	c := lp.c
	l.rs.ends++
	go func() {
		l.finish(cause)
		if retire {
			c.retire([]session.ID{l.id}, l.owner, 0, false)
		}
		c.r.results <- result{l: l}
	}()
	lp.endRenewals(l)
}

// endRenewals ends l's renewals: its renewals on the wire are of no more use to it (a statement none of whose
// leases wants it is cut), and they are said ended once its end (if lost) has run.
func (lp *loop) endRenewals(l *Lease) {
	rs := &l.rs
	lp.drop(l)
	if rs.idx >= 0 {
		heap.Remove(&lp.h, rs.idx)
	}
	rs.ending = true
	if rs.ends == 0 {
		l.renewalsEnded()
	} else {
		lp.ending++
	}
}

// trustNow is when the holder stops trusting l, as it stands.
func (l *Lease) trustNow() time.Time {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.trust
}

// leaseHeap orders the loop's leases by when each is stepped next.
type leaseHeap []*Lease

func (h leaseHeap) Len() int           { return len(h) }
func (h leaseHeap) Less(i, j int) bool { return h[i].rs.wake.Before(h[j].rs.wake) }
func (h leaseHeap) Swap(i, j int) {
	h[i], h[j] = h[j], h[i]
	h[i].rs.idx, h[j].rs.idx = i, j
}
func (h *leaseHeap) Push(x any) {
	l := x.(*Lease)
	l.rs.idx = len(*h)
	*h = append(*h, l)
}
func (h *leaseHeap) Pop() any {
	old := *h
	l := old[len(old)-1]
	old[len(old)-1] = nil
	*h = old[:len(old)-1]
	l.rs.idx = -1
	return l
}
