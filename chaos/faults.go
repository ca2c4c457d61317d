package main

// The faults: their kinds, the injector that draws them (inject) and what they aim at. A lease campaign's own kinds
// are in leasefaults.go.

import (
	"context"
	"fmt"
	"math/rand/v2"
	"slices"
	"sort"
	"strings"
	"syscall"
	"time"

	"github.com/jackc/pgx/v5"
)

// Fault kinds the injector draws from; "cancel" (a ctx cancelled at a random moment of a wait) is fired by the
// workers themselves and counted with them, and "failover" is drawn only in a failover campaign.
var faultKinds = []string{"terminate_holder", "terminate_waiter", "cut", "blackhole", "partition", "latency", "slow_link", "sigstop",
	"sigkill", "restart_fast", "restart_immediate", "close_locker"}

// fault is one injected fault: when, what, and which worker it aimed at (-1: all of them).
type fault struct {
	Kind  string
	At    time.Time
	Until time.Time
	// Stopped: a server restart's stop had returned (a crash had happened by then).
	Stopped time.Time
	Worker  int
	Detail  string
	PID     int32         // the backend it ended (terminate)
	Term    int64         // the lease it deleted (break_lease)
	Keys    []string      // the advisory locks that backend held just before
	Held    int           // advisory locks its target (a worker, or every worker) held when it was injected
	Waits   int           // advisory locks its target waited for then (slow_link, aimed at a worker that waits)
	Delay   time.Duration // late_answers: how late each answer came (Until is the end of its span and this)
}

func (c *campaign) record(f fault) {
	c.mu.Lock()
	c.faults = append(c.faults, f)
	c.mu.Unlock()
	c.logf("fault %s worker %d %s", f.Kind, f.Worker, f.Detail)
}

func sleepCtx(ctx context.Context, d time.Duration) bool {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-ctx.Done():
		return false
	case <-t.C:
		return true
	}
}

// inject draws faults from a deck of every kind, shuffled with the seed, until ctx ends. Each fault aims at what
// pg_locks shows holding a lock, when something does (a fault that hits nobody tests little), and is counted only
// once it took effect; the locks its target held then are recorded.
func (c *campaign) inject(ctx context.Context) {
	rng := rand.New(rand.NewPCG(c.opt.Seed, 1))
	var deck []string
	var proxied []*slot
	for _, s := range c.slots {
		if len(s.proxies) > 0 {
			proxied = append(proxied, s)
		}
	}
	ka := c.opt.Keepalive
	for sleepCtx(ctx, time.Duration(300+rng.IntN(900))*time.Millisecond) {
		if len(deck) == 0 {
			deck = append(deck, c.kinds()...)
			rng.Shuffle(len(deck), func(i, j int) { deck[i], deck[j] = deck[j], deck[i] })
		}
		kind := deck[0]
		deck = deck[1:]
		now := c.locksNow(ctx)
		target := c.pickHolder(now, c.slots, rng)
		long := 2*ka + time.Duration(rng.Int64N(int64(3*ka))) // past the server's 3-keepalive idle timeout, mostly
		f := fault{Kind: kind, At: time.Now(), Worker: target.cfg.ID, Held: heldIn(now, target.cfg.Name)}
		switch kind {
		case "terminate_holder", "terminate_waiter":
			// A waiter (or holder) may be there only now and then: look again for a while before giving up, and
			// then try again later in this round of the deck.
			done := false
			for try := 0; try < 10 && !done && ctx.Err() == nil; try++ {
				if try > 0 {
					sleepCtx(ctx, 100*time.Millisecond)
					now = c.locksNow(ctx)
				}
				pid, w, keys, ok := pickBackend(now, kind == "terminate_holder", rng)
				if !ok {
					continue
				}
				f.Worker, f.PID, f.Keys, f.Held, f.Detail = w, pid, keys, len(keys), fmt.Sprintf("pid %d holding %v", pid, keys)
				f.At = time.Now()
				// Counted only when it took effect: the backend was still there to be signalled.
				if n, err := c.execRows(ctx, `SELECT 1 WHERE pg_terminate_backend($1)`, pid); err == nil && n == 1 {
					c.record(f)
					done = true
				}
			}
			if !done {
				deck = append(deck, kind)
			}
		case "break_lease", "slow_then_silent", "late_answers", "clock_step", "pgbouncer_stall", "pause_edge", "cut_edge",
			"break_in_flight":
			if !c.injectLease(ctx, kind, f, rng, now, proxied) {
				deck = append(deck, kind) // nothing to aim at now: later in this round of the deck
			}
		case "cut", "blackhole", "partition", "latency", "slow_link":
			if len(proxied) == 0 {
				continue
			}
			s := c.pickHolder(now, proxied, rng)
			if kind == "slow_link" {
				s = c.pickWaiter(now, proxied, rng)
			}
			f.Worker, f.Held, f.Waits = s.cfg.ID, heldIn(now, s.cfg.Name), waitingIn(now, s.cfg.Name)
			switch kind {
			case "cut":
				for _, p := range s.proxies {
					p.Cut()
				}
				c.record(f)
			case "blackhole":
				for _, p := range s.proxies {
					p.Blackhole(true)
				}
				f.Detail = fmt.Sprintf("%v, holding %d", long, f.Held)
				sleepCtx(ctx, long)
				for _, p := range s.proxies {
					p.Blackhole(false)
				}
				f.Until = time.Now()
				c.record(f)
			case "partition":
				// A partition as TCP lives through it: what the worker sends meanwhile (a renewal, an unlock, the
				// statements of a call that gave up, the close of a connection it gave up) reaches the server when
				// it ends, late, and the answers reach a worker that went on. With leases, past a lease length: the
				// holder stops trusting its lease, another may take the key over, and then the held requests come.
				// Half of a lease campaign's partitions cut every worker behind a proxy off at once: nobody takes a
				// key over meanwhile, so the held renewals arrive after their holders stopped trusting their leases
				// with the rows still there (what a renewal without its latest moment revives).
				d, cut := long, []*slot{s}
				if c.opt.Leases {
					d = c.opt.LeaseLength + time.Duration(500+rng.IntN(1000))*time.Millisecond
					if rng.IntN(2) == 0 {
						cut, f.Worker, f.Held = proxied, -1, 0
						for _, t := range proxied {
							f.Held += heldIn(now, t.cfg.Name)
						}
					}
				}
				for _, t := range cut {
					for _, p := range t.proxies {
						p.Partition(true)
					}
				}
				f.Detail = fmt.Sprintf("%v, %d worker(s), holding %d", d, len(cut), f.Held)
				sleepCtx(ctx, d)
				for _, t := range cut {
					for _, p := range t.proxies {
						p.Partition(false)
					}
				}
				f.Until = time.Now()
				c.record(f)
			case "latency":
				d := time.Duration(10+rng.IntN(70)) * time.Millisecond
				for _, p := range s.proxies {
					p.Latency(d)
				}
				f.Detail = d.String()
				sleepCtx(ctx, time.Duration(1000+rng.IntN(1000))*time.Millisecond)
				for _, p := range s.proxies {
					p.Latency(0)
				}
				f.Until = time.Now()
				c.record(f)
			case "slow_link":
				// Slow, not dead: a round trip of 0.4 to 1 s, for 1 to 3 s. A wait through it goes on (a Wait bound
				// ends not acquired, with no deadline its caller never set); the watcher of a lock held through it
				// may take it for dead (a keepalive round trip longer than the keepalive interval) and say so.
				d := time.Duration(200+rng.IntN(300)) * time.Millisecond
				for _, p := range s.proxies {
					p.Latency(d)
				}
				span := time.Duration(1000+rng.IntN(2000)) * time.Millisecond
				f.Detail = fmt.Sprintf("%v a chunk for %v, waiting for %d, holding %d", d, span, f.Waits, f.Held)
				sleepCtx(ctx, span)
				for _, p := range s.proxies {
					p.Latency(0)
				}
				f.Until = time.Now()
				c.record(f)
			}
		case "sigstop":
			// Some pauses are far past the bound: a stopped holder is what fencing must stop.
			long = 3*ka + 200*time.Millisecond + time.Duration(rng.Int64N(int64(2*ka))) // past the idle timeout, always
			if rng.IntN(3) == 0 {
				long = 4*(2*ka+time.Second) + time.Duration(rng.Int64N(int64(time.Second)))
			}
			f.Detail = fmt.Sprintf("%v, holding %d", long, f.Held)
			c.signal(target, syscall.SIGSTOP)
			sleepCtx(ctx, long)
			c.signal(target, syscall.SIGCONT)
			f.Until = time.Now()
			c.record(f)
			c.mu.Lock()
			c.pauses = append(c.pauses, Pause{Worker: target.cfg.ID, From: f.At, To: f.Until})
			c.mu.Unlock()
		case "sigkill":
			c.record(f)
			c.signal(target, syscall.SIGKILL)
		case "close_locker":
			if c.opt.Broken {
				continue
			}
			c.record(f)
			c.signal(target, syscall.SIGUSR1)
		case "restart_fast", "restart_immediate":
			// From the stop to the server accepting connections again (a crash recovery on a loaded machine can take
			// seconds): no Locker can read the server meanwhile.
			f.Worker, f.Held = -1, heldIn(now, "")
			if c.opt.Leases && kind == "restart_immediate" {
				c.awaitFreshGrant(ctx)
				f.At = time.Now()
			}
			p := c.primary()
			if err := p.Stop(strings.TrimPrefix(kind, "restart_")); err != nil {
				c.logf("restart: %v", err)
			}
			f.Stopped = time.Now()
			if err := p.Start(); err != nil {
				c.logf("restart: %v", err)
				_ = p.Start()
			}
			f.Until = time.Now()
			f.Detail = fmt.Sprintf("back after %v", f.Until.Sub(f.At).Round(time.Millisecond))
			c.record(f)
			if c.opt.Leases && kind == "restart_immediate" {
				// Nothing is granted for a lease length after a crash (its quiet period): the server grants a while
				// before the next fault, so that a crash comes among grants, not always within the last one's quiet.
				sleepCtx(ctx, c.opt.LeaseLength+time.Second)
			}
		case "failover":
			f.Worker, f.Held = -1, heldIn(now, "")
			c.failover(ctx, rng, f)
			// The new primary serves a while before anything else happens to it (a base backup and a crash
			// recovery aside cost the machine a burst of work, which back-to-back failovers would repeat).
			sleepCtx(ctx, 3*time.Second)
		}
	}
}

// kinds lists the fault kinds this campaign draws from.
func (c *campaign) kinds() []string {
	if len(c.opt.Faults) > 0 {
		return c.opt.Faults
	}
	kinds := slices.Clone(faultKinds)
	if c.opt.Leases {
		kinds = append(slices.DeleteFunc(kinds, func(k string) bool { return strings.HasPrefix(k, "terminate_") }),
			leaseFaultKinds...)
		kinds = slices.DeleteFunc(kinds, func(k string) bool { return !c.canInject(k) })
	}
	if c.opt.Failover {
		kinds = append(kinds, "failover")
	}
	return kinds
}

// pickHolder picks one of the slots whose sessions pg_locks shows holding a lock, or any of them when none does.
func (c *campaign) pickHolder(now Sample, slots []*slot, rng *rand.Rand) *slot {
	var holding []*slot
	for _, s := range slots {
		if heldIn(now, s.cfg.Name) > 0 {
			holding = append(holding, s)
		}
	}
	if len(holding) == 0 {
		holding = slots
	}
	return holding[rng.IntN(len(holding))]
}

// pickWaiter picks one of the slots whose sessions pg_locks shows waiting for a lock, or else a holder.
func (c *campaign) pickWaiter(now Sample, slots []*slot, rng *rand.Rand) *slot {
	var waiting []*slot
	for _, s := range slots {
		if waitingIn(now, s.cfg.Name) > 0 {
			waiting = append(waiting, s)
		}
	}
	if len(waiting) == 0 {
		return c.pickHolder(now, slots, rng)
	}
	return waiting[rng.IntN(len(waiting))]
}

// waitingIn counts the advisory locks the sessions named app wait for in a sample.
func waitingIn(s Sample, app string) int {
	n := 0
	for _, rows := range s.Held {
		for _, h := range rows {
			if !h.Granted && h.App == app {
				n++
			}
		}
	}
	return n
}

// heldIn counts the advisory locks granted to the sessions named app in a sample (every worker's: app "").
func heldIn(s Sample, app string) int {
	n := 0
	for _, rows := range s.Held {
		for _, h := range rows {
			if h.Granted && (h.App == app || app == "" && strings.HasPrefix(h.App, "chaos-w")) {
				n++
			}
		}
	}
	return n
}

// pickBackend picks a worker session that holds (or waits for) an advisory lock, one lock drawn at random, and
// lists the keys it holds.
func pickBackend(now Sample, holder bool, rng *rand.Rand) (pid int32, worker int, keys []string, ok bool) {
	type row struct {
		pid int32
		app string
		key string
	}
	var list []row // one per lock held (or waited for): a shared session holding many is picked as often
	held := map[int32][]string{}
	for key, rows := range now.Held {
		for _, h := range rows {
			if !strings.HasPrefix(h.App, "chaos-w") {
				continue
			}
			if h.Granted {
				held[h.PID] = append(held[h.PID], key)
			}
			if h.Granted == holder {
				list = append(list, row{h.PID, h.App, key})
			}
		}
	}
	if len(list) == 0 {
		return 0, 0, nil, false
	}
	sort.Slice(list, func(i, j int) bool { // the seed picks in one order
		return list[i].pid < list[j].pid || list[i].pid == list[j].pid && list[i].key < list[j].key
	})
	r := list[rng.IntN(len(list))]
	_, _ = fmt.Sscanf(r.app, "chaos-w%d", &worker)
	keys = held[r.pid]
	sort.Strings(keys)
	return r.pid, worker, keys, true
}

// locksNow reads pg_locks on a connection of its own (empty when the server does not answer).
func (c *campaign) locksNow(ctx context.Context) Sample {
	qctx, cancel := context.WithTimeout(ctx, 2*time.Second)
	defer cancel()
	conn, err := pgx.Connect(qctx, c.primary().URL)
	if err != nil {
		return Sample{}
	}
	defer conn.Close(context.Background())
	s, _ := c.read(qctx, conn)
	return s
}

// execRows runs sql on a connection of its own and says how many rows it returned or changed.
func (c *campaign) execRows(ctx context.Context, sql string, args ...any) (int64, error) {
	qctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	conn, err := pgx.Connect(qctx, c.primary().URL)
	if err != nil {
		return 0, err
	}
	defer conn.Close(context.Background())
	tag, err := conn.Exec(qctx, sql, args...)
	return tag.RowsAffected(), err
}
