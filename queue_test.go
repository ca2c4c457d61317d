package advlock

import (
	"context"
	"errors"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/advlock/advlock/internal/session"
	"github.com/advlock/advlock/internal/testkit/pgtest"
	"github.com/jackc/pgx/v5/pgxpool"
)

// The promises of a server-side queue that sliced waits keep, at the moments that broke them.

// Two readers of one key in one Locker stack their holds on its one shared session; with the lock table full, the
// second reader's try fails (53200: its test of the key's intent needs an entry for a moment, even though the key's
// own re-entrant try needs none), fenced and not. The undo of the refused try gives back exactly what it took: the
// first reader still holds the key in pg_locks, and another Locker cannot take it exclusively. (When the intent was
// tested before the key, the fenced undo released the first reader's hold, and another Locker took the key.)
func TestStackedReadersLockTableFull(t *testing.T) {
	if testing.Short() {
		t.Skip("starts a private cluster")
	}
	c := pgtest.StartCluster(t, "max_locks_per_transaction = 10", "autovacuum = off")
	obs := pgtest.Conn(t, c.URL)
	ctx := ctxT(t, 60*time.Second)
	for _, fenced := range []bool{true, false} {
		name := "fenced"
		if !fenced {
			name = "unfenced"
		}
		t.Run(name, func(t *testing.T) {
			opts := []Option{WithSharedSessions(1)}
			if fenced {
				opts = append(opts, WithFencing())
			}
			l := New(pgtest.Pool(t, c.URL, func(c *pgxpool.Config) { c.MaxConns = 4 }), opts...)
			defer l.Close()
			other := New(pgtest.Pool(t, c.URL, func(c *pgxpool.Config) { c.MaxConns = 2 }), WithSharedSessions(0))
			defer other.Close()
			k := key(t)
			// Warm the other Locker's pool (no connection can be opened while the table is full).
			if w, err := other.TryLock(ctx, key(t)); err != nil {
				t.Fatal(err)
			} else if err := w.Unlock(ctx); err != nil {
				t.Fatal(err)
			}
			r1, err := l.TryRLock(ctx, k)
			if err != nil {
				t.Fatal(err)
			}
			if _, ok := r1.h.(*session.Held); !ok {
				t.Fatalf("the first reader is not on a shared session: %T", r1.h)
			}
			filler := pgtest.Conn(t, c.URL)
			if _, err := filler.Exec(ctx, "SELECT pg_advisory_lock(g) FROM generate_series(1, 1000000) g"); errCode(err) != "53200" {
				t.Fatalf("filling the lock table: %v", err)
			}
			r2, err := l.TryRLock(ctx, k)
			t.Logf("second reader with the table full: %v", err)
			if err == nil {
				_ = r2.Unlock(ctx)
			}
			if _, err := filler.Exec(ctx, "SELECT pg_advisory_unlock_all()"); err != nil {
				t.Fatal(err)
			}
			// Let the undo (if any) go out: one more round trip on the shared session.
			if x, err := l.TryLock(ctx, key(t)); err == nil {
				_ = x.Unlock(ctx)
			}
			v, _ := k.Int64()
			holders, err := pgtest.Holders(ctx, obs, v)
			if err != nil {
				t.Fatal(err)
			}
			t.Logf("first reader: Err()=%v, pid %d; pg_locks holders of the key: %v", r1.Err(), r1.PID(), holders)
			if r1.Err() == nil && len(holders) == 0 {
				t.Errorf("the first reader's lock reports held, but no session holds the key in the server")
			}
			if w, err := other.TryLock(ctx, k); err == nil {
				t.Errorf("another Locker took the key EXCLUSIVELY while the first reader (Err()=%v) holds it shared", r1.Err())
				_ = w.Unlock(ctx)
			} else {
				t.Logf("another Locker's TryLock: %v", err)
			}
			_ = r1.Unlock(ctx)
		})
	}
}

// A writer waiting behind a reader holds the key's intent; its link is blackholed mid-slice, and its Lock fails
// (the server stopped answering) with its session closed on the client's side, which the server does not learn
// through the dead link. The server ends that session soon all the same (the idle_session_timeout it had while it
// held the intent), so the intent does not hold readers back: within 3 s of the writer's failure, new readers are
// granted and Inspect lists no intent. (Before, the session sat idle holding the intent until TCP keepalive noticed,
// hours with the server's defaults, and every reader was refused.)
func TestGivenUpWriterLeavesNoIntent(t *testing.T) {
	b := setup(t)
	ctx := ctxT(t, 60*time.Second)
	p, wpool := proxiedPool(t, b.url, 4)
	writer := New(wpool, WithSharedSessions(0), WithKeepalive(300*time.Millisecond))
	defer writer.Close()
	readers := New(b.pool) // shared sessions (the default): their tries test the intent
	defer readers.Close()
	k := key(t)
	rl, err := readers.RLock(ctx, k)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = rl.Unlock(ctx) }()
	werr := make(chan error, 1)
	go func() {
		lk, err := writer.Lock(ctx, k)
		if err == nil {
			_ = lk.Unlock(ctx)
		}
		werr <- err
	}()
	for deadline := time.Now().Add(10 * time.Second); len(intentRows(t, b.obs, k)) == 0; time.Sleep(2 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatal("the writer took no intent")
		}
	}
	wpid := intentRows(t, b.obs, k)[0]
	time.Sleep(300 * time.Millisecond) // mid-slice
	p.Blackhole(true)
	defer p.Blackhole(false)
	start := time.Now()
	err = <-werr
	t.Logf("writer returned after %v: %v", time.Since(start).Round(time.Millisecond), err)
	if err == nil || errors.Is(err, ErrNotAcquired) {
		t.Fatalf("writer: %v", err)
	}
	// The caller has been told the wait failed. What does the server hold for it now?
	returned := time.Now()
	refused := 0
	for i := 0; i < 30; i++ {
		time.Sleep(100 * time.Millisecond)
		got := intentRows(t, b.obs, k)
		lk, err := readers.TryRLock(ctx, k)
		if err == nil {
			_ = lk.Unlock(ctx)
		} else if errors.Is(err, ErrNotAcquired) {
			refused++
		}
		if i%10 == 0 || i == 29 {
			t.Logf("%v after the writer returned: intent held by %v (writer's backend %d); a new reader: %v",
				time.Since(returned).Round(100*time.Millisecond), got, wpid, err)
		}
	}
	// Inspect (and advlock ls) say they never list intents; this one has no key row to be folded into.
	if rows, err := Inspect(ctx, b.obs); err == nil {
		for _, r := range rows {
			if r.Key.Equal(Int64Key(k.id.Intent().V)) {
				t.Errorf("Inspect lists the abandoned writer's intent as a lock of its own: %+v", r)
			}
		}
	}
	if refused > 0 {
		t.Errorf("%d of 30 TryRLock calls (over 3 s after the writer's Lock had returned an error) were refused: "+
			"the abandoned writer's backend still holds the intent", refused)
	}
}

// When a lock is lost, Do's fn is told (its context cancelled) before the Locker's observers are, whatever they do
// (here 100 ms of LockEnd): a second Do of the key in the same Locker, queued behind the first, starts only after the
// first fn's context was cancelled. (With the observers told before Done closed, the second fn ran for as long as
// they took before the first was told: 300 ms with an observer of 300 ms.)
func TestDoToldOfLossBeforeObservers(t *testing.T) {
	b := setup(t)
	ctx := ctxT(t, 20*time.Second)
	l := New(b.pool, WithSharedSessions(0), WithObserver(slowEnd{}))
	defer l.Close()
	k := key(t)
	started := make(chan struct{})
	fn1Cancelled := make(chan time.Time, 1)
	go func() {
		_ = l.Do(ctx, k, func(fctx context.Context) error {
			close(started)
			<-fctx.Done()
			fn1Cancelled <- time.Now()
			return fctx.Err()
		})
	}()
	<-started
	pids := b.holders(t, k)
	if len(pids) != 1 {
		t.Fatalf("holders %v", pids)
	}
	fn2Started := make(chan time.Time, 1)
	go func() {
		time.Sleep(20 * time.Millisecond) // queued in the gate behind the first Do
		_ = l.Do(ctx, k, func(context.Context) error {
			fn2Started <- time.Now()
			return nil
		})
	}()
	time.Sleep(50 * time.Millisecond)
	terminated := time.Now()
	if _, err := b.obs.Exec(ctx, "SELECT pg_terminate_backend($1)", int32(pids[0])); err != nil {
		t.Fatal(err)
	}
	c1, s2 := <-fn1Cancelled, <-fn2Started
	t.Logf("after the terminate: fn1's ctx cancelled at +%v, fn2 started at +%v",
		c1.Sub(terminated).Round(time.Millisecond), s2.Sub(terminated).Round(time.Millisecond))
	if s2.Before(c1) {
		t.Errorf("fn2 (a second holder in this Locker) ran %v before fn1's context was cancelled for the loss",
			c1.Sub(s2).Round(time.Millisecond))
	}
}

// A timed reader behind a writer's intent waits its whole bound and ends as a timed wait does: ErrNotAcquired for a
// Wait bound, an error matching context.DeadlineExceeded for a ctx deadline, on both session kinds, after about its
// 500 ms. The intent is held by an observer's connection, as a writer between two slices (or a stalled one) holds
// it, so every grant the reader gets is given back. (Before, its last slice's give-back returned at once, with an
// error that matched neither.)
func TestTimedReaderBehindIntent(t *testing.T) {
	b := setup(t)
	ctx := ctxT(t, 30*time.Second)
	k := key(t)
	if _, err := b.obs.Exec(ctx, "SELECT pg_advisory_lock($1)", k.id.Intent().V); err != nil {
		t.Fatal(err)
	}
	defer b.obs.Exec(ctx, "SELECT pg_advisory_unlock($1)", k.id.Intent().V)
	for _, shared := range []bool{false, true} {
		var opts []Option
		if !shared {
			opts = append(opts, WithSharedSessions(0))
		}
		l := New(b.pool, opts...)
		start := time.Now()
		_, err := l.RLock(ctx, k, Wait(500*time.Millisecond))
		took := time.Since(start)
		t.Logf("shared sessions=%v: RLock(Wait(500ms)) returned after %v: %v", shared, took.Round(time.Millisecond), err)
		if !errors.Is(err, ErrNotAcquired) {
			t.Errorf("shared sessions=%v: a Wait bound's end did not return ErrNotAcquired", shared)
		}
		if took < 400*time.Millisecond {
			t.Errorf("shared sessions=%v: the timed wait gave up after %v of its 500 ms", shared, took.Round(time.Millisecond))
		}
		dctx, cancel := context.WithTimeout(ctx, 500*time.Millisecond)
		start = time.Now()
		_, err = l.RLock(dctx, k)
		took = time.Since(start)
		cancel()
		t.Logf("shared sessions=%v: RLock(ctx with a 500ms deadline) returned after %v: %v", shared, took.Round(time.Millisecond), err)
		if !errors.Is(err, context.DeadlineExceeded) {
			t.Errorf("shared sessions=%v: a ctx deadline's end does not match context.DeadlineExceeded", shared)
		}
		saysOnce(t, err, "deadline", "cancel")
		cctx, cancel := context.WithCancel(ctx)
		time.AfterFunc(300*time.Millisecond, cancel)
		_, err = l.RLock(cctx, k)
		t.Logf("shared sessions=%v: RLock(ctx cancelled after 300ms): %v", shared, err)
		if !errors.Is(err, context.Canceled) {
			t.Errorf("shared sessions=%v: a cancel does not match context.Canceled", shared)
		}
		saysOnce(t, err, "cancel", "deadline")
		l.Close()
	}
}

// saysOnce checks that err's text says what ended the wait (want), never what did not (not), and no clause twice
// (a deadline's error once read "...(the server's lock_timeout): not granted before the deadline (a writer ...)",
// and said "cancelled" for a deadline).
func saysOnce(t *testing.T, err error, want, not string) {
	t.Helper()
	s := strings.ToLower(err.Error())
	if !strings.Contains(s, want) || strings.Contains(s, not) {
		t.Errorf("the error should say %q and not %q: %v", want, not, err)
	}
	seen := map[string]bool{}
	for _, c := range strings.Split(s, ": ") {
		for _, part := range strings.Split(c, " (") {
			if part = strings.Trim(part, " ()"); seen[part] {
				t.Errorf("the error says %q twice: %v", part, err)
			}
			seen[part] = true
		}
	}
	if strings.Count(s, "not granted") > 1 {
		t.Errorf("the error says \"not granted\" twice: %v", err)
	}
}

// Readers that retry TryRLock at once on sessions of their own (WithSharedSessions(0), as lib/pq's always are), four
// of them overlapping, each holding 1.5 s: a writer's Lock(Wait(10s)) is granted, and no reader is granted while it
// waits (their tries test its intent). (Before, a try on a session of its own ignored intents: the writer was never
// granted while the readers took the key 21 times.)
func TestWriterBehindTryReaders(t *testing.T) {
	b := setup(t)
	ctx := ctxT(t, 40*time.Second)
	k := key(t)
	var stop atomic.Bool
	var wg sync.WaitGroup
	var grants atomic.Int64
	for i := range 4 {
		l := New(b.pool, WithSharedSessions(0))
		defer l.Close()
		wg.Add(1)
		go func() {
			defer wg.Done()
			time.Sleep(time.Duration(i) * 375 * time.Millisecond)
			for !stop.Load() {
				lk, err := l.TryRLock(ctx, k)
				if err != nil {
					continue
				}
				grants.Add(1)
				time.Sleep(1500 * time.Millisecond)
				_ = lk.Unlock(ctx)
			}
		}()
	}
	time.Sleep(2 * time.Second)
	writer := New(b.pool, WithSharedSessions(0))
	defer writer.Close()
	// The writer takes the intent one round trip after its first statement found readers: grants are counted from
	// when pg_locks shows it (a loaded machine once let a reader's try in, in that round trip).
	var before atomic.Int64
	before.Store(-1)
	watched, watching := make(chan struct{}), make(chan struct{})
	go func() {
		defer close(watched)
		iv := k.id.Intent().V
		for {
			if pids, err := pgtest.Holders(ctx, b.obs, iv); err == nil && len(pids) > 0 {
				before.Store(grants.Load())
				return
			}
			select {
			case <-watching:
				return
			case <-time.After(time.Millisecond):
			}
		}
	}()
	start := time.Now()
	lk, err := writer.Lock(ctx, k, Wait(10*time.Second))
	took := time.Since(start)
	after := grants.Load()
	close(watching)
	<-watched
	stop.Store(true)
	if err == nil {
		_ = lk.Unlock(ctx)
	}
	wg.Wait()
	b0 := before.Load()
	if b0 < 0 {
		t.Fatalf("pg_locks never showed the writer's intent (writer: %v after %v)", err, took.Round(time.Millisecond))
	}
	t.Logf("writer: %v after %v; reader grants while its intent stood: %d", err, took.Round(time.Millisecond), after-b0)
	if after > b0 {
		t.Errorf("readers were granted %d times past the waiting writer's intent (writer: %v after %v)", after-b0, err, took.Round(time.Millisecond))
	}
}

// The graph each Locker builds is not the same on every client: a Locker adds its own watched waits that are in no
// server queue (waiting for a pool connection). Here
//
//	B's caller holds Ky and Kl and waits for K (X, in the server);
//	A's caller 1 holds K shared and waits for Ky (Y, in the server);
//	A's caller 2 holds K shared and waits for Kl (LA: A's pool is exhausted, so it waits for a connection).
//
// The cycles are X<->Y, which both Lockers see, and X<->LA, which only A sees. The waits every client sees are
// judged first, alike everywhere (the least of X<->Y, Y), and what is left through waits only A sees is broken by A
// alone (LA): some wait gives up within about a second. (Choosing over each Locker's whole graph, A chose X, B's
// wait, and B chose Y, A's: nobody gave up for 12 s.)
func TestDeadlockVictimsOwnWaits(t *testing.T) {
	b := setup(t)
	ctx := ctxT(t, 60*time.Second)
	warm := func(p *pgxpool.Pool, n int) {
		var cs []*pgxpool.Conn
		for range n {
			c, err := p.Acquire(ctx)
			if err != nil {
				t.Fatal(err)
			}
			cs = append(cs, c)
		}
		for _, c := range cs {
			c.Release()
		}
	}
	poolA := pgtest.Pool(t, b.url, func(c *pgxpool.Config) { c.MaxConns = 3 })
	warm(poolA, 3) // A's sessions get lower pids than B's
	poolB := pgtest.Pool(t, b.url, func(c *pgxpool.Config) { c.MaxConns = 4 })
	warm(poolB, 4)
	A := New(poolA, WithSharedSessions(0))
	defer A.Close()
	B := New(poolB, WithSharedSessions(0))
	defer B.Close()
	K, Ky, Kl := key(t), key(t), key(t)
	ly, err := B.TryLock(ctx, Ky)
	if err != nil {
		t.Fatal(err)
	}
	ll, err := B.TryLock(ctx, Kl)
	if err != nil {
		t.Fatal(err)
	}
	a1, err := A.TryRLock(ctx, K)
	if err != nil {
		t.Fatal(err)
	}
	a2, err := A.TryRLock(ctx, K)
	if err != nil {
		t.Fatal(err)
	}
	type res struct {
		who string
		err error
	}
	out := make(chan res, 3)
	wctx, cancel := context.WithTimeout(ctx, 12*time.Second)
	defer cancel()
	run := func(who string, l *Locker, c context.Context, k Key) {
		lk, err := l.Lock(c, k)
		out <- res{who, err}
		if err == nil {
			<-wctx.Done()
			_ = lk.Unlock(ctx)
		}
	}
	go run("Y (A waits for Ky)", A, Holding(wctx, a1), Ky)
	waitFor := func(k Key) uint32 {
		for deadline := time.Now().Add(5 * time.Second); time.Now().Before(deadline); time.Sleep(5 * time.Millisecond) {
			rows, err := pgtest.Locks(ctx, b.obs)
			if err != nil {
				t.Fatal(err)
			}
			for _, r := range rows {
				v, _ := k.Int64()
				if !r.Granted && r.Int64Key(v) {
					return r.PID
				}
			}
		}
		t.Fatalf("no wait for %v seen", k)
		return 0
	}
	ypid := waitFor(Ky)
	go run("LA (A waits for Kl, no connection)", A, Holding(wctx, a2), Kl)
	time.Sleep(100 * time.Millisecond)
	if st := A.Stats(); st.Pool.InUse < 3 {
		t.Fatalf("A's pool is not exhausted: %+v", st.Pool)
	}
	go run("X (B waits for K)", B, Holding(wctx, ly, ll), K)
	xpid := waitFor(K)
	t.Logf("Y on pid %d, X on pid %d", ypid, xpid)
	if ypid > xpid { // A's pool connected first: its backends' pids are the lower, but for a pid wrap-around
		t.Fatalf("setup: Y's pid %d is above X's %d; the scenario needs it below", ypid, xpid)
	}
	start := time.Now()
	var got []res
	for len(got) < 3 {
		r := <-out
		t.Logf("%v: %s: %v", time.Since(start).Round(10*time.Millisecond), r.who, r.err)
		got = append(got, r)
		if errors.Is(r.err, ErrDeadlock) {
			cancel() // resolved: let the others go
		}
	}
	deadlocks := 0
	for _, r := range got {
		if errors.Is(r.err, ErrDeadlock) {
			deadlocks++
		}
	}
	t.Logf("A: %d readings; B: %d readings", A.Stats().GraphReadings, B.Stats().GraphReadings)
	if deadlocks == 0 {
		t.Errorf("a cycle of waits lasted 12 s and no Locker ended any wait of it (ErrDeadlock)")
	}
}
