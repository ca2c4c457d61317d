package main

import (
	"cmp"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"maps"
	"os"
	"slices"
	"sort"
	"strings"
	"text/tabwriter"
	"time"
)

// Percentiles of one fault kind's loss-notice times.
type Percentiles struct {
	P50 float64 `json:"p50"`
	P99 float64 `json:"p99"`
	N   int     `json:"n"`
}

// Report is what a campaign found.
type Report struct {
	Seed             uint64                    `json:"seed"`
	DurationS        float64                   `json:"duration_s"`
	Workers          int                       `json:"workers"`
	Operations       int                       `json:"operations"`
	Grants           int                       `json:"grants"`
	Releases         int                       `json:"releases"`
	LossesTold       int                       `json:"losses_told"`
	Writes           int                       `json:"writes"`
	Refused          int                       `json:"refused_writes"`
	Samples          int                       `json:"pg_locks_samples"`
	Confirmed        int                       `json:"pg_locks_confirmed"` // believing holders seen holding in a sample
	ExcusedOverlaps  int                       `json:"excused_overlaps"`   // overlaps after server evidence of the first holder's loss
	SessionEnds      int                       `json:"session_ends"`       // backends of the workers that the server logged ending
	BoundMS          float64                   `json:"bound_ms"`
	Ops              map[string]map[string]int `json:"ops"`
	Faults           map[string]int            `json:"faults"`     // injected and taken effect
	FaultsHit        map[string]int            `json:"faults_hit"` // of those, the ones whose target held a lock
	LossNoticeMS     map[string]Percentiles    `json:"loss_notice_ms"`
	LossNotice       map[string]map[string]int `json:"loss_notice"` // fault -> learned by (watcher, reader, unlock, none) and late, never
	LossesInSections int                       `json:"losses_in_sections"`
	Violations       int                       `json:"violations"`
	ViolationsByKind map[string]int            `json:"violations_by_kind"`
	Examples         map[string][]string       `json:"examples"`
	LeakedLocks      int                       `json:"leaked_locks"`
	Errors           map[string]int            `json:"errors"` // operations that failed with an error, by message
	// Cycles of waits among the pair operations: how many formed, how each was broken (deadlock: one wait ended
	// with ErrDeadlock; other: a fault, a loss or a timeout ended one first), and how long after forming the
	// victim's wait returned.
	Cycles          int            `json:"cycles"`
	CyclesBroken    map[string]int `json:"cycles_broken"`
	DeadlockMS      Percentiles    `json:"deadlock_ms"`
	DeadlockMaxMS   float64        `json:"deadlock_max_ms"`
	DeadlockBoundMS float64        `json:"deadlock_bound_ms"`
	// The readers' and writers' waits for the queue key judged by their queue (no fault near them), and how long
	// after their key was free to them the granted ones were granted.
	WaitsJudged      int         `json:"waits_judged"`
	OvertakeChances  int         `json:"overtake_chances,omitempty"`
	FreeToGrantMS    Percentiles `json:"free_to_grant_ms"`
	FreeToGrantMaxMS float64     `json:"free_to_grant_max_ms"`
	StarveBoundMS    float64     `json:"starve_bound_ms"`
	// Failovers (a -failover campaign): how long each took from the primary's stop to the standby's promotion, and
	// from the promotion to the first grant a worker recorded on the new primary.
	Failovers       int         `json:"failovers,omitempty"`
	PromoteMS       Percentiles `json:"promote_ms"`
	FirstGrantMS    Percentiles `json:"first_grant_after_promotion_ms"`
	FirstGrantMaxMS float64     `json:"first_grant_after_promotion_max_ms"`
	FirstGrantMinMS float64     `json:"first_grant_after_promotion_min_ms"`
	// A lease campaign: the terms the lease table granted, those granted to a worker while its answers came late
	// (late_answers), the steps of the server's clock, and the longest time between two records of a lease.
	LeaseTerms       int      `json:"lease_terms,omitempty"`
	LateAnswerGrants int      `json:"late_answer_grants,omitempty"`
	LostGrants       int      `json:"lost_grants,omitempty"` // grants a crash took back (see crashLosses)
	ClockSteps       int      `json:"clock_steps,omitempty"`
	LongestGapMS     float64  `json:"longest_record_gap_ms,omitempty"`
	NotExercised     []string `json:"not_exercised,omitempty"` // why a run under faults proves nothing
	Dir              string   `json:"dir,omitempty"`           // kept when something was found
}

// OK is true with zero violations and zero leaks.
func (r *Report) OK() bool {
	return r.Violations == 0 && r.LeakedLocks == 0 && len(r.NotExercised) == 0
}

func (c *campaign) report(ctx context.Context, leaked []Leftover) (*Report, error) {
	css, ops, probs, cancels, err := c.history()
	if err != nil {
		return nil, err
	}
	writes, err := c.ledger(ctx)
	if err != nil {
		return nil, fmt.Errorf("read the ledger: %w", err)
	}
	semSlots := map[string]int{}
	for i := range semN + 2 {
		semSlots[semSlotKey(i)] = i
	}
	ends := c.sessionEnds()
	var leases map[int64]*LeaseLife
	var leaseLog []time.Time
	if c.opt.Leases {
		if leases, leaseLog, err = c.leaseLog(ctx); err != nil {
			return nil, fmt.Errorf("read the lease log: %w", err)
		}
		c.keepLeaseLives(leases)
	}
	c.mu.Lock()
	faults := append([]fault(nil), c.faults...)
	var ev []Evidence
	for _, f := range faults {
		ev = append(ev, Evidence{Kind: f.Kind, At: f.At, Until: f.Until, Worker: f.Worker, PID: f.PID, Keys: f.Keys, Term: f.Term,
			Delay: f.Delay, Stopped: f.Stopped})
	}
	h := &History{CS: css, Writes: writes, Samples: c.samples, Pauses: c.pauses, Leaked: leaked, Problems: probs,
		Evidence: append(ev, ends...), Bound: 2*c.opt.Keepalive + time.Second, SemSlots: semSlots,
		Waits: c.waits, DeadlockBound: cmp.Or(c.opt.DeadlockBound, DeadlockBound), StarveBound: StarveBound, WaitSlice: c.opt.WaitSlice, Unreachable: c.unreachable,
		SemN: semN, RunEnd: c.runEnd,
		AppName: func(w int) string { return fmt.Sprintf("chaos-w%d", w) },
		WorkerOf: func(app string) (int, bool) {
			var w int
			_, err := fmt.Sscanf(app, "chaos-w%d", &w)
			return w, err == nil && !strings.HasSuffix(app, "-ledger")
		}}
	c.mu.Unlock()
	if c.opt.Leases {
		h.Leases, h.LeaseLog, h.LeaseLength, h.LeaseRenew = leases, leaseLog, c.opt.LeaseLength, c.opt.LeaseLength/3
	}
	vs := Check(h)

	r := &Report{Seed: c.opt.Seed, DurationS: c.opt.Duration.Seconds(), Workers: c.opt.Workers, Ops: ops,
		Faults: map[string]int{}, FaultsHit: map[string]int{}, LossNoticeMS: map[string]Percentiles{},
		LossNotice: map[string]map[string]int{}, ViolationsByKind: map[string]int{},
		Examples: map[string][]string{}, Writes: len(writes), Samples: len(h.Samples), Errors: c.errors,
		Confirmed: h.Confirmed, ExcusedOverlaps: h.ExcusedOverlaps, SessionEnds: len(ends),
		BoundMS: float64(h.Bound.Milliseconds()), CyclesBroken: map[string]int{},
		DeadlockBoundMS: float64(h.DeadlockBound.Milliseconds()), WaitsJudged: h.WaitsJudged, OvertakeChances: h.OvertakeChances,
		StarveBoundMS: float64(h.StarveBound.Milliseconds())}
	if len(h.FreeToGrant) > 0 {
		ms := make([]float64, len(h.FreeToGrant))
		for i, d := range h.FreeToGrant {
			ms[i] = float64(d.Microseconds()) / 1000
		}
		sort.Float64s(ms)
		r.FreeToGrantMS = Percentiles{P50: pct(ms, 0.5), P99: pct(ms, 0.99), N: len(ms)}
		r.FreeToGrantMaxMS = pct(ms, 1)
	}
	var took []float64
	for _, cy := range h.Cycles {
		r.Cycles++
		if cy.Excused {
			r.CyclesBroken["excused"]++ // past the bound while a fault kept its Lockers from reading
		}
		switch {
		case len(cy.Victims) > 0:
			r.CyclesBroken["deadlock"]++
			took = append(took, float64(cy.Victims[0].End.Sub(cy.Formed).Microseconds())/1000)
		case cy.Broken == forever:
			r.CyclesBroken["never"]++
		default:
			r.CyclesBroken["other"]++
		}
	}
	if len(took) > 0 {
		sort.Float64s(took)
		r.DeadlockMS = Percentiles{P50: pct(took, 0.5), P99: pct(took, 0.99), N: len(took)}
		r.DeadlockMaxMS = pct(took, 1)
	}
	for _, m := range ops {
		for _, n := range m {
			r.Operations += n
		}
	}
	for _, w := range writes {
		if w.Accepted != nil && !*w.Accepted {
			r.Refused++
		}
	}
	for _, f := range faults {
		r.Faults[f.Kind]++
		if f.Held > 0 || f.Kind == "latency" || f.Kind == "terminate_waiter" || (f.Kind == "slow_link" || f.Kind == "late_answers") && f.Waits > 0 {
			r.FaultsHit[f.Kind]++
		}
	}
	if cancels > 0 {
		r.Faults["cancel"] = int(cancels)
	}
	var promote, first []float64
	for _, f := range faults {
		if f.Kind != "failover" {
			continue
		}
		r.Failovers++
		promote = append(promote, float64(f.Until.Sub(f.At).Microseconds())/1000)
		var next time.Time
		for _, cs := range css {
			if b := cs.begin(); b.After(f.Until) && cs.Clean && (next.IsZero() || b.Before(next)) { // a late record of an old grant is never clean
				next = b
			}
		}
		if !next.IsZero() {
			first = append(first, float64(next.Sub(f.Until).Microseconds())/1000)
		}
	}
	if len(promote) > 0 {
		sort.Float64s(promote)
		r.PromoteMS = Percentiles{P50: pct(promote, 0.5), P99: pct(promote, 0.99), N: len(promote)}
	}
	if len(first) > 0 {
		sort.Float64s(first)
		r.FirstGrantMS = Percentiles{P50: pct(first, 0.5), P99: pct(first, 0.99), N: len(first)}
		r.FirstGrantMaxMS, r.FirstGrantMinMS = pct(first, 1), pct(first, 0)
	}
	if h.Leases != nil {
		r.LeaseTerms = len(h.Leases)
		for _, l := range h.Leases {
			if l.Lost {
				r.LostGrants++
			}
			r.LongestGapMS = max(r.LongestGapMS, float64(l.Gap.Microseconds())/1000)
			for _, e := range h.Evidence {
				if e.Kind == "late_answers" && e.Worker == l.Worker && !l.Granted.Before(e.At) && l.Granted.Before(e.Until.Add(-e.Delay)) {
					r.LateAnswerGrants++
					break
				}
			}
		}
		for _, e := range h.Evidence {
			if e.Kind == "clock_step" {
				r.ClockSteps++
			}
		}
	}
	if c.opt.Failover && !c.opt.NoFaults && r.Failovers == 0 && (len(c.opt.Faults) == 0 || slices.Contains(c.opt.Faults, "failover")) {
		r.NotExercised = append(r.NotExercised, "no failover took place")
	}
	if c.lostLogsUnread > 0 {
		r.NotExercised = append(r.NotExercised, fmt.Sprintf("the lease logs of %d primaries lost to a failover could not be read: their holders were not judged", c.lostLogsUnread))
	}
	for _, cs := range css {
		r.Grants++
		if cs.Ended && cs.Unlock == "ok" {
			r.Releases++
		}
		if cs.Cause == "lost" && !cs.Told.IsZero() {
			r.LossesTold++
		}
	}
	// How each loss inside a section was first learned, judged against the bound.
	lat := map[string][]float64{}
	for _, n := range h.Notices {
		m := r.LossNotice[n.Fault]
		if m == nil {
			m = map[string]int{}
			r.LossNotice[n.Fault] = m
		}
		m[n.By]++
		if n.Verdict != "ok" {
			m[n.Verdict]++
		}
		if n.By == "watcher" || n.By == "reader" {
			r.LossesInSections++
			lat[n.Fault] = append(lat[n.Fault], float64(n.After.Microseconds())/1000)
		}
	}
	for kind, ds := range lat {
		sort.Float64s(ds)
		r.LossNoticeMS[kind] = Percentiles{P50: pct(ds, 0.50), P99: pct(ds, 0.99), N: len(ds)}
	}
	// A run whose pair operations never formed a cycle proves nothing about deadlocks.
	if n := sum(ops["pair"]); n > 0 && r.Cycles == 0 && (len(c.opt.Ops) == 0 || slices.Contains(c.opt.Ops, "pair")) &&
		c.opt.Duration >= 10*time.Second {
		r.NotExercised = append(r.NotExercised, fmt.Sprintf("%d pair operations formed no cycle of waits", n))
	}
	// A run under faults that refused no write, told no holder of a loss inside its section, or had a kind of
	// fault that never hit a holder did not exercise what the checker's excusing rules are about: it proves less
	// than it seems, and fails.
	if !c.opt.NoFaults {
		if r.Refused == 0 {
			r.NotExercised = append(r.NotExercised, "no write was refused by its token")
		}
		if r.LossesInSections == 0 {
			r.NotExercised = append(r.NotExercised, "no holder was told of a loss inside its section")
		}
		for _, k := range c.kinds() {
			if r.FaultsHit[k] == 0 {
				r.NotExercised = append(r.NotExercised, "fault "+k+" never hit a holder")
			}
		}
	}
	for _, v := range vs {
		if v.Kind == VLeak {
			r.LeakedLocks++
		}
		r.Violations++
		r.ViolationsByKind[v.Kind]++
		if len(r.Examples[v.Kind]) < 3 {
			r.Examples[v.Kind] = append(r.Examples[v.Kind], v.Detail)
		}
	}
	return r, nil
}

func sum(m map[string]int) int {
	n := 0
	for _, v := range m {
		n += v
	}
	return n
}

func pct(sorted []float64, p float64) float64 {
	i := int(p*float64(len(sorted)-1) + 0.5)
	return float64(int(sorted[i]*10+0.5)) / 10
}

// Print writes the report as tables.
func (r *Report) Print(w io.Writer) {
	fmt.Fprintf(w, "advlock chaos: seed %d, %d workers, %s\n\n", r.Seed, r.Workers, time.Duration(r.DurationS*float64(time.Second)))
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', tabwriter.AlignRight)
	fmt.Fprintf(tw, "operations\tgrants\treleases\tlosses told\tledger writes\trefused (fenced)\tpg_locks samples\tholders confirmed\t\n")
	fmt.Fprintf(tw, "%d\t%d\t%d\t%d\t%d\t%d\t%d\t%d\t\n", r.Operations, r.Grants, r.Releases, r.LossesTold, r.Writes, r.Refused, r.Samples, r.Confirmed)
	tw.Flush()
	fmt.Fprintf(w, "overlaps excused by the server's evidence that the earlier holder's session had ended: %d (backend ends logged: %d)\n\n",
		r.ExcusedOverlaps, r.SessionEnds)

	tw = tabwriter.NewWriter(w, 0, 0, 2, ' ', 0)
	fmt.Fprintf(tw, "operation\tresults\n")
	for _, op := range sortedKeys(r.Ops) {
		var parts []string
		for _, res := range sortedKeys(r.Ops[op]) {
			parts = append(parts, fmt.Sprintf("%s %d", res, r.Ops[op][res]))
		}
		fmt.Fprintf(tw, "%s\t%s\n", op, strings.Join(parts, ", "))
	}
	tw.Flush()
	fmt.Fprintln(w)

	if r.Failovers > 0 {
		fmt.Fprintf(w, "failovers: %d; the standby promoted %.0f ms after the primary stopped (p50; max %.0f ms), the first grant on the new primary %.0f ms after the promotion (p50; max %.0f ms)\n\n",
			r.Failovers, r.PromoteMS.P50, r.PromoteMS.P99, r.FirstGrantMS.P50, r.FirstGrantMaxMS)
	}
	if r.LeaseTerms > 0 {
		fmt.Fprintf(w, "leases: %d terms granted, %d of them to a worker while its answers came late, %d taken back by a crash; %d steps of the server's clock; the longest time between two records of a lease %.0f ms\n\n",
			r.LeaseTerms, r.LateAnswerGrants, r.LostGrants, r.ClockSteps, r.LongestGapMS)
	}
	if r.Cycles > 0 {
		fmt.Fprintf(w, "cycles of waits: %d formed; broken by one ErrDeadlock %d (after p50 %.0f ms, p99 %.0f ms, max %.0f ms; bound %v), by a fault, loss or timeout first %d, never %d; past the bound during a fault that kept a Locker from reading %d\n\n",
			r.Cycles, r.CyclesBroken["deadlock"], r.DeadlockMS.P50, r.DeadlockMS.P99, r.DeadlockMaxMS,
			time.Duration(r.DeadlockBoundMS)*time.Millisecond, r.CyclesBroken["other"], r.CyclesBroken["never"], r.CyclesBroken["excused"])
	}

	if r.WaitsJudged > 0 {
		fmt.Fprintf(w, "readers' and writers' waits judged by their queue: %d; the granted ones granted after their key was free to them: p50 %.0f ms, p99 %.0f ms, max %.0f ms (of %d; bound %v)\n\n",
			r.WaitsJudged, r.FreeToGrantMS.P50, r.FreeToGrantMS.P99, r.FreeToGrantMaxMS, r.FreeToGrantMS.N,
			time.Duration(r.StarveBoundMS)*time.Millisecond)
	}
	if r.OvertakeChances > 0 {
		fmt.Fprintf(w, "crowd waits that returned a whole slice or more after a wait begun %v or more after them was recorded (chances to overtake): %d\n\n",
			OvertakeSlack, r.OvertakeChances)
	}

	tw = tabwriter.NewWriter(w, 0, 0, 2, ' ', 0)
	fmt.Fprintf(tw, "fault\tinjected\thit a holder\tlosses in sections\tlearned by\tnotice p50 ms\tp99 ms\tpast the bound (%v)\n",
		time.Duration(r.BoundMS)*time.Millisecond)
	kinds := map[string]bool{}
	for k := range r.Faults {
		kinds[k] = true
	}
	for k := range r.LossNotice {
		kinds[k] = true
	}
	for _, k := range sortedKeys(kinds) {
		m := r.LossNotice[k]
		var by []string
		total := 0
		for _, b := range []string{"watcher", "reader", "unlock", "none"} {
			if m[b] > 0 {
				by = append(by, fmt.Sprintf("%s %d", b, m[b]))
				total += m[b]
			}
		}
		p50, p99 := "-", "-"
		if l, ok := r.LossNoticeMS[k]; ok {
			p50, p99 = fmt.Sprintf("%.1f", l.P50), fmt.Sprintf("%.1f", l.P99)
		}
		hit := fmt.Sprint(r.FaultsHit[k])
		if k == "cancel" || k == "session_end" {
			hit = "-"
		}
		fmt.Fprintf(tw, "%s\t%d\t%s\t%d\t%s\t%s\t%s\t%d\n", k, r.Faults[k], hit, total, strings.Join(by, ", "), p50, p99,
			m[VLateNotice]+m[VNeverTold])
	}
	tw.Flush()
	fmt.Fprintln(w)

	if len(r.Errors) > 0 {
		type kv struct {
			k string
			n int
		}
		var es []kv
		for k, n := range r.Errors {
			es = append(es, kv{k, n})
		}
		sort.Slice(es, func(i, j int) bool { return es[i].n > es[j].n || es[i].n == es[j].n && es[i].k < es[j].k })
		fmt.Fprintln(w, "operations that failed with an error (the faults' expected effects), most frequent first:")
		for i, e := range es {
			if i == 8 {
				fmt.Fprintf(w, "  ... %d more kinds\n", len(es)-8)
				break
			}
			fmt.Fprintf(w, "  %5d  %s\n", e.n, e.k)
		}
		fmt.Fprintln(w)
	}
	fmt.Fprintf(w, "violations: %d   leaked locks: %d\n", r.Violations, r.LeakedLocks)
	for _, why := range r.NotExercised {
		fmt.Fprintf(w, "not exercised: %s\n", why)
	}
	if r.Dir != "" {
		fmt.Fprintf(w, "the workers' histories and output are kept in %s\n", r.Dir)
	}
	for _, k := range sortedKeys(r.ViolationsByKind) {
		fmt.Fprintf(w, "  %s: %d\n", k, r.ViolationsByKind[k])
		for _, e := range r.Examples[k] {
			fmt.Fprintf(w, "    %s\n", strings.ReplaceAll(e, "\n", "\n    "))
		}
	}
}

// WriteJSON writes the report to path.
func (r *Report) WriteJSON(path string) error {
	b, err := json.MarshalIndent(r, "", "  ")
	if err != nil {
		return err
	}
	return os.WriteFile(path, append(b, '\n'), 0o644)
}

func sortedKeys[K cmp.Ordered, V any](m map[K]V) []K {
	return slices.Sorted(maps.Keys(m))
}
