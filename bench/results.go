package main

import (
	"encoding/csv"
	"encoding/json"
	"fmt"
	"html"
	"io"
	"math"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"text/tabwriter"
	"time"
)

type result struct {
	Workload  string    `json:"workload"`
	Contender string    `json:"contender"`
	Metric    string    `json:"metric"`
	Unit      string    `json:"unit"`
	Value     float64   `json:"value"`           // median of the rounds; -1 when not applicable
	Rounds    []float64 `json:"rounds"`          // one value per round
	XRaw      float64   `json:"x_raw,omitempty"` // Value / raw pgx's Value for the same workload and metric
	Note      string    `json:"note,omitempty"`
	values    []float64
}

type results struct {
	When  time.Time `json:"when"`
	Setup string    `json:"setup"`
	Rows  []*result `json:"rows"`
}

// collate takes the median of each result's rounds, computes the ratio to raw pgx, and orders the rows by
// workload, then by contender in the order of cs.
func collate(c *collector, cs []contender) *results {
	res := &results{When: time.Now().UTC(), Setup: fmt.Sprintf("rounds=%d dur=%v handoffs=%d", *flagRounds, *flagDur, *flagHandoffs)}
	raw := map[string]float64{}
	for _, id := range c.order {
		r := c.samples[id]
		r.Rounds, r.Value = r.values, median(r.values)
		if r.Contender == rawName {
			raw[r.Workload+"|"+r.Metric+"|"+r.Unit] = r.Value
		}
		res.Rows = append(res.Rows, r)
	}
	rank := map[string]int{}
	for i, x := range cs {
		rank[x.name] = i
	}
	slices.SortStableFunc(res.Rows, func(a, b *result) int {
		if a.Workload != b.Workload { // by number: "10. ..." after "9. ..."
			if c := workloadNumber(a.Workload) - workloadNumber(b.Workload); c != 0 {
				return c
			}
			return strings.Compare(a.Workload, b.Workload)
		}
		return rank[a.Contender] - rank[b.Contender]
	})
	for _, r := range res.Rows {
		if v, ok := raw[r.Workload+"|"+r.Metric+"|"+r.Unit]; ok && v > 0 && r.Value >= 0 {
			r.XRaw = r.Value / v
		}
	}
	return res
}

func (res *results) find(w, who, metric, unit string) *result {
	for _, r := range res.Rows {
		if r.Workload == w && r.Contender == who && r.Metric == metric && r.Unit == unit {
			return r
		}
	}
	return nil
}

func num(v float64) string {
	switch {
	case v < 0:
		return "n/a"
	case v >= 1000:
		return strconv.FormatFloat(math.Round(v), 'f', 0, 64)
	case v >= 10:
		return strconv.FormatFloat(v, 'f', 1, 64)
	case v > 0 && v < 0.01:
		return strconv.FormatFloat(v, 'g', 2, 64)
	}
	return strconv.FormatFloat(v, 'f', 2, 64)
}

func (res *results) print(w io.Writer) {
	fmt.Fprintf(w, "\nadvlock benchmarks, %s (%s; medians of the rounds)\n\n", res.When.Format(time.RFC3339), res.Setup)
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', tabwriter.AlignRight)
	fmt.Fprintln(tw, "workload\tcontender\tmetric\tvalue\tunit\tx raw pgx\tnote\t")
	last := ""
	for _, r := range res.Rows {
		wl := r.Workload
		if wl == last {
			wl = ""
		}
		last = r.Workload
		x := ""
		if r.XRaw > 0 {
			x = strconv.FormatFloat(r.XRaw, 'f', 2, 64)
		}
		fmt.Fprintf(tw, "%s\t%s\t%s\t%s\t%s\t%s\t%s\t\n", wl, r.Contender, r.Metric, num(r.Value), r.Unit, x, r.Note)
	}
	tw.Flush()
	fmt.Fprintln(w, "\nTargets:")
	target := func(desc string, r *result, ok func(*result) bool, show string) {
		verdict := "MISSED"
		if r == nil {
			fmt.Fprintf(w, "  %-62s no data\n", desc)
			return
		}
		if ok(r) {
			verdict = "met"
		}
		fmt.Fprintf(w, "  %-62s %-10s %s\n", desc, show, verdict)
	}
	for _, t := range []struct {
		desc, w, who string
		min          float64
	}{
		{"advlock TryLock+Unlock, 1 goroutine >= 1.0x raw pgx", wUncontended, "advlock TryLock", 1},
		{"advlock Lock+Unlock, 1 goroutine >= 1.0x raw pgx", wUncontended, "advlock Lock", 1},
		{"advlock Do, 1 goroutine >= 1.0x raw pgx", wUncontended, "advlock Do", 1},
		{"advlock TryLock+Unlock, 8 goroutines >= 0.95x raw pgx", wDistinct, "advlock TryLock", 0.95},
		{"advlock Lock+Unlock, 8 goroutines >= 0.95x raw pgx", wDistinct, "advlock Lock", 0.95},
	} {
		r := res.find(t.w, t.who, "throughput", "cycles/s")
		show := ""
		if r != nil {
			show = fmt.Sprintf("%.2fx", r.XRaw)
		}
		target(t.desc, r, func(r *result) bool { return r.XRaw >= t.min }, show)
	}
	if r := res.find(wOneKey, "advlock Lock", "fairness (max/min per goroutine)", "x"); r != nil {
		target("advlock Lock, 8 goroutines on one key: fairness <= 1.1x", r, func(r *result) bool { return r.Value <= 1.1 }, fmt.Sprintf("%.2fx", r.Value))
	}
	if r := res.find(wMany, "advlock TryLock", "throughput", "cycles/s"); r != nil {
		target("advlock TryLock+Unlock, 256 goroutines >= 100,000 cycles/s", r, func(r *result) bool { return r.Value >= 100000 }, num(r.Value))
	}
	if r := res.find(wMany, openDefault, "throughput", "cycles/s"); r != nil {
		target("advlock Open, 256 goroutines >= 5x raw pgx on 8 connections", r, func(r *result) bool { return r.XRaw >= 5 }, fmt.Sprintf("%.2fx", r.XRaw))
	}
	if r := res.find(wMemory, "advlock Lock", "heap per held lock", "B"); r != nil {
		target("advlock heap per held lock (shared sessions) <= 618 B", r, func(r *result) bool { return r.Value <= 618 }, num(r.Value)+" B")
	}
	if r := res.find(wHandoff, "advlock Lock", "p50", "ms"); r != nil {
		target("advlock handoff p50 <= 1.05x raw pgx's", r, func(r *result) bool { return r.XRaw <= 1.05 }, fmt.Sprintf("%.2fx", r.XRaw))
	}
	if r := res.find(wHandoff, "advlock Lock", "p99", "ms"); r != nil {
		target("advlock handoff p99 <= 2x raw pgx's", r, func(r *result) bool { return r.XRaw <= 2 }, fmt.Sprintf("%.2fx", r.XRaw))
	}
	if r := res.find(wLoss, "advlock Lock", "p50 after pg_terminate_backend", "ms"); r != nil {
		target("advlock loss noticed p50 <= 100 ms", r, func(r *result) bool { return r.Value <= 100 }, num(r.Value)+" ms")
	}
	for _, via := range []string{"", viaBouncer} {
		l, raw := res.find(wUncontended, leasesName+via, "throughput", "cycles/s"), res.find(wUncontended, rawLeaseName+via, "throughput", "cycles/s")
		if l != nil && raw != nil && raw.Value > 0 {
			x := l.Value / raw.Value
			target("leases"+via+", 1 goroutine >= 0.8x the raw lease loop", l, func(*result) bool { return x >= 0.8 }, fmt.Sprintf("%.2fx", x))
		}
	}
	if r := res.find(wUncontended, leasesName, "throughput", "cycles/s"); r != nil {
		target("leases, 1 goroutine, x raw pgx's advisory locks (aim 0.5x)", r, func(r *result) bool { return r.XRaw >= 0.5 }, fmt.Sprintf("%.2fx", r.XRaw))
	}
	if r := res.find(wMemory, leasesName, "per acquire+release", "allocs/op"); r != nil { // half the 94 of 2026-12-04
		target("leases, allocations per cycle <= 47", r, func(r *result) bool { return r.Value <= 47 }, num(r.Value))
	}
	for _, via := range []string{"", viaBouncer} {
		if r := res.find(wHandoff, leasesName+via, "p50", "ms"); r != nil {
			target("leases"+via+" handoff p50 <= 2x the poll interval (400 ms)", r, func(r *result) bool { return r.Value <= 2*ms(leasePoll) }, num(r.Value)+" ms")
		}
	}
	held := "2000 of 3s" // renewed every second
	if r := res.find(wLeasesHeld, leasesName, "goroutines added, "+held, "goroutines"); r != nil {
		target("leases: 2,000 held by one Locker, <= 50 goroutines", r, func(r *result) bool { return r.Value <= 50 }, num(r.Value))
	}
	if r := res.find(wLeasesHeld, leasesName, "heap per held lease, "+held, "B"); r != nil {
		target("leases: 2,000 held by one Locker, <= 800 B of heap each", r, func(r *result) bool { return r.Value <= 800 }, num(r.Value)+" B")
	}
	if r := res.find(wLeasesHeld, leasesName, "server transactions a second, "+held, "xact/s"); r != nil {
		target("leases: 2,000 held, renewed every 1 s, <= 100 transactions/s", r, func(r *result) bool { return r.Value <= 100 }, num(r.Value))
	}
	if r := res.find(wSwept, leasesName, "1,000 leases of 3s gone after the cut", "s"); r != nil {
		target("leases: a dead holder's rows gone within a lease length and a sweep period (4 s)", r, func(r *result) bool { return r.Value <= 4 }, fmt.Sprintf("%.1f s", r.Value))
	}
	if r := res.find(wSwept, leasesName, "100 waits gone after the cut", "s"); r != nil {
		target("leases: a dead waiter's rows gone within 6 s and a sweep period (7 s)", r, func(r *result) bool { return r.Value <= 7 }, fmt.Sprintf("%.1f s", r.Value))
	}
	if r := res.find(wLoss, leasesName, "p50 after its row is deleted (renewed every 5s)", "ms"); r != nil {
		target("leases loss noticed p50 <= the lease length (15 s)", r, func(r *result) bool { return r.Value <= 15000 }, num(r.Value)+" ms")
	}
}

func (res *results) write(dir string) error {
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return err
	}
	f, err := os.Create(filepath.Join(dir, "results.csv"))
	if err != nil {
		return err
	}
	cw := csv.NewWriter(f)
	_ = cw.Write([]string{"workload", "contender", "metric", "unit", "value", "x_raw", "rounds", "note"})
	for _, r := range res.Rows {
		var rounds []string
		for _, v := range r.Rounds {
			rounds = append(rounds, strconv.FormatFloat(v, 'g', 6, 64))
		}
		_ = cw.Write([]string{r.Workload, r.Contender, r.Metric, r.Unit, strconv.FormatFloat(r.Value, 'g', 6, 64),
			strconv.FormatFloat(r.XRaw, 'f', 3, 64), strings.Join(rounds, " "), r.Note})
	}
	cw.Flush()
	if err := cw.Error(); err != nil {
		return err
	}
	if err := f.Close(); err != nil {
		return err
	}
	js, err := json.MarshalIndent(res, "", "  ")
	if err != nil {
		return err
	}
	if err := os.WriteFile(filepath.Join(dir, "results.json"), append(js, '\n'), 0o644); err != nil {
		return err
	}
	return os.WriteFile(filepath.Join(dir, "chart.svg"), res.svg(), 0o644)
}

// svg draws one panel of horizontal bars per chart-worthy metric.
func (res *results) svg() []byte {
	type panel struct {
		title   string
		w, m, u string
		log     bool
	}
	panels := []panel{
		{"1 goroutine, uncontended: cycles/s (more is better)", wUncontended, "throughput", "cycles/s", false},
		{"8 goroutines, distinct keys: cycles/s", wDistinct, "throughput", "cycles/s", false},
		{"8 goroutines, one key: cycles/s", wOneKey, "throughput", "cycles/s", false},
		{"handoff p50, ms (log scale; less is better)", wHandoff, "p50", "ms", true},
	}
	const width, labelW, barH, gap = 900, 230, 16, 4
	var b strings.Builder
	y := 20
	var body strings.Builder
	for _, p := range panels {
		var rows []*result
		maxV := 0.0
		for _, r := range res.Rows {
			if r.Workload == p.w && r.Metric == p.m && r.Unit == p.u && r.Value > 0 {
				rows = append(rows, r)
				maxV = math.Max(maxV, r.Value)
			}
		}
		if len(rows) == 0 {
			continue
		}
		fmt.Fprintf(&body, `<text x="10" y="%d" font-weight="bold">%s</text>`+"\n", y+12, html.EscapeString(p.title))
		y += 20
		for _, r := range rows {
			frac := r.Value / maxV
			if p.log {
				lo := 0.01
				frac = (math.Log10(math.Max(r.Value, lo)) - math.Log10(lo)) / (math.Log10(maxV) - math.Log10(lo))
			}
			bw := int(frac * float64(width-labelW-120))
			color := "#7a8fa6"
			if strings.HasPrefix(r.Contender, "advlock") {
				color = "#2f7d4f"
			} else if r.Contender == rawName {
				color = "#333"
			}
			fmt.Fprintf(&body, `<text x="%d" y="%d" text-anchor="end">%s</text>`+"\n", labelW-6, y+12, html.EscapeString(r.Contender))
			fmt.Fprintf(&body, `<rect x="%d" y="%d" width="%d" height="%d" fill="%s"/>`+"\n", labelW, y, max(bw, 1), barH, color)
			fmt.Fprintf(&body, `<text x="%d" y="%d">%s</text>`+"\n", labelW+max(bw, 1)+6, y+12, num(r.Value))
			y += barH + gap
		}
		y += 14
	}
	fmt.Fprintf(&b, `<svg xmlns="http://www.w3.org/2000/svg" width="%d" height="%d" font-family="sans-serif" font-size="12">`+"\n", width, y)
	fmt.Fprintf(&b, `<rect width="100%%" height="100%%" fill="white"/>`+"\n")
	b.WriteString(body.String())
	b.WriteString("</svg>\n")
	return []byte(b.String())
}

// workloadNumber is the number a workload's name begins with ("10. 20 writers ..."), 0 for none.
func workloadNumber(w string) int {
	n, _ := strconv.Atoi(w[:max(0, strings.Index(w, "."))])
	return n
}
