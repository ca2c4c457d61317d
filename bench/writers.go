package main

import (
	"context"
	"errors"
	"slices"
	"sync"
	"time"
)

// writersOf are the contenders of the writers workload: PostgreSQL's own queue and advlock's sliced waits.
var writersOf = map[string]bool{rawName: true, "advlock Lock": true, openDefault: true}

const (
	writersN    = 20
	writersHold = 100 * time.Millisecond
	writersRun  = 10 * time.Second // five turns of every writer: counts one apart are 1.2x
)

type writersResult struct {
	fair    float64
	longest time.Duration
}

// writers measures writersN writers, each through a client of its own (as writers in as many processes), taking
// one key in turn and holding it writersHold, for writersRun: max/min grants per writer, and the longest wait
// (each writer's first, behind the start, not counted). Waits longer than advlock's slice (0.9 s) must keep their
// place across slices for these to match PostgreSQL's queue.
func writers(ctx context.Context, cs []contender, tag string) map[string]writersResult {
	out := map[string]writersResult{}
	for _, c := range cs {
		if !writersOf[c.name] {
			continue
		}
		clients := make([]client, writersN)
		var err error
		for i := range clients {
			if clients[i], err = c.new(ctx); err != nil {
				break
			}
		}
		closeAll := func() {
			for _, cl := range clients {
				if cl != nil {
					cl.close()
				}
			}
		}
		if !check(c, wWriters, err) {
			closeAll()
			continue
		}
		key := tag + "-" + c.name
		// Warm up, uncounted: every client takes the key in turn once, each waiting for the others, so that each has
		// opened what waiting takes (connections, checks, a session of its own for advlock) before the counting
		// starts, as raw pgx's connections are made: a client that connects while the others take turns joins the
		// line late, and is counted as passed over by its own start.
		warmErrs := make([]error, writersN)
		var warm sync.WaitGroup
		for i, cl := range clients {
			warm.Add(1)
			go func() {
				defer warm.Done()
				warmErrs[i] = cl.cycle(ctx, key+"-warm", func() { time.Sleep(5 * time.Millisecond) })
			}()
		}
		warm.Wait()
		if err == nil {
			err = errors.Join(warmErrs...)
		}
		if !check(c, wWriters, err) {
			closeAll()
			continue
		}
		counts := make([]int, writersN)
		longest := make([]time.Duration, writersN)
		errs := make([]error, writersN)
		stop := time.Now().Add(writersRun)
		var wg sync.WaitGroup
		for i, cl := range clients {
			wg.Add(1)
			go func() {
				defer wg.Done()
				for first := true; time.Now().Before(stop); first = false {
					began := time.Now()
					un, err := cl.lock(ctx, key)
					if err != nil {
						errs[i] = err
						return
					}
					if !first {
						longest[i] = max(longest[i], time.Since(began))
					}
					counts[i]++
					time.Sleep(writersHold)
					if err := un(ctx); err != nil {
						errs[i] = err
						return
					}
				}
			}()
		}
		wg.Wait()
		closeAll()
		if err := errors.Join(errs...); !check(c, wWriters, err) {
			continue
		}
		fair := 0.0
		if lo := slices.Min(counts); lo > 0 {
			fair = float64(slices.Max(counts)) / float64(lo)
		}
		out[c.name] = writersResult{fair, slices.Max(longest)}
	}
	return out
}
