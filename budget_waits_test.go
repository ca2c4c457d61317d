package advlock

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/advlock/advlock/internal/config"
	"github.com/advlock/advlock/internal/session"
	"github.com/advlock/advlock/internal/testkit/pgtest"
)

// Two Lockers from Open, as two processes of a service, 100 goroutines each waiting for 50 keys (200 in all): the
// server never shows either with more sessions than its budget (DefaultOpenConns), its Stats agree, the calls
// waited for sessions of their own in the process (the budget bound), and every wait was granted: nobody failed
// for want of a connection. pg_locks shows nothing left afterwards.
func TestOpenBudget(t *testing.T) {
	url := pgtest.URL(t)
	apps := []string{appName(t, "budget-a"), appName(t, "budget-b")}
	ls := []*Locker{openApp(t, url, apps[0], ""), openApp(t, url, apps[1], "")}
	obs := pgtest.Conn(t, url)
	ctx := ctxT(t, 90*time.Second)
	keys := make([]Key, 50)
	for i := range keys {
		keys[i] = key(t)
	}
	smp := sample(t, url, apps...)
	var queued, inServer atomic.Int64 // the most seen at once, from Stats
	watchStats := make(chan struct{})
	var statsWG sync.WaitGroup
	statsWG.Add(1)
	go func() {
		defer statsWG.Done()
		for {
			select {
			case <-watchStats:
				return
			case <-time.After(time.Millisecond):
			}
			for _, l := range ls {
				st := l.Stats()
				if st.Conns > DefaultOpenConns || st.PeakConns > DefaultOpenConns {
					t.Errorf("Stats past the budget: %+v", st)
				}
				queued.Store(max(queued.Load(), int64(st.WaitingForSession)))
				inServer.Store(max(inServer.Load(), int64(st.WaitingInServer)))
			}
		}
	}()
	const rounds = 6
	var grants atomic.Int64
	var wg sync.WaitGroup
	errs := make(chan error, 200*rounds)
	for g := range 200 {
		l := ls[g%2]
		wg.Add(1)
		go func() {
			defer wg.Done()
			for r := range rounds {
				k := keys[(g/2+r*7)%len(keys)]
				err := l.Do(ctx, k, func(ctx context.Context) error {
					time.Sleep(2 * time.Millisecond)
					return nil
				})
				if err != nil {
					errs <- fmt.Errorf("goroutine %d, round %d: %w", g, r, err)
					continue
				}
				grants.Add(1)
			}
		}()
	}
	wg.Wait()
	close(watchStats)
	statsWG.Wait()
	peak := smp.end(t)
	close(errs)
	for err := range errs {
		t.Error(err)
	}
	for i, l := range ls {
		st := l.Stats()
		t.Logf("%s: server peak %d sessions; Stats %+v", apps[i], peak[apps[i]], st)
		if peak[apps[i]] > DefaultOpenConns {
			t.Errorf("%s: the server showed %d sessions at once, want at most %d", apps[i], peak[apps[i]], DefaultOpenConns)
		}
		if st.MaxOwnSessions != 3 || st.Pool.Max != DefaultOpenConns || st.SharedSessions > 1 {
			t.Errorf("%s: Stats %+v, want 3 sessions of their own at most, in a pool of %d, 1 shared session", apps[i],
				st, DefaultOpenConns)
		}
	}
	t.Logf("%d grants; at most %d waits queued for a session of their own, %d waiting in the server", grants.Load(),
		queued.Load(), inServer.Load())
	if grants.Load() != 200*rounds {
		t.Errorf("%d grants, want %d", grants.Load(), 200*rounds)
	}
	if queued.Load() == 0 {
		t.Errorf("no wait ever queued for a session of its own: the budget was never reached")
	}
	for _, k := range keys {
		v, _ := k.Int64()
		pgtest.WaitFree(t, obs, v, 10*time.Second)
	}
}

// A wait queued for a session of its own takes its key on a shared session once the key is free, while the
// sessions of their own stay busy: with a pool of 3 (1 shared session, 1 kept, 1 of its own), one Lock waits in
// the server for a key held elsewhere, a second one queues in the process; when the other holder lets the second
// key go, the queued Lock gets it without a session of its own.
func TestQueuedWaitTakesFreedKey(t *testing.T) {
	url := pgtest.URL(t)
	b := setup(t)
	l := openApp(t, url, appName(t, "queued"), "pool_max_conns=3")
	ctx := ctxT(t, 30*time.Second)
	x, y := key(t), key(t)
	hx, err := b.l.Lock(ctx, x)
	if err != nil {
		t.Fatal(err)
	}
	defer hx.Unlock(ctx)
	hy, err := b.l.Lock(ctx, y)
	if err != nil {
		t.Fatal(err)
	}
	if lk, err := l.TryLock(ctx, key(t)); err != nil { // opens the shared session
		t.Fatal(err)
	} else if err := lk.Unlock(ctx); err != nil {
		t.Fatal(err)
	}
	xctx, cancelX := context.WithCancel(ctx)
	defer cancelX()
	xerr := make(chan error, 1)
	go func() { _, err := l.Lock(xctx, x); xerr <- err }() // takes the one session of its own
	waitStats(t, l, "the first Lock waiting in the server", func(st Stats) bool { return st.WaitingInServer == 1 })
	got := make(chan *Lock, 1)
	yerr := make(chan error, 1)
	go func() {
		lk, err := l.Lock(ctx, y)
		if err != nil {
			yerr <- err
			return
		}
		got <- lk
	}()
	waitStats(t, l, "the second Lock queued", func(st Stats) bool { return st.WaitingForSession == 1 })
	if st := l.Stats(); st.MaxOwnSessions != 1 || st.Conns != 2 {
		t.Errorf("Stats %+v: want 1 session of its own at most, 2 connections (the shared session and the wait)", st)
	}
	released := time.Now()
	if err := hy.Unlock(ctx); err != nil {
		t.Fatal(err)
	}
	select {
	case lk := <-got:
		t.Logf("granted %v after the other holder let it go", time.Since(released).Round(time.Millisecond))
		if st := l.Stats(); st.HeldShared != 1 || st.WaitingForSession != 0 || st.WaitingInServer != 1 {
			t.Errorf("Stats %+v: want the lock on the shared session, nothing queued, the other wait still in the server", st)
		}
		if pids := b.holders(t, y); len(pids) != 1 || pids[0] != lk.PID() {
			t.Errorf("pg_locks shows %v holding the key, want the shared session %d", pids, lk.PID())
		}
		if err := lk.Unlock(ctx); err != nil {
			t.Fatal(err)
		}
	case err := <-yerr:
		t.Fatalf("the queued Lock failed: %v", err)
	case <-time.After(5 * time.Second):
		t.Fatalf("the queued Lock did not take the freed key within 5 s: %+v", l.Stats())
	}
	cancelX()
	if err := <-xerr; !errors.Is(err, context.Canceled) {
		t.Errorf("the wait in the server, cancelled: %v", err)
	}
	b.waitFree(t, y)
}

// A wait of a Locker from Open is served when its sessions of their own are all taken by waits that last: 3 Lead
// campaigns for keys another Locker leads take all 3, and a Lock(Wait(10s)) for a key that three other Lockers
// take in turn (each waiting for it in the server, so the server hands it from each holder straight to the next)
// must be granted. Before, it tried the key every 20 ms from the process and was never granted while the others
// took it about 195 times. The budget holds throughout (at most 5 sessions in pg_stat_activity), the campaigns
// gave their sessions up (Stats().WaitYields), and nothing is left held.
func TestBudgetWaitServed(t *testing.T) {
	url := pgtest.URL(t)
	ctx := ctxT(t, time.Minute)
	app := appName(t, "budget-served")
	l := openApp(t, url, app, "")
	leader := New(pgtest.Pool(t, url, nil))
	defer leader.Close()
	var bg sync.WaitGroup
	cctx, stop := context.WithCancel(ctx)
	defer func() { stop(); bg.Wait() }()
	for i := range 3 { // led elsewhere: l's campaigns wait for ever, each on a session of its own
		k := key(t)
		lk, err := leader.TryLock(ctx, k)
		if err != nil {
			t.Fatal(err)
		}
		defer func() { _ = lk.Unlock(ctx) }()
		bg.Add(1)
		go func() {
			defer bg.Done()
			err := l.Lead(cctx, k, func(context.Context) error { t.Errorf("campaign %d led a key held elsewhere", i); return nil })
			if cctx.Err() == nil {
				t.Errorf("campaign %d: %v", i, err)
			}
		}()
	}
	for deadline := time.Now().Add(10 * time.Second); l.Stats().WaitingInServer < 3; time.Sleep(5 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatalf("the campaigns did not take the sessions: %+v", l.Stats())
		}
	}
	hot := key(t)
	var taken atomic.Int64
	for range 3 {
		o := New(pgtest.Pool(t, url, nil))
		defer o.Close()
		bg.Add(1)
		go func() {
			defer bg.Done()
			for cctx.Err() == nil {
				lk, err := o.Lock(cctx, hot)
				if err != nil {
					return
				}
				taken.Add(1)
				time.Sleep(5 * time.Millisecond)
				_ = lk.Unlock(context.Background())
			}
		}()
	}
	s := sample(t, url, app)
	time.Sleep(200 * time.Millisecond) // the others take the key in turn
	// A try may find the key free between two of the others (once in a loaded CI run, after 22 ms): no wait then,
	// and nothing gave its session up. Again, at most 20 times, until a wait was served by a campaign's session.
	for try := 1; l.Stats().WaitYields == 0; try++ {
		if try > 20 {
			t.Fatal("in 20 waits, none made a campaign give its session up: each found the key free at once")
		}
		start := time.Now()
		lk, err := l.Lock(ctx, hot, Wait(10*time.Second))
		if err != nil {
			t.Fatalf("a wait behind a hot key with every session of its own taken, while the others took it %d times: %v",
				taken.Load(), err)
		}
		t.Logf("granted after %v (the others took it %d times meanwhile); %d yields", time.Since(start).Round(time.Millisecond),
			taken.Load(), l.Stats().WaitYields)
		if err := lk.Unlock(ctx); err != nil {
			t.Fatal(err)
		}
	}
	stop()
	bg.Wait()
	if peak := s.end(t)[app]; peak > DefaultOpenConns {
		t.Errorf("the Locker had %d sessions at once, over its budget of %d", peak, DefaultOpenConns)
	}
	if st := l.Stats(); st.PeakConns > DefaultOpenConns {
		t.Errorf("PeakConns %d, over the budget", st.PeakConns)
	}
}

// A writer behind readers keeps its place when its Locker shares sessions of their own out (Open's budget): the
// one session of its own is wanted by a Lead campaign for a key led elsewhere, so the writer is asked to give it up
// after each slice; giving it up would give its intent back, let the readers that came meanwhile in, and make it
// wait for them again at its next turn, for ever. Four readers in Lockers of their own keep the key held shared,
// each taking it again at once. The writer keeps its session while readers hold its key: granted within the
// readers' hold (never within 6 s before).
func TestBudgetYieldKeepsWriterIntent(t *testing.T) {
	url := pgtest.URL(t)
	ctx := ctxT(t, 60*time.Second)
	l, err := Open(ctx, url, WithMaxConns(2), WithSharedSessions(0), withSlice(100*time.Millisecond))
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	leader := New(pgtest.Pool(t, url, nil))
	defer leader.Close()
	ck := key(t)
	hl, err := leader.TryLock(ctx, ck)
	if err != nil {
		t.Fatal(err)
	}
	defer hl.Unlock(ctx)
	cctx, stopCampaign := context.WithCancel(ctx)
	campaigned := make(chan struct{})
	go func() {
		defer close(campaigned)
		_ = l.Lead(cctx, ck, func(context.Context) error { return nil })
	}()
	defer func() { stopCampaign(); <-campaigned }()
	for l.Stats().WaitingInServer < 1 {
		time.Sleep(5 * time.Millisecond)
	}
	k := key(t)
	const hold = 300 * time.Millisecond
	rctx, stopReaders := context.WithCancel(ctx)
	var readers sync.WaitGroup
	for i := range 4 {
		r := New(pgtest.Pool(t, url, nil), WithSharedSessions(0))
		defer r.Close()
		readers.Add(1)
		go func() {
			defer readers.Done()
			time.Sleep(time.Duration(i) * hold / 4) // staggered: the key is always held shared
			for rctx.Err() == nil {
				lk, err := r.RLock(rctx, k)
				if err != nil {
					return
				}
				time.Sleep(hold)
				_ = lk.Unlock(context.Background())
			}
		}()
	}
	defer func() { stopReaders(); readers.Wait() }()
	time.Sleep(hold + hold/4)
	start := time.Now()
	lk, err := l.Lock(ctx, k, Wait(6*time.Second))
	t.Logf("writer: %v after %v; the Locker's waits gave their session up %d times", err,
		time.Since(start).Round(time.Millisecond), l.Stats().WaitYields)
	if err != nil {
		t.Fatalf("the writer behind readers, asked to share its session, was not granted within 6 s: %v", err)
	}
	if err := lk.Unlock(ctx); err != nil {
		t.Fatal(err)
	}
}

// A wait that gives its session up to another wait and queues again still reports when it began: each of its
// statements publishes its start, also the first on a session it got back (two waits for keys held elsewhere
// taking turns on one session of their own).
func TestInspectWaitStartAcrossYields(t *testing.T) {
	url := pgtest.URL(t)
	ctx := ctxT(t, 60*time.Second)
	obs := pgtest.Conn(t, url)
	l, err := Open(ctx, url, WithMaxConns(2), WithSharedSessions(0), withSlice(100*time.Millisecond))
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	holder := New(pgtest.Pool(t, url, nil))
	defer holder.Close()
	keys := []Key{key(t), key(t)}
	for _, k := range keys {
		hl, err := holder.TryLock(ctx, k)
		if err != nil {
			t.Fatal(err)
		}
		defer hl.Unlock(ctx)
	}
	var began time.Time
	if err := obs.QueryRow(ctx, "SELECT clock_timestamp()").Scan(&began); err != nil {
		t.Fatal(err)
	}
	wctx, cancel := context.WithCancel(ctx)
	var wg sync.WaitGroup
	for _, k := range keys {
		wg.Add(1)
		go func() { defer wg.Done(); _, _ = l.Lock(wctx, k) }()
	}
	defer func() { cancel(); wg.Wait() }()
	time.Sleep(time.Second)
	samples, late := 0, 0
	var worst time.Duration
	for end := time.Now().Add(1500 * time.Millisecond); time.Now().Before(end); time.Sleep(20 * time.Millisecond) {
		rows, err := Inspect(ctx, obs)
		if err != nil {
			t.Fatal(err)
		}
		for _, r := range rows {
			if r.Granted || r.WaitStart == nil || !(r.Key.Equal(keys[0]) || r.Key.Equal(keys[1])) {
				continue
			}
			samples++
			if d := r.WaitStart.Sub(began); d > 300*time.Millisecond {
				late++
				worst = max(worst, d)
			}
		}
	}
	t.Logf("%d yields; %d of %d samples with a WaitStart over 300 ms after the calls began", l.Stats().WaitYields, late, samples)
	if samples == 0 || l.Stats().WaitYields == 0 {
		t.Fatalf("%d samples, %d yields: the waits never took turns in the server", samples, l.Stats().WaitYields)
	}
	if late > 0 {
		t.Errorf("WaitStart moved forward after a yield in %d of %d samples (up to %v after the calls began)", late, samples, worst.Round(time.Millisecond))
	}
}

// A session of its own whose connection is still being checked when its call's bound ends keeps its slot until the
// check has ended (the connection pooled or destroyed): the waits queued for a slot do not take more connections
// meanwhile, and the connection kept for the Locker's reads stays free. The slot used to go to the next wait at
// once, which took the kept connection while the checks went on.
func TestBudgetWhileCheckingApart(t *testing.T) {
	url := pgtest.URL(t)
	var hang atomic.Bool
	hang.Store(true)
	l := openApp(t, url, appName(t, "apart"), "", WithSharedSessions(0), option(func(o *config.Options) {
		o.Wrap = func(c session.Conn) session.Conn { return &hungCheck{Conn: c, hang: &hang} }
	}))
	ctx := ctxT(t, 30*time.Second)
	lock := func(wg *sync.WaitGroup, n int, bound time.Duration) {
		for range n {
			wg.Add(1)
			go func() {
				defer wg.Done()
				if _, err := l.Lock(ctx, key(t), Wait(bound)); !errors.Is(err, ErrNotAcquired) {
					t.Errorf("Lock with Wait(%v) while new connections' checks hang: %v, want ErrNotAcquired", bound, err)
				}
			}()
		}
	}
	var first, queued sync.WaitGroup
	lock(&first, 6, 100*time.Millisecond) // every slot's check hangs, past the calls' bound
	time.Sleep(20 * time.Millisecond)
	lock(&queued, 4, 1500*time.Millisecond) // queued for a slot, still waiting when the first calls return
	first.Wait()
	time.Sleep(300 * time.Millisecond)
	if st := l.Stats(); st.Conns > st.Pool.Max-1 {
		t.Errorf("with the checks going on after their calls: Stats %+v, want at most %d connections (one kept)", st, st.Pool.Max-1)
	}
	rctx, cancel := context.WithTimeout(ctx, 2*time.Second)
	defer cancel()
	if err := l.Ping(rctx); err != nil {
		t.Errorf("Ping with every slot's check going on: %v", err)
	}
	queued.Wait()
	hang.Store(false)
	closed := make(chan struct{})
	go func() { l.Close(); close(closed) }()
	pgtest.WaitClosed(t, closed, 5*time.Second, "Close with checks going on")
}

// hungCheck leaves a connection's first query, advlock's check of it, unanswered until its ctx ends, while hang.
type hungCheck struct {
	session.Conn
	hang    *atomic.Bool
	checked bool
}

func (c *hungCheck) QueryInt(ctx context.Context, sql string, args ...any) (int64, error) {
	if !c.checked && c.hang.Load() {
		c.checked = true
		<-ctx.Done()
		return 0, ctx.Err()
	}
	c.checked = true
	return c.Conn.QueryInt(ctx, sql, args...)
}
