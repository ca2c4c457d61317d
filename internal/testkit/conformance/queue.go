package conformance

import (
	"context"
	"errors"
	"sync"
	"testing"
	"time"

	"github.com/advlock/advlock"
	"github.com/advlock/advlock/internal/testkit/pgtest"
	"github.com/jackc/pgx/v5"
)

// The promises of a server-side queue that a wait sent again every slice must keep.

// slowLink: a wait whose link stalls or is slow does not end for it. Two waits sent again every 300 ms through a
// proxy that starts delaying every chunk by 250 ms while they wait (a round trip of 500 ms, more than a slice's end
// plus a fixed margin allowed): a Wait(2.5s) ends with ErrNotAcquired (not a deadline of a context the caller never
// set) and keeps its session (it goes back to the pool), and a Lock without a deadline goes on waiting through the
// slow link and is granted once the link is fast again and the holder lets go.
func (s *suite) slowLink(t *testing.T) {
	holder, obs := s.open(t), s.observer(t)
	url, p := s.proxyURL(t)
	h, timed := s.openURL(t, url, withWaitSlice(300*time.Millisecond)), s.openURL(t, url, withWaitSlice(300*time.Millisecond))
	t.Cleanup(h.L.Close)
	t.Cleanup(timed.L.Close) // a Locker of its own: a second wait of h would wait in h's in-process queue
	ctx := ctxT(t, time.Minute)
	k := Key(t)
	hl, err := holder.L.TryLock(ctx, k)
	if err != nil {
		t.Fatal(err)
	}
	// The timed Locker's connections are opened and proved before the link turns slow (its shared session, and a
	// session of its own for a wait): the test is about waits, not about round trips before them.
	if lk, err := timed.L.TryLock(ctx, Key(t)); err != nil {
		t.Fatal(err)
	} else if err := lk.Unlock(ctx); err != nil {
		t.Fatal(err)
	}
	if _, err := timed.L.Lock(ctx, k, advlock.Wait(100*time.Millisecond)); !errors.Is(err, advlock.ErrNotAcquired) {
		t.Fatalf("a wait on a held key: %v", err)
	}
	got := make(chan error, 1)
	go func() {
		lk, err := h.L.Lock(context.Background(), k) // no deadline: nothing but the grant ends it
		if err == nil {
			err = lk.Unlock(ctx)
		}
		got <- err
	}()
	untimed := waiterPID(t, obs, k, 10*time.Second)
	time.Sleep(450 * time.Millisecond) // past the first slice: the wait has been sent again
	p.Latency(250 * time.Millisecond)
	sampled := make(chan uint32, 1)
	go func() { // the timed wait's server pid: the waiter that is not the untimed one
		v, _ := k.Int64()
		for deadline := time.Now().Add(10 * time.Second); time.Now().Before(deadline); time.Sleep(2 * time.Millisecond) {
			rows, err := pgtest.Locks(context.Background(), obs)
			if err != nil {
				t.Error(err)
				break
			}
			for _, r := range rows {
				if waitRow(r, v) && r.PID != untimed { // in the key's line, behind the untimed wait
					sampled <- r.PID
					return
				}
			}
		}
		sampled <- 0
	}()
	start := time.Now()
	_, err = timed.L.Lock(context.Background(), k, advlock.Wait(2500*time.Millisecond))
	took := time.Since(start)
	if !errors.Is(err, advlock.ErrNotAcquired) || errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("Wait(2.5s) over a slow link on a held key: %v, want ErrNotAcquired and no deadline", err)
	}
	if took < 2500*time.Millisecond {
		t.Errorf("the wait ended after %v, before its bound", took)
	}
	pid := <-sampled
	if pid == 0 {
		t.Fatal("the timed wait never waited in the server")
	}
	kept := false
	for _, idle := range timed.Idle(t) {
		kept = kept || idle == pid
	}
	if !kept {
		t.Errorf("the timed-out wait's session (pid %d) was not given back to the pool", pid)
	}
	p.Latency(0)
	select {
	case err := <-got:
		t.Fatalf("the wait without a deadline ended while the key was held: %v", err)
	default:
	}
	if err := hl.Unlock(ctx); err != nil {
		t.Fatal(err)
	}
	select {
	case err := <-got:
		if err != nil {
			t.Fatalf("a wait over a link that was slow: %v", err)
		}
	case <-time.After(20 * time.Second):
		t.Fatal("the wait was not granted within 20s of the holder letting go")
	}
	waitFree(t, obs, k)
	noIdleLocks(t, h, obs)
	noIdleLocks(t, timed, obs)
}

// waiterPID returns the server pid of the first waiter for k that pg_locks shows within d (0 if none).
func waiterPID(t *testing.T, obs *pgx.Conn, k advlock.Key, d time.Duration) uint32 {
	v, _ := k.Int64()
	for deadline := time.Now().Add(d); time.Now().Before(deadline); time.Sleep(2 * time.Millisecond) {
		rows, err := pgtest.Locks(context.Background(), obs)
		if err != nil {
			t.Error(err)
			return 0
		}
		for _, r := range rows {
			if r.Int64Key(v) && !r.Granted {
				return r.PID
			}
		}
	}
	return 0
}

// writerBehindReaders: a writer is granted behind readers that come and go, each taking the key again as soon as
// it let go, overlapping so that the key is never free of readers: four readers hold it 400 ms at a time, and a
// Lock(Wait(10s)) must be granted. Readers in four Lockers (four processes), the writer's wait sent again every
// 150 ms (sliced waits left the queue at each slice, and the readers queued behind the writer were granted then,
// for ever); and readers in one Locker, the writer's wait in one slice (on a shared session, each new reader was
// granted again past the writer by PostgreSQL's re-entrancy, with no slicing at all). While the writer holds the
// key no reader does (pg_locks).
func (s *suite) writerBehindReaders(t *testing.T) {
	t.Run("four Lockers", func(t *testing.T) { s.writerBehindReaders1(t, false, 1) })
	t.Run("one Locker", func(t *testing.T) { s.writerBehindReaders1(t, true, 1) })
	t.Run("three writers", func(t *testing.T) { s.writerBehindReaders1(t, false, 3) })
}

// writerBehindReaders1 runs writers writers, each a Locker of its own, behind four readers (in one Locker, or four).
// With several writers, a writer that waits behind another cannot tell that readers hold the key (PostgreSQL
// refuses a shared try while an exclusive request waits): each must take the intent once the first lets go, or the
// readers pass at every slice of the rest.
func (s *suite) writerBehindReaders1(t *testing.T, oneLocker bool, writers int) {
	const readers, hold = 4, 400 * time.Millisecond
	obs := s.observer(t)
	slice := 150 * time.Millisecond
	if oneLocker {
		slice = 20 * time.Second // one slice: what is left to fail is a shared session granting the key again
	}
	var ws []Harness
	for range writers {
		ws = append(ws, s.open(t, withWaitSlice(slice)))
	}
	ctx := ctxT(t, time.Minute)
	k := Key(t)
	var ls []*advlock.Locker
	for i := range readers {
		if i == 0 || !oneLocker {
			ls = append(ls, s.open(t, withWaitSlice(150*time.Millisecond)).L)
		} else {
			ls = append(ls, ls[0])
		}
	}
	rctx, stop := context.WithCancel(ctx)
	var wg sync.WaitGroup
	var mu sync.Mutex
	granted := 0
	for i, l := range ls {
		wg.Add(1)
		go func() {
			defer wg.Done()
			time.Sleep(time.Duration(i) * hold / readers) // staggered: some reader always holds the key
			for rctx.Err() == nil {
				lk, err := l.RLock(rctx, k)
				if err != nil {
					if rctx.Err() == nil {
						t.Errorf("reader %d: %v", i, err)
					}
					return
				}
				mu.Lock()
				granted++
				mu.Unlock()
				select {
				case <-time.After(hold):
				case <-rctx.Done():
				}
				if err := lk.Unlock(context.Background()); err != nil {
					t.Errorf("reader %d: unlock: %v", i, err)
					return
				}
			}
		}()
	}
	defer func() { stop(); wg.Wait() }()
	time.Sleep(2 * hold) // the readers overlap
	start := time.Now()
	var wwg sync.WaitGroup
	for i, writer := range ws {
		wwg.Add(1)
		go func() {
			defer wwg.Done()
			wl, err := writer.L.Lock(ctx, k, advlock.Wait(10*time.Second))
			if err != nil {
				mu.Lock()
				defer mu.Unlock()
				t.Errorf("writer %d was not granted while readers came and went (%d grants to readers): %v", i, granted, err)
				return
			}
			t.Logf("writer %d granted after %v", i, time.Since(start).Round(time.Millisecond))
			v, _ := k.Int64()
			rows, err := pgtest.Locks(ctx, obs)
			if err != nil {
				t.Error(err)
			}
			for _, r := range rows {
				if r.Int64Key(v) && r.Granted && r.PID != wl.PID() {
					t.Errorf("pid %d holds %s (%s) while writer %d (pid %d) does", r.PID, k, r.Mode, i, wl.PID())
				}
			}
			if err := wl.Unlock(ctx); err != nil {
				t.Error(err)
			}
		}()
	}
	wwg.Wait()
	stop()
	wg.Wait()
	waitFree(t, obs, k)
	for _, w := range ws {
		noIdleLocks(t, w, obs)
	}
}
