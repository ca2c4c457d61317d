package advlock

import (
	"context"
	"errors"
	"sync"
	"testing"
	"time"

	"github.com/advlock/advlock/internal/testkit/pgtest"
	"github.com/jackc/pgx/v5/pgxpool"
)

// A cycle of waits that holds every connection of a Locker from Open but the one it keeps: A's four callers each
// hold a key on A's shared session and wait for a key B's callers hold; B's four callers each hold that key and wait
// for the next of A's. A has 3 sessions of their own, so three of its waits wait in the server and the fourth in
// the process, for a session to wait on. A's readings (on the kept connection) see the whole cycle, with that
// fourth wait as a wait for its key's holder; exactly one wait gives up (ErrDeadlock: the fourth, the only one no
// other process can see), and every other caller gets its key. pg_locks shows nothing left afterwards.
func TestDeadlockBudgetSpent(t *testing.T) {
	url := pgtest.URL(t)
	app := appName(t, "cycle")
	a := openApp(t, url, app, "")
	b := New(pgtest.Pool(t, url, func(c *pgxpool.Config) { c.MaxConns = 12 }))
	defer b.Close()
	obs := pgtest.Conn(t, url)
	ctx := ctxT(t, 60*time.Second)
	const n = 4
	ks, ms := make([]Key, n), make([]Key, n)
	for i := range n {
		ks[i], ms[i] = key(t), key(t)
	}
	smp := sample(t, url, app)
	var holding sync.WaitGroup // every caller holds its first key before any waits for its second
	holding.Add(2 * n)
	var wg sync.WaitGroup
	errs := make([]error, 2*n)
	for i := range n {
		wg.Add(2)
		go func() { // A's caller i: holds ks[i], waits for ms[i]
			defer wg.Done()
			errs[i] = a.Do(ctx, ks[i], func(ctx context.Context) error {
				holding.Done()
				holding.Wait()
				return a.Do(ctx, ms[i], func(context.Context) error { return nil })
			})
		}()
		go func() { // B's caller i: holds ms[i], waits for ks[i+1]
			defer wg.Done()
			errs[n+i] = b.Do(ctx, ms[i], func(ctx context.Context) error {
				holding.Done()
				holding.Wait()
				return b.Do(ctx, ks[(i+1)%n], func(context.Context) error { return nil })
			})
		}()
	}
	done := make(chan struct{})
	go func() { wg.Wait(); close(done) }()
	sawQueued := false
	for waiting := true; waiting; {
		select {
		case <-done:
			waiting = false
		case <-time.After(5 * time.Millisecond):
			if a.Stats().WaitingForSession > 0 {
				sawQueued = true
			}
		}
	}
	peak := smp.end(t)
	st := a.Stats()
	t.Logf("A: %+v; the server showed at most %d sessions of A", st, peak[app])
	dead := 0
	for i, err := range errs {
		switch {
		case errors.Is(err, ErrDeadlock):
			dead++
			t.Logf("caller %d: %v", i, err)
			if i >= n {
				t.Errorf("B's caller %d gave up; want A's wait for a session of its own to", i-n)
			}
		case err != nil:
			t.Errorf("caller %d: %v, want its keys or ErrDeadlock", i, err)
		}
	}
	if dead != 1 {
		t.Errorf("%d waits ended with ErrDeadlock, want exactly one", dead)
	}
	if !sawQueued {
		t.Errorf("no wait of A queued for a session of its own: the cycle did not spend the budget")
	}
	if peak[app] > DefaultOpenConns || st.PeakConns > DefaultOpenConns {
		t.Errorf("A used %d connections (Stats: %d), want at most %d", peak[app], st.PeakConns, DefaultOpenConns)
	}
	if st.Deadlocks != 1 || st.GraphReadings == 0 {
		t.Errorf("A's Stats: %d deadlocks, %d readings; want 1, and readings", st.Deadlocks, st.GraphReadings)
	}
	for _, k := range append(ks, ms...) {
		v, _ := k.Int64()
		pgtest.WaitFree(t, obs, v, 10*time.Second)
	}
}

// Ping, Inspect, Leader and LockTable on a Locker from Open whose sessions of their own are all waiting in the
// server answer at once, on the connection kept for them; when that one is taken too, they wait for a connection,
// as long as ctx allows (a deadline error), and answer once one is free. Stats().Conns matches the server's count.
func TestReadsWithBudgetSpent(t *testing.T) {
	url := pgtest.URL(t)
	b := setup(t)
	app := appName(t, "reads")
	l := openApp(t, url, app, "")
	ctx := ctxT(t, 30*time.Second)
	if _, err := l.TryLock(ctx, key(t)); err != nil { // the shared session
		t.Fatal(err)
	}
	wctx, cancelWaits := context.WithCancel(ctx)
	var waits sync.WaitGroup
	for range 3 { // every session of its own waits in the server
		k := key(t)
		if _, err := b.l.Lock(ctx, k); err != nil {
			t.Fatal(err)
		}
		waits.Add(1)
		go func() {
			defer waits.Done()
			_, _ = l.Lock(wctx, k)
		}()
	}
	defer func() { cancelWaits(); waits.Wait() }()
	waitStats(t, l, "3 Locks waiting in the server", func(st Stats) bool { return st.WaitingInServer == 3 })
	st := l.Stats()
	if n, err := sessionsOf(ctx, b.obs, app); err != nil || n != st.Conns || st.Conns != 4 {
		t.Errorf("the server shows %d sessions (%v), Stats %+v: want 4 (1 shared, 3 waits) on both", n, err, st)
	}
	reads := map[string]func(ctx context.Context) error{
		"Ping":      l.Ping,
		"Inspect":   func(ctx context.Context) error { _, err := l.Inspect(ctx); return err },
		"Leader":    func(ctx context.Context) error { _, _, err := l.Leader(ctx, key(t)); return err },
		"LockTable": func(ctx context.Context) error { _, err := l.LockTable(ctx); return err },
	}
	for name, read := range reads {
		rctx, cancel := context.WithTimeout(ctx, 2*time.Second)
		if err := read(rctx); err != nil {
			t.Errorf("%s with every session of its own waiting: %v", name, err)
		}
		cancel()
	}
	if st := l.Stats(); st.Conns != 4 || st.PeakConns != 5 {
		t.Errorf("after the reads: Stats %+v, want 4 connections now and 5 at most (each read took the kept one)", st)
	}
	kept, err := l.pool.Acquire(ctx) // the last connection
	if err != nil {
		t.Fatal(err)
	}
	for name, read := range reads {
		rctx, cancel := context.WithTimeout(ctx, 200*time.Millisecond)
		err := read(rctx)
		cancel()
		if !errors.Is(err, context.DeadlineExceeded) {
			t.Errorf("%s with no connection free: %v, want it to wait until its deadline", name, err)
		}
	}
	res := make(chan error, 1)
	go func() { res <- l.Ping(ctx) }()
	time.Sleep(50 * time.Millisecond)
	kept.Release()
	if err := <-res; err != nil {
		t.Errorf("Ping waiting for a connection, given one: %v", err)
	}
}
