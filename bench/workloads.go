package main

import (
	"context"
	"fmt"
	"log"
	"slices"
	"sync"
	"time"
)

const (
	wUncontended = "1. uncontended, 1 goroutine"
	wDistinct    = "2. 8 goroutines, distinct keys"
	wOneKey      = "3. 8 goroutines, one key"
	wHandoff     = "4. handoff latency"
	wLoss        = "5. loss noticed"
	wMemory      = "6. client memory"
	wMany        = "7. 256 goroutines, one process, distinct keys"
	wManyOneKey  = "8. 256 goroutines, one process, one key"
	wWAL         = "9. WAL written"
	wWriters     = "10. 20 writers holding 100 ms, one key"
)

const rawName = "raw pgx (dedicated conn)"

// collector gathers one value per round for each (workload, contender, metric).
type collector struct {
	mu      sync.Mutex
	order   []string
	samples map[string]*result
}

func (c *collector) add(w, who, metric, unit string, v float64, note string) {
	c.mu.Lock()
	defer c.mu.Unlock()
	id := w + "|" + who + "|" + metric + "|" + unit
	r := c.samples[id]
	if r == nil {
		r = &result{Workload: w, Contender: who, Metric: metric, Unit: unit, Note: note}
		c.samples[id] = r
		c.order = append(c.order, id)
	}
	r.values = append(r.values, v)
}

func run(ctx context.Context, e *env, cs []contender) *results {
	col := &collector{samples: map[string]*result{}}
	for round := 1; round <= *flagRounds; round++ {
		log.Printf("round %d of %d", round, *flagRounds)
		// Each round starts with a different contender, so that no one always runs first (or last).
		order := append(slices.Clone(cs[(round-1)%len(cs):]), cs[:(round-1)%len(cs)]...)
		tag := fmt.Sprintf("r%d-%d", round, time.Now().UnixNano())
		for _, w := range []struct {
			name    string
			n       int
			sameKey bool
		}{{wUncontended, 1, false}, {wDistinct, 8, false}, {wOneKey, 8, true}} {
			for name, tp := range throughput(ctx, order, w.n, w.sameKey, tag+"-"+w.name[:1]) {
				col.add(w.name, name, "throughput", "cycles/s", tp.ops, "")
				if w.sameKey {
					col.add(w.name, name, "fairness (max/min per goroutine)", "x", tp.fair, "")
				}
			}
		}
		for name, lat := range handoffs(ctx, order, tag+"-w4") {
			col.add(wHandoff, name, "p50", "ms", ms(percentile(lat, 50)), "")
			col.add(wHandoff, name, "p99", "ms", ms(percentile(lat, 99)), "")
		}
		for _, c := range order {
			tag := fmt.Sprintf("r%d-%s-%d", round, c.name, time.Now().UnixNano())
			if b, a, err := memory(ctx, c, tag+"-w6"); check(c, wMemory, err) {
				col.add(wMemory, c.name, "per acquire+release", "B/op", b, "")
				col.add(wMemory, c.name, "per acquire+release", "allocs/op", a, "")
			}
		}
		loss(ctx, e, col, round, hasLeases(cs))
		if hasLeases(cs) {
			leaseWAL(ctx, e, cs, col, tag+"-wal")
		}
		for name, ops := range many(ctx, e, cs, 256, tag+"-m") {
			col.add(wMany, name, "throughput", "cycles/s", ops, manyNotes[name])
		}
		for name, r := range writers(ctx, cs, tag+"-q") {
			col.add(wWriters, name, "fairness (max/min grants per writer)", "x", r.fair, "")
			col.add(wWriters, name, "longest wait", "ms", ms(r.longest), "")
		}
		for name, tp := range oneKeyMany(ctx, e, cs, 256, tag+"-o") {
			col.add(wManyOneKey, name, "throughput", "cycles/s", tp.ops, oneKeyNotes[name])
			col.add(wManyOneKey, name, "fairness (max/min per goroutine)", "x", tp.fair, "")
		}
	}
	held(ctx, e, cs, col)
	if hasLeases(cs) {
		leasesHeld(ctx, e, col)
		leasesSwept(ctx, e, col)
	}
	return collate(col, cs)
}

func check(c contender, w string, err error) bool {
	if err != nil {
		log.Printf("%s / %s: %v", w, c.name, err)
		return false
	}
	return true
}
