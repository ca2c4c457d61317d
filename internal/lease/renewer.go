package lease

import (
	"container/heap"
	"context"
	"fmt"
	"sync"
	"time"

	"github.com/advlock/advlock/internal/mutant"
	"github.com/advlock/advlock/internal/session"
)

// A Client renews all its leases from one goroutine (renewLoop), not one per lease: each lease is a small state
// machine that the loop steps at its next moment (a renewal due, one to send again, its trust ending) and at each
// answer. A renewal is still a statement of its own, sent on a goroutine that lives while it is on the wire, with
// the same rules as ever:
//
// A lease is renewed every Renew (from the send of the last confirmed statement), and ends when the trust window
// closes without a confirmed renewal, or at once when the server says the lease is no longer this owner's. A
// renewal unanswered for a third of the trust left at its send (or three of the last round trips, when longer) is
// sent again on another connection, the first still waiting (at most two at once): one stuck on a dead connection
// does not spend the trust, and a link that is only slow is not taken for a dead one. The trust is counted from the
// send of whichever is confirmed.

// renewers hands leases to the renewal loop and tells it of halts; the loop runs while it has leases (or
// statements of ended ones on the wire), and starts again with the next lease.
type renewers struct {
	mu      sync.Mutex
	running bool
	adds    []*Lease
	halts   []*Lease
	kick    chan struct{} // capacity 1: adds or halts are waiting
	results chan renewal  // the answers of the statements on the wire
}

func (r *renewers) init() {
	r.kick = make(chan struct{}, 1)
	r.results = make(chan renewal, 64)
}

// renewal is one renewal statement's outcome.
type renewal struct {
	l          *Lease
	round      int
	sent, recv time.Time
	txt        string
	err        error
}

// renewState is a lease's renewals, as the loop keeps them.
type renewState struct {
	next        time.Time // the next renewal period begins (when none of this one's is on the wire)
	round       int       // renewals of one period: a success ends the others
	current     int       // round's renewals not yet answered
	inflight    int       // all renewals not yet answered (earlier rounds' were cut)
	lastSent    time.Time // the latest send
	roundCtx    context.Context
	cancelRound context.CancelFunc // cuts round's renewals on the wire
	wake        time.Time          // when the loop steps it next
	idx         int                // its place in the loop's heap; -1 once it has left it
	ending      bool               // its renewals have ended: stopped closes once inflight is 0
}

func (r *renewers) add(l *Lease) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.adds = append(r.adds, l)
	if !r.running {
		r.running = true
		go l.c.renewLoop()
		return
	}
	r.poke()
}

// halt tells the loop that l's renewals are to stop (l.stop is closed). A loop that is not running has no lease
// that has not ended: l's renewals have ended, and stopped is closed.
func (r *renewers) halt(l *Lease) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.running {
		r.halts = append(r.halts, l)
		r.poke()
	}
}

func (r *renewers) poke() {
	select {
	case r.kick <- struct{}{}:
	default:
	}
}

// renewLoop steps the Client's leases until none is left.
func (c *Client) renewLoop() {
	r := &c.r
	h := &leaseHeap{}
	ending := 0 // leases whose renewals have ended with statements still on the wire
	timer := time.NewTimer(time.Hour)
	timer.Stop()
	for {
		r.mu.Lock()
		adds, halts := r.adds, r.halts
		r.adds, r.halts = nil, nil
		if len(adds) == 0 && len(halts) == 0 && h.Len() == 0 && ending == 0 {
			r.running = false
			r.mu.Unlock()
			return
		}
		r.mu.Unlock()
		for _, l := range adds {
			l.rs.roundCtx, l.rs.cancelRound = cancellable()
			l.rs.wake = time.Time{} // stepped below
			heap.Push(h, l)
		}
		for _, l := range halts {
			if !l.rs.ending {
				c.endRenewals(l, h, &ending)
			}
		}
		for h.Len() > 0 && !(*h)[0].rs.wake.After(time.Now()) {
			c.step((*h)[0], h, &ending)
		}
		if h.Len() == 0 && ending == 0 {
			continue // nothing left to wait for: the top ends the loop, unless adds came meanwhile
		}
		if h.Len() > 0 {
			timer.Reset(time.Until((*h)[0].rs.wake))
		}
		select {
		case <-r.kick:
		case res := <-r.results:
			c.answered(res, h, &ending)
		case <-timer.C:
		}
		timer.Stop()
	}
}

// step sends what l's renewals need sent now, and sets when it is stepped next; or ends them, when l was stopped or
// its trust has ended.
func (c *Client) step(l *Lease, h *leaseHeap, ending *int) {
	select {
	case <-l.stop:
		c.endRenewals(l, h, ending)
		return
	default:
	}
	cfg := c.cfg
	rs := &l.rs
	for {
		l.mu.Lock()
		trust, rtt := l.trust, l.rtt
		l.mu.Unlock()
		now := time.Now()
		if l.expired(now) {
			c.lost(l, l.errTrustEnded(), true, h, ending)
			return
		}
		send, wake := false, trust
		switch {
		case rs.current == 0 && !now.Before(rs.next):
			send = true
		case rs.current == 0:
			wake = earliest(wake, rs.next)
		case rs.current < 2:
			again := rs.lastSent.Add(max(trust.Sub(rs.lastSent)/3, 3*rtt))
			send, wake = !now.Before(again), earliest(wake, again)
		}
		if !send {
			rs.wake = wake
			heap.Fix(h, rs.idx)
			return
		}
		if rs.current == 0 { // a new period: what is left of the last one is cut
			rs.cancelRound()
			rs.round++
			rs.roundCtx, rs.cancelRound = cancellable()
		}
		rs.current++
		rs.inflight++
		rs.lastSent = now
		go func(ctx context.Context, round int, stmt string, bound time.Duration) {
			txt, _, err := exec(ctx, c.pool, bound, stmt, false)
			c.r.results <- renewal{l, round, now, time.Now(), txt, err}
		}(rs.roundCtx, rs.round, c.renewSQL(l, trust), min(trust.Sub(now), cfg.Bound))
	}
}

func (c *Client) renewSQL(l *Lease, trust time.Time) string {
	if mutant.On(mutant.LeaseRenewUnkeyed) {
		return renewUnkeyedSQL(l.id, c.cfg.Length)
	}
	until := c.clock.estimate(trust)
	if mutant.On(mutant.LeaseRenewNoDeadline) {
		until = 0
	}
	return RenewSQL(l.id, l.owner, l.term, c.cfg.Length, until)
}

// answered takes a renewal's answer, then steps its lease.
func (c *Client) answered(r renewal, h *leaseHeap, ending *int) {
	l := r.l
	rs := &l.rs
	rs.inflight--
	if r.round == rs.round {
		rs.current--
	}
	if rs.ending {
		if rs.inflight == 0 {
			*ending--
			close(l.stopped)
		}
		return
	}
	cfg := c.cfg
	if mutant.On(mutant.LeaseTrustFromReply) {
		r.sent = r.recv
	}
	var ok string
	var srv int64
	if r.err == nil {
		if _, err := fmt.Sscan(r.txt, &ok, &srv); err != nil {
			r.err = fmt.Errorf("advlock: unexpected renewal answer %q", r.txt)
		} else {
			c.clock.sample(r.recv, srv)
		}
	}
	switch {
	case r.err == nil && ok == "1" && l.expired(r.recv):
		// Answered after the trust had ended (the loop ran late, its timer and the answer ready at once): Err has
		// said lost since then, and a late answer is not handed out, as for a grant. The step ends the lease.
	case r.err == nil && ok == "1":
		l.mu.Lock()
		if t := c.trustFrom(r.sent); t.After(l.trust) {
			l.trust, l.wall, l.rtt = t, c.trustFrom(r.sent.Round(0)), r.recv.Sub(r.sent)
		}
		l.mu.Unlock()
		if r.round == rs.round {
			rs.next = r.sent.Add(cfg.Renew)
			rs.cancelRound() // the others of its period are of no use now: what they answer is only counted
			rs.round, rs.current = rs.round+1, 0
		}
	case r.err == nil && ok == "0":
		c.lost(l, fmt.Errorf("%w: %w", session.ErrLockLost, errNotYours), false, h, ending)
		return
	case r.round != rs.round || rs.current > 0:
		// cut because another of its period was confirmed, or others of its period are still on their way
	case r.err == nil: // "l": the server's clock is ahead of what this client knew; the answer told it: at once
		rs.next = time.Now()
	default:
		rs.next = time.Now().Add(min(cfg.Renew/5, time.Second, max(time.Until(l.trustNow())/10, time.Millisecond)))
	}
	c.step(l, h, ending)
}

// lost ends l with cause, and its renewals. The end runs apart (it calls the Locker's hooks, and its observers,
// which must not hold up other leases' renewals), and stopped closes after it, as after the statements still on the
// wire: whoever stops the lease finds it ended. With retire, its row, if the server still has it, is deleted apart
// (a trust that ended: the key is free once it is gone).
func (c *Client) lost(l *Lease, cause error, retire bool, h *leaseHeap, ending *int) {
	l.rs.inflight++ // the end, counted as a statement on the wire: its renewal says round -1
	go func() {
		l.finish(cause)
		if retire {
			c.retire([]session.ID{l.id}, l.owner, 0, false)
		}
		c.r.results <- renewal{l: l, round: -1}
	}()
	c.endRenewals(l, h, ending)
}

// endRenewals ends l's renewals: its statements on the wire are cut, and stopped closes once they have answered.
func (c *Client) endRenewals(l *Lease, h *leaseHeap, ending *int) {
	rs := &l.rs
	rs.cancelRound()
	if rs.idx >= 0 {
		heap.Remove(h, rs.idx)
	}
	rs.ending = true
	if rs.inflight == 0 {
		close(l.stopped)
	} else {
		*ending++
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
