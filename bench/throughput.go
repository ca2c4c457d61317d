package main

import (
	"context"
	"fmt"
	"time"
)

type tput struct{ ops, fair float64 }

// throughput measures every contender on one workload: n goroutines each, each its own client (a separate
// process, say), taking and releasing a lock; one key for all with sameKey (blocking contenders only), else one
// key each. The contenders take turns in 50 ms slices until each has run *flagDur, so that they share the
// machine's weather. It returns cycles/s and max/min cycles per goroutine.
func throughput(ctx context.Context, cs []contender, n int, sameKey bool, tag string) map[string]tput {
	type runner struct {
		c      contender
		cl     []client
		close  func()
		counts []int64
		spent  time.Duration
		err    error
	}
	var rs []*runner
	for _, c := range cs {
		if sameKey && !c.blocking {
			continue
		}
		cl, closeAll, err := newClients(ctx, c, n)
		if !check(c, "throughput", err) {
			continue
		}
		rs = append(rs, &runner{c: c, cl: cl, close: closeAll, counts: make([]int64, n)})
	}
	defer func() {
		for _, r := range rs {
			r.close()
		}
	}()
	key := func(r *runner, g int) string {
		if sameKey {
			return tag + "-" + r.c.name
		}
		return fmt.Sprintf("%s-%s-%d", tag, r.c.name, g)
	}
	cycle := func(r *runner, g int) error { return r.cl[g].cycle(ctx, key(r, g), nil) }
	for _, r := range rs { // warm up: connections, prepared statements
		for g := range r.cl {
			for range 3 {
				if err := cycle(r, g); err != nil && r.err == nil {
					r.err = err
				}
			}
		}
		if sameKey && r.err == nil {
			// and one uncounted turn of the workload itself, so that every client has opened what waiting takes (a
			// session of its own for advlock) before the counting starts: a client that connects while the others
			// cycle is counted as starved by its own start.
			if _, err := runTurn(len(r.cl), func(g int) error { return cycle(r, g) }, 100*time.Millisecond); err != nil {
				r.err = err
			}
		}
	}
	turns := make([]turn, len(rs))
	for i, r := range rs {
		turns[i] = turn{n: len(r.cl), spent: &r.spent, err: &r.err, cycle: func(g int) error {
			err := cycle(r, g)
			if err == nil {
				r.counts[g]++
			}
			return err
		}}
	}
	takeTurns(turns)
	out := map[string]tput{}
	for _, r := range rs {
		if !check(r.c, "throughput", r.err) {
			continue
		}
		var total int64
		lo, hi := r.counts[0], r.counts[0]
		for _, v := range r.counts {
			total += v
			lo, hi = min(lo, v), max(hi, v)
		}
		fair := 0.0
		if lo > 0 {
			fair = float64(hi) / float64(lo)
		}
		out[r.c.name] = tput{float64(total) / r.spent.Seconds(), fair}
	}
	return out
}
