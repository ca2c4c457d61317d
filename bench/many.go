package main

import (
	"context"
	"errors"
	"fmt"
	"log"
	"sync"
	"sync/atomic"
	"time"

	"github.com/advlock/advlock"
)

var manyNotes = map[string]string{
	rawName:                 "8 dedicated connections shared by the goroutines",
	"raw pgxpool":           "pool of 32",
	"advlock TryLock":       "shared sessions (default 4), pool of 32",
	sessionPerLock:          "TryLock, pool of 32",
	openDefault:             "TryLock, Open's default pool",
	open24:                  "TryLock, Open with a pool of 24",
	leasesName:              "TryLock, leases, pool of 64",
	leasesName + viaBouncer: "TryLock, leases, pool of 64",
}

// many measures one process whose n goroutines each take and release a lock on a key of their own (a lock per
// entity, per request) through one client: raw pgx over 8 dedicated connections (the baseline), raw pgxpool,
// advlock with shared sessions and advlock with a session per lock, and leases (with -only lease). The contenders take turns in 50 ms slices
// until each has run *flagDur. It returns cycles/s.
func many(ctx context.Context, e *env, cs []contender, n int, tag string) map[string]float64 {
	type runner struct {
		name  string
		cycle func(g int) error
		close func()
		count atomic.Int64
		spent time.Duration
		err   error
	}
	var rs []*runner
	raw, err := newRawConns(ctx, e.pgURL, 8)
	if err != nil {
		log.Printf("%s: %v", wMany, err)
		return nil
	}
	rs = append(rs, &runner{name: rawName, close: raw.close, cycle: func(g int) error {
		return raw.cycle(ctx, g, pgKey(fmt.Sprintf("%s-raw-%d", tag, g)))
	}})
	for _, c := range cs {
		if c.name != "raw pgxpool" && c.name != "advlock TryLock" && c.name != sessionPerLock && c.name != openDefault &&
			c.name != open24 && c.name != leasesName && c.name != leasesName+viaBouncer {
			continue
		}
		// Pools of 32 here: every contender is connected at once, within max_connections (100 by default).
		cl, err := c.new(context.WithValue(ctx, poolSizeKey{}, 32))
		if !check(c, wMany, err) {
			continue
		}
		rs = append(rs, &runner{name: c.name, close: cl.close, cycle: func(g int) error {
			var un func(context.Context) error
			var err error
			if a, ok := cl.(*advClient); ok { // TryLock for both advlock contenders
				var lk *advlock.Lock
				lk, err = a.l.TryLock(ctx, advlock.NameKey(fmt.Sprintf("bench-%s-%s-%d", tag, c.name, g)))
				if errors.Is(err, advlock.ErrPoolExhausted) {
					// A session per lock: 256 goroutines over 32 connections. A try does not wait for a
					// connection; the attempt is not a cycle.
					return errNoCycle
				}
				if lk != nil {
					un = lk.Unlock
				}
			} else {
				un, err = cl.lock(ctx, fmt.Sprintf("%s-%s-%d", tag, c.name, g))
			}
			if err == nil {
				err = un(ctx)
			}
			return err
		}})
	}
	defer func() {
		for _, r := range rs {
			r.close()
		}
	}()
	for _, r := range rs { // warm up: connections, shared sessions, prepared statements
		var wg sync.WaitGroup
		for g := range n {
			wg.Add(1)
			go func() {
				defer wg.Done()
				if err := r.cycle(g); err != nil && err != errNoCycle && r.err == nil {
					r.err = err
				}
			}()
		}
		wg.Wait()
	}
	turns := make([]turn, len(rs))
	for i, r := range rs {
		turns[i] = turn{n: n, spent: &r.spent, err: &r.err, cycle: func(g int) error {
			err := r.cycle(g)
			if err == nil {
				r.count.Add(1)
			}
			if err == errNoCycle {
				return nil
			}
			return err
		}}
	}
	takeTurns(turns)
	out := map[string]float64{}
	for _, r := range rs {
		if r.err != nil {
			log.Printf("%s / %s: %v", wMany, r.name, r.err)
			continue
		}
		out[r.name] = float64(r.count.Load()) / r.spent.Seconds()
	}
	return out
}

var oneKeyNotes = map[string]string{
	rawName:        "8 dedicated connections shared by the goroutines, pg_advisory_lock",
	"raw pgxpool":  "pool of 32, pg_advisory_lock",
	"advlock Lock": "Lock, pool of 32",
	"advlock Do":   "Do, pool of 32",
	openDefault:    "Lock, Open's default pool",
	open24:         "Lock, Open with a pool of 24",
}

// oneKeyMany measures one process whose n goroutines all take and release one key, waiting for it, through one
// client: raw pgx over 8 dedicated connections (the baseline: each goroutine waits for its connection, then in
// the server), raw pgxpool, and the blocking advlock contenders that share sessions (in-process hand-off
// behind the Locker's gate). The contenders take turns in 50 ms slices until each has run *flagDur. It returns
// cycles/s and max/min cycles per goroutine.
func oneKeyMany(ctx context.Context, e *env, cs []contender, n int, tag string) map[string]tput {
	type runner struct {
		name   string
		cycle  func(g int) error
		close  func()
		counts []atomic.Int64
		spent  time.Duration
		err    error
	}
	var rs []*runner
	raw, err := newRawConns(ctx, e.pgURL, 8)
	if err != nil {
		log.Printf("%s: %v", wManyOneKey, err)
		return nil
	}
	rawKey := pgKey(tag + "-raw")
	rs = append(rs, &runner{name: rawName, close: raw.close, cycle: func(g int) error { return raw.cycleWait(ctx, g, rawKey) }})
	for _, c := range cs {
		if _, ok := oneKeyNotes[c.name]; !ok || c.name == rawName {
			continue
		}
		cl, err := c.new(context.WithValue(ctx, poolSizeKey{}, 32))
		if !check(c, wManyOneKey, err) {
			continue
		}
		k := tag + "-" + c.name
		rs = append(rs, &runner{name: c.name, close: cl.close, cycle: func(g int) error { return cl.cycle(ctx, k, nil) }})
	}
	defer func() {
		for _, r := range rs {
			r.close()
		}
	}()
	for _, r := range rs {
		r.counts = make([]atomic.Int64, n)
		var wg sync.WaitGroup
		for g := range n { // warm up
			wg.Add(1)
			go func() {
				defer wg.Done()
				if err := r.cycle(g); err != nil && r.err == nil {
					r.err = err
				}
			}()
		}
		wg.Wait()
	}
	turns := make([]turn, len(rs))
	for i, r := range rs {
		turns[i] = turn{n: n, spent: &r.spent, err: &r.err, cycle: func(g int) error {
			err := r.cycle(g)
			if err == nil {
				r.counts[g].Add(1)
			}
			return err
		}}
	}
	takeTurns(turns)
	out := map[string]tput{}
	for _, r := range rs {
		if r.err != nil {
			log.Printf("%s / %s: %v", wManyOneKey, r.name, r.err)
			continue
		}
		var total int64
		lo, hi := r.counts[0].Load(), r.counts[0].Load()
		for i := range r.counts {
			v := r.counts[i].Load()
			total += v
			lo, hi = min(lo, v), max(hi, v)
		}
		fair := 0.0
		if lo > 0 {
			fair = float64(hi) / float64(lo)
		}
		out[r.name] = tput{float64(total) / r.spent.Seconds(), fair}
	}
	return out
}
