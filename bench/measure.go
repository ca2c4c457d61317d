package main

import (
	"context"
	"errors"
	"slices"
	"sort"
	"sync"
	"sync/atomic"
	"time"
)

func ms(d time.Duration) float64 { return float64(d.Microseconds()) / 1000 }

func percentile(d []time.Duration, p int) time.Duration {
	if len(d) == 0 {
		return 0
	}
	s := slices.Clone(d)
	slices.Sort(s)
	i := (len(s)*p + 99) / 100
	if i > 0 {
		i--
	}
	return s[i]
}

func newClients(ctx context.Context, c contender, n int) ([]client, func(), error) {
	var cl []client
	closeAll := func() {
		for _, x := range cl {
			x.close()
		}
	}
	for range n {
		x, err := c.new(ctx)
		if err != nil {
			closeAll()
			return nil, nil, err
		}
		cl = append(cl, x)
	}
	return cl, closeAll, nil
}

func median(v []float64) float64 {
	s := slices.Clone(v)
	sort.Float64s(s)
	if len(s)%2 == 1 {
		return s[len(s)/2]
	}
	return (s[len(s)/2-1] + s[len(s)/2]) / 2
}

// errNoCycle marks an attempt that did no work and is not counted (and is no failure).
var errNoCycle = errors.New("no cycle")

// turn is one contender's part in takeTurns: n goroutines running cycle.
type turn struct {
	n     int
	cycle func(g int) error // one cycle of goroutine g; counts its own successes
	spent *time.Duration    // time run so far
	err   *error            // the first failure; the contender then sits out
}

// takeTurns runs the contenders in 50 ms slices, one after another, until each has run *flagDur, so that they
// share the machine's weather.
func takeTurns(ts []turn) {
	const slice = 50 * time.Millisecond
	for spent := time.Duration(0); spent < *flagDur; spent += slice {
		for _, t := range ts {
			if *t.err != nil {
				continue
			}
			d, err := runTurn(t.n, t.cycle, slice)
			*t.spent += d
			if err != nil {
				*t.err = err
			}
		}
	}
}

// runTurn runs cycle on n goroutines at once until d has passed, and returns how long that took (the last cycle
// ends past d) and the first error.
func runTurn(n int, cycle func(g int) error, d time.Duration) (time.Duration, error) {
	var wg sync.WaitGroup
	var failed atomic.Value
	start := time.Now()
	stop := start.Add(d)
	for g := range n {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for time.Now().Before(stop) {
				if err := cycle(g); err != nil {
					failed.Store(err)
					return
				}
			}
		}()
	}
	wg.Wait()
	err, _ := failed.Load().(error)
	return time.Since(start), err
}
