package main

import (
	"fmt"
	"slices"
	"sort"
	"time"
)

// The slack between an injected fault and its effect (the campaign records a fault just before it is applied, and
// a holder records its grant just after the server made it).
const (
	faultSlack    = 100 * time.Millisecond
	logSlack      = 20 * time.Millisecond
	logLate       = 100 * time.Millisecond // how much later than the grant it explains a backend's end may be logged
	survivedAfter = 50 * time.Millisecond  // a sample this long after a fault that still shows the backend: not ended
)

// pids lists the backends that held c's lock: the one its holder was told of, else those pg_locks showed holding
// c's key for c's worker while c believed it held. Each comes with the last time a sample showed it holding c's
// key while c believed (zero if none did).
func (h *History) pids(c *CS) map[int32]time.Time {
	out := map[int32]time.Time{}
	if c.PID != 0 {
		out[int32(c.PID)] = time.Time{}
	}
	if h.AppName == nil {
		return out
	}
	from, to := c.begin(), c.until()
	for _, s := range h.Samples {
		if s.At.Before(from) || s.readBy().After(to) {
			continue
		}
		for _, r := range s.Held[c.Key] {
			if !r.Granted || r.App != h.AppName(c.Worker) {
				continue
			}
			if _, known := out[r.PID]; c.PID != 0 && !known {
				continue // another backend of that worker (a shared holder's)
			}
			if s.At.After(out[r.PID]) {
				out[r.PID] = s.At
			}
		}
	}
	return out
}

// lostBy returns the first evidence between from (c's grant) and to that ended the session of c's lock: a restart,
// a fault that ends every session of c's worker (cut, SIGKILL, its Locker closed), a terminate of c's backend, or
// the server's log of that backend's end. c's backend is the one the library named at the grant, else the ones
// pg_locks showed holding c's key; evidence after which a sample still showed that backend holding the key did not
// end it. When c's backend is unknown (no pid from the library and no sample during the section), loose accepts
// the end of any backend of c's worker instead (a terminate must then have found c's key on its backend).
func (h *History) lostBy(c *CS, from, to time.Time, loose bool) (Evidence, bool) {
	pids := h.pids(c)
	for _, e := range h.Evidence {
		if !e.ends() {
			continue
		}
		_, own := pids[e.PID]
		// The server logs a backend's end after it released its locks: the holder next in line may be granted
		// first, so the log of c's own backend is allowed a little later than the grant it explains.
		if e.At.After(to) && !(e.Kind == "session_end" && own && !e.At.After(to.Add(logLate))) {
			continue
		}
		slack := faultSlack
		if e.Kind == "session_end" {
			slack = logSlack
		}
		exact := c.PID != 0 && e.PID == int32(c.PID) // the very backend the library named: whenever it ended
		if !exact && e.At.Add(slack).Before(from) {
			continue // before c's grant: not c's session
		}
		if e.Worker != -1 && e.Worker != c.Worker {
			continue
		}
		if survived(pids, e.At) {
			continue // a later sample still showed c's backend holding c's key: e did not end it
		}
		switch e.Kind {
		case "session_end":
			if !own && !(loose && len(pids) == 0) {
				continue
			}
		case "terminate_holder", "terminate_waiter":
			if !own && !(len(pids) == 0 && c.Mode == "x" && slices.Contains(e.Keys, c.Key)) {
				continue
			}
		}
		return e, true
	}
	return Evidence{}, false
}

// survived reports whether a sample taken well after at showed one of the backends holding the key.
func survived(pids map[int32]time.Time, at time.Time) bool {
	for _, seen := range pids {
		if seen.After(at.Add(survivedAfter)) {
			return true
		}
	}
	return false
}

// Check reads the history and returns every violation found.
func Check(h *History) []Violation {
	var out []Violation
	add := func(kind, f string, a ...any) { out = append(out, Violation{kind, fmt.Sprintf(f, a...)}) }

	for _, w := range h.Writes {
		if c := h.CS[w.CS]; c != nil {
			c.Writes = append(c.Writes, w)
		}
	}
	sort.Slice(h.Evidence, func(i, j int) bool { return h.Evidence[i].At.Before(h.Evidence[j].At) })
	byKey := map[string][]*CS{}
	for _, c := range h.CS {
		sort.Slice(c.Writes, func(i, j int) bool { return c.Writes[i].ID < c.Writes[j].ID })
		if len(c.believing()) > 0 {
			byKey[c.Key] = append(byKey[c.Key], c)
		}
	}
	keys := sortedKeys(byKey)

	ids := sortedKeys(h.CS)
	if h.Leases != nil { // a lease campaign: judged by the lease table's log
		out = append(out, h.checkLeases()...)
	} else {
		// Exclusion: each holder's interval runs from its grant to its last write before it was told of an end (its
		// first write follows the grant and its last one precedes the release, so the ledger shows it whole). Two
		// intervals of one key (not both shared) that overlap are a violation, unless the server's evidence shows
		// that the earlier holder's session had ended by the later grant: a terminate of the backend pg_locks showed
		// holding the key, the server's log of that backend's end, a restart, a cut of its network, its process
		// killed or its Locker closed. The earlier holder must then have been told in time (the notice rule below)
		// and its fenced writes refused (the token rules). An earlier holder that released cleanly held throughout:
		// nothing excuses an overlap with it.
		//
		// Which of two was granted first is told by their tokens (drawn in the grant statement, in the server's order
		// of grants), or, without tokens, by their records of the grant (a holder stopped between the grant and its
		// record would be misplaced by the record alone).
		type span struct {
			c          *CS
			begin, end time.Time
		}
		for _, k := range keys {
			list := make([]span, 0, len(byKey[k]))
			for _, c := range byKey[k] {
				list = append(list, span{c, c.begin(), c.until()})
			}
			sort.Slice(list, func(i, j int) bool { return list[i].begin.Before(list[j].begin) })
			for i, x := range list {
				for _, y := range list[i+1:] {
					if !y.begin.Before(x.end) {
						break // sorted by grant record: no later one overlaps x either
					}
					a, b, aEnd := x.c, y.c, x.end
					if a.Token > 0 && b.Token > 0 && b.Token < a.Token {
						a, b, aEnd = y.c, x.c, y.end
					}
					if a.Mode == "s" && b.Mode == "s" {
						continue
					}
					if a.Clean {
						add(VOverlap, "key %s: %s %s (token %d, %s-%s, released cleanly) and %s %s (token %d, granted %s) both held it",
							k, a.Op, a.ID, a.Token, ts(a.begin()), ts(aEnd), b.Op, b.ID, b.Token, ts(b.begin()))
						continue
					}
					// a was granted before b, so no later than b's record of its grant, whatever a's record says; and
					// if its worker was stopped just before a's record, maybe before that stop.
					from := a.begin()
					if b.begin().Before(from) {
						from = b.begin()
					}
					for _, p := range h.Pauses {
						if p.Worker == a.Worker && p.From.Before(from) && !p.To.Before(from.Add(-faultSlack)) {
							from = p.From
						}
					}
					if _, ok := h.lostBy(a, from, b.begin().Add(logSlack), true); ok {
						h.ExcusedOverlaps++
						continue
					}
					add(VOverlap, "key %s: %s %s (token %d, told %s) held it %s-%s, and %s %s (token %d) was granted at %s with no evidence that the first one's session had ended",
						k, a.Op, a.ID, a.Token, tsOr(a.Told), ts(a.begin()), ts(aEnd), b.Op, b.ID, b.Token, ts(b.begin()))
				}
			}
		}

		// Loss notice: a holder whose session the server's evidence shows ended inside its section must learn it
		// within the bound (from the evidence, or from the end of a pause that covered it): through the lock's Done,
		// or by leaving its section in time (when Unlock is what says so). A holder told later is late_notice; one
		// that stayed in its section past the bound and learned only at Unlock (or never) is never_told.
		for _, id := range ids {
			c := h.CS[id]
			if c.Clean || c.Op == "dotx" || c.Op == "broken" || c.begin().IsZero() {
				continue
			}
			end := h.RunEnd
			if c.Ended {
				end = c.End
			}
			e, ok := h.lostBy(c, c.begin(), end, false)
			if !ok || !c.Told.IsZero() && c.Told.Before(e.At) && c.ToldBy == "done" {
				continue // no loss the server shows, or the holder knew first
			}
			deadline := e.At.Add(h.Bound)
			for _, p := range h.Pauses { // a stopped process learns nothing: the bound runs from its resumption
				if p.Worker == c.Worker && p.From.Before(deadline) && p.To.After(e.At) && p.To.Add(h.Bound).After(deadline) {
					deadline = p.To.Add(h.Bound)
				}
			}
			if h.killed(c.Worker, e.At.Add(-faultSlack), deadline) {
				continue // its process died: nobody left to tell
			}
			from := e.At // the notice is timed from the loss, or from the end of a pause that covered it
			for _, p := range h.Pauses {
				if p.Worker == c.Worker && !p.From.After(e.At) && p.To.After(from) {
					from = p.To
				}
			}
			n := judgeNotice(c, e.Kind, from, deadline)
			switch n.Verdict {
			case VLateNotice:
				add(VLateNotice, "key %s: %s %s told of its loss at %s, %v after %s at %s (bound %v)",
					c.Key, c.Op, c.ID, ts(c.Told), c.Told.Sub(e.At).Round(time.Millisecond), e.Kind, ts(e.At), h.Bound)
			case VNeverTold:
				add(VNeverTold, "key %s: %s %s lost its lock (%s at %s) and wrote on until %s, never told (learned by: %s)",
					c.Key, c.Op, c.ID, e.Kind, ts(e.At), ts(lastWrite(c)), n.By)
			}
			h.Notices = append(h.Notices, n)
		}

	}

	// The resource: accepted fenced writes per key never go back, and one token belongs to one grant.
	type acc struct {
		token int64
		cs    string
	}
	last := map[string]acc{}
	writes := append([]Write(nil), h.Writes...)
	sort.Slice(writes, func(i, j int) bool { return writes[i].ID < writes[j].ID })
	for _, w := range writes {
		if w.Accepted == nil || !*w.Accepted {
			continue
		}
		p, ok := last[w.Key]
		if ok && (w.Token < p.token || w.Token == p.token && w.CS != p.cs) {
			add(VStaleToken, "key %s: write %d by %s with token %d accepted after token %d of %s", w.Key, w.ID, w.CS, w.Token, p.token, p.cs)
		}
		if !ok || w.Token >= p.token {
			last[w.Key] = acc{w.Token, w.CS}
		}
	}

	// Tokens follow grants: a clean holder's token is greater than the token of every holder whose writes all
	// came before its own first one, and a clean exclusive holder is never refused.
	for _, k := range keys {
		list := append([]*CS(nil), byKey[k]...)
		sort.Slice(list, func(i, j int) bool { return list[i].believing()[0].At.Before(list[j].believing()[0].At) })
		byLast := append([]*CS(nil), list...)
		sort.Slice(byLast, func(i, j int) bool { return lastWrite(byLast[i]).Before(lastWrite(byLast[j])) })
		var maxAll, maxX *CS
		j := 0
		for _, b := range list { // sorted by first believing write
			bFirst := b.believing()[0].At
			for ; j < len(byLast) && lastWrite(byLast[j]).Before(bFirst); j++ {
				a := byLast[j]
				if maxAll == nil || a.Token > maxAll.Token {
					maxAll = a
				}
				if a.Mode == "x" && (maxX == nil || a.Token > maxX.Token) {
					maxX = a
				}
			}
			if !b.Clean {
				continue
			}
			prev := maxAll
			if b.Mode == "s" {
				prev = maxX
			}
			if prev != nil && prev != b && prev.Token >= b.Token {
				add(VTokenOrder, "key %s: %s %s got token %d, not greater than token %d of %s %s, which ended before it began",
					k, b.Op, b.ID, b.Token, prev.Token, prev.Op, prev.ID)
			}
			if b.Mode == "x" {
				for _, w := range b.Writes {
					if w.Accepted != nil && !*w.Accepted {
						add(VTokenOrder, "key %s: %s %s (token %d) held the lock throughout and was refused at %s",
							k, b.Op, b.ID, b.Token, ts(w.At))
						break
					}
				}
			}
		}
	}

	// Failover: every token granted after a promotion is greater than every token granted before the primary was
	// lost, whatever the key (one sequence draws them all). A grant is before when its holder recorded it before the
	// primary stopped, after when it recorded it once the standby was promoted and held it cleanly to the end: a
	// grant of the old primary that its holder recorded late (descheduled, paused or killed in between) lost its
	// session with the stop, so it is never clean.
	for _, e := range h.Evidence {
		if e.Kind != "failover" {
			continue
		}
		var before, after *CS
		for _, id := range sortedKeys(h.CS) {
			c := h.CS[id]
			b := c.begin()
			switch {
			case c.Token <= 0 || b.IsZero():
			case b.Before(e.At):
				if before == nil || c.Token > before.Token {
					before = c
				}
			case b.After(e.Until) && c.Clean && !h.paused(c.Worker, e.At, b) && !h.killed(c.Worker, e.At, b):
				if after == nil || c.Token < after.Token {
					after = c
				}
			}
		}
		if before != nil && after != nil && after.Token <= before.Token {
			add(VTokenOrder, "failover at %s (promoted %s): %s %s was granted token %d after the promotion, not greater than token %d of %s %s granted before",
				ts(e.At), ts(e.Until), after.Op, after.ID, after.Token, before.Token, before.Op, before.ID)
		}
	}

	// pg_locks: while a holder believes it holds, the server shows its session holding the key.
	if h.AppName != nil {
		var all []*CS
		for _, k := range keys {
			all = append(all, byKey[k]...)
		}
		const margin = 20 * time.Millisecond
		for _, s := range h.Samples {
			for _, c := range all {
				bw := c.believing()
				first, lastW := bw[0].At, bw[len(bw)-1].At
				// The sample shows one moment between its statement's start and its first row (a loaded server may
				// start reading pg_locks many milliseconds after the statement began): the belief must span both.
				if !first.Before(s.At.Add(-margin)) || !lastW.After(s.readBy().Add(margin)) {
					continue
				}
				held := false
				for _, r := range s.Held[c.Key] {
					if r.Granted && r.App == h.AppName(c.Worker) {
						held = true
					}
				}
				if held {
					h.Confirmed++
					continue
				}
				if h.Leases != nil && h.failedOverBefore(c, s.At) {
					continue
				}
				if c.Clean || lastW.Sub(s.readBy()) > h.Bound && !h.paused(c.Worker, s.At, lastW) {
					add(VPhantom, "key %s: %s %s believed it held at %s (wrote until %s) but pg_locks showed no such holder",
						c.Key, c.Op, c.ID, ts(s.At), ts(lastW))
				}
			}
		}
	}

	// The semaphore, by slot and by operation: every holder a Semaphore hands out holds one of its n slots (a key
	// of another slot, n or above, is a violation at once), and never more than n clean holders' sections at once,
	// whatever keys they hold.
	if h.SemN > 0 {
		type edge struct {
			at time.Time
			d  int
		}
		var edges []edge
		for _, id := range ids {
			c := h.CS[id]
			if c.Op != "semaphore" {
				continue
			}
			if slot, ok := h.SemSlots[c.Key]; !ok || slot >= h.SemN {
				add(VSemaphore, "%s %s holds key %s, none of the semaphore's %d slots", c.Op, c.ID, c.Key, h.SemN)
				continue
			}
			if bw := c.believing(); c.Clean && len(bw) > 0 {
				edges = append(edges, edge{bw[0].At, 1}, edge{bw[len(bw)-1].At, -1})
			}
		}
		sort.Slice(edges, func(i, j int) bool {
			if edges[i].at.Equal(edges[j].at) {
				return edges[i].d < edges[j].d
			}
			return edges[i].at.Before(edges[j].at)
		})
		n := 0
		for _, e := range edges {
			n += e.d
			if n > h.SemN {
				add(VSemaphore, "%d semaphore holders at %s (n=%d)", n, ts(e.at), h.SemN)
				break
			}
		}
	}

	// The semaphore by pg_locks: no backend holds a slot numbered n or above, and never more than n hold slots.
	if h.SemN > 0 && len(h.SemSlots) > 0 {
		var extra, over bool
		for _, s := range h.Samples {
			n := 0
			for k, slot := range h.SemSlots {
				for _, r := range s.Held[k] {
					if !r.Granted {
						continue
					}
					n++
					if slot >= h.SemN && !extra {
						extra = true
						add(VSemaphore, "pg_locks at %s: %q holds slot %d of a semaphore of %d", ts(s.At), r.App, slot, h.SemN)
					}
				}
			}
			if n > h.SemN && !over {
				over = true
				add(VSemaphore, "pg_locks at %s: %d backends hold the slots of a semaphore of %d", ts(s.At), n, h.SemN)
			}
		}
	}

	out = append(out, h.leaksDuringRun()...)
	out = append(out, h.deadlocks()...)
	out = append(out, h.queue()...)
	for _, l := range h.Leaked {
		if l.Term != 0 && (h.releasedBeforeCrash(l.Term) || h.deletedElsewhere(l.Term, h.RunEnd)) {
			continue
		}
		add(VLeak, "%s", l)
	}
	return append(out, h.Problems...)
}

// judgeNotice judges how c's holder learned of an end (of kind fault) that it should have learned of by deadline:
// told through Done later than deadline is late_notice; told only by Unlock, or never, while it wrote on past
// deadline is never_told. After is timed from from.
func judgeNotice(c *CS, fault string, from, deadline time.Time) Notice {
	n := Notice{Fault: fault, By: "none", Verdict: "ok"}
	switch {
	case c.ToldBy == "done":
		n.By, n.After = "watcher", max(0, c.Told.Sub(from))
		if c.Session == "shared" {
			n.By = "reader"
		}
		if c.Told.After(deadline) {
			n.Verdict = VLateNotice
		}
	default:
		if c.ToldBy == "unlock" {
			n.By, n.After = "unlock", max(0, c.Told.Sub(from))
		}
		if lastWrite(c).After(deadline) {
			n.Verdict = VNeverTold
		}
	}
	return n
}

func lastWrite(c *CS) time.Time {
	if len(c.Writes) == 0 {
		return time.Time{}
	}
	return c.Writes[len(c.Writes)-1].At
}

func ts(t time.Time) string { return t.Format("15:04:05.000000") }

func tsOr(t time.Time) string {
	if t.IsZero() {
		return "never"
	}
	return ts(t)
}
