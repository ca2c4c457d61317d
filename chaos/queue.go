package main

import (
	"cmp"
	"fmt"
	"slices"
	"sort"
	"time"

	"github.com/advlock/advlock/internal/session"
)

// Queue violations.
const (
	VStarvedWait = "starved_wait" // a wait not granted while its key was free to it (PostgreSQL's queue order), past the bound
	VFailedWait  = "failed_wait"  // a wait its caller bounded with Wait alone that failed, with no fault to explain it
	VOvertaken   = "overtaken"    // a crowd's wait granted after a conflicting one that began OvertakeSlack or more after it
)

// OvertakeSlack is how much later than a wait another may begin and still be granted first: both began their
// calls within it. The records are taken before each call, whose first round trips come after, and a Locker's
// first wait makes a connection of its own first: on a loaded machine (the race detector, every package's tests
// at once) that took 530 to 670 ms, and the suite's control without a mutant has seen waits begun 1.1 to 1.3 s
// later granted first (3 of 3 such runs in one CI run, none in most).
const OvertakeSlack = 1500 * time.Millisecond

// StarveBound is the campaign's History.StarveBound: how long a wait may go ungranted once its key is free to it.
// The library may let a reader in between two slices of a writer's wait (a newcomer, which PostgreSQL would have
// queued behind the writer), and the writer then waits for it: one slice (0.9 s) and one reader's hold (at most
// 0.9 s here), with room for a loaded machine.
const StarveBound = 3 * time.Second

// conflicts reports whether two lock modes conflict: all but two shared ones do.
func conflicts(a, b string) bool { return a != "s" || b != "s" }

// queue judges the readers' and writers' waits for the queue key, every one of which is recorded (a pair's wait is
// judged by the deadlock rules; its key's other waits, such as Do's, are not recorded):
//
//   - starved_wait: a wait that was neither granted nor given up within the bound of the moment its key was free
//     to it in PostgreSQL's queue order: every section of the key held in a conflicting mode when it began had
//     ended, and every conflicting wait that began before it had ended (given up, or granted and its section
//     ended). Later waits, and newcomers let in meanwhile, do not move that moment: PostgreSQL queues them behind
//     it. A wait is not judged when a fault touched any worker that held or waited for the key around it (from
//     leakBoundFault before it began to its end): a stopped, cut-off or slow client's sessions hold and wait in the
//     server past what its records say, and a writer that froze holding the key's intent holds readers back;
//   - overtaken: a wait of a crowd (each the only caller of its Locker, so that every one of them stands in the
//     key's line in the server, none in a Locker's in-process queue) granted while a wait of another crowd's writer
//     that began OvertakeSlack or more before it was still waiting, with no fault near either: PostgreSQL's queue
//     grants them in the order they came, and so must the line, whatever slices each of them crossed;
//   - failed_wait: such a wait is bounded by advlock.Wait under a context without a deadline, and nothing cancels
//     it, so it ends granted or not acquired. Any other end (an error, a context deadline its caller never set)
//     needs a fault near it on its worker, or on every worker, that ends sessions, cuts the worker off or stops
//     it; latency and a slow link excuse nothing: a wait goes on through a slow link.
func (h *History) queue() []Violation {
	var out []Violation
	add := func(kind, f string, a ...any) { out = append(out, Violation{kind, fmt.Sprintf(f, a...)}) }
	waits := map[string][]*Wait{} // by key
	for _, w := range h.Waits {
		if w.ID != "" && !w.Start.IsZero() {
			waits[w.Key] = append(waits[w.Key], w)
		}
	}
	sections := map[string][]*CS{}
	got := map[string]*CS{} // wait ID -> the section its grant began
	for _, id := range sortedKeys(h.CS) {
		c := h.CS[id]
		if c.Wait != "" {
			got[c.Wait] = c
		}
		if _, queued := waits[c.Key]; queued && !c.begin().IsZero() {
			sections[c.Key] = append(sections[c.Key], c)
		}
	}
	for _, key := range sortedKeys(waits) {
		list := waits[key]
		sort.Slice(list, func(i, j int) bool { return list[i].Start.Before(list[j].Start) })
		for i, w := range list {
			if w.Op != "crowd" || w.End.IsZero() {
				continue
			}
			h.countChance(w, list[i+1:], sections[key], list)
			for _, o := range list[i+1:] {
				c := got[o.ID]
				if o.Op != "crowd" || o.Start.Sub(w.Start) < OvertakeSlack || c == nil || c.begin().IsZero() ||
					!w.End.After(c.begin().Add(faultSlack)) || !conflicts(w.Mode, o.Mode) {
					continue
				}
				if wc := got[w.ID]; wc != nil && !wc.begin().After(c.begin()) {
					continue
				}
				if h.queueDisturbed(w, sections[key], list) || h.queueDisturbed(o, sections[key], list) {
					continue
				}
				add(VOvertaken, "key %s: %s %s (worker %d) began at %s and waited until %s (%s); %s %s (worker %d), begun %v later at %s, was granted first, at %s",
					key, w.Op, w.ID, w.Worker, ts(w.Start), ts(w.End), w.Result, o.Op, o.ID, o.Worker,
					o.Start.Sub(w.Start).Round(time.Millisecond), ts(o.Start), ts(c.begin()))
				break // once per overtaken wait
			}
		}
		for _, w := range list {
			if w.End.IsZero() {
				continue // its worker was killed: nothing says when it ended
			}
			if w.Result != "ok" && w.Result != "not_acquired" && !h.cutOff(w.Worker, w.Start.Add(-leakBoundFault), w.End) &&
				!(w.Result == "closed" && h.lockerClosed(w.Worker, w.End)) {
				add(VFailedWait, "key %s: %s %s (worker %d, mode %s, no deadline, Wait(%v)) failed after %v with no fault that ends sessions near it: %s: %s",
					key, w.Op, w.ID, w.Worker, w.Mode, queueWait, w.End.Sub(w.Start).Round(time.Millisecond), w.Result, w.Err)
			}
			free, held, before, ok := freeTo(w, sections[key], list, got)
			if !ok || h.queueDisturbed(w, sections[key], list) {
				continue
			}
			h.WaitsJudged++
			late := w.End.Sub(free)
			if w.Result == "ok" {
				h.FreeToGrant = append(h.FreeToGrant, max(0, late))
			}
			if late > h.StarveBound {
				add(VStarvedWait, "key %s: %s %s (worker %d, mode %s) waited %s-%s (%s) and was free to it from %s (%d sections held when it began, %d waits before it), %v past that (bound %v)",
					key, w.Op, w.ID, w.Worker, w.Mode, ts(w.Start), ts(w.End), w.Result, ts(free), held, before,
					late.Round(time.Millisecond), h.StarveBound)
			}
		}
	}
	return out
}

// countChance counts w, a crowd's wait, in OvertakeChances when a wait of another crowd that began OvertakeSlack or
// more after it (one of later) was recorded a whole slice of w's before w's call returned. It measures whether a
// campaign's waits were long enough for a line that sends a wait to the back of the server's queue at each slice's
// end to let a later one pass, not that one could: a wait is recorded before its call, which may make a connection
// first, and its end once its answer is back; and one that shows the bug may have had none (the later wait's try
// came between two of w's slices). The report shows the count, which explains a campaign that showed nothing.
func (h *History) countChance(w *Wait, later []*Wait, sections []*CS, list []*Wait) {
	if h.queueDisturbed(w, sections, list) {
		return
	}
	slice := cmp.Or(h.WaitSlice, session.DefaultWaitSlice)
	for _, o := range later {
		if o.Op == "crowd" && o.Start.Sub(w.Start) >= OvertakeSlack && w.End.Sub(o.Start) > slice &&
			conflicts(w.Mode, o.Mode) && !h.queueDisturbed(o, sections, list) {
			h.OvertakeChances++
			return
		}
	}
}

// freeTo returns when w's key became free to it in PostgreSQL's queue order (see queue), with how many sections and
// earlier waits it waited for; ok is false when one of them has no recorded end (its worker was killed). A section
// whose holder recorded its grant up to faultSlack after w began may have been granted before: it counts as held.
func freeTo(w *Wait, sections []*CS, waits []*Wait, got map[string]*CS) (free time.Time, held, before int, ok bool) {
	free = w.Start
	for _, c := range sections {
		if !conflicts(c.Mode, w.Mode) || c.Wait == w.ID || c.begin().After(w.Start.Add(faultSlack)) {
			continue
		}
		if !c.Ended {
			return free, held, before, false
		}
		if c.End.After(w.Start) {
			held++
			free = maxTime(free, c.End)
		}
	}
	for _, o := range waits {
		if o == w || !o.Start.Before(w.Start) || !conflicts(o.Mode, w.Mode) {
			continue
		}
		if o.End.IsZero() {
			return free, held, before, false
		}
		if !o.End.After(w.Start) {
			continue // it ended before w began
		}
		end := o.End
		if c := got[o.ID]; c != nil {
			if !c.Ended {
				return free, held, before, false
			}
			end = maxTime(end, c.End)
		}
		before++
		free = maxTime(free, end)
	}
	return free, held, before, true
}

// queueDisturbed reports whether a fault touched w's worker, or any worker that held or waited for w's key, from
// leakBoundFault before w began to its end.
func (h *History) queueDisturbed(w *Wait, sections []*CS, waits []*Wait) bool {
	from, to := w.Start.Add(-leakBoundFault), w.End
	workers := []int{w.Worker}
	for _, c := range sections {
		if c.begin().Before(to) && (!c.Ended || c.End.After(from)) && !slices.Contains(workers, c.Worker) {
			workers = append(workers, c.Worker)
		}
	}
	for _, o := range waits {
		if o.Start.Before(to) && (o.End.IsZero() || o.End.After(from)) && !slices.Contains(workers, o.Worker) {
			workers = append(workers, o.Worker)
		}
	}
	for _, wk := range workers {
		if h.faultNear(wk, from, to) || h.paused(wk, from, to) {
			return true
		}
	}
	return false
}

// cutOff reports whether a fault that ends sessions, cuts the worker off or stops it (anything but latency and a
// slow link) touched the worker, or every worker, between from and to.
func (h *History) cutOff(worker int, from, to time.Time) bool {
	for _, e := range h.Evidence {
		if e.Kind == "session_end" || e.Kind == "latency" || e.Kind == "slow_link" || e.Worker != -1 && e.Worker != worker {
			continue
		}
		if !e.At.After(to) && !maxTime(e.At, e.Until).Before(from) {
			return true
		}
	}
	return h.paused(worker, from, to)
}

// lockerClosed reports whether worker's Locker was closed (close_locker) before at: until its new Locker is open,
// which takes as long as the old one's Close (its releases, bounded by their timeout, on a loaded machine past
// leakBoundFault once), its calls fail with ErrClosed at once. Only that Close gives them ErrClosed.
func (h *History) lockerClosed(worker int, at time.Time) bool {
	for _, e := range h.Evidence {
		if e.Kind == "close_locker" && e.Worker == worker && !e.At.After(at) {
			return true
		}
	}
	return false
}

func maxTime(a, b time.Time) time.Time {
	if b.After(a) {
		return b
	}
	return a
}
