package main

import (
	"fmt"
	"slices"
	"sort"
	"strings"
	"time"
)

// Wait is one wait for a key, as its worker recorded it: a pair operation's wait for its second key, made while its
// caller holds the first (in the critical section CS), or a reader's or writer's wait for the queue key, which
// holds nothing (named by ID; the section its grant began names it back).
type Wait struct {
	ID     string // a reader's or writer's wait; empty for a pair's (named by CS)
	CS     string // the section of the key its caller holds (a pair's); empty for a reader's or writer's
	Worker int
	Op     string
	Key    string    // the key it waits for
	Mode   string    // x or s
	Start  time.Time // just before the Lock call
	End    time.Time // just after it returned; zero if that was never recorded (the worker was killed)
	Result string    // ok, not_acquired, deadlock, timeout, lost, error, ...
	Err    string
}

// Deadlock violations.
const (
	VDeadlockHang   = "deadlock_hang"   // a cycle of waits that nothing broke within the bound
	VDoubleDeadlock = "double_deadlock" // two waits of one cycle ended with ErrDeadlock: both callers gave up
	VFalseDeadlock  = "false_deadlock"  // a wait ended with ErrDeadlock that was in no cycle
)

// DeadlockBound is how long a cycle of waits may last: the Lockers find one within about 2 s of forming (a reading
// about once a second, confirmed by a second one), and the victim's wait then returns at once.
const DeadlockBound = 3 * time.Second

// justifySlack is how long before a victim's return the other waits of its cycle must still have been there: the
// victim gives up on what a reading showed a moment before.
const justifySlack = 300 * time.Millisecond

// Cycle is one cycle of waits the checker found in the pair operations' records: every member holds the key the
// one before it waits for, all at once.
type Cycle struct {
	Members []*Wait
	Formed  time.Time // the last member's wait started: from then on every member waited
	Broken  time.Time // the first member stopped waiting or holding
	Victims []*Wait
	Excused bool // it lasted past the bound while a fault kept its Lockers from reading the graph
}

// member is a pair wait with its outer section's held interval.
type member struct {
	w                *Wait
	cs               *CS
	holdFrom, holdTo time.Time
	waitFrom, waitTo time.Time
	idx              int
	victimOf         []*Cycle
}

func (m *member) until() time.Time { return minTime(m.waitTo, m.holdTo) }

func minTime(a, b time.Time) time.Time {
	if b.Before(a) {
		return b
	}
	return a
}

// forever stands for an end that was never recorded.
var forever = time.Unix(1<<40, 0)

// deadlocks rebuilds every cycle of waits from the pair operations' records (a wait for a key while holding
// another; a cycle at some moment is a ring of such waits, each for the key the next one holds) and judges each:
//
//   - a cycle must be broken within the bound (DeadlockBound from the moment it formed): by exactly one of its
//     waits ending with ErrDeadlock, or by a fault, a timeout or a loss ending one of them; a cycle that stays past
//     the bound is deadlock_hang, unless a fault touched one of its workers then (a stopped or cut-off process
//     cannot read the graph);
//   - two waits of one cycle that both ended with ErrDeadlock, each while the cycle was still whole, are
//     double_deadlock (the victim is chosen the same way by every Locker, so only one gives up);
//   - an ErrDeadlock is false_deadlock unless its wait was in a cycle that was still whole just before it
//     returned (justifySlack), or a fault touched its worker just before (a reading answered before a pause).
//
// Every other operation never waits while holding, so an ErrDeadlock from one is false_deadlock too.
func (h *History) deadlocks() []Violation {
	var out []Violation
	add := func(kind, f string, a ...any) { out = append(out, Violation{kind, fmt.Sprintf(f, a...)}) }
	var ms []*member
	for _, w := range h.Waits {
		c := h.CS[w.CS]
		if w.CS == "" || c == nil || w.Start.IsZero() {
			continue // a wait that holds nothing closes no cycle
		}
		m := &member{w: w, cs: c, holdFrom: c.begin(), holdTo: forever, waitFrom: w.Start, waitTo: forever}
		if !w.End.IsZero() {
			m.waitTo = w.End
		} else if at, ok := h.killedAfter(w.Worker, w.Start); ok {
			m.waitTo = at
		}
		if c.Ended {
			m.holdTo = c.End
		} else if at, ok := h.killedAfter(c.Worker, c.begin()); ok {
			m.holdTo = at
		}
		if !c.Told.IsZero() && c.Told.Before(m.holdTo) {
			m.holdTo = c.Told
		}
		ms = append(ms, m)
	}
	sort.Slice(ms, func(i, j int) bool { return ms[i].waitFrom.Before(ms[j].waitFrom) })
	for i, m := range ms {
		m.idx = i
	}

	// Cycles can only form when a wait starts: evaluate the graph at each start.
	cycles := map[string]*Cycle{}
	var order []*Cycle
	for _, s := range ms {
		t := s.waitFrom
		var active []*member
		byHeld := map[string][]*member{}
		for _, m := range ms {
			if m.waitFrom.After(t) {
				break // sorted by start
			}
			if t.Before(m.waitTo) && !t.Before(m.holdFrom) && t.Before(m.holdTo) {
				active = append(active, m)
				byHeld[m.cs.Key] = append(byHeld[m.cs.Key], m)
			}
		}
		for _, ring := range rings(active, byHeld) {
			ids := make([]string, len(ring))
			for i, m := range ring {
				ids[i] = m.w.CS
			}
			sort.Strings(ids)
			id := strings.Join(ids, "+")
			if cycles[id] != nil {
				continue
			}
			c := &Cycle{Broken: forever}
			for _, m := range ring {
				c.Members = append(c.Members, m.w)
				if m.waitFrom.After(c.Formed) {
					c.Formed = m.waitFrom
				}
				c.Broken = minTime(c.Broken, m.until())
			}
			// A victim is a member that ended with ErrDeadlock while the rest of the cycle was still whole.
			for _, m := range ring {
				if m.w.Result != "deadlock" || m.waitTo.Before(c.Formed) {
					continue
				}
				whole := true
				for _, o := range ring {
					if o != m && o.until().Before(m.waitTo.Add(-justifySlack)) {
						whole = false
					}
				}
				if whole {
					c.Victims = append(c.Victims, m.w)
					m.victimOf = append(m.victimOf, c)
				}
			}
			cycles[id] = c
			order = append(order, c)
		}
	}
	h.Cycles = order

	workers := func(c *Cycle) []int {
		var ws []int
		for _, m := range c.Members {
			if !slices.Contains(ws, m.Worker) {
				ws = append(ws, m.Worker)
			}
		}
		return ws
	}
	// What can keep a Locker from reading the graph, or from being answered, in time: a restart of the server (the
	// reading fails until it is back), a cut, blackhole or latency on its worker's network, its process stopped;
	// each until the Locker has noticed the connections the fault broke and has others, within the loss bound
	// after the fault ends (a reading on a connection a blackhole left dead waits for its keepalive bound). A
	// terminate never hits a reading (it aims at backends that hold or wait), and one that ends a wait of the
	// cycle breaks the cycle. after is how long a fault's effect is counted past its end.
	disturbed := func(ws []int, from, to time.Time, after time.Duration) bool {
		for _, e := range h.Evidence {
			efrom, eto := e.At, e.At
			if e.Until.After(eto) {
				eto = e.Until
			}
			eto = eto.Add(after)
			switch {
			case e.Kind == "restart_fast" || e.Kind == "restart_immediate" || e.Kind == "failover":
				efrom = efrom.Add(-time.Second)
			case e.Kind == "cut" || e.Kind == "blackhole" || e.Kind == "partition" || e.Kind == "latency" || e.Kind == "slow_link" ||
				e.Kind == "sigstop":
				if !slices.Contains(ws, e.Worker) {
					continue
				}
			default:
				continue
			}
			if !efrom.After(to) && !eto.Before(from) {
				return true
			}
		}
		for _, w := range ws {
			if h.paused(w, from, to) || h.killed(w, from, to) {
				return true
			}
		}
		return false
	}
	for _, c := range order {
		switch {
		case len(c.Victims) > 1:
			var vs []string
			for _, v := range c.Victims {
				vs = append(vs, fmt.Sprintf("%s (worker %d, ended %s)", v.CS, v.Worker, ts(v.End)))
			}
			add(VDoubleDeadlock, "cycle %s formed at %s: %d of its waits ended with ErrDeadlock: %s",
				describe(c), ts(c.Formed), len(c.Victims), strings.Join(vs, ", "))
		case len(c.Victims) > 0 && c.Victims[0].End.Sub(c.Formed) <= h.DeadlockBound,
			len(c.Victims) == 0 && c.Broken.Sub(c.Formed) <= h.DeadlockBound:
		case disturbed(workers(c), c.Formed.Add(-faultSlack), c.Formed.Add(h.DeadlockBound), h.Bound):
			c.Excused = true
		case len(c.Victims) > 0:
			add(VDeadlockHang, "cycle %s formed at %s and was broken by %s's ErrDeadlock only at %s, %v later (bound %v)",
				describe(c), ts(c.Formed), c.Victims[0].CS, ts(c.Victims[0].End),
				c.Victims[0].End.Sub(c.Formed).Round(time.Millisecond), h.DeadlockBound)
		default:
			broken := "never broken"
			if c.Broken != forever {
				broken = fmt.Sprintf("broken only at %s, %v later", ts(c.Broken), c.Broken.Sub(c.Formed).Round(time.Millisecond))
			}
			add(VDeadlockHang, "cycle %s formed at %s and was %s (bound %v)", describe(c), ts(c.Formed), broken, h.DeadlockBound)
		}
	}
	for _, m := range ms {
		if m.w.Result != "deadlock" || len(m.victimOf) > 0 {
			continue
		}
		if disturbed([]int{m.w.Worker}, m.waitTo.Add(-h.DeadlockBound), m.waitTo, 0) {
			continue // a reading answered before a pause or a cut, judged after it
		}
		if h.strandedNear(m.w.Worker, m.waitTo.Add(-h.DeadlockBound), m.waitTo) {
			// Another worker was behind a blackhole or stopped: its server sessions go on holding and waiting after
			// its own records say it gave up, so the server's cycle may run through them.
			continue
		}
		add(VFalseDeadlock, "worker %d: %s's wait for key %s (holding %s) ended with ErrDeadlock at %s, in no cycle",
			m.w.Worker, m.w.CS, m.w.Key, m.cs.Key, ts(m.waitTo))
	}
	return out
}

// rings returns the cycles of the wait-for graph among active waits: an edge from a wait to each active wait whose
// caller holds the key it waits for. Each cycle once, from its least member.
func rings(active []*member, byHeld map[string][]*member) [][]*member {
	var out [][]*member
	var path []*member
	on := map[*member]bool{}
	var dfs func(start, m *member)
	dfs = func(start, m *member) {
		for _, next := range byHeld[m.w.Key] {
			switch {
			case next == m:
			case next == start:
				out = append(out, slices.Clone(path))
			case next.idx > start.idx && !on[next]:
				on[next] = true
				path = append(path, next)
				dfs(start, next)
				path = path[:len(path)-1]
				on[next] = false
			}
		}
	}
	for _, s := range active {
		path = append(path[:0], s)
		on[s] = true
		dfs(s, s)
		on[s] = false
	}
	return out
}

func describe(c *Cycle) string {
	var parts []string
	for _, m := range c.Members {
		parts = append(parts, fmt.Sprintf("%s(w%d waits %s)", m.CS, m.Worker, m.Key))
	}
	return strings.Join(parts, " ")
}

// strandedNear reports whether a worker other than w was behind a blackhole, a partition or a slow link, or stopped (SIGSTOP),
// between from and to: its sessions stay in the server, holding and waiting, whatever its client has given up
// since (through a slow link, the news reaches the server a round trip late).
func (h *History) strandedNear(w int, from, to time.Time) bool {
	for _, e := range h.Evidence {
		if (e.Kind != "blackhole" && e.Kind != "partition" && e.Kind != "slow_link" && e.Kind != "sigstop") || e.Worker == w ||
			e.Worker == -1 {
			continue
		}
		eto := e.At
		if e.Until.After(eto) {
			eto = e.Until
		}
		if !e.At.After(to) && !eto.Before(from) {
			return true
		}
	}
	for _, p := range h.Pauses {
		if p.Worker != w && p.From.Before(to) && p.To.After(from) {
			return true
		}
	}
	return false
}
