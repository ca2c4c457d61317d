package main

import (
	"cmp"
	"context"
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"sort"
	"time"

	"github.com/advlock/advlock"
	"github.com/jackc/pgx/v5"
)

// LeaseLife is what the lease table's log (chaos_lease_log, a trigger's) says of one lease, by its term, with the
// server's clock read back to the real one (see correctClock): when it was granted, when a grant or renewal last
// made its record, when its row was deleted and when another term took its key over (zero: never). Each entry
// commits with the change it records: it is what the server holds, crash or not.
type LeaseLife struct {
	Key      string
	Worker   int // whose it was, by its holder text (-1: not a worker's)
	Granted  time.Time
	Renewed  time.Time
	Deleted  time.Time
	Replaced time.Time
	// Ambiguous: an entry of it was logged while the server's clock stepped, so its times may be off by the step:
	// no rule times it.
	Ambiguous bool
	// Gap is the longest time between two records of it (its grant and a renewal, or two renewals), ending at GapAt.
	Gap   time.Duration
	GapAt time.Time
	// CrashEnd, when set, is when it ended on the server, given what crashes of the server (restart_immediate) may
	// have taken back (see crashLosses): at the latest, or, for one its holder released, when that release began.
	// It stands for the end its log implies.
	CrashEnd time.Time `json:",omitempty"`
	// Lost: its grant is not in the log; a crash took it back (see crashLosses). Granted is when its holder was
	// told of it.
	Lost bool `json:",omitempty"`
}

// end is when the lease ended on the server: deleted (released, broken, retired), or one lease length after the
// grant or renewal that last made its record, when its holder had stopped trusting it (its trust is shorter,
// counted from a send that came before): a takeover comes later, or the taker broke the rules.
func (l *LeaseLife) end(length time.Duration) time.Time {
	e := l.Renewed.Add(length)
	if !l.CrashEnd.IsZero() {
		e = l.CrashEnd
	}
	if !l.Deleted.IsZero() && l.Deleted.Before(e) {
		return l.Deleted
	}
	return e
}

// gone is when the lease's row left the server: deleted, or taken over (zero: never).
func (l *LeaseLife) gone() time.Time {
	switch {
	case l.Deleted.IsZero():
		return l.Replaced
	case l.Replaced.IsZero() || l.Deleted.Before(l.Replaced):
		return l.Deleted
	}
	return l.Replaced
}

// leaseEntry is one line of the lease table's log; the op S and T mark a step of the server's clock (before and
// after it, the offset in milliseconds in Term).
type leaseEntry struct {
	ID          int64
	At, Expires time.Time
	Op          string
	Key, Term   int64
	Holder      string
	ambiguous   bool
}

// readLeaseLog reads the log of the lease table on the server at url, in the order it was written.
func readLeaseLog(ctx context.Context, url string) ([]leaseEntry, error) {
	conn, err := pgx.Connect(ctx, url)
	if err != nil {
		return nil, err
	}
	defer conn.Close(context.Background())
	rows, err := conn.Query(ctx, "SELECT id, at, op, key, term, expires, holder FROM chaos_lease_log ORDER BY id")
	if err != nil {
		return nil, err
	}
	var out []leaseEntry
	for rows.Next() {
		var e leaseEntry
		if err := rows.Scan(&e.ID, &e.At, &e.Op, &e.Key, &e.Term, &e.Expires, &e.Holder); err != nil {
			return nil, err
		}
		e.At, e.Expires = e.At.UTC(), e.Expires.UTC() // comparable as values across servers
		out = append(out, e)
	}
	return out, rows.Err()
}

// correctClock reads the times of one server's log (in the order written) back to the real clock: an entry logged
// after a step's T mark is read back by that step's offset. One logged between a step's S and T marks (read with
// the clock before the step or after it) is read back by whichever offset puts it between the two marks on the
// real clock; one that either or neither would is marked ambiguous. The marks themselves are dropped.
func correctClock(entries []leaseEntry) []leaseEntry {
	const window = 50 * time.Millisecond // a mark's own statement, around its clock reading
	var out, between []leaseEntry
	var offset time.Duration
	var mark leaseEntry // the last S
	stepping := false
	for _, e := range entries {
		switch e.Op {
		case "S":
			stepping, mark = true, e
			continue
		case "T":
			next := time.Duration(e.Term) * time.Millisecond
			from, to := mark.At.Add(-offset).Add(-window), e.At.Add(-next).Add(window)
			for _, b := range between {
				before, after := b.At.Add(-offset), b.At.Add(-next)
				inBefore := !before.Before(from) && !before.After(to)
				inAfter := !after.Before(from) && !after.After(to)
				switch {
				case inBefore && !inAfter:
					b.At = before
				case inAfter && !inBefore:
					b.At = after
				default:
					b.At, b.ambiguous = before, true
				}
				out = append(out, b)
			}
			stepping, offset, between = false, next, between[:0]
			continue
		}
		if stepping {
			between = append(between, e)
			continue
		}
		e.At = e.At.Add(-offset)
		out = append(out, e)
	}
	for _, b := range between { // a step whose T mark was never written
		b.At, b.ambiguous = b.At.Add(-offset), true
		out = append(out, b)
	}
	return out
}

// leaseLog reads the log of the lease table: the primary's now, and in a failover campaign what each primary lost
// to a failover had committed (read aside before it was rebuilt, see failover): the promoted server never saw the
// last grants and renewals of the old one, which its holders were told of. The logs share the part the standby
// had received: an entry in both counts once.
func (c *campaign) leaseLog(ctx context.Context) (map[int64]*LeaseLife, []time.Time, error) {
	entries, err := readLeaseLog(ctx, c.primary().URL)
	if err != nil {
		return nil, nil, err
	}
	if b, err := json.Marshal(entries); err == nil { // as logged, kept with the histories
		_ = os.WriteFile(filepath.Join(c.dir, "lease_log.json"), b, 0o644)
	}
	c.srvMu.Lock()
	entries = slices.Concat(c.lostLeaseLog, correctClock(entries))
	c.srvMu.Unlock()
	lives := leaseLives(entries) // sorts entries
	times := make([]time.Time, len(entries))
	for i, e := range entries {
		times[i] = e.At
	}
	return lives, times, nil
}

// keepLeaseLives writes the lives of the leases, by term, beside the workers' histories (kept when the campaign
// found something): the evidence behind its verdicts.
func (c *campaign) keepLeaseLives(lives map[int64]*LeaseLife) {
	b, err := json.Marshal(lives)
	if err == nil {
		err = os.WriteFile(filepath.Join(c.dir, "leases.json"), b, 0o644)
	}
	if err != nil {
		c.logf("keeping the lease log: %v", err)
	}
}

// leaseLives reads entries (each server's read back to the real clock) as the lives of the leases, by term. An
// entry of a term that makes a new record (its expiry changed) renews it; the first entry of another term for the
// same key takes it over.
func leaseLives(entries []leaseEntry) map[int64]*LeaseLife {
	sort.SliceStable(entries, func(i, j int) bool { return entries[i].At.Before(entries[j].At) })
	type seenEntry struct {
		at, expires time.Time
		op          string
		key, term   int64
	}
	seen := map[seenEntry]bool{}
	out := map[int64]*LeaseLife{}
	current := map[int64]int64{}    // key -> its term now
	record := map[int64]time.Time{} // term -> the expiry of its record
	for _, e := range entries {
		se := seenEntry{e.At, e.Expires, e.Op, e.Key, e.Term}
		if seen[se] || e.Term == 0 { // a grant's insert writes term 0, then draws its term in an update
			continue
		}
		seen[se] = true
		l := out[e.Term]
		if l == nil {
			l = &LeaseLife{Key: canon(advlock.Int64Key(e.Key)), Granted: e.At, Renewed: e.At, Worker: workerOf(e.Holder)}
			out[e.Term] = l
			if prev, ok := current[e.Key]; ok && prev != e.Term && e.Op != "D" {
				if p := out[prev]; p != nil && p.Replaced.IsZero() && p.Deleted.IsZero() {
					p.Replaced = e.At
				}
			}
		}
		l.Ambiguous = l.Ambiguous || e.ambiguous
		switch e.Op {
		case "D":
			if l.Deleted.IsZero() {
				l.Deleted = e.At
			}
			if current[e.Key] == e.Term {
				delete(current, e.Key)
			}
		default: // a grant (insert, or the update of a takeover) or a renewal; or a mark of its holder (no new record)
			current[e.Key] = e.Term
			if !e.Expires.Equal(record[e.Term]) {
				record[e.Term] = e.Expires
				if e.At.After(l.Renewed) {
					if gap := e.At.Sub(l.Renewed); gap > l.Gap {
						l.Gap, l.GapAt = gap, e.At
					}
					l.Renewed = e.At
				}
			}
		}
	}
	return out
}

// workerOf is the worker a lease's holder text names (it ends with the worker's name), or -1.
func workerOf(holder string) int {
	var w int
	for i := len(holder) - 1; i >= 0; i-- {
		if holder[i] == ' ' {
			if _, err := fmt.Sscanf(holder[i+1:], "chaos-w%d", &w); err == nil {
				return w
			}
			break
		}
	}
	return -1
}

// Slacks of the lease rules. A holder checks its lease before each write and the ledger stamps the write as it
// runs it: a loaded machine may put some time between the two. A holder that was stopped, or whose Locker was
// closed under it, learns of the end within noticeSlack of its resumption or of the close. A lease granted to
// nobody (its caller gave up on the grant, or gave it back) is gone within orphanBound of the grant, or of the end
// of the last fault that kept its worker from deleting it (its undo goes on apart until the server answers).
const (
	leaseSlack  = 250 * time.Millisecond
	noticeSlack = time.Second
	orphanBound = 1500 * time.Millisecond
)

// checkLeases judges the holders of leases: against each other (belief), and by the lease table's log.
//
// Belief: of two holders of one key, the one granted first (the lesser term) stops believing it holds (its last
// write before it was told of an end) before the other's grant, whatever any clock did: every time compared is
// on the real clock of this machine (the holders' records, the ledger's stamps on a server of its own when the
// lock server's clock steps). Excused only where docs/leases.md says a holder may act on: its lease was broken
// (until the trust of its last renewal, within a lease length of the break), its process was stopped across the
// other's grant, or its Locker was closed (then within noticeSlack of the resumption or the close).
//
// By the log: a holder writes (before it is told of an end) only while its lease lives on the server (see
// LeaseLife.end), with the same excuses; a lease that ended inside its holder's section, not by its own release,
// must have been told by then (late_notice; never_told when only Unlock said so while it wrote on); two leases of
// one key never live at once (a term granted while another term of its key, which a holder was told of, had not
// ended: a promoted server that grants what the lost primary had granted or renewed past, or a takeover that came
// too early); a holder whose term the log never saw held a lease the server never granted (phantom); a lease no
// holder was ever told of is gone soon (orphan).
func (h *History) checkLeases() []Violation {
	var out []Violation
	add := func(kind, f string, a ...any) { out = append(out, Violation{kind, fmt.Sprintf(f, a...)}) }
	holders := map[int64]*CS{}
	for _, id := range sortedKeys(h.CS) {
		if c := h.CS[id]; c.Token > 0 && !c.begin().IsZero() && holders[c.Token] == nil {
			holders[c.Token] = c
		}
	}
	out = append(out, h.beliefs(holders)...)
	h.crashLosses(holders)

	terms := map[string][]int64{}
	for t := range holders {
		if l := h.Leases[t]; l != nil && !l.Ambiguous {
			terms[l.Key] = append(terms[l.Key], t)
		}
	}
	for _, k := range sortedKeys(terms) {
		list := terms[k]
		sort.Slice(list, func(i, j int) bool { return h.Leases[list[i]].Granted.Before(h.Leases[list[j]].Granted) })
		for i, a := range list {
			for _, b := range list[i+1:] {
				la, lb := h.Leases[a], h.Leases[b]
				if lb.Granted.Before(la.end(h.LeaseLength)) {
					add(VOverlap, "key %s: term %d (%s %s) was granted at %s while term %d (%s %s, granted %s) lived until %s",
						k, b, holders[b].Op, holders[b].ID, ts(lb.Granted), a, holders[a].Op, holders[a].ID, ts(la.Granted),
						ts(la.end(h.LeaseLength)))
				}
			}
		}
	}
	for _, id := range sortedKeys(h.CS) {
		c := h.CS[id]
		if c.Token <= 0 || c.begin().IsZero() {
			continue
		}
		life := h.Leases[c.Token]
		if life == nil {
			add(VPhantom, "key %s: %s %s held term %d, which the lease table never recorded", c.Key, c.Op, c.ID, c.Token)
			continue
		}
		if life.Ambiguous {
			continue
		}
		end := life.end(h.LeaseLength)
		broken, closed := h.brokenOrClosed(c, end)
		// The latest moment c may still act, and be told, for an end that is not its own release. A broken lease's
		// holder learns at its next renewal (a fault on its network may hold that answer back), and at the latest
		// when its trust window closes, within a lease length of its last renewal.
		deadline := end.Add(leaseSlack)
		if broken != nil {
			deadline = life.Renewed.Add(h.LeaseLength).Add(leaseSlack)
		}
		deadline = h.excused(c, end, deadline, closed)
		lastW := lastWrite(c)
		if bw := c.believing(); len(bw) > 0 && bw[len(bw)-1].At.After(deadline) {
			add(VOverlap, "key %s: %s %s (term %d) wrote at %s, after its lease ended at %s (%s)",
				c.Key, c.Op, c.ID, c.Token, ts(bw[len(bw)-1].At), ts(end), endKind(life, broken, closed))
		}
		// Notice, for a lease that ended inside the section and not by its own release (a clean holder's release is
		// what deleted its row).
		if c.Clean || !c.Ended || !end.Before(c.End) || h.killed(c.Worker, c.begin(), c.End) {
			continue
		}
		n := judgeNotice(c, endKind(life, broken, closed), end, h.noticeDeadline(c, end, deadline))
		switch n.Verdict {
		case VLateNotice:
			add(VLateNotice, "key %s: %s %s (term %d) told at %s that its lease ended, which it did at %s (%s)",
				c.Key, c.Op, c.ID, c.Token, ts(c.Told), ts(end), n.Fault)
		case VNeverTold:
			add(VNeverTold, "key %s: %s %s (term %d) lost its lease at %s (%s) and wrote on until %s, never told (learned by: %s)",
				c.Key, c.Op, c.ID, c.Token, ts(end), n.Fault, ts(lastW), n.By)
		}
		h.Notices = append(h.Notices, n)
	}
	out = append(out, h.revived()...)
	return append(out, h.orphans(holders)...)
}

// walWriterDelay is the round of a lease campaign's WAL writer (see run), and lostWindow how long before a crash a
// commit may have been and still be taken back by it: grants and renewals commit without waiting for their WAL to
// be flushed, and the WAL writer writes it out within three of its rounds (fsync is off on the campaign's server,
// so what is written survives a crash of the server), then a second's slack for a loaded machine.
const (
	walWriterDelay = time.Second
	lostWindow     = 3*walWriterDelay + time.Second
)

// crashLosses reads into the lease log what the server's crashes (restart_immediate, and the immediate stop of a
// failover, whose lost primary's log is read from its own WAL) took back: the log commits with the change it
// records, so it lost them too. A crash had happened by the time its stop returned (Stopped), and
// the server answers on for a moment after the fault begins: whatever a worker was told before the restart's end
// may be what the crash took back, and a release a worker was told of before then came before the crash.
//   - A holder's term that the log never saw, told to its holder within lostWindow of a crash and after the last
//     entry the log kept from before the crash, is a grant the crash took back (the log is WAL: what it kept is a
//     prefix of what was written, so an entry written after the grant means that the grant was kept). It is a life
//     of its own (Lost), from when its holder was told of it until one lease length after the crash (its holder may
//     have been told of renewals the crash took back too), or its release when its holder released it before the
//     crash.
//   - A lease that lived at a crash, and had not ended by its log long before it, may have lost renewals its holder
//     was told of, sent before the crash: it lives until one lease length after the crash, unless another grant of
//     its key came before the crash (a renewal after it would have changed the record its taker watched, or found
//     the row another's: it ended by then). One its holder released before the crash ended when its release
//     began, whatever the log says after (the crash may have taken the release back, and the row is then taken
//     over as after a death; the next grant may come before the release returns).
//
// So no later grant of its key may come before then (the quiet period after a crash), and its holder may act until
// then.
func (h *History) crashLosses(holders map[int64]*CS) {
	// released: t's holder released it, confirmed, before at; its lease ended on the server once its release began
	// (at End when that was not recorded): another grant of its key may come before the release returns.
	released := func(t int64, at time.Time) (time.Time, bool) {
		if c := holders[t]; c != nil && c.Clean && c.End.Before(at) {
			return cmp.Or(c.Release, c.End), true
		}
		return time.Time{}, false
	}
	// next is the first grant of l's key after l's, before at (zero: none).
	next := func(l *LeaseLife, at time.Time) time.Time {
		var n time.Time
		for _, o := range h.Leases {
			if o != l && o.Key == l.Key && o.Granted.After(l.Granted) && o.Granted.Before(at) && (n.IsZero() || o.Granted.Before(n)) {
				n = o.Granted
			}
		}
		return n
	}
	for _, e := range h.Evidence {
		if e.Kind != "restart_immediate" && e.Kind != "failover" { // a failover stops the primary as a crash does
			continue
		}
		stopped := cmp.Or(e.Stopped, e.Until)
		var kept time.Time // the log's last entry from before the restart's end
		for _, at := range h.LeaseLog {
			if at.Before(stopped) && at.After(kept) { // the server is down from the crash until after Stopped
				kept = at
			}
		}
		for _, t := range sortedKeys(holders) {
			c := holders[t]
			if h.Leases[t] != nil || c.begin().Before(e.At.Add(-lostWindow)) || c.begin().After(e.Until) || !kept.Before(c.begin()) {
				continue
			}
			l := &LeaseLife{Key: c.Key, Worker: c.Worker, Granted: c.begin(), Renewed: c.begin(), Lost: true,
				CrashEnd: stopped.Add(h.LeaseLength)}
			if end, ok := released(t, e.Until); ok {
				l.Deleted = end
			}
			h.Leases[t] = l
		}
		for _, t := range sortedKeys(h.Leases) {
			l := h.Leases[t]
			if l.Lost || l.Granted.After(e.Until) || l.end(h.LeaseLength).Before(e.At.Add(-lostWindow)) {
				continue
			}
			if g := l.gone(); !g.IsZero() && g.Before(e.At.Add(-lostWindow)) {
				continue
			}
			if end, ok := released(t, e.Until); ok { // the crash may have taken its release back: it ended then
				if g := l.gone(); g.IsZero() || g.After(holders[t].End) { // unless the log kept it
					l.CrashEnd = end
				}
				continue
			}
			end := stopped.Add(h.LeaseLength)
			if n := next(l, e.Until); !n.IsZero() {
				end = n
			}
			if end.After(l.end(h.LeaseLength)) {
				l.CrashEnd = end
			}
		}
	}
}

// revived finds the leases whose record changed more than a lease length (and leaseSlack) after the record before
// it: a renewal (or a grant handed out late and then renewed) that acted after its holder had stopped trusting the
// lease. Every grant and renewal carries the latest moment it may act, the end of its holder's trust on the
// server's clock as the holder knows it, so none does; what a step of the server's clock puts in between is not
// judged (the holder's knowledge of that clock lags the step).
func (h *History) revived() []Violation {
	var out []Violation
	for _, term := range sortedKeys(h.Leases) {
		l := h.Leases[term]
		if l.Ambiguous || l.Gap <= h.LeaseLength+leaseSlack {
			continue
		}
		stepped := false // or crashed: renewals between the two records may have been taken back
		for _, e := range h.Evidence {
			switch {
			case e.Kind == "clock_step" && !e.At.Before(l.GapAt.Add(-l.Gap)) && !e.At.After(l.GapAt):
				stepped = true
			case (e.Kind == "restart_immediate" || e.Kind == "failover") && !e.At.Before(l.GapAt.Add(-l.Gap)) && e.At.Before(l.GapAt) &&
				!l.GapAt.After(cmp.Or(e.Stopped, e.Until).Add(h.LeaseLength+leaseSlack)):
				stepped = true // a renewal after the restart, within a lease length of the crash
			}
		}
		if !stepped {
			out = append(out, Violation{VRevived, fmt.Sprintf("key %s: term %d (worker %d) was renewed at %s, %v after its "+
				"record before (a lease length is %v): acted on after its holder had stopped trusting it",
				l.Key, term, l.Worker, ts(l.GapAt), l.Gap.Round(time.Millisecond), h.LeaseLength)})
		}
	}
	return out
}

// brokenOrClosed finds the evidence that c's lease was broken (its term's row deleted by the campaign), or that
// c's Locker was closed while it held (before end).
func (h *History) brokenOrClosed(c *CS, end time.Time) (broken, closed *Evidence) {
	for i, e := range h.Evidence {
		switch {
		case (e.Kind == "break_lease" || e.Kind == "break_in_flight") && e.Term == c.Token:
			broken = &h.Evidence[i]
		case e.Kind == "close_locker" && e.Worker == c.Worker && !e.At.Before(c.begin().Add(-faultSlack)) &&
			!e.At.After(end.Add(faultSlack)):
			closed = &h.Evidence[i]
		}
	}
	return broken, closed
}

// excused extends deadline, the latest moment c may act for an end at end, by its Locker's close (noticeSlack
// after it) and by a stop of its process across the end (noticeSlack after it resumed).
func (h *History) excused(c *CS, end, deadline time.Time, closed *Evidence) time.Time {
	if closed != nil && closed.At.Add(noticeSlack).After(deadline) {
		deadline = closed.At.Add(noticeSlack)
	}
	for _, p := range h.Pauses { // stopped across the end: it learns after it resumes
		if p.Worker == c.Worker && p.From.Before(end) && p.To.Add(noticeSlack).After(deadline) &&
			p.To.After(end.Add(-h.LeaseLength)) {
			deadline = p.To.Add(noticeSlack)
		}
	}
	return deadline
}

// noticeDeadline is when c's holder must have been told of its lease's end at end, deadline the latest moment it
// may act: a process stopped before then (after the end too: the renewal that would have told it had not come yet)
// learns once it resumes. Only the notice waits for it: a resumed holder does not act on a lease its trust has
// left (its clock ran while it was stopped).
func (h *History) noticeDeadline(c *CS, end, deadline time.Time) time.Time {
	for _, p := range h.Pauses {
		if p.Worker == c.Worker && p.From.Before(deadline) && p.To.After(end) && p.To.Add(noticeSlack).After(deadline) {
			deadline = p.To.Add(noticeSlack)
		}
	}
	return deadline
}

// beliefs judges every two holders of one key against each other (see checkLeases): the earlier term's holder
// stops believing before the later one's grant, on this machine's real clock.
func (h *History) beliefs(holders map[int64]*CS) []Violation {
	var out []Violation
	byKey := map[string][]*CS{}
	for _, c := range holders {
		byKey[c.Key] = append(byKey[c.Key], c)
	}
	for _, k := range sortedKeys(byKey) {
		list := byKey[k]
		sort.Slice(list, func(i, j int) bool { return list[i].Token < list[j].Token })
		for i, a := range list {
			bw := a.believing()
			if len(bw) == 0 {
				continue
			}
			until := bw[len(bw)-1].At
			for _, b := range list[i+1:] {
				if !b.begin().Before(until) {
					continue
				}
				broken, closed := h.brokenOrClosed(a, b.begin())
				deadline := b.begin().Add(leaseSlack)
				if broken != nil {
					deadline = maxTime(deadline, broken.At.Add(h.LeaseLength).Add(leaseSlack))
				}
				if deadline = h.excused(a, b.begin(), deadline, closed); !until.After(deadline) {
					continue
				}
				out = append(out, Violation{VOverlap, fmt.Sprintf("key %s: %s %s (term %d) believed it held until %s, "+
					"after %s %s (term %d) was granted at %s", k, a.Op, a.ID, a.Token, ts(until), b.Op, b.ID, b.Token, ts(b.begin()))})
				break // one is enough for a
			}
		}
	}
	return out
}

// orphans finds the leases no holder was ever told of (a grant whose caller gave up on it or gave it back) that
// stayed past orphanBound after their grant, or after the end of the last fault that could keep their worker from
// deleting them (a fault on its path or its process, or on every worker's). A lease its worker could not delete
// because the worker died or its Locker was closed (which stops the deletes still to do) is excused, and so is one
// granted as the workers were stopped.
func (h *History) orphans(holders map[int64]*CS) []Violation {
	var out []Violation
	for _, term := range sortedKeys(h.Leases) {
		l := h.Leases[term]
		if holders[term] != nil || l.Ambiguous || l.Worker < 0 || l.Granted.After(h.RunEnd.Add(-2*time.Second)) {
			continue
		}
		gone := l.gone()
		if gone.IsZero() {
			gone = h.RunEnd
		}
		if h.killed(l.Worker, l.Granted.Add(-faultSlack), gone) || h.closedNear(l.Worker, l.Granted.Add(-time.Second), gone) ||
			h.releasedBeforeCrash(term) {
			continue
		}
		clear := maxTime(l.Granted, h.clearAfter(l.Worker, l.Granted.Add(-time.Second), gone))
		if gone.Sub(clear) > orphanBound {
			out = append(out, Violation{VOrphan, fmt.Sprintf("key %s: term %d of worker %d, which no holder was told of, "+
				"was granted at %s and stayed until %s, %v after the last fault that could hold its deletion back (%s)",
				l.Key, term, l.Worker, ts(l.Granted), ts(gone), gone.Sub(clear).Round(time.Millisecond), ts(clear))})
		}
	}
	return out
}

// endKind says how a lease ended: broken, its Locker closed, deleted (released), or its trust run out.
func endKind(l *LeaseLife, broken, closed *Evidence) string {
	switch {
	case broken != nil:
		return "broken"
	case closed != nil:
		return "Locker closed"
	case !l.Deleted.IsZero():
		return "deleted"
	}
	return "not renewed"
}
