package main

import (
	"fmt"
	"slices"
	"sort"
	"strings"
	"time"
)

// Write is one attempt on the protected resource, as the ledger recorded it with the server's clock. Only
// committed rows exist: a transaction lock's writes that rolled back never happened.
type Write struct {
	ID       int64
	Key      string
	Token    int64
	CS       string
	Worker   int
	Mode     string // x: a fenced write; s: a shared holder's read
	Accepted *bool  // nil for reads
	At       time.Time
}

// CS is one critical section: a grant and what its holder was told.
type CS struct {
	ID      string
	Worker  int
	Op      string
	Key     string
	Mode    string
	Token   int64
	PID     uint32    // the server session that held it, as the library said (0: unknown)
	Wait    string    // the recorded wait that was granted it (a reader's or writer's), if any
	Begin   time.Time // just after the grant (its holder's record; zero in old histories: its first write)
	End     time.Time // just after the release returned; zero if its end was never recorded
	Ended   bool      // its end was recorded (a SIGKILLed worker records none)
	Told    time.Time // when the library said the lock ended; zero if never
	ToldBy  string    // done: the lock's Done (fn's ctx) closed; unlock: only the release said so
	Session string    // where it was held: shared (a shared session's reader tells) or dedicated (its watcher)
	Cause   string
	Unlock  string
	Clean   bool // never told of an end, and the release was confirmed
	Writes  []Write
}

// Evidence is something that ended sessions, with the server's clock: a fault the campaign injected and saw take
// effect, or a line of the server's log saying a backend ended.
type Evidence struct {
	Kind   string    // a fault kind, or "session_end" (the server's log: a backend of the worker ended)
	At     time.Time // for a fault, when it was injected (its effect follows); for session_end, the end itself
	Until  time.Time // a fault with a span (sigstop, blackhole, latency, slow_link): when it stopped
	Worker int       // -1: every worker (a restart)
	PID    int32     // the backend it ended, when one
	Keys   []string  // the advisory locks that backend held just before (terminate)
	Term   int64     // the lease it deleted (break_lease)
}

// ends reports whether e ends sessions (rather than only slowing or stopping a client).
func (e Evidence) ends() bool {
	switch e.Kind {
	case "sigstop", "blackhole", "latency", "slow_link", "break_lease", "slow_then_silent", "break_in_flight",
		"late_answers", "clock_step", "pgbouncer_stall", "pause_edge", "cut_edge":
		return false
	}
	return true
}

// Notice is one loss the server's evidence shows inside a critical section, and how its holder learned of it.
type Notice struct {
	Fault   string        // the evidence's kind
	By      string        // watcher, reader (a shared session's), unlock (only the release said so), none
	After   time.Duration // from the evidence to the notice (0 when the holder knew first)
	Verdict string        // ok, late_notice, never_told
}

// Holder is one row of a pg_locks sample.
type Holder struct {
	App     string
	PID     int32
	Granted bool
	Term    int64 `json:",omitempty"` // a lease's (lease campaigns)
}

// Sample is pg_locks at one moment (server clock), advisory rows only.
type Sample struct {
	At   time.Time
	Read time.Time           // pg_locks was read between At (the statement's start) and Read (zero: At)
	Held map[string][]Holder // Key.String() -> rows
}

// readBy is the latest moment the sample may show.
func (s Sample) readBy() time.Time {
	if s.Read.After(s.At) {
		return s.Read
	}
	return s.At
}

// Pause is a span in which a worker was stopped (SIGSTOP to SIGCONT).
type Pause struct {
	Worker   int
	From, To time.Time
}

// History is everything the checker reads.
type History struct {
	CS       map[string]*CS
	Writes   []Write
	Samples  []Sample
	Pauses   []Pause
	Evidence []Evidence  // faults that took effect, and backend ends from the server's log
	Leaked   []Leftover  // advisory locks (or leases) left after the workers stopped
	Problems []Violation // worker panics, goroutine leaks, hangs, unexpected deaths
	Bound    time.Duration
	SemSlots map[string]int // the semaphore's slot keys, numbered, including slots n and above
	SemN     int
	AppName  func(worker int) string
	WorkerOf func(app string) (int, bool) // the inverse of AppName
	Shared   map[int]bool                 // workers whose Locker runs shared sessions (a loss is then learned by the reader)
	RunEnd   time.Time
	// The recorded waits: the pair operations' for their second key (a cycle of them must end within
	// DeadlockBound), and the readers' and writers' for the queue key (each granted within StarveBound of its key
	// being free to it in PostgreSQL's queue order).
	Waits         []*Wait
	DeadlockBound time.Duration
	StarveBound   time.Duration
	// A lease campaign: the lease table's log by term (nil otherwise), and the leases' length and renewal period.
	Leases      map[int64]*LeaseLife
	LeaseLength time.Duration
	LeaseRenew  time.Duration

	// Filled in by Check: how much it compared (a check that compared nothing proves nothing).
	Confirmed       int             // (sample, holder) pairs where pg_locks showed the believing holder
	ExcusedOverlaps int             // overlaps with a holder whose session the server's evidence shows ended first
	Notices         []Notice        // losses inside sections, judged against the bound
	Cycles          []*Cycle        // cycles of waits among the pair operations
	WaitsJudged     int             // readers' and writers' waits judged by their queue (no fault near them)
	FreeToGrant     []time.Duration // of those granted: from the moment their key was free to them to the grant
}

// Violation is one broken guarantee.
type Violation struct {
	Kind   string `json:"kind"`
	Detail string `json:"detail"`
}

// Violation kinds.
const (
	VOverlap    = "overlap"     // two holders of one key at once, without server evidence that the first had lost it
	VStaleToken = "stale_token" // the resource accepted a token not greater than one it accepted before
	VTokenOrder = "token_order" // a later grant's token not greater than an earlier one's; a clean holder refused
	VPhantom    = "phantom"     // a holder that believed it held while pg_locks showed it did not
	VSemaphore  = "semaphore"   // a holder of a slot n or above, or more than n holders at once
	VLeak       = "leak"        // an advisory lock held with no holder believing it, past the release bound
	VOrphan     = "orphan"      // a lease no holder was ever told of (its caller gave up on it) that stayed
	VRevived    = "revived"     // a lease renewed more than a lease length after its record before
	VLateNotice = "late_notice" // a holder told of a loss later than the bound after the server's evidence
	VNeverTold  = "never_told"  // a holder that stayed in its section past the bound, told of its loss only by Unlock
	VPanic      = "panic"
	VGoroutines = "goroutine_leak"
	VHang       = "hang"
	VDied       = "worker_died"
)

// believing returns the writes a holder made before it was told the lock ended.
func (c *CS) believing() []Write {
	if c.Told.IsZero() {
		return c.Writes
	}
	var out []Write
	for _, w := range c.Writes {
		if w.At.Before(c.Told) {
			out = append(out, w)
		}
	}
	return out
}

func (h *History) paused(worker int, from, to time.Time) bool {
	for _, p := range h.Pauses {
		if p.Worker == worker && p.From.Before(to) && p.To.After(from) {
			return true
		}
	}
	return false
}

// begin is when c's holder started to believe it held: its record right after the grant, or its first write.
func (c *CS) begin() time.Time {
	if !c.Begin.IsZero() {
		return c.Begin
	}
	if len(c.Writes) > 0 {
		return c.Writes[0].At
	}
	return time.Time{}
}

// until is when c's holder stopped believing it held: its last write before it was told of an end.
func (c *CS) until() time.Time {
	bw := c.believing()
	if len(bw) == 0 {
		return c.begin()
	}
	return bw[len(bw)-1].At
}

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
		if l.Term != 0 && h.releasedBeforeCrash(l.Term) {
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
					if h.killed(w, first.Add(-leakBoundFault), s.At) || h.closedNear(w, first.Add(-leakBoundFault), s.At) ||
						h.releasedBeforeCrash(r.Term) {
						continue
					}
					late = s.At.Sub(maxTime(first, h.clearAfter(w, first.Add(-leakBoundFault), s.At))) > orphanBound
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
