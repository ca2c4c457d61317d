package advlock

import (
	"context"
	"errors"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/advlock/advlock/internal/testkit/pgtest"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
)

// waiting reports whether the server shows a session waiting for int8 key k.
func (b *bundle) waiting(t *testing.T, k Key) bool {
	t.Helper()
	v, _ := k.Int64()
	rows, err := pgtest.Locks(context.Background(), b.obs)
	if err != nil {
		t.Fatal(err)
	}
	for _, r := range rows {
		if !r.Granted && r.Int64Key(v) {
			return true
		}
	}
	return false
}

// takeNext waits for next while holding first, as a caller does inside Do, and then releases both; on ErrDeadlock
// it releases first, so that the other can go on.
func takeNext(ctx context.Context, t *testing.T, l *Locker, first *Lock, next Key) error {
	lk, err := l.Lock(Holding(ctx, first), next)
	if err == nil {
		err = lk.Unlock(ctx)
	}
	if uerr := first.Unlock(ctx); uerr != nil {
		t.Errorf("unlock %s: %v", first.Key(), uerr)
	}
	return err
}

// crossing is two waits of one cycle under way: each of two Lockers holds a key and waits for the other's.
type crossing struct {
	errs   chan error
	victim chan *Locker // the Locker of each wait that ended with ErrDeadlock
}

// cross starts two takeNext waits: l1's caller, holding h1, waits for k1, and l2's, holding h2, for k2.
func cross(ctx context.Context, t *testing.T, l1 *Locker, h1 *Lock, k1 Key, l2 *Locker, h2 *Lock, k2 Key) *crossing {
	c := &crossing{errs: make(chan error, 2), victim: make(chan *Locker, 2)}
	wait := func(l *Locker, first *Lock, next Key) {
		err := takeNext(ctx, t, l, first, next)
		if errors.Is(err, ErrDeadlock) {
			c.victim <- l
		}
		c.errs <- err
	}
	go wait(l1, h1, k1)
	go wait(l2, h2, k2)
	return c
}

// ends waits for both waits to end (failing the test if ctx ends first) and says how many ended with ErrDeadlock,
// and, when exactly one did, its Locker. Any other error than ErrDeadlock fails the test.
func (c *crossing) ends(ctx context.Context, t *testing.T) (dead int, victim *Locker) {
	t.Helper()
	for range 2 {
		select {
		case err := <-c.errs:
			switch {
			case errors.Is(err, ErrDeadlock):
				dead++
			case err != nil:
				t.Errorf("a wait of the cycle ended with %v, want ErrDeadlock or the key", err)
			}
		case <-ctx.Done():
			t.Fatal("the cycle did not end")
		}
	}
	if dead == 1 {
		victim = <-c.victim
	}
	return dead, victim
}

// A cycle that forms while a detection query runs: the reading that was under way sees no cycle, and is judged
// after the cycle formed. The next readings find it, and exactly one of the two waits ends with ErrDeadlock; the
// other gets its key.
func TestDeadlockFormsDuringReading(t *testing.T) {
	b := setup(t)
	l2 := New(pgtest.Pool(t, b.url, nil))
	defer l2.Close()
	ctx := ctxT(t, 30*time.Second)
	a, bk := key(t), key(t)

	la, err := b.l.Lock(ctx, a) // caller 1 holds a
	if err != nil {
		t.Fatal(err)
	}
	lb, err := l2.Lock(ctx, bk) // caller 2 holds b
	if err != nil {
		t.Fatal(err)
	}

	take := func(l *Locker, first *Lock, next Key) error { return takeNext(ctx, t, l, first, next) }
	var mu sync.Mutex
	var formed time.Time
	readings := 0
	errs := make(chan error, 2)
	var ends sync.WaitGroup
	ends.Add(1)
	hook := func(l *Locker) bool {
		mu.Lock()
		defer mu.Unlock()
		if l != b.l {
			return false
		}
		if readings++; readings != 1 {
			return false
		}
		// The first reading of caller 1's Locker has its answer, in which caller 1 waits for b and caller 2
		// waits for nothing. Now caller 2 asks for a, and the cycle forms before that answer is judged.
		go func() {
			defer ends.Done()
			errs <- take(l2, lb, a)
		}()
		for !b.waiting(t, a) {
			time.Sleep(2 * time.Millisecond)
		}
		formed = time.Now()
		return false
	}
	testHookGraphRead.Store(&hook)
	defer testHookGraphRead.Store(nil)

	got1 := take(b.l, la, bk) // caller 1 waits for b: watched, so its Locker reads the graph
	ends.Wait()
	testHookGraphRead.Store(nil)
	got2 := <-errs
	mu.Lock()
	t.Logf("caller 1: %v; caller 2: %v; %d readings by caller 1's Locker; ended %v after the cycle formed",
		got1, got2, readings, time.Since(formed).Round(time.Millisecond))
	if readings < 2 {
		t.Errorf("the cycle was never read after it formed")
	}
	mu.Unlock()
	dead := 0
	for _, err := range []error{got1, got2} {
		switch {
		case errors.Is(err, ErrDeadlock):
			dead++
		case err != nil:
			t.Errorf("a wait of the cycle ended with %v, want ErrDeadlock or the key", err)
		}
	}
	if dead != 1 {
		t.Errorf("%d waits ended with ErrDeadlock, want exactly one", dead)
	}
	b.waitFree(t, a)
	b.waitFree(t, bk)
}

// The victim's key is granted as the reading that chose it is judged: the other wait of the cycle gave up and
// released its first key, and the server granted that key to the victim before the stale answer ended the
// victim's wait. The victim then either has the key (a grant the server shows) or ErrDeadlock and nothing (its
// session closed, so the server dropped the grant): never an error while the server holds the key for it.
func TestDeadlockVictimGrantedAsItIsChosen(t *testing.T) {
	outcomes, hit, runs := map[string]int{}, 0, 0
	for ; runs < 3 || hit == 0 && runs < 10; runs++ {
		o := victimGrantedRace(t)
		outcomes[o]++
		if strings.Contains(o, "as the answer was judged") {
			hit++
		}
	}
	t.Logf("the victim's outcomes: %v", outcomes)
	if hit == 0 { // every run took the early way out: the moment this test is about never came
		t.Errorf("the grant never landed as the answer was judged in %d runs: %v", runs, outcomes)
	}
}

func victimGrantedRace(t *testing.T) string {
	b := setup(t)
	l2 := New(pgtest.Pool(t, b.url, nil))
	defer l2.Close()
	ctx := ctxT(t, 30*time.Second)
	a, bk := key(t), key(t)
	va, _ := a.Int64()
	vb, _ := bk.Int64()
	waiter := func(v int64) uint32 { // the pid the server shows waiting for v, or 0
		rows, err := pgtest.Locks(context.Background(), b.obs)
		if err != nil {
			t.Error(err)
		}
		for _, r := range rows {
			if !r.Granted && r.Int64Key(v) {
				return r.PID
			}
		}
		return 0
	}
	type caller struct {
		l      *Locker
		first  *Lock
		next   Key
		ctx    context.Context
		cancel context.CancelFunc
		err    error
		pid    uint32 // the pid of its wait
		obs    *pgx.Conn
		done   chan struct{} // closed when its Lock returned
	}
	c1, c2 := &caller{l: b.l, next: bk}, &caller{l: l2, next: a}
	var err error
	if c1.first, err = b.l.Lock(ctx, a); err != nil {
		t.Fatal(err)
	}
	if c2.first, err = l2.Lock(ctx, bk); err != nil {
		t.Fatal(err)
	}
	c1.ctx, c1.cancel = context.WithCancel(ctx)
	c2.ctx, c2.cancel = context.WithCancel(ctx)

	var mu sync.Mutex
	var victim, other *caller
	judged, raced := 0, false
	hook := func(l *Locker) bool {
		mu.Lock()
		defer mu.Unlock()
		if judged >= 2 {
			return false
		}
		if victim == nil {
			if c1.pid, c2.pid = waiter(vb), waiter(va); c1.pid == 0 || c2.pid == 0 {
				// A wait between two of its statements (a loaded machine): this reading is dropped, so that no
				// Locker counts a sighting of the cycle that the test did not (a CI run's victim ended its wait on
				// its second sighting with one of them uncounted here, and the test saw one reading).
				return true
			}
			victim, other = c1, c2 // the least pid gives up
			if c2.pid < c1.pid {
				victim, other = c2, c1
			}
		}
		if l != victim.l {
			return false
		}
		if judged++; judged < 2 {
			return false
		}
		// This reading's answer ends the victim's wait (the cycle's second sighting). The other caller gives up
		// now and releases its first key, which the server grants to the victim before the answer is judged.
		other.cancel()
		victimKey, _ := victim.next.Int64()
		for deadline := time.Now().Add(10 * time.Second); ; time.Sleep(time.Millisecond) {
			select {
			case <-victim.done: // its Lock returned the grant before this answer was judged: no race this time
				return false
			default:
			}
			pids, err := pgtest.Holders(context.Background(), b.obs, victimKey)
			if err != nil || time.Now().After(deadline) {
				t.Errorf("the victim was not granted %s: %v", victim.next, err)
				return false
			}
			if len(pids) == 1 && pids[0] == victim.pid {
				raced = true
				return false
			}
		}
	}
	testHookGraphRead.Store(&hook)
	defer testHookGraphRead.Store(nil)

	var wg sync.WaitGroup
	for _, c := range []*caller{c1, c2} {
		c.obs, c.done = pgtest.Conn(t, b.url), make(chan struct{}) // the hook has b.obs
		wg.Add(1)
		go func() {
			defer wg.Done()
			lk, err := c.l.Lock(Holding(c.ctx, c.first), c.next)
			close(c.done)
			c.err = err
			v, _ := c.next.Int64()
			pids, qerr := pgtest.Holders(context.Background(), c.obs, v)
			switch {
			case qerr != nil:
				t.Error(qerr)
			case err == nil && (len(pids) != 1 || pids[0] != lk.PID()):
				t.Errorf("Lock of %s returned a lock on pid %d, the server shows holders %v", c.next, lk.PID(), pids)
			case err != nil && slices.Contains(pids, c.pid):
				// A closed session's backend drops its locks a moment after the socket closes: wait for that.
				for deadline := time.Now().Add(5 * time.Second); slices.Contains(pids, c.pid); time.Sleep(5 * time.Millisecond) {
					if time.Now().After(deadline) {
						t.Errorf("Lock of %s failed (%v) while the server holds it for its wait (pid %d)", c.next, err, c.pid)
						break
					}
					if pids, qerr = pgtest.Holders(context.Background(), c.obs, v); qerr != nil {
						t.Error(qerr)
						break
					}
				}
			}
			if err == nil {
				if err := lk.Unlock(ctx); err != nil {
					t.Error(err)
				}
			}
			if err := c.first.Unlock(ctx); err != nil {
				t.Error(err)
			}
		}()
	}
	wg.Wait()
	c1.cancel()
	c2.cancel()
	mu.Lock()
	defer mu.Unlock()
	if judged < 2 {
		t.Fatalf("the victim's Locker read the cycle %d times", judged)
	}
	if !errors.Is(other.err, context.Canceled) {
		t.Errorf("the caller that gave up got %v, want context.Canceled", other.err)
	}
	b.waitFree(t, a)
	b.waitFree(t, bk)
	when := "before the answer was judged"
	if raced {
		when = "as the answer was judged"
	}
	switch {
	case victim.err == nil:
		return "granted " + when
	case errors.Is(victim.err, ErrDeadlock):
		return "ErrDeadlock " + when
	default:
		t.Errorf("the victim got %v, want its key or ErrDeadlock", victim.err)
		return "other"
	}
}

// A cycle that passes through a wait for a pool connection: every connection of the pool is taken (by the locks
// held and by the other wait of the cycle), so one wait is in no server queue and the reading itself finds no
// free connection. The reading goes on a connection of its own, outside the pool; the wait for a connection is
// this Locker's own node; exactly one wait gives up, the other gets its key.
func TestDeadlockPoolExhausted(t *testing.T) {
	for _, tc := range []struct {
		name   string
		conns  int32
		shared int
	}{
		{"a session per lock", 3, 0}, // two held locks and one wait
		{"shared sessions", 2, 4},    // one shared session holding both, and one wait
	} {
		t.Run(tc.name, func(t *testing.T) {
			b := setup(t)
			l := New(pgtest.Pool(t, b.url, func(c *pgxpool.Config) { c.MaxConns = tc.conns }), WithSharedSessions(tc.shared))
			defer l.Close()
			ctx := ctxT(t, 30*time.Second)
			a, bk := key(t), key(t)
			la, err := l.Lock(ctx, a)
			if err != nil {
				t.Fatal(err)
			}
			lb, err := l.Lock(ctx, bk)
			if err != nil {
				t.Fatal(err)
			}
			take := func(first *Lock, next Key) error { return takeNext(ctx, t, l, first, next) }
			errs := make(chan error, 2)
			go func() { errs <- take(la, bk) }()
			for !b.waiting(t, bk) { // in the server's queue, on the pool's last connection
				time.Sleep(5 * time.Millisecond)
			}
			if st := l.Stats(); !st.Pool.Exhausted() {
				t.Fatalf("the pool is not exhausted: %+v", st.Pool)
			}
			start := time.Now()
			go func() { errs <- take(lb, a) }() // waits for a connection of the pool
			got := []error{<-errs, <-errs}
			took := time.Since(start)
			dead := 0
			for _, err := range got {
				switch {
				case errors.Is(err, ErrDeadlock):
					dead++
				case err != nil:
					t.Errorf("a wait of the cycle ended with %v", err)
				}
			}
			t.Logf("after %v: %v; Stats %+v", took.Round(time.Millisecond), got, l.Stats())
			if dead != 1 {
				t.Errorf("%d waits ended with ErrDeadlock, want exactly one", dead)
			}
			b.waitFree(t, a)
			b.waitFree(t, bk)
		})
	}
}

// A reading that fails right after the one that first saw a cycle (the server away for a moment, no connection
// free), or whose answer lacks the wait (between two of its slices), does not make the cycle's confirmation wait a
// whole round: the next reading comes at deadlockConfirm, and the cycle still ends with exactly one ErrDeadlock. A
// second failure in a row waits a round (a server away for long is not asked twice a second).
func TestDeadlockConfirmAfterFailedReading(t *testing.T) {
	for _, miss := range []bool{false, true} {
		name := "failed reading"
		if miss {
			name = "reading without the wait"
		}
		t.Run(name, func(t *testing.T) { testDeadlockConfirmSoon(t, miss) })
	}
}

func testDeadlockConfirmSoon(t *testing.T, miss bool) {
	b := setup(t)
	l2 := New(pgtest.Pool(t, b.url, nil))
	defer l2.Close()
	ctx := ctxT(t, 30*time.Second)
	a, bk := key(t), key(t)

	var mu sync.Mutex
	spoilNext := map[*Locker]int{}        // its next readings to fail or miss its wait
	spoilt := map[*Locker]bool{}          // one of its readings did
	afterSpoilt := map[*Locker][]string{} // the delays it chose from then on
	next := func(l *Locker, d time.Duration) {
		mu.Lock()
		defer mu.Unlock()
		switch {
		case spoilt[l]:
			afterSpoilt[l] = append(afterSpoilt[l], d.String())
		case d == deadlockConfirm: // this reading saw a cycle through one of its waits: spoil the next (two)
			spoilNext[l] = 1
			if !miss {
				spoilNext[l] = 2
			}
		}
	}
	spoil := func(l *Locker) bool {
		mu.Lock()
		defer mu.Unlock()
		if spoilNext[l] == 0 {
			return false
		}
		spoilNext[l]--
		spoilt[l] = true
		return true
	}
	read := func(l *Locker) bool { return !miss && spoil(l) }
	rows := func(l *Locker, rows string) string {
		if !miss || !spoil(l) {
			return rows
		}
		// the answer as if the Locker's waits had been between two slices as pg_locks was read
		own := map[string]bool{}
		l.mu.Lock()
		for w := range l.waiters {
			own[strconv.FormatUint(uint64(w.tag.PID()), 10)] = true
		}
		l.mu.Unlock()
		var kept []string
		for line := range strings.SplitSeq(rows, "\n") {
			if pid, _, _ := strings.Cut(line, "\t"); !own[pid] {
				kept = append(kept, line)
			}
		}
		return strings.Join(kept, "\n")
	}
	testHookNextReading.Store(&next)
	defer testHookNextReading.Store(nil)
	testHookGraphRead.Store(&read)
	defer testHookGraphRead.Store(nil)
	testHookGraphRows.Store(&rows)
	defer testHookGraphRows.Store(nil)

	la, err := b.l.Lock(ctx, a)
	if err != nil {
		t.Fatal(err)
	}
	lb, err := l2.Lock(ctx, bk)
	if err != nil {
		t.Fatal(err)
	}
	dead, _ := cross(ctx, t, b.l, la, bk, l2, lb, a).ends(ctx, t)
	testHookNextReading.Store(nil)
	testHookGraphRead.Store(nil)
	testHookGraphRows.Store(nil)
	if dead != 1 {
		t.Errorf("%d waits ended with ErrDeadlock, want exactly one", dead)
	}
	mu.Lock()
	defer mu.Unlock()
	var victim *Locker
	for _, l := range []*Locker{b.l, l2} {
		if spoilt[l] {
			victim = l
		}
	}
	if victim == nil {
		t.Fatal("no Locker saw the cycle and then had a reading spoilt (the test did not exercise the case)")
	}
	t.Logf("delays chosen after the spoilt reading: %v", afterSpoilt[victim])
	if len(afterSpoilt[victim]) == 0 || afterSpoilt[victim][0] != deadlockConfirm.String() {
		t.Errorf("after a spoilt reading with a cycle seen once, the next reading was due after %v, want %v",
			afterSpoilt[victim], deadlockConfirm)
	}
	if !miss && (len(afterSpoilt[victim]) < 2 || afterSpoilt[victim][1] == deadlockConfirm.String()) {
		t.Errorf("after a second failed reading in a row, the next was due after %v, want a round", afterSpoilt[victim])
	}
	b.waitFree(t, a)
	b.waitFree(t, bk)
}

// A wait of a cycle that gives its session up to another wait and queues for one again (a Locker whose sessions
// of its own are all in use shares them out a slice at a time) is, for a moment, a wait only its own Locker sees.
// The other Locker's readings saw it in the server a moment before, and chose among the waits every client sees:
// its own Locker must choose the same wait (the one whose caller holds the least lock), not end its own as the
// only one it can, so that exactly one wait of the cycle ends with ErrDeadlock. Here every reading of the Locker
// whose wait ranks greater finds that wait just gone from its session; the other Locker's readings see it there.
func TestDeadlockWaitBetweenSessions(t *testing.T) {
	b := setup(t)
	l2 := New(pgtest.Pool(t, b.url, nil))
	defer l2.Close()
	ctx := ctxT(t, 60*time.Second)
	var high atomic.Pointer[Locker] // the Locker whose wait ranks greater: its readings find that wait away
	away := func(l *Locker, w *waiter) bool { return l == awaitLocker(&high) }
	testHookAway.Store(&away)
	defer testHookAway.Store(nil)
	// The other Locker judges its readings 300 ms after the server answered: whichever wait the Locker whose wait is
	// away would choose, it has chosen twice before the other could have ended one.
	late := func(l *Locker) bool {
		if (l == b.l || l == l2) && l != awaitLocker(&high) {
			time.Sleep(300 * time.Millisecond)
		}
		return false
	}
	testHookGraphRead.Store(&late)
	defer testHookGraphRead.Store(nil)
	for round := range 2 {
		high.Store(nil)
		ka, kb, ha, hb := holdTwo(ctx, t, b.l, l2)
		c := cross(ctx, t, b.l, ha, kb, l2, hb, ka)
		b.waitingPIDs(t, kb, ka)
		if heldLess(ha, hb) {
			high.Store(l2)
		} else {
			high.Store(b.l)
		}
		dead, v := c.ends(ctx, t)
		if dead != 1 {
			t.Errorf("round %d: %d waits ended with ErrDeadlock, want exactly one", round, dead)
		} else if v == high.Load() {
			t.Errorf("round %d: the wait that ranks greater gave up, which the other Locker's readings did not choose", round)
		}
		b.waitFree(t, ka)
		b.waitFree(t, kb)
	}
}

// awaitLocker returns what p holds once it holds something (a reading that needs it waits for the test to tell),
// or nil after 10 s.
func awaitLocker(p *atomic.Pointer[Locker]) *Locker {
	for deadline := time.Now().Add(10 * time.Second); time.Now().Before(deadline); time.Sleep(time.Millisecond) {
		if l := p.Load(); l != nil {
			return l
		}
	}
	return nil
}

// A Locker whose readings see a cycle one way and then the other, by turns (here every other reading of the Locker
// whose wait ranks greater shows the other wait's caller holding its lock on a session with a higher pid still),
// does not end its wait on two readings that chose it with one that chose the other wait between them: that one is
// the wait every other client chooses. The other Locker's readings fail for the first 3 s; then it ends its own
// wait, the only ErrDeadlock.
func TestDeadlockChoiceFlips(t *testing.T) {
	b := setup(t)
	l2 := New(pgtest.Pool(t, b.url, nil))
	defer l2.Close()
	ctx := ctxT(t, 60*time.Second)
	ka, kb, ha, hb := holdTwo(ctx, t, b.l, l2)
	var high, low atomic.Pointer[Locker]
	var lowPID atomic.Uint32  // the session that holds the lock of the low wait's caller
	var highPID atomic.Uint32 // and of the high wait's
	var mu sync.Mutex
	readings := 0    // the high Locker's
	flipped := false // its last reading was flipped, and none since showed both waits as they are
	var readsFrom time.Time
	read := func(l *Locker) bool { // the low Locker's readings fail for its first 3 s
		if l != awaitLocker(&low) {
			return false
		}
		mu.Lock()
		defer mu.Unlock()
		if readsFrom.IsZero() {
			readsFrom = time.Now().Add(3 * time.Second)
		}
		return time.Now().Before(readsFrom)
	}
	rows := func(l *Locker, rows string) string {
		if l != awaitLocker(&high) {
			return rows
		}
		// Flipped, then as it is until a reading as it is shows both waits (the cycle, whose other wait it chooses),
		// then flipped again. One that missed either wait, between two of its slices, is a miss to the detector (the
		// high Locker's own wait too: a wait of its in no row), and a miss is allowed between two choices: the next
		// flipped reading would count with the one before.
		other := "h=" + strconv.FormatUint(uint64(lowPID.Load()), 10) + "."
		own := "h=" + strconv.FormatUint(uint64(highPID.Load()), 10) + "."
		mu.Lock()
		defer mu.Unlock()
		readings++
		if flipped {
			var seenOther, seenOwn bool
			for line := range strings.SplitSeq(rows, "\n") {
				if f := strings.Split(line, "\t"); len(f) > 6 && f[5] == "w" {
					seenOther = seenOther || strings.Contains(f[6], other)
					seenOwn = seenOwn || strings.Contains(f[6], own)
				}
			}
			flipped = !seenOther || !seenOwn
			return rows
		}
		flipped = true
		// the session that holds what the other wait's caller holds as if on a pid above this one's
		return raise(rows, lowPID.Load())
	}
	testHookGraphRead.Store(&read)
	defer testHookGraphRead.Store(nil)
	testHookGraphRows.Store(&rows)
	defer testHookGraphRows.Store(nil)
	c := cross(ctx, t, b.l, ha, kb, l2, hb, ka)
	b.waitingPIDs(t, kb, ka)
	if heldLess(ha, hb) {
		lowPID.Store(ha.h.PID())
		highPID.Store(hb.h.PID())
		low.Store(b.l)
		high.Store(l2)
	} else {
		lowPID.Store(hb.h.PID())
		highPID.Store(ha.h.PID())
		low.Store(l2)
		high.Store(b.l)
	}
	dead, v := c.ends(ctx, t)
	testHookGraphRead.Store(nil)
	testHookGraphRows.Store(nil)
	mu.Lock()
	t.Logf("the high Locker's readings: %d", readings)
	enough := readings >= 3
	mu.Unlock()
	if dead != 1 {
		t.Errorf("%d waits ended with ErrDeadlock, want exactly one", dead)
	} else if v == high.Load() {
		t.Error("the wait that ranks greater gave up: its Locker counted two readings that chose it with one that chose the other between them")
	}
	if !enough {
		t.Error("the Locker whose readings flipped read fewer than 3 times: the test did not make its moment")
	}
	b.waitFree(t, ka)
	b.waitFree(t, kb)
}

// waitingPIDs returns the pids of the sessions the server shows waiting for int8 keys a and b, once both wait.
func (b *bundle) waitingPIDs(t *testing.T, a, bk Key) (uint32, uint32) {
	t.Helper()
	var pa, pb uint32
	for deadline := time.Now().Add(10 * time.Second); pa == 0 || pb == 0; time.Sleep(5 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatal("the two waits did not both wait in the server")
		}
		pa, pb = b.waitingPID(t, a), b.waitingPID(t, bk)
	}
	return pa, pb
}

// waitingPID returns the pid of a session the server shows waiting for int8 key k, or 0.
func (b *bundle) waitingPID(t *testing.T, k Key) uint32 {
	t.Helper()
	v, _ := k.Int64()
	rows, err := pgtest.Locks(context.Background(), b.obs)
	if err != nil {
		t.Fatal(err)
	}
	for _, r := range rows {
		if !r.Granted && r.Int64Key(v) {
			return r.PID
		}
	}
	return 0
}

// A Locker reads the lock graph only for a watched wait that has lasted half a second (deadlockFirst), also when
// its detector was started by an earlier wait, granted at once: a wait begun 400 ms later that lasts 300 ms (its
// key held by another Locker meanwhile) used to be read at the first wait's 500 ms, 100 ms into its own.
func TestDeadlockNoReadingOfAYoungWait(t *testing.T) {
	b := setup(t)
	other := New(b.pool)
	defer other.Close()
	ctx := ctxT(t, 60*time.Second)
	nop := func(context.Context) error { return nil }
	for try := 1; ; try++ {
		before := b.l.Stats().GraphReadings
		outer, first, young := key(t), key(t), key(t)
		start := time.Now()
		if err := b.l.Do(ctx, outer, func(ctx context.Context) error { return b.l.Do(ctx, first, nop) }); err != nil {
			t.Fatal(err) // a watched wait granted at once: it starts the detector
		}
		hold, err := other.Lock(ctx, young)
		if err != nil {
			t.Fatal(err)
		}
		time.Sleep(time.Until(start.Add(400 * time.Millisecond)))
		go func() {
			time.Sleep(300 * time.Millisecond)
			if err := hold.Unlock(ctx); err != nil {
				t.Error(err)
			}
		}()
		var began time.Time
		var lasted time.Duration
		err = b.l.Do(ctx, outer, func(ctx context.Context) error {
			began = time.Now()
			defer func() { lasted = time.Since(began) }()
			return b.l.Do(ctx, young, nop)
		})
		if err != nil {
			t.Fatal(err)
		}
		time.Sleep(1500 * time.Millisecond) // past any reading either wait's timer would make
		readings := b.l.Stats().GraphReadings - before
		// The moment the first wait's timer fires (start+deadlockFirst) falls within the second wait, which is
		// younger than deadlockFirst throughout.
		if at := start.Add(deadlockFirst); lasted < deadlockFirst && began.Before(at) && began.Add(lasted).After(at) {
			if readings != 0 {
				t.Errorf("%d readings of the lock graph for waits of %v at most (the first began %v before the second)",
					readings, lasted.Round(time.Millisecond), 400*time.Millisecond)
			}
			return
		}
		// A loaded machine: the second wait came too late, or lasted half a second itself (and may have been read).
		t.Logf("try %d: the second wait began %v after the first and lasted %v; again", try,
			began.Sub(start).Round(time.Millisecond), lasted.Round(time.Millisecond))
		if try == 5 {
			t.Fatalf("in 5 tries no wait shorter than %v across the first's timer: the test proves nothing", deadlockFirst)
		}
	}
}
