package main

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"os"
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
	LateOverlaps     int                       `json:"late_overlaps"`      // overlaps with a lost holder within the bound
	PausedOverlaps   int                       `json:"paused_overlaps"`    // overlaps with a paused holder (fencing decides)
	BoundMS          float64                   `json:"bound_ms"`
	Ops              map[string]map[string]int `json:"ops"`
	Faults           map[string]int            `json:"faults"`
	LossNoticeMS     map[string]Percentiles    `json:"loss_notice_ms"`
	Violations       int                       `json:"violations"`
	ViolationsByKind map[string]int            `json:"violations_by_kind"`
	Examples         map[string][]string       `json:"examples"`
	LeakedLocks      int                       `json:"leaked_locks"`
	Errors           map[string]int            `json:"errors"`                  // operations that failed with an error, by message
	NotExercised     []string                  `json:"not_exercised,omitempty"` // why a run under faults proves nothing
	Dir              string                    `json:"dir,omitempty"`           // kept when something was found
}

// OK is true with zero violations and zero leaks.
func (r *Report) OK() bool {
	return r.Violations == 0 && r.LeakedLocks == 0 && len(r.NotExercised) == 0
}

func (c *campaign) report(ctx context.Context, leaked []string) (*Report, error) {
	css, ops, probs, cancels, err := c.history()
	if err != nil {
		return nil, err
	}
	writes, err := c.ledger(ctx)
	if err != nil {
		return nil, fmt.Errorf("read the ledger: %w", err)
	}
	semKeys := map[string]bool{}
	for i := range semN {
		semKeys[semSlotKey(i)] = true
	}
	c.mu.Lock()
	h := &History{CS: css, Writes: writes, Samples: c.samples, Pauses: c.pauses, Leaked: leaked, Problems: probs,
		Bound: 2*c.opt.Keepalive + time.Second, SemKeys: semKeys, SemN: semN,
		AppName: func(w int) string { return fmt.Sprintf("chaos-w%d", w) }}
	faults := append([]fault(nil), c.faults...)
	c.mu.Unlock()
	vs := Check(h)

	r := &Report{Seed: c.opt.Seed, DurationS: c.opt.Duration.Seconds(), Workers: c.opt.Workers, Ops: ops,
		Faults: map[string]int{}, LossNoticeMS: map[string]Percentiles{}, ViolationsByKind: map[string]int{},
		Examples: map[string][]string{}, Writes: len(writes), Samples: len(h.Samples), Errors: c.errors,
		Confirmed: h.Confirmed, LateOverlaps: h.LateOverlaps, PausedOverlaps: h.PausedOverlaps,
		BoundMS: float64(h.Bound.Milliseconds())}
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
	}
	if cancels > 0 {
		r.Faults["cancel"] = int(cancels)
	}
	lat := map[string][]float64{}
	for _, cs := range css {
		r.Grants++
		if cs.Ended && cs.Unlock == "ok" {
			r.Releases++
		}
		if cs.Cause != "lost" || cs.Told.IsZero() {
			continue
		}
		r.LossesTold++
		kind := "unattributed"
		var at time.Time
		for _, f := range faults {
			if (f.Worker == -1 || f.Worker == cs.Worker) && !f.At.After(cs.Told) && cs.Told.Sub(f.At) < 10*time.Second &&
				f.At.After(at) {
				kind, at = f.Kind, f.At
			}
		}
		d := 0.0
		if !at.IsZero() {
			d = float64(cs.Told.Sub(at).Microseconds()) / 1000
		}
		lat[kind] = append(lat[kind], d)
	}
	for kind, ds := range lat {
		if kind == "unattributed" {
			r.LossNoticeMS[kind] = Percentiles{N: len(ds)}
			continue
		}
		sort.Float64s(ds)
		r.LossNoticeMS[kind] = Percentiles{P50: pct(ds, 0.50), P99: pct(ds, 0.99), N: len(ds)}
	}
	// A run under faults that refused no write, told no holder of a loss, or never injected a kind of fault did
	// not exercise what the checker's excusing rules are about: it proves less than it seems, and fails.
	if !c.opt.NoFaults {
		if r.Refused == 0 {
			r.NotExercised = append(r.NotExercised, "no write was refused by its token")
		}
		if r.LossesTold == 0 {
			r.NotExercised = append(r.NotExercised, "no holder was told of a loss inside its section")
		}
		for _, k := range faultKinds {
			if r.Faults[k] == 0 {
				r.NotExercised = append(r.NotExercised, "fault "+k+" never took effect")
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
	fmt.Fprintf(w, "overlaps with a holder that had lost its lock: %d within the detection bound (%v), %d with a paused holder (fencing decides)\n\n",
		r.LateOverlaps, time.Duration(r.BoundMS)*time.Millisecond, r.PausedOverlaps)

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

	tw = tabwriter.NewWriter(w, 0, 0, 2, ' ', 0)
	fmt.Fprintf(tw, "fault\tinjected\tlosses told\tnotice p50 ms\tnotice p99 ms\n")
	kinds := map[string]bool{}
	for k := range r.Faults {
		kinds[k] = true
	}
	for k := range r.LossNoticeMS {
		kinds[k] = true
	}
	for _, k := range sortedKeys(kinds) {
		l, ok := r.LossNoticeMS[k]
		p50, p99 := "-", "-"
		if ok && k != "unattributed" {
			p50, p99 = fmt.Sprintf("%.1f", l.P50), fmt.Sprintf("%.1f", l.P99)
		}
		fmt.Fprintf(tw, "%s\t%d\t%d\t%s\t%s\n", k, r.Faults[k], l.N, p50, p99)
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

func sortedKeys[V any](m map[string]V) []string {
	out := make([]string, 0, len(m))
	for k := range m {
		out = append(out, k)
	}
	sort.Strings(out)
	return out
}
