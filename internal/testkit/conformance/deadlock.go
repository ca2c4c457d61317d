package conformance

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/advlock/advlock"
	"github.com/jackc/pgx/v5"
)

// caller is one party of a deadlock test: a Locker and the keys it takes, in order, each nested in the last.
type caller struct {
	l    *advlock.Locker
	keys []advlock.Key
	// wait, if set, bounds the waits (advlock.Wait).
	wait        time.Duration
	lead        bool          // the last key is taken by Lead instead of Do
	hold        time.Duration // nested: how long the innermost holds
	sharedFirst bool          // the first key is taken shared (RLock, and Holding for what follows)
	late        time.Duration // how long it waits, once all hold their first key, before it asks for its second
}

// run takes c's keys nested (Do inside Do; Lead for the last key if lead), holding each until the next is asked
// for; every caller asks for its second key only once all hold their first (ready).
func (c caller) run(ctx context.Context, holding chan<- struct{}, ready <-chan struct{}) error {
	var opts []advlock.CallOption
	if c.wait > 0 {
		opts = append(opts, advlock.Wait(c.wait))
	}
	var take func(ctx context.Context, i int) error
	take = func(ctx context.Context, i int) error {
		if i == 0 && c.sharedFirst {
			lk, err := c.l.RLock(ctx, c.keys[0], opts...)
			if err != nil {
				return err
			}
			holding <- struct{}{}
			<-ready
			time.Sleep(c.late)
			err = take(advlock.Holding(ctx, lk), 1)
			if uerr := lk.Unlock(context.WithoutCancel(ctx)); err == nil {
				err = uerr
			}
			return err
		}
		if i == len(c.keys)-1 && c.lead {
			lctx, cancel := context.WithCancel(ctx)
			defer cancel()
			err := c.l.Lead(lctx, c.keys[i], func(context.Context) error { cancel(); return nil })
			if errors.Is(err, context.Canceled) && ctx.Err() == nil {
				return nil // led once
			}
			return err
		}
		return c.l.Do(ctx, c.keys[i], func(ctx context.Context) error {
			if i == 0 {
				holding <- struct{}{}
				<-ready
			}
			if i == len(c.keys)-1 {
				time.Sleep(20 * time.Millisecond)
				return nil
			}
			return take(ctx, i+1)
		}, opts...)
	}
	return take(ctx, 0)
}

// runCycle runs the callers at once and returns their errors and how long after every caller held its first key
// the first one returned.
func runCycle(t *testing.T, callers []caller) ([]error, time.Duration) {
	t.Helper()
	ctx := ctxT(t, 30*time.Second)
	holding, ready := make(chan struct{}, len(callers)), make(chan struct{})
	errs := make([]error, len(callers))
	firstDone := make(chan time.Time, len(callers))
	var wg sync.WaitGroup
	for i, c := range callers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			errs[i] = c.run(ctx, holding, ready)
			firstDone <- time.Now()
		}()
	}
	for range callers {
		<-holding
	}
	formed := time.Now()
	close(ready)
	wg.Wait()
	return errs, (<-firstDone).Sub(formed)
}

// oneVictim checks that exactly one caller failed, with an error matching ErrDeadlock and not context.Canceled,
// and that every other one finished.
func oneVictim(t *testing.T, errs []error) int {
	t.Helper()
	victim := -1
	for i, err := range errs {
		switch {
		case err == nil:
		case errors.Is(err, advlock.ErrDeadlock) && victim < 0:
			victim = i
			if errors.Is(err, context.Canceled) || errors.Is(err, context.DeadlineExceeded) {
				t.Errorf("the victim's error also matches a context error: %v", err)
			}
		default:
			t.Errorf("caller %d: %v", i, err)
		}
	}
	if victim < 0 {
		t.Fatalf("no caller got ErrDeadlock: %v", errs)
	}
	return victim
}

func noneHeld(t *testing.T, obs *pgx.Conn, keys ...advlock.Key) {
	t.Helper()
	for _, k := range keys {
		waitFree(t, obs, k)
	}
}

// deadlock: a cycle of waits through advlock's own locks ends in ErrDeadlock for exactly one of its waits, whatever
// mix of Lockers (processes) and in-process waits forms it, and the others then proceed; pg_locks then shows
// neither holder nor waiter. A Locker reads the lock graph only while a wait whose caller holds a lock waits.
func (s *suite) deadlock(t *testing.T) {
	keys := func(n int) []advlock.Key {
		ks := make([]advlock.Key, n)
		for i := range ks {
			ks[i] = Key(t)
		}
		return ks
	}
	for _, tc := range []struct {
		name    string
		lockers int   // distinct Lockers
		on      []int // caller i uses Locker on[i]
		wait    time.Duration
		lead    bool
	}{
		{name: "two lockers", lockers: 2, on: []int{0, 1}},
		{name: "three lockers", lockers: 3, on: []int{0, 1, 2}},
		{name: "one locker", lockers: 1, on: []int{0, 0}},
		{name: "in-process and across", lockers: 2, on: []int{0, 0, 1}},
		// Two callers of each Locker wait for keys held in their own process: before such waits went to the
		// server, each waited in its Locker's gate, and neither Locker saw the other's half of the cycle.
		{name: "gates of two lockers", lockers: 2, on: []int{0, 0, 1, 1}},
		{name: "timed waits", lockers: 2, on: []int{0, 1}, wait: time.Minute},
		{name: "lead", lockers: 2, on: []int{0, 1}, lead: true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel() // each its own keys, Lockers and observer
			obs := s.observer(t)
			hs := make([]Harness, tc.lockers)
			for i := range hs {
				hs[i] = s.open(t)
			}
			ks := keys(len(tc.on))
			callers := make([]caller, len(tc.on))
			for i, li := range tc.on {
				callers[i] = caller{l: hs[li].L, keys: []advlock.Key{ks[i], ks[(i+1)%len(ks)]}, wait: tc.wait, lead: tc.lead}
			}
			errs, took := runCycle(t, callers)
			v := oneVictim(t, errs)
			t.Logf("caller %d gave up %v after the cycle formed: %v", v, took.Round(time.Millisecond), errs[v])
			noneHeld(t, obs, ks...)
			var found int64
			for _, h := range hs {
				found += h.L.Stats().Deadlocks
			}
			if found != 1 {
				t.Errorf("Stats report %d deadlocks, want 1", found)
			}
		})
	}

	// Two cycles through one wait: caller 0 holds A shared and waits for B, which callers 1 and 2 hold shared, and
	// each of them waits for A. Ending caller 0's wait breaks both cycles; ending the least wait of each cycle (as
	// before) ended two callers whenever caller 0's wait's pid was not the lowest of the three, as here.
	t.Run("two cycles, one victim", func(t *testing.T) {
		t.Parallel()
		obs := s.observer(t)
		ks := keys(2)
		a, b := ks[0], ks[1]
		// Caller 0 waits last, on the newest session: its pid is not the lowest (the least of each cycle).
		callers := []caller{
			{l: s.open(t).L, keys: []advlock.Key{a, b}, sharedFirst: true, late: 100 * time.Millisecond},
			{l: s.open(t).L, keys: []advlock.Key{b, a}, sharedFirst: true},
			{l: s.open(t).L, keys: []advlock.Key{b, a}, sharedFirst: true},
		}
		errs, took := runCycle(t, callers)
		if v := oneVictim(t, errs); v != 0 {
			t.Errorf("caller %d gave up; caller 0, whose wait both cycles pass through, should have", v)
		}
		t.Logf("gave up %v after the cycles formed: %v", took.Round(time.Millisecond), errs)
		noneHeld(t, obs, ks...)
	})

	// A cycle through a writer's intent (a reader held back by a writer that waits), across Lockers and within one.
	t.Run("through an intent", func(t *testing.T) { t.Parallel(); s.cycleThroughIntent(t, false) })
	t.Run("through an intent, one locker", func(t *testing.T) { t.Parallel(); s.cycleThroughIntent(t, true) })

	t.Run("no readings without a wait", func(t *testing.T) {
		t.Parallel()
		h, obs := s.open(t), s.observer(t)
		ctx := ctxT(t, 30*time.Second)
		ks := keys(3)
		// A watched wait's first reading comes 0.5 s into it, the next ones at least 0.75 s apart. A wait granted at
		// once causes none; on a loaded machine taking its session may itself outlast 0.5 s, and such a wait may be
		// read: allowed is what the waits' lengths (measured from before each call, so never shorter) permit.
		allowed := int64(0)
		for range 20 { // nested, uncontended: each inner Lock is a watched wait granted at once
			err := h.L.Do(ctx, ks[0], func(ctx context.Context) error {
				start := time.Now()
				return h.L.Do(ctx, ks[1], func(ctx context.Context) error {
					if d := time.Since(start); d >= 500*time.Millisecond {
						allowed += 1 + int64((d-500*time.Millisecond)/(750*time.Millisecond))
					}
					return nil
				})
			})
			if err != nil {
				t.Fatal(err)
			}
		}
		time.Sleep(time.Second) // past the first reading a watched wait would have caused
		if st := h.L.Stats(); st.GraphReadings > allowed {
			t.Errorf("%d readings of the lock graph with no wait that lasted (the waits' lengths allow %d)", st.GraphReadings, allowed)
		} else if allowed > 0 {
			t.Logf("%d readings; waits slow enough to be read allowed %d", st.GraphReadings, allowed)
		}
		// A watched wait that lasts: about one reading a second, never more than one per 0.75 s, plus a
		// confirming one for each cycle seen (none here).
		other := s.open(t)
		blocker, err := other.L.Lock(ctx, ks[2])
		if err != nil {
			t.Fatal(err)
		}
		start := time.Now()
		wctx, cancel := context.WithTimeout(ctx, 3*time.Second)
		err = h.L.Do(wctx, ks[0], func(ctx context.Context) error {
			_, err := h.L.Lock(ctx, ks[2])
			return err
		})
		cancel()
		if !errors.Is(err, context.DeadlineExceeded) {
			t.Fatalf("the wait ended with %v, want its deadline", err)
		}
		elapsed := time.Since(start)
		n := h.L.Stats().GraphReadings
		if limit := int64(elapsed/(750*time.Millisecond)) + 1; n < 1 || n > limit {
			t.Errorf("%d readings in %v of waiting, want 1 to %d", n, elapsed.Round(time.Millisecond), limit)
		}
		if err := blocker.Unlock(ctx); err != nil {
			t.Fatal(err)
		}
		noneHeld(t, obs, ks...)
	})

	t.Run("consistent order", func(t *testing.T) {
		t.Parallel()
		obs := s.observer(t)
		// Many callers take several keys, always in one order, holding each long enough that waits last past the
		// first reading of the lock graph, for seconds: never ErrDeadlock.
		// Two callers per Locker: each holds up to four locks and waits for a fifth, which a pool of eight
		// connections gives even with a session per lock (more callers would wait for connections instead).
		// With shared sessions, two of them: four (the default), two waits, a reading of the lock graph and a new
		// connection's proof, which needs a second free connection, would take the whole pool of eight, and the
		// proof gave up after 2 s on a loaded machine (ErrUnverified).
		var opts []advlock.Option
		if s.shared {
			opts = append(opts, advlock.WithSharedSessions(2))
		}
		lockers := 4
		if s.be.Pooled {
			// Two Lockers, four callers: behind PgBouncer in session mode every client connection takes one of
			// its 60 server connections, which both drivers' suites share at once, and a new connection's proof
			// that waited for one ran past its 10 s bound (twice in CI: "check session: no answer within 10s").
			lockers = 2
		}
		var hs []Harness
		for range lockers {
			hs = append(hs, s.open(t, opts...))
		}
		ks := keys(4)
		ctx := ctxT(t, 60*time.Second)
		stop := time.Now().Add(3 * time.Second)
		var wg sync.WaitGroup
		errc := make(chan error, 64)
		var mu sync.Mutex
		rounds := 0
		for i := range 2 * len(hs) {
			wg.Add(1)
			go func() {
				defer wg.Done()
				h, own := hs[i%len(hs)], Key(t)
				for j := 0; time.Now().Before(stop); j++ {
					// a key of its own first (so that every later wait is one whose caller holds a lock, which
					// the detection watches), then three of the four keys, always in the order of ks
					take := []advlock.Key{own}
					for _, k := range ks {
						if k != ks[(i+j)%4] {
							take = append(take, k)
						}
					}
					c := caller{l: h.L, keys: take, hold: time.Duration(100+(i*37+j*53)%300) * time.Millisecond}
					if err := c.nested(ctx); err != nil {
						errc <- fmt.Errorf("caller %d: %w", i, err)
						return
					}
					mu.Lock()
					rounds++
					mu.Unlock()
				}
			}()
		}
		wg.Wait()
		close(errc)
		for err := range errc {
			t.Error(err)
		}
		var readings int64
		for _, h := range hs {
			readings += h.L.Stats().GraphReadings
		}
		t.Logf("%d rounds, %d readings of the lock graph", rounds, readings)
		if readings == 0 {
			t.Error("no reading of the lock graph: no wait lasted; the test proves nothing")
		}
		noneHeld(t, obs, ks...)
	})
}

// nested takes c's keys one inside the other without waiting for other callers.
func (c caller) nested(ctx context.Context) error {
	var take func(ctx context.Context, i int) error
	take = func(ctx context.Context, i int) error {
		if i == len(c.keys) {
			time.Sleep(c.hold)
			return nil
		}
		return c.l.Do(ctx, c.keys[i], func(ctx context.Context) error { return take(ctx, i+1) })
	}
	return take(ctx, 0)
}
