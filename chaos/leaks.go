package main

import (
	"fmt"
	"strings"
	"time"
)

// Leak bounds: a lock in pg_locks that no holder of its worker believes it holds is a leak once it stays so for
// leakBound; near a fault on that worker (a client that gave up on a session the server keeps until its idle
// timeout or the next keepalive) for leakBoundFault.
const (
	leakBound      = time.Second
	leakBoundFault = 4 * time.Second
)

// leaksDuringRun finds, in the pg_locks samples, advisory locks granted to a worker's backend while none of that
// worker's holders believed it held the key, for longer than the release bound.
func (h *History) leaksDuringRun() []Violation {
	if h.WorkerOf == nil {
		return nil
	}
	type holding struct {
		key  string
		pid  int32
		term int64 // a lease is one holding per term
	}
	byWorkerKey := map[string][]*CS{}
	for _, c := range h.CS {
		wk := fmt.Sprintf("%d/%s", c.Worker, c.Key)
		byWorkerKey[wk] = append(byWorkerKey[wk], c)
	}
	believed := func(w int, key string, pid int32, at time.Time) bool {
		for _, c := range byWorkerKey[fmt.Sprintf("%d/%s", w, key)] {
			if c.PID != 0 && int32(c.PID) != pid {
				continue // held there by another backend of that worker
			}
			end := h.RunEnd
			if c.Ended {
				end = c.End
			} else if k, ok := h.killedAfter(w, c.begin()); ok {
				end = k
			}
			if !c.begin().After(at) && !end.Before(at) {
				return true
			}
		}
		return false
	}
	var out []Violation
	since := map[holding]time.Time{}
	origin := map[holding]time.Time{} // first seen, never moved (since moves while its worker is paused)
	reported := map[holding]bool{}
	for _, s := range h.Samples {
		seen := map[holding]bool{}
		for key, rows := range s.Held {
			for _, r := range rows {
				w, ok := h.WorkerOf(r.App)
				if !ok || !r.Granted {
					continue
				}
				hk := holding{key, r.PID, r.Term}
				if believed(w, key, r.PID, s.At) {
					continue
				}
				seen[hk] = true
				if _, ok := origin[hk]; !ok {
					origin[hk] = s.At
				}
				if h.paused(w, s.At.Add(-leakBoundFault), s.At) {
					// A stopped process records nothing: what it holds (a transaction lock taken just before
					// the stop, not yet recorded) is judged from a while after it resumes.
					since[hk] = s.At
					continue
				}
				first, ok := since[hk]
				if !ok {
					since[hk] = s.At
					continue
				}
				late := s.At.Sub(first) > leakBound
				if h.faultNear(w, first.Add(-leakBoundFault), s.At) {
					late = s.At.Sub(first) > leakBoundFault
				}
				if r.Term != 0 {
					// A lease stays until it is deleted or taken over: one whose worker died, or whose Locker was
					// closed (which stops its deletes still to do), or whose release a crash took back, is taken
					// over by another; one its worker lost is deleted by it once the faults on its path have ended.
					// The process that held it is judged from when the row was first seen: a later pause of the
					// worker's next process (which moves since) does not bring a dead one's lease back.
					o := origin[hk].Add(-leakBoundFault)
					if h.killed(w, o, s.At) || h.closedNear(w, o, s.At) ||
						h.releasedBeforeCrash(r.Term) || h.deletedElsewhere(r.Term, s.At) {
						continue
					}
					clear := maxTime(h.clearAfter(w, first.Add(-leakBoundFault), s.At), h.lastUnreachable(w, first.Add(-leakBoundFault), s.At))
					late = s.At.Sub(maxTime(first, clear)) > orphanBound
				}
				if late && !reported[hk] {
					reported[hk] = true
					what := fmt.Sprintf("pid %d", r.PID)
					if r.Term != 0 {
						what = fmt.Sprintf("term %d", r.Term)
					}
					out = append(out, Violation{VLeak, fmt.Sprintf("key %s held by %q (%s) from %s to at least %s with no holder of that worker believing it held it",
						key, r.App, what, ts(first), ts(s.At))})
				}
			}
		}
		for hk := range since {
			if !seen[hk] {
				delete(since, hk)
			}
		}
	}
	return out
}

// failedOverBefore reports whether c, a lease granted before a failover, may be missing from a sample at at: the
// sample read the standby or the promoted server, which may lack its grant or its last renewals, and its holder
// trusts it (until its trust window closes, within one lease length of the stop) or renews it there first.
func (h *History) failedOverBefore(c *CS, at time.Time) bool {
	for _, e := range h.Evidence {
		if e.Kind == "failover" && c.begin().Before(e.At) && !at.Before(e.At) && !at.After(e.Until.Add(h.LeaseLength)) {
			return true
		}
	}
	return false
}

// releasedBeforeCrash reports whether the lease of term may have been released just before the server crashed (an
// immediate stop) or failed over, by its holder, or given back or undone by a caller that was never told of it: a
// release commits without waiting for its WAL to be written (docs/leases.md), so a crash may take it back, and a
// failover loses what the standby had not received (the campaign makes it lag first); the lease's row then stays
// until another takes the key over.
func (h *History) releasedBeforeCrash(term int64) bool {
	crashIn := func(from, to time.Time) bool {
		for _, e := range h.Evidence {
			switch {
			case e.Kind == "restart_immediate" && !e.At.Before(from) && !e.At.After(to):
				return true
			case e.Kind == "failover" && !e.Until.Before(from) && !e.At.After(to): // lagging from At, promoted at Until
				return true
			}
		}
		return false
	}
	believed := false
	for _, c := range h.CS {
		if c.Token != term {
			continue
		}
		believed = true
		if c.Clean && c.Ended && crashIn(c.End.Add(-faultSlack), c.End.Add(time.Second)) {
			return true
		}
	}
	if l := h.Leases[term]; l != nil && !believed { // given back, or undone, within its bounds of the grant
		return crashIn(l.Granted.Add(-faultSlack), l.Granted.Add(3*time.Second))
	}
	return false
}

// deletedElsewhere reports whether the lease of term, which a sample showed at at, had been deleted by then by the
// log of a server that failed over: the promoted server never received the delete (its standby lagged), and the row
// stays there until another takes the key over.
func (h *History) deletedElsewhere(term int64, at time.Time) bool {
	l := h.Leases[term]
	return l != nil && !l.Deleted.IsZero() && !l.Deleted.After(at)
}

// Leftover is a lock (or a lease) that a sample showed after the workers had stopped.
type Leftover struct {
	Key     string
	App     string
	Granted bool
	Term    int64 // a lease's
	PID     int32
}

func (l Leftover) String() string {
	if l.Term != 0 {
		return fmt.Sprintf("%s held by %q (term %d, pid %d) after the workers stopped", l.Key, l.App, l.Term, l.PID)
	}
	return fmt.Sprintf("%s held by %q (granted %v) after the workers stopped", l.Key, l.App, l.Granted)
}

// clearAfter is when the last of the faults that touched the worker (or every worker) between from and to ended,
// or from when none did.
func (h *History) clearAfter(worker int, from, to time.Time) time.Time {
	clear := from
	for _, e := range h.Evidence {
		if e.Kind == "session_end" || e.Kind == "clock_step" || e.Worker != -1 && e.Worker != worker {
			continue
		}
		end := maxTime(e.At, e.Until)
		if strings.HasPrefix(e.Kind, "restart_") || e.Kind == "failover" {
			// PgBouncer refuses logins for its server_login_retry (1 s) after its server came back, and tries again
			// then: its clients are served a second or two after the server is.
			end = end.Add(2 * time.Second)
		}
		if !e.At.After(to) && !end.Before(from) {
			clear = maxTime(clear, end)
		}
	}
	for _, p := range h.Pauses {
		if p.Worker == worker && !p.From.After(to) && !p.To.Before(from) {
			clear = maxTime(clear, p.To)
		}
	}
	return clear
}

// lastUnreachable is the last moment between from and to at which a call of the worker failed to connect (the zero
// time if none did): a lease it has to delete cannot be deleted before its path is open again.
func (h *History) lastUnreachable(worker int, from, to time.Time) time.Time {
	var last time.Time
	for _, at := range h.Unreachable[worker] {
		if !at.Before(from) && !at.After(to) {
			last = maxTime(last, at)
		}
	}
	return last
}

// closedNear reports whether the worker's Locker was closed between from and to.
func (h *History) closedNear(worker int, from, to time.Time) bool {
	for _, e := range h.Evidence {
		if e.Kind == "close_locker" && e.Worker == worker && !e.At.Before(from) && !e.At.After(to) {
			return true
		}
	}
	return false
}

// faultNear reports whether a fault touched the worker (or every worker) between from and to.
func (h *History) faultNear(worker int, from, to time.Time) bool {
	for _, e := range h.Evidence {
		if e.Kind == "session_end" || e.Worker != -1 && e.Worker != worker {
			continue
		}
		efrom, eto := e.At, e.At
		if e.Until.After(eto) {
			eto = e.Until
		}
		if !efrom.After(to) && !eto.Before(from) {
			return true
		}
	}
	return false
}

// killedAfter returns when the worker's process was first SIGKILLed after from.
func (h *History) killedAfter(worker int, from time.Time) (time.Time, bool) {
	for _, e := range h.Evidence {
		if e.Kind == "sigkill" && e.Worker == worker && !e.At.Before(from) {
			return e.At, true
		}
	}
	return time.Time{}, false
}

// killed reports whether the worker's process was SIGKILLed between from and to.
func (h *History) killed(worker int, from, to time.Time) bool {
	at, ok := h.killedAfter(worker, from)
	return ok && !at.After(to)
}
