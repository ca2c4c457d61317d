package main

import (
	"context"
	"fmt"
	"time"
)

// handoffWarmup is how many handoffs each contender makes, uncounted, before its samples: a fresh client opens its
// connections (raw pgx's is connected before it starts; advlock opens its shared session on the first call and a
// session of its own for the first wait), which is a client's start, not a handoff.
const handoffWarmup = 2

// handoffs measures workload 4 for every blocking contender: each with a holder and a waiter of its own, the
// contenders taking turns one sample at a time, so that all of them share the machine's weather.
func handoffs(ctx context.Context, cs []contender, tag string) map[string][]time.Duration {
	type pair struct {
		c              contender
		holder, waiter client
		n              int
		lat            []time.Duration
		err            error
	}
	var ps []*pair
	for _, c := range cs {
		if !c.blocking {
			continue
		}
		cl, closeAll, err := newClients(ctx, c, 2)
		if !check(c, wHandoff, err) {
			continue
		}
		defer closeAll()
		n := *flagHandoffs
		if !c.pg || c.polls {
			n = 20
		}
		ps = append(ps, &pair{c: c, holder: cl[0], waiter: cl[1], n: n + handoffWarmup})
	}
	for i := 0; ; i++ {
		more := false
		for _, p := range ps {
			if p.err != nil || i >= p.n {
				continue
			}
			more = true
			d, err := handoff(ctx, p.holder, p.waiter, fmt.Sprintf("%s-%s-%d", tag, p.c.name, i))
			if err != nil {
				p.err = err
				check(p.c, wHandoff, err)
				continue
			}
			if i >= handoffWarmup {
				p.lat = append(p.lat, d)
			}
		}
		if !more {
			break
		}
	}
	out := map[string][]time.Duration{}
	for _, p := range ps {
		if p.err == nil {
			out[p.c.name] = p.lat
		}
	}
	return out
}

// handoff is one sample of workload 4: the time from the holder's release call to the blocked waiter's grant.
func handoff(ctx context.Context, holder, waiter client, key string) (time.Duration, error) {
	un, err := holder.lock(ctx, key)
	if err != nil {
		return 0, err
	}
	type grant struct {
		at  time.Time
		err error
	}
	got := make(chan grant, 1)
	go func() { // the waiter takes the key as its API is called (one Do for advlock Do) and releases it
		var at time.Time
		err := waiter.cycle(ctx, key, func() { at = time.Now() })
		got <- grant{at, err}
	}()
	time.Sleep(10 * time.Millisecond) // the waiter is queued (or polling) by now
	t0 := time.Now()
	if err := un(ctx); err != nil {
		return 0, err // the waiter may wait on: the run reports the error and ends this contender's samples
	}
	g := <-got
	if g.err != nil {
		return 0, g.err
	}
	return g.at.Sub(t0), nil
}
