package advlock

import (
	"context"
	"errors"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/advlock/advlock/internal/pgtest"
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
	holdTerm := atomic.Bool{} // when set, a leader holds its term until its ctx ends
	fn := func(fctx context.Context) error {
		tm := &term{token: FenceToken(fctx), start: time.Now()}
		mu.Lock()
		terms = append(terms, tm)
		mu.Unlock()
		started <- struct{}{}
		d := 20 * time.Millisecond
		if holdTerm.Load() {
			d = time.Hour
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
	for len(started) > 0 {
		<-started
	}
	<-started // a term that holds
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
	case <-started:
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
