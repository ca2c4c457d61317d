package advlock

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	neturl "net/url"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/advlock/advlock/internal/testkit/pgtest"
	"github.com/jackc/pgx/v5/pgxpool"
)

// Three Lockers (three pods) campaign for one key. Terms hand over cleanly (a leader's fn returns after 20 ms):
// never two leaders at once, every term's fencing token larger than the last. Terms may overlap only when the
// earlier one was lost (its process learns of the loss a moment after the server ended its session; that window
// is what fencing tokens are for), and then the later term's token is the larger. The leader's backend is terminated:
// its fn's ctx is cancelled with ErrLockLost, and another leader runs within a second. Leader reports who leads.
// Cancelling ctx ends Lead with ctx's error and leaves the key free.
func TestLead(t *testing.T) {
	url := pgtest.URL(t)
	obs := pgtest.Conn(t, url)
	k := key(t)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()

	type term struct {
		token      int64
		start, end time.Time
		lost       bool
	}
	var mu sync.Mutex
	var terms []*term // in the order they began
	lostSeen := make(chan time.Time, 8)
	started := make(chan struct{}, 64)
	holding := make(chan struct{}, 8) // a term that holds on began
	holdTerm := atomic.Bool{}         // when set, a term that begins holds on until its ctx ends
	fn := func(fctx context.Context) error {
		hold := holdTerm.Load() // read once, before the term says it began
		tm := &term{token: FenceToken(fctx), start: time.Now()}
		mu.Lock()
		terms = append(terms, tm)
		mu.Unlock()
		select {
		case started <- struct{}{}:
		default: // nobody counts terms any more
		}
		d := 20 * time.Millisecond
		if hold {
			d = time.Hour
			holding <- struct{}{}
		}
		select {
		case <-time.After(d):
		case <-fctx.Done():
			if errors.Is(context.Cause(fctx), ErrLockLost) {
				tm.lost = true
				lostSeen <- time.Now()
			}
		}
		mu.Lock()
		tm.end = time.Now()
		mu.Unlock()
		return nil
	}
	results := make(chan error, 3)
	for range 3 {
		l := New(pgtest.Pool(t, url, func(c *pgxpool.Config) { c.MaxConns = 4 }), WithFencing())
		t.Cleanup(l.Close)
		go func() { results <- l.Lead(ctx, k, fn) }()
	}
	for range 12 {
		select {
		case <-started:
		case <-time.After(10 * time.Second):
			t.Fatal("leadership did not change hands")
		}
	}
	// Now a leader that holds on: terminate its backend.
	holdTerm.Store(true)
	select {
	case <-holding:
	case <-time.After(10 * time.Second):
		t.Fatal("no term that holds on began")
	}
	time.Sleep(20 * time.Millisecond)
	who, ok, err := Leader(ctx, obs, k)
	if err != nil || !ok {
		t.Fatalf("Leader: %v, %v; want a leader", ok, err)
	}
	v, _ := k.Int64()
	pids, err := pgtest.Holders(ctx, obs, v)
	if err != nil || len(pids) != 1 || uint32(who.PID) != pids[0] {
		t.Fatalf("Leader says pid %d; pg_locks shows %v (%v)", who.PID, pids, err)
	}
	terminated := time.Now()
	pgtest.Terminate(t, obs, pids[0])
	select {
	case at := <-lostSeen:
		t.Logf("the deposed leader's fn saw the loss %v after pg_terminate_backend", at.Sub(terminated))
	case <-time.After(5 * time.Second):
		t.Fatal("the deposed leader's fn ctx was not cancelled")
	}
	select {
	case <-holding:
		took := time.Since(terminated)
		t.Logf("a new leader ran %v after the old leader's backend was terminated", took)
		if took > time.Second {
			t.Errorf("a new leader ran %v after the old one was terminated, want within a second", took)
		}
	case <-time.After(5 * time.Second):
		t.Fatal("no new leader after the leader's backend was terminated")
	}

	cancel()
	for range 3 {
		select {
		case err := <-results:
			if !errors.Is(err, context.Canceled) {
				t.Errorf("Lead after ctx was cancelled: %v, want context.Canceled", err)
			}
		case <-time.After(10 * time.Second):
			t.Fatal("Lead did not return after ctx was cancelled")
		}
	}
	pgtest.WaitFree(t, obs, v, 10*time.Second)

	mu.Lock()
	defer mu.Unlock()
	lostTerms := 0
	for i, tm := range terms {
		if tm.lost {
			lostTerms++
		}
		if i == 0 {
			continue
		}
		prev := terms[i-1]
		if tm.token <= prev.token {
			t.Errorf("term %d's token %d after %d", i, tm.token, prev.token)
		}
		if tm.start.Before(prev.end) && !prev.lost {
			t.Errorf("term %d began %v before term %d, which was not lost, ended", i, prev.end.Sub(tm.start), i-1)
		}
	}
	t.Logf("%d terms, %d lost", len(terms), lostTerms)
	if lostTerms != 1 {
		t.Errorf("%d terms lost, want the 1 whose backend was terminated", lostTerms)
	}
}

// runLead runs l.Lead in a goroutine; the channel gets its result, or the value of a panic that escaped it (as a
// job runner that recovers would see it).
func runLead(ctx context.Context, l *Locker, k Key, fn func(context.Context) error) <-chan any {
	out := make(chan any, 1)
	go func() {
		defer func() {
			if r := recover(); r != nil {
				out <- r
			}
		}()
		out <- l.Lead(ctx, k, fn)
	}()
	return out
}

// A leader whose fn panics steps down before the panic goes on: the key is free in pg_locks at once, another
// process leads, and the same Locker leads again later (it waited behind its own orphaned lock before).
func TestLeadPanicStepsDown(t *testing.T) {
	for _, shared := range []int{4, 0} {
		b := setup(t, WithSharedSessions(shared))
		other := New(pgtest.Pool(t, b.url, nil), WithSharedSessions(shared))
		t.Cleanup(other.Close)
		ctx := ctxT(t, 30*time.Second)
		k := key(t)
		res := runLead(ctx, b.l, k, func(context.Context) error { panic("boom") })
		select {
		case r := <-res:
			if r != "boom" {
				t.Fatalf("shared %d: Lead whose fn panics: %v, want the panic to go on", shared, r)
			}
		case <-time.After(10 * time.Second):
			t.Fatal("Lead whose fn panics did not return")
		}
		b.waitFree(t, k)
		if st := b.l.Stats(); st.Leading != 0 || st.Held != 0 {
			t.Errorf("shared %d: after the panic, Stats %+v, want nothing leading or held", shared, st)
		}
		for _, l := range []*Locker{other, b.l} {
			lctx, cancel := context.WithCancel(ctx)
			led := make(chan struct{})
			res := runLead(lctx, l, k, func(ctx context.Context) error {
				close(led)
				<-ctx.Done()
				return nil
			})
			select {
			case <-led:
			case <-time.After(5 * time.Second):
				t.Fatalf("shared %d: no leader after the panicking one stepped down", shared)
			}
			cancel()
			if r := <-res; !errors.Is(r.(error), context.Canceled) {
				t.Errorf("Lead after cancel: %v", r)
			}
		}
	}
}

// fn's own error ends Lead when its context was live as it returned, even when the session is terminated at that
// very moment (the unlock then finds it lost): the loss is judged from fn's context, not afterwards. When fn's
// context had already been cancelled by the loss, Lead takes fn's error as the loss's doing and leads again.
//
// fn looks at its context just before it returns; the loss's cancellation may land between that look and the
// term's own (the moment Lead judges). So Lead's outcome is checked against the term's judgment, and the judgment
// against fn's look: a context fn saw cancelled is never judged live.
func TestLeadErrorRacingLoss(t *testing.T) {
	errOwn, errSecond := errors.New("fn's own error"), errors.New("second term")
	for _, shared := range []int{4, 0} {
		b := setup(t, WithSharedSessions(shared))
		ctx := ctxT(t, 60*time.Second)
		live, dead, between := 0, 0, 0
		for i := range 30 {
			k := key(t)
			runs := 0
			var wasLive bool
			var judged []bool
			hook := func(lost bool) { judged = append(judged, lost) } // Lead runs its terms one at a time
			testHookTermJudged.Store(&hook)
			err := b.l.Lead(ctx, k, func(fctx context.Context) error {
				runs++
				if runs > 1 {
					return errSecond
				}
				pgtest.Terminate(t, b.obs, b.holders(t, k)[0])
				if i%2 == 1 {
					time.Sleep(time.Duration(i%5) * 100 * time.Microsecond)
				}
				wasLive = fctx.Err() == nil
				return errOwn
			})
			testHookTermJudged.Store(nil)
			if len(judged) == 0 {
				t.Fatalf("shared %d, iteration %d: Lead = %v, and no term was judged", shared, i, err)
			}
			switch lost := judged[0]; {
			case !lost && !wasLive:
				t.Fatalf("shared %d, iteration %d: fn saw its context cancelled by the loss, and its term was judged live", shared, i)
			case !lost:
				live++
				if !errors.Is(err, errOwn) || runs != 1 {
					t.Fatalf("shared %d, iteration %d: fn returned its own error with its context live: Lead = %v after %d runs, want fn's error after 1", shared, i, err, runs)
				}
			default:
				if wasLive {
					between++ // the cancellation landed between fn's look and its return
				} else {
					dead++
				}
				if !errors.Is(err, errSecond) || runs != 2 {
					t.Fatalf("shared %d, iteration %d: fn returned after the loss cancelled its context: Lead = %v after %d runs, want a second term", shared, i, err, runs)
				}
			}
			b.waitFree(t, k)
		}
		t.Logf("shared %d: fn's context live at its return %d times, already cancelled by the loss %d times, cancelled between fn's look and its return %d times",
			shared, live, dead, between)
		if live == 0 {
			t.Errorf("shared %d: the race was never met with fn's context live", shared)
		}
	}
}

// Which errors end Lead: those an operator must fix (a zero key, a closed Locker); a passing failure of the first
// fenced campaign (the pool's idle connection terminated) is retried, counted in Stats and logged, and Lead leads.
func TestLeadEnds(t *testing.T) {
	b := setup(t)
	ctx := ctxT(t, 30*time.Second)
	if err := b.l.Lead(ctx, Key{}, func(context.Context) error { return nil }); !errors.Is(err, ErrInvalidKey) {
		t.Errorf("Lead of the zero key: %v, want ErrInvalidKey", err)
	}
	closed := New(pgtest.Pool(t, b.url, nil))
	closed.Close()
	if err := closed.Lead(ctx, key(t), func(context.Context) error { return nil }); !errors.Is(err, ErrClosed) {
		t.Errorf("Lead on a closed Locker: %v, want ErrClosed", err)
	}

	var logs syncBuffer
	pool := pgtest.Pool(t, b.url, func(c *pgxpool.Config) { c.MaxConns = 4 })
	var pid uint32
	if err := pool.QueryRow(ctx, "SELECT pg_backend_pid()").Scan(&pid); err != nil {
		t.Fatal(err)
	}
	pgtest.Terminate(t, b.obs, pid) // the pool's one idle connection is dead, and the pool does not know yet
	l := New(pool, WithFencing(), WithLogger(slog.New(slog.NewTextHandler(&logs, nil))))
	defer l.Close()
	lctx, cancel := context.WithCancel(ctx)
	led := make(chan Stats, 1)
	res := runLead(lctx, l, key(t), func(ctx context.Context) error {
		led <- l.Stats()
		<-ctx.Done()
		return nil
	})
	select {
	case st := <-led:
		if st.Campaigning != 1 || st.Leading != 1 {
			t.Errorf("Stats while leading: %+v, want 1 campaigning, 1 leading", st)
		}
		t.Logf("led after %d failed campaigns; log: %s", st.CampaignRetries, logs.String())
		if st.CampaignRetries < 1 || !strings.Contains(logs.String(), "advlock: campaign failed; trying again") {
			t.Errorf("the failed first campaign is not in Stats (%d) or the log", st.CampaignRetries)
		}
	case r := <-res:
		t.Fatalf("Lead ended on a passing failure: %v", r)
	case <-time.After(10 * time.Second):
		t.Fatal("Lead did not lead")
	}
	cancel()
	<-res
	if st := l.Stats(); st.Campaigning != 0 || st.Leading != 0 {
		t.Errorf("Stats after Lead returned: %+v", st)
	}

	// A pool closed under the Locker, and a database that does not exist, end Lead: retrying cannot help.
	closedPool := pgtest.Pool(t, b.url, nil)
	lc := New(closedPool)
	defer lc.Close()
	closedPool.Close()
	if err := lc.Lead(ctx, key(t), func(context.Context) error { return nil }); !errors.Is(err, ErrNoPool) {
		t.Errorf("Lead over a closed pool: %v, want ErrNoPool", err)
	}
	u, _ := neturl.Parse(b.url)
	u.Path = "/advlock_no_such_database"
	ln := New(pgtest.Pool(t, u.String(), nil))
	defer ln.Close()
	if err := ln.Lead(ctx, key(t), func(context.Context) error { return nil }); errCode(err) != "3D000" {
		t.Errorf("Lead on a database that does not exist: %v, want it ended with SQLSTATE 3D000", err)
	}

	// fn returning an error that matches ErrLockLost (it found out itself, say a write refused for its token)
	// steps down and campaigns again; Close while leading ends Lead with ErrClosed, logged as no failure.
	var logs2 syncBuffer
	lr := New(pgtest.Pool(t, b.url, nil), WithLogger(slog.New(slog.NewTextHandler(&logs2, nil))))
	terms := 0
	leading := make(chan struct{})
	res = runLead(ctx, lr, key(t), func(ctx context.Context) error {
		terms++
		if terms == 1 {
			return fmt.Errorf("write refused: %w", ErrLockLost)
		}
		close(leading)
		<-ctx.Done()
		return nil
	})
	select {
	case <-leading:
	case r := <-res:
		t.Fatalf("Lead whose fn reported a loss: %v after %d terms, want a second term", r, terms)
	case <-time.After(5 * time.Second):
		t.Fatal("no second term")
	}
	lr.Close()
	if r := <-res; !errors.Is(r.(error), ErrClosed) {
		t.Errorf("Lead after Close: %v, want ErrClosed", r)
	}
	if strings.Contains(logs2.String(), "campaign ended") {
		t.Errorf("Close logged as a failure: %s", logs2.String())
	}
}

// An fn that returns nil at once (it started its work in the background, say) does not make Lead lead again and
// again: it backs off, growing to about a second, and says so once in the log. The key is free in pg_locks while
// it backs off, so another process leads meanwhile.
func TestLeadShortTerms(t *testing.T) {
	b := setup(t)
	ctx := ctxT(t, 30*time.Second)
	var logs syncBuffer
	l := New(pgtest.Pool(t, b.url, nil), WithLogger(slog.New(slog.NewTextHandler(&logs, nil))))
	defer l.Close()
	other := New(pgtest.Pool(t, b.url, nil))
	defer other.Close()
	k := key(t)
	var terms atomic.Int64
	lctx, stop := context.WithCancel(ctx)
	res := runLead(lctx, l, k, func(context.Context) error { terms.Add(1); return nil })

	// Once it backs off for long, another Locker takes the key between two terms: the server saw it free.
	time.Sleep(1500 * time.Millisecond)
	var lk *Lock
	for deadline := time.Now().Add(5 * time.Second); lk == nil; time.Sleep(5 * time.Millisecond) {
		var err error
		if lk, err = other.TryLock(ctx, k); err != nil && !errors.Is(err, ErrNotAcquired) {
			t.Fatal(err)
		}
		if lk == nil && time.Now().After(deadline) {
			t.Fatalf("the key was never free to another Locker between terms (%d terms)", terms.Load())
		}
	}
	if holders, err := pgtest.Holders(ctx, b.obs, k.id.V); err != nil || len(holders) != 1 || holders[0] != lk.PID() {
		t.Errorf("pg_locks holders of the key while the other Locker holds it: %v (%v), want its pid %d", holders, err, lk.PID())
	}
	n := terms.Load()
	if err := lk.Unlock(ctx); err != nil {
		t.Fatal(err)
	}
	stop()
	if r := <-res; !errors.Is(r.(error), context.Canceled) {
		t.Errorf("Lead after its ctx was cancelled: %v", r)
	}
	// 50 + 100 + 200 + 400 + 800 ms (each 0.5 to 1.5 times) and then about a second: a handful of terms in 1.5 s.
	if n < 2 || n > 12 {
		t.Errorf("%d terms in about 1.5 s of an fn that returns at once, want a few (it led again at once before: thousands)", n)
	}
	if c := strings.Count(logs.String(), "fn returned at once"); c != 1 {
		t.Errorf("the log says %d times that fn returned at once, want once:\n%s", c, logs.String())
	}
	t.Logf("%d terms before another Locker took the key", n)
}
