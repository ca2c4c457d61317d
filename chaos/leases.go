package main

import (
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

// LeaseLife is what the lease table's log (chaos_lease_log, a trigger's) says of one lease, by its term: when it
// was granted, the last expiry a grant or renewal gave it, and when its row was deleted (zero: never). Each entry
// commits with the change it records: it is what the server holds, crash or not.
type LeaseLife struct {
	Key     string
	Granted time.Time
	Expires time.Time
	Deleted time.Time
}

// end is when the lease ended on the server: deleted (released, broken, its Locker closed), or expired.
func (l *LeaseLife) end() time.Time {
	if !l.Deleted.IsZero() && l.Deleted.Before(l.Expires) {
		return l.Deleted
	}
	return l.Expires
}

// leaseEntry is one line of the lease table's log.
type leaseEntry struct {
	At, Expires time.Time
	Op          string
	Key, Term   int64
}

// readLeaseLog reads the log of the lease table on the server at url.
func readLeaseLog(ctx context.Context, url string) ([]leaseEntry, error) {
	conn, err := pgx.Connect(ctx, url)
	if err != nil {
		return nil, err
	}
	defer conn.Close(context.Background())
	rows, err := conn.Query(ctx, "SELECT at, op, key, term, expires FROM chaos_lease_log ORDER BY id")
	if err != nil {
		return nil, err
	}
	var out []leaseEntry
	for rows.Next() {
		var e leaseEntry
		if err := rows.Scan(&e.At, &e.Op, &e.Key, &e.Term, &e.Expires); err != nil {
			return nil, err
		}
		e.At, e.Expires = e.At.UTC(), e.Expires.UTC() // comparable as values across servers
		out = append(out, e)
	}
	return out, rows.Err()
}

// leaseLog reads the log of the lease table: the primary's now, and in a failover campaign what each primary lost
// to a failover had committed (read aside before it was rebuilt, see failover): the promoted server never saw the
// last grants and renewals of the old one, which its holders were told of. The logs share the part the standby
// had received: an entry in both counts once.
func (c *campaign) leaseLog(ctx context.Context) (map[int64]*LeaseLife, error) {
	entries, err := readLeaseLog(ctx, c.primary().URL)
	if err != nil {
		return nil, err
	}
	c.srvMu.Lock()
	entries = slices.Concat(c.lostLeaseLog, entries)
	c.srvMu.Unlock()
	return leaseLives(entries), nil
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

// leaseLives reads entries as the lives of the leases, by term.
func leaseLives(entries []leaseEntry) map[int64]*LeaseLife {
	sort.SliceStable(entries, func(i, j int) bool { return entries[i].At.Before(entries[j].At) })
	seen := map[leaseEntry]bool{}
	out := map[int64]*LeaseLife{}
	for _, e := range entries {
		if seen[e] || e.Term == 0 { // a grant's insert writes term 0, then draws its term in an update
			continue
		}
		seen[e] = true
		l := out[e.Term]
		if l == nil {
			l = &LeaseLife{Key: canon(advlock.Int64Key(e.Key)), Granted: e.At}
			out[e.Term] = l
		}
		switch e.Op {
		case "D":
			if l.Deleted.IsZero() {
				l.Deleted = e.At
			}
		default: // a grant (insert, or the update of a takeover) or a renewal
			if e.Expires.After(l.Expires) {
				l.Expires = e.Expires
			}
		}
	}
	return out
}

// Slacks of the lease rules. A holder checks its lease before each write and the ledger stamps the write as it
// runs it: a loaded machine may put some time between the two. A holder that was stopped, or whose Locker was
// closed under it, learns of the end within noticeSlack of its resumption or of the close.
const (
	leaseSlack  = 250 * time.Millisecond
	noticeSlack = time.Second
)

// checkLeases judges each holder of a lease by the table's log. Exclusion: a holder writes (before it is told of
// an end) only while its lease lives on the server: a write after the lease ended is a violation (overlap),
// unless the lease was broken (its holder may write until its next renewal, docs/leases.md: at the latest until the
// expiry its last renewal gave, when its trust window has closed), or the holder's
// process was stopped across the end, or its Locker was closed (then it must learn within noticeSlack). Notice: a
// lease that ended while its holder was in its section (not by its own release) must have been told by then (its
// trust window closes before the lease expires; for a break, before the expiry it had): later is late_notice; told only
// by Unlock, or never, while it wrote on past that, is never_told. A holder whose term the log never saw held a
// lease the server never granted (phantom).
func (h *History) checkLeases() []Violation {
	var out []Violation
	add := func(kind, f string, a ...any) { out = append(out, Violation{kind, fmt.Sprintf(f, a...)}) }
	// Two leases of one key at once: the server granted a term while another term of that key, which a holder was
	// told of, still lived by the logs (a lost primary's included: a promoted server that grants what the old one
	// had granted or renewed past, before its holder stops trusting it).
	holders := map[int64]*CS{}
	for _, id := range sortedKeys(h.CS) {
		if c := h.CS[id]; c.Token > 0 && !c.begin().IsZero() && holders[c.Token] == nil {
			holders[c.Token] = c
		}
	}
	terms := map[string][]int64{}
	for t := range holders {
		if l := h.Leases[t]; l != nil {
			terms[l.Key] = append(terms[l.Key], t)
		}
	}
	for _, k := range sortedKeys(terms) {
		list := terms[k]
		sort.Slice(list, func(i, j int) bool { return h.Leases[list[i]].Granted.Before(h.Leases[list[j]].Granted) })
		for i, a := range list {
			for _, b := range list[i+1:] {
				la, lb := h.Leases[a], h.Leases[b]
				if lb.Granted.Before(la.end()) {
					add(VOverlap, "key %s: term %d (%s %s) was granted at %s while term %d (%s %s, granted %s) lived until %s",
						k, b, holders[b].Op, holders[b].ID, ts(lb.Granted), a, holders[a].Op, holders[a].ID, ts(la.Granted), ts(la.end()))
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
		end := life.end()
		var broken, closed *Evidence
		for i, e := range h.Evidence {
			switch {
			case e.Kind == "break_lease" && e.Term == c.Token:
				broken = &h.Evidence[i]
			case e.Kind == "close_locker" && e.Worker == c.Worker && !e.At.Before(c.begin().Add(-faultSlack)) &&
				!e.At.After(end.Add(faultSlack)):
				closed = &h.Evidence[i]
			}
		}
		// The latest moment c may still act, and be told, for an end that is not its own release. A broken lease's
		// holder learns at its next renewal (a fault on its network may hold that answer back), and at the latest
		// when its trust window closes, before the expiry its last renewal gave the lease.
		deadline := end.Add(leaseSlack)
		if broken != nil {
			deadline = life.Expires.Add(leaseSlack)
		}
		if closed != nil && closed.At.Add(noticeSlack).After(deadline) {
			deadline = closed.At.Add(noticeSlack)
		}
		for _, p := range h.Pauses { // stopped across the end: it learns after it resumes
			if p.Worker == c.Worker && p.From.Before(end) && p.To.Add(noticeSlack).After(deadline) &&
				p.To.After(end.Add(-h.LeaseLength)) {
				deadline = p.To.Add(noticeSlack)
			}
		}
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
		n := judgeNotice(c, endKind(life, broken, closed), end, deadline)
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
	return out
}

// endKind says how a lease ended: broken, its Locker closed, deleted (released), or expired.
func endKind(l *LeaseLife, broken, closed *Evidence) string {
	switch {
	case broken != nil:
		return "broken"
	case closed != nil:
		return "Locker closed"
	case !l.Deleted.IsZero() && l.Deleted.Before(l.Expires):
		return "deleted"
	}
	return "expired"
}
