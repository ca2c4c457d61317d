package main

import (
	"context"
	"fmt"
	"math/rand/v2"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/advlock/advlock"
	"github.com/jackc/pgx/v5"
)

// A lease campaign's own faults, in place of the terminates (a lease has no session to end). What time can do to a
// lease: answers that come after their senders gave up, a server clock that steps, a pooler that stalls with
// requests in it; and faults aimed at a lease's edges, where a holder's trust window closes.
//
//   - break_lease: a live lease's row deleted, as advlock break does; its holder learns at its next renewal, and
//     another may take the key meanwhile (docs/leases.md);
//   - break_in_flight: the same while the holder's link is slowed (100 to 300 ms a chunk), so that its next
//     statement (a renewal, a release) reaches the server after the break and, as often as not, after a waiter's
//     takeover;
//   - slow_then_silent: a holder's link slowed to 0.6 to 0.9 s a chunk for a renewal period and a round trip, then
//     silent for a lease length and a second: a renewal answered late, then silence;
//   - late_answers: the link of a worker next in a key's queue delays every answer 1.15 to 1.3 lease lengths (its requests
//     reach the server at once) for one to three lease lengths: grants answered past their trust window (cut at it,
//     and undone; never handed out), renewals confirmed too late, answers that come after their senders gave up;
//   - clock_step: the server's wall clock steps 3 to 30 s forward or back (libfaketime under the primary), every
//     lease's expiry with it: the server's clock orders, it never decides;
//   - pgbouncer_stall: PgBouncer stopped (SIGSTOP) for 2 to 4 s with its workers' statements in it, then continued:
//     it forwards what it buffered, requests whose senders have given up among them;
//   - pause_edge and cut_edge: a holder stopped (SIGSTOP), or its link silent, for its trust window (the lease
//     length less a fifteenth) give or take 150 ms: a holder stopped or cut off until just past its trust, or a
//     renewal that fails once just before it ends.
var leaseFaultKinds = []string{"break_lease", "break_in_flight", "slow_then_silent", "late_answers", "clock_step",
	"pgbouncer_stall", "pause_edge", "cut_edge"}

// stepsClock says whether this campaign steps the server's clock (its primary then runs under libfaketime).
func (c *campaign) stepsClock() bool {
	if !c.opt.Leases || c.opt.Failover || c.opt.NoFaults {
		return false
	}
	return len(c.opt.Faults) == 0 || slices.Contains(c.opt.Faults, "clock_step")
}

// canInject says whether a lease fault kind has something to aim at in this campaign: a worker behind a proxy, or
// PgBouncer.
func (c *campaign) canInject(kind string) bool {
	switch kind {
	case "late_answers", "slow_then_silent", "cut_edge", "break_in_flight":
		for _, s := range c.slots {
			if len(s.proxies) > 0 {
				return true
			}
		}
		return false
	case "pgbouncer_stall":
		return c.bouncer != nil
	case "clock_step":
		return c.stepsClock()
	}
	return true
}

// trustWindow is how long a holder of the campaign's leases trusts a grant or renewal: the length less a fifteenth.
func (c *campaign) trustWindow() time.Duration { return c.opt.LeaseLength - c.opt.LeaseLength/15 }

// injectLease injects one lease fault of kind; it reports false when it found nothing to aim at (the injector
// tries that kind again later).
func (c *campaign) injectLease(ctx context.Context, kind string, f fault, rng *rand.Rand, now Sample, proxied []*slot) bool {
	length := c.opt.LeaseLength
	switch kind {
	case "break_lease":
		for try := 0; try < 10 && ctx.Err() == nil; try++ { // a lease may be held only now and then
			if try > 0 {
				sleepCtx(ctx, 100*time.Millisecond)
			}
			key, term, w, ok := c.breakLease(ctx, -1)
			if !ok {
				continue
			}
			f.Worker, f.Term, f.Keys, f.Held, f.Detail = w, term, []string{key}, 1, fmt.Sprintf("term %d of %s", term, key)
			c.record(f)
			return true
		}
		return false
	case "break_in_flight":
		if len(proxied) == 0 {
			return false
		}
		s := c.pickHolder(now, proxied, rng)
		d := time.Duration(100+rng.IntN(200)) * time.Millisecond
		for _, p := range s.proxies {
			p.Latency(d)
		}
		defer func() {
			for _, p := range s.proxies {
				p.Latency(0)
			}
		}()
		// Its statements are on their way, slowly, when its lease goes: the next one arrives after the break.
		sleepCtx(ctx, d+time.Duration(rng.Int64N(int64(length/3))))
		key, term, w, ok := c.breakLease(ctx, s.cfg.ID)
		if !ok {
			return false
		}
		f.Worker, f.Term, f.Keys, f.Held = w, term, []string{key}, 1
		f.Detail = fmt.Sprintf("term %d of %s, %v a chunk", term, key, d)
		c.record(f)
		sleepCtx(ctx, length/3+2*d) // its next renewal goes out and arrives
		return true
	case "slow_then_silent":
		if len(proxied) == 0 {
			return false
		}
		s := c.pickHolder(now, proxied, rng)
		f.Worker, f.Held = s.cfg.ID, heldIn(now, s.cfg.Name)
		d := time.Duration(600+rng.IntN(300)) * time.Millisecond
		silent := length + time.Second
		for _, p := range s.proxies {
			p.Latency(d)
		}
		// Long enough that a renewal goes out and is answered (late) before the silence: a renewal period and a
		// slow round trip.
		sleepCtx(ctx, length/3+2*d+300*time.Millisecond)
		for _, p := range s.proxies {
			p.Blackhole(true)
		}
		sleepCtx(ctx, silent)
		for _, p := range s.proxies {
			p.Blackhole(false)
			p.Latency(0)
		}
		f.Until = time.Now()
		f.Detail = fmt.Sprintf("%v a chunk, then silent for %v, holding %d", d, silent, f.Held)
		c.record(f)
		return true
	case "late_answers":
		if len(proxied) == 0 {
			return false
		}
		s, key := c.pickNext(now, proxied, rng)
		f.Worker, f.Held, f.Waits = s.cfg.ID, heldIn(now, s.cfg.Name), waitingIn(now, s.cfg.Name)
		d := length + length*3/20 + time.Duration(rng.Int64N(int64(length/6)))
		span := length + time.Duration(rng.Int64N(int64(2*length)))
		for _, p := range s.proxies {
			p.AnswerLatency(d)
		}
		if key != "" {
			// The key it is next in line for is broken from under its holder: it is granted that key while its
			// answers come late (the broken holder may act on until its next renewal: a break's excuse).
			if k, err := strconv.ParseInt(key, 10, 64); err == nil {
				if bkey, term, w, ok := c.breakLease(ctx, -1, k); ok {
					c.record(fault{Kind: "break_lease", At: time.Now(), Worker: w, Term: term, Keys: []string{bkey}, Held: 1,
						Detail: fmt.Sprintf("term %d of %s, for worker %d's late answers", term, bkey, s.cfg.ID)})
				}
			}
		}
		sleepCtx(ctx, span)
		for _, p := range s.proxies {
			p.AnswerLatency(0)
		}
		f.Until, f.Delay = time.Now().Add(d), d // what it held back arrives up to d later
		f.Detail = fmt.Sprintf("answers %v late for %v, holding %d, waiting for %d", d, span, f.Held, f.Waits)
		c.record(f)
		return true
	case "clock_step":
		// A step of 3 to 30 s, forward or back, keeping the offset within a minute of the real clock.
		step := time.Duration(3000+rng.IntN(27000)) * time.Millisecond
		if rng.IntN(2) == 0 {
			step = -step
		}
		if off := c.clockOffset + step; off > time.Minute || off < -time.Minute {
			step = -step
		}
		f.Worker, f.Held = -1, heldIn(now, "")
		if err := c.stepClock(ctx, c.clockOffset+step); err != nil {
			c.logf("clock_step: %v", err)
			return true
		}
		f.Until = time.Now()
		f.Detail = fmt.Sprintf("%+v, to %+v", step, c.clockOffset)
		c.record(f)
		return true
	case "pgbouncer_stall":
		if c.bouncer == nil {
			return false
		}
		f.Worker, f.Held = -1, heldIn(now, "")
		d := time.Duration(2000+rng.IntN(2000)) * time.Millisecond
		if err := c.bouncer.Stall(true); err != nil {
			c.logf("pgbouncer_stall: %v", err)
			return true
		}
		sleepCtx(ctx, d)
		if err := c.bouncer.Stall(false); err != nil {
			c.logf("pgbouncer_stall: %v", err)
		}
		f.Until = time.Now()
		f.Detail = fmt.Sprintf("%v, holding %d", d, f.Held)
		c.record(f)
		return true
	case "pause_edge", "cut_edge":
		d := c.trustWindow() + time.Duration(rng.IntN(300)-150)*time.Millisecond
		target := c.pickHolder(now, c.slots, rng)
		if kind == "cut_edge" {
			if len(proxied) == 0 {
				return false
			}
			target = c.pickHolder(now, proxied, rng)
		}
		f.Worker, f.Held = target.cfg.ID, heldIn(now, target.cfg.Name)
		f.Detail = fmt.Sprintf("%v (the trust window %+v), holding %d", d, d-c.trustWindow(), f.Held)
		if kind == "pause_edge" {
			c.signal(target, syscall.SIGSTOP)
			sleepCtx(ctx, d)
			c.signal(target, syscall.SIGCONT)
		} else {
			for _, p := range target.proxies {
				p.Blackhole(true)
			}
			sleepCtx(ctx, d)
			for _, p := range target.proxies {
				p.Blackhole(false)
			}
		}
		f.Until = time.Now()
		c.record(f)
		if kind == "pause_edge" {
			c.mu.Lock()
			c.pauses = append(c.pauses, Pause{Worker: target.cfg.ID, From: f.At, To: f.Until})
			c.mu.Unlock()
		}
		return true
	}
	return false
}

// pickNext picks one of the slots that is first in the queue of a key another worker holds, and that key (to
// break, so that the slot is granted it while the fault lasts); or else one that waits, or else a holder, and no
// key. A lease sample lists each key's waits in their queue's order.
func (c *campaign) pickNext(now Sample, slots []*slot, rng *rand.Rand) (*slot, string) {
	type next struct {
		s   *slot
		key string
	}
	var list []next
	for _, s := range slots {
		for _, key := range sortedKeys(now.Held) {
			held := false
			for _, r := range now.Held[key] {
				if r.Granted {
					held = held || r.App != s.cfg.Name
					continue
				}
				if held && r.App == s.cfg.Name {
					list = append(list, next{s, key})
				}
				break // the first wait
			}
		}
	}
	if len(list) == 0 {
		return c.pickWaiter(now, slots, rng), ""
	}
	n := list[rng.IntN(len(list))]
	return n.s, n.key
}

// stepClock sets the primary's clock offset, between two marks in the lease table's log ('S' before the step, 'T'
// after, with the offset in milliseconds as their term): the checker reads the log's clock back to the real one by
// the marks, and does not time what the log recorded between them.
func (c *campaign) stepClock(ctx context.Context, offset time.Duration) error {
	qctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	conn, err := pgx.Connect(qctx, c.primary().URL)
	if err != nil {
		return err
	}
	defer conn.Close(context.Background())
	mark := func(op string, off time.Duration) error {
		_, err := conn.Exec(qctx, "INSERT INTO chaos_lease_log (op, key, term, expires, holder) VALUES ($1, 0, $2, clock_timestamp(), '')",
			op, off.Milliseconds())
		return err
	}
	if err := mark("S", c.clockOffset); err != nil {
		return err
	}
	if err := c.primary().StepClock(offset); err != nil {
		return err
	}
	c.clockOffset = offset
	time.Sleep(20 * time.Millisecond) // a statement that read the clock before the step logs before the mark
	return mark("T", offset)
}

// awaitFreshGrant waits, for up to 5 s, until the server has granted a worker a lease in the last 100 ms (on its
// clock): a lease campaign's crash comes right after a grant, whose WAL the WAL writer has likely not written
// out yet (it writes whole pages as they fill, the rest at its round, 1 s here), while its holder is still in its
// section. The crash then takes the grant back, and the restarted server must grant nothing while its holder
// trusts it.
func (c *campaign) awaitFreshGrant(ctx context.Context) {
	qctx, cancel := context.WithTimeout(ctx, 6*time.Second)
	defer cancel()
	conn, err := pgx.Connect(qctx, c.primary().URL)
	if err != nil {
		return
	}
	defer conn.Close(context.Background())
	for deadline := time.Now().Add(5 * time.Second); time.Now().Before(deadline); {
		var fresh bool
		if err := conn.QueryRow(qctx, "SELECT EXISTS (SELECT 1 FROM public.advlock_lease WHERE holder LIKE '% chaos-w%' AND "+
			"granted > clock_timestamp() - interval '100 milliseconds')").Scan(&fresh); err != nil || fresh {
			return
		}
	}
}

// breakLease deletes one live lease of a worker (of worker w when w >= 0; of key k when keys holds it), picked at
// random: its key, term and worker.
func (c *campaign) breakLease(ctx context.Context, w int, keys ...int64) (key string, term int64, worker int, ok bool) {
	qctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	conn, err := pgx.Connect(qctx, c.primary().URL)
	if err != nil {
		return "", 0, 0, false
	}
	defer conn.Close(context.Background())
	like := "% chaos-w%"
	if w >= 0 {
		like = fmt.Sprintf("%% chaos-w%d", w)
	}
	var k int64
	var holder string
	err = conn.QueryRow(qctx, `DELETE FROM public.advlock_lease WHERE (space, key) = (SELECT space, key FROM public.advlock_lease
			WHERE expires > clock_timestamp() AND holder LIKE $1 AND (coalesce(cardinality($2::int8[]), 0) = 0 OR key = ANY($2))
			ORDER BY random() LIMIT 1)
		RETURNING key, term, holder`, like, keys).Scan(&k, &term, &holder)
	if err != nil {
		return "", 0, 0, false
	}
	if _, err := fmt.Sscanf(holder[strings.LastIndexByte(holder, ' ')+1:], "chaos-w%d", &worker); err != nil {
		return "", 0, 0, false
	}
	return canon(advlock.Int64Key(k)), term, worker, true
}
