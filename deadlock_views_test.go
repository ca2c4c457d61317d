package advlock

import (
	"context"
	"errors"
	"math"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/advlock/advlock/internal/session"
	"github.com/advlock/advlock/internal/testkit/pgtest"
)

// Readings of one cycle that see it differently. Each Locker reads the server on its own schedule, so two Lockers
// judge one cycle on snapshots taken at different moments; between them a wait may have moved to another session
// (a Locker from Open shares its sessions of their own out a slice at a time, and a wait of a cycle may give its
// session up before its own Locker has read the cycle once), or one snapshot may be old when it is judged (its
// answer came late). Every Locker must still choose the same wait.

// Here one Locker's readings show the other Locker's wait on a session with a higher pid than the one it waits on
// (as if read before that wait moved to its present session), and each Locker sends its second reading only once
// the other has judged its first, so that neither wait has ended when either Locker reads. Ranked by the pid it waits
// on, each Locker chose its own wait, and both ended; ranked by what its caller holds, which stays on its session
// whatever session the wait is on, both choose the same wait: the one whose caller holds the least lock.
func TestDeadlockWaitSeenOnAnotherSession(t *testing.T) {
	b := setup(t)
	l2 := New(pgtest.Pool(t, b.url, nil))
	defer l2.Close()
	ctx := ctxT(t, 60*time.Second)
	ka, kb, ha, hb := holdTwo(ctx, t, b.l, l2)
	var seer atomic.Pointer[Locker] // whose readings show the other wait on pid 4294967295
	var moved atomic.Uint32         // that wait's pid
	var mu sync.Mutex
	cond := sync.NewCond(&mu)
	readings := map[*Locker]int{} // judged
	var met atomic.Bool           // a second reading was held back until both Lockers had judged their first
	next := func(l *Locker, d time.Duration) {
		if l != b.l && l != l2 {
			return
		}
		mu.Lock()
		defer mu.Unlock()
		if readings[l] == 1 { // the second reading is sent once the other Locker has judged its first (or 5 s on)
			deadline := time.Now().Add(5 * time.Second)
			tm := time.AfterFunc(5*time.Second, cond.Broadcast)
			defer tm.Stop()
			for min(readings[b.l], readings[l2]) < 1 && time.Now().Before(deadline) {
				cond.Wait()
			}
			if min(readings[b.l], readings[l2]) >= 1 {
				met.Store(true)
			}
		}
	}
	rows := func(l *Locker, rows string) string {
		if l == b.l || l == l2 {
			mu.Lock()
			readings[l]++
			cond.Broadcast()
			mu.Unlock()
		}
		if l != awaitLocker(&seer) {
			return rows
		}
		p := strconv.FormatUint(uint64(moved.Load()), 10)
		var out []string
		for line := range strings.SplitSeq(rows, "\n") {
			if f := strings.Split(line, "\t"); len(f) > 5 && f[0] == p && f[5] == "w" {
				f[0] = "4294967295"
				line = strings.Join(f, "\t")
			}
			out = append(out, line)
		}
		return strings.Join(out, "\n")
	}
	testHookNextReading.Store(&next)
	defer testHookNextReading.Store(nil)
	testHookGraphRows.Store(&rows)
	defer testHookGraphRows.Store(nil)
	c := cross(ctx, t, b.l, ha, kb, l2, hb, ka)
	pa, pb := b.waitingPIDs(t, kb, ka) // b.l's wait, l2's
	if pa < pb {
		moved.Store(pa)
		seer.Store(l2)
	} else {
		moved.Store(pb)
		seer.Store(b.l)
	}
	least := b.l // the Locker whose caller holds the least lock
	if heldLess(hb, ha) {
		least = l2
	}
	dead, v := c.ends(ctx, t)
	testHookNextReading.Store(nil)
	testHookGraphRows.Store(nil)
	mu.Lock()
	t.Logf("readings judged: %d and %d", readings[b.l], readings[l2])
	if !met.Load() {
		t.Error("no second reading waited for both Lockers' first: the test did not make its moment")
	}
	mu.Unlock()
	if dead != 1 {
		t.Errorf("%d waits ended with ErrDeadlock, want exactly one", dead)
	} else if v != least {
		t.Error("the wait whose caller holds the greater lock gave up")
	}
	b.waitFree(t, ka)
	b.waitFree(t, kb)
}

// heldLess reports whether a wait whose caller holds a alone ranks before one whose caller holds b alone.
func heldLess(a, b *Lock) bool {
	return refLess(session.Ref{PID: a.h.PID(), ID: a.key.id, Shared: a.shared}, session.Ref{PID: b.h.PID(), ID: b.key.id, Shared: b.shared})
}

// A reading judged long after it was sent shows what may have changed since: the victim another client chose may be
// gone, or still show for a slice after its Locker ended it, and a wait of this Locker may have left the server
// since (for long enough, it is judged as a wait only its Locker sees). Such a reading counts for nothing: here the
// readings of the Locker whose wait ranks least are judged 600 ms after the server answered for their first 3 s,
// and its wait, the only one to give up, ends only once its readings are judged in time.
func TestDeadlockLateReadingCountsForNothing(t *testing.T) {
	b := setup(t)
	l2 := New(pgtest.Pool(t, b.url, nil))
	defer l2.Close()
	ctx := ctxT(t, 60*time.Second)
	ka, kb, ha, hb := holdTwo(ctx, t, b.l, l2)
	least := b.l
	if heldLess(hb, ha) {
		least = l2
	}
	var mu sync.Mutex
	var from time.Time // the least Locker's first reading
	late := 0
	read := func(l *Locker) bool {
		if l != least {
			return false
		}
		mu.Lock()
		if from.IsZero() {
			from = time.Now()
		}
		slow := time.Since(from) < 3*time.Second
		if slow {
			late++
		}
		mu.Unlock()
		if slow {
			time.Sleep(600 * time.Millisecond)
		}
		return false
	}
	testHookGraphRead.Store(&read)
	defer testHookGraphRead.Store(nil)
	c := cross(ctx, t, b.l, ha, kb, l2, hb, ka)
	dead, v := c.ends(ctx, t)
	ended := time.Now()
	testHookGraphRead.Store(nil)
	mu.Lock()
	defer mu.Unlock()
	t.Logf("readings judged late: %d; the cycle ended %v after the first", late, ended.Sub(from).Round(time.Millisecond))
	if late < 2 {
		t.Error("fewer than two readings were judged late: the test did not make its moment")
	}
	if dead != 1 || v != least {
		t.Errorf("%d waits ended with ErrDeadlock (the least's: %v), want exactly one, the least's", dead, v == least)
	}
	if d := ended.Sub(from); d < 3*time.Second {
		t.Errorf("the cycle ended %v after the first reading judged late: a reading judged late counted", d)
	}
	b.waitFree(t, ka)
	b.waitFree(t, kb)
}

// A reading sent before a wait of its Locker left its session (to give it to another wait), and judged after, shows
// that wait on the session it left: that row is the wait, judged as every client that read it there judges it, not
// a second wait of the same caller beside the one between sessions (the two would draw the choice away from it, to
// another wait that no other client chooses). Here every reading of the Locker whose wait ranks least shows that
// wait in the server while the Locker takes it for one that has just left: it ends that wait, the only ErrDeadlock.
func TestDeadlockReadingShowsAWaitThatLeft(t *testing.T) {
	b := setup(t)
	l2 := New(pgtest.Pool(t, b.url, nil))
	defer l2.Close()
	ctx := ctxT(t, 60*time.Second)
	for round := range 2 {
		ka, kb, ha, hb := holdTwo(ctx, t, b.l, l2)
		least := b.l
		if heldLess(hb, ha) {
			least = l2
		}
		var shown atomic.Int64
		away := func(l *Locker, w *waiter) bool {
			if l == least {
				shown.Add(1)
				return true
			}
			return false
		}
		testHookAwayShown.Store(&away)
		cctx, cancel := context.WithTimeout(ctx, 15*time.Second)
		c := cross(cctx, t, b.l, ha, kb, l2, hb, ka)
		dead, v := c.ends(cctx, t)
		cancel()
		testHookAwayShown.Store(nil)
		if shown.Load() == 0 {
			t.Fatalf("round %d: no reading took the wait for one between sessions: the test did not make its moment", round)
		}
		if dead != 1 || v != least {
			t.Errorf("round %d: %d waits ended with ErrDeadlock (the least's: %v), want exactly one, the least's", round, dead, v == least)
		}
		b.waitFree(t, ka)
		b.waitFree(t, kb)
	}
}

// raise rewrites a reading's rows as if every lock held on a session of pids were held on a session with one of the
// highest pids (the highest for the first, and so on): the granted rows, and what waits' comments say their callers
// hold. The waits of the callers that hold them rank greater.
func raise(rows string, pids ...uint32) string {
	to := map[uint32]uint32{}
	for i, p := range pids {
		to[p] = math.MaxUint32 - uint32(i)
	}
	return repid(rows, to)
}

// repid rewrites a reading's rows as if every lock held on a session with a pid of to's were held on a session with
// the pid it maps to (see raise).
func repid(rows string, to map[uint32]uint32) string {
	var out []string
	for line := range strings.SplitSeq(rows, "\n") {
		f := strings.Split(line, "\t")
		for p, q := range to {
			ps, qs := strconv.FormatUint(uint64(p), 10), strconv.FormatUint(uint64(q), 10)
			if len(f) > 5 && f[0] == ps && f[5] == "g" {
				f[0] = qs
			}
			if len(f) > 6 {
				f[6] = strings.ReplaceAll(f[6], "h="+ps+".", "h="+qs+".")
				f[6] = strings.ReplaceAll(f[6], ","+ps+".", ","+qs+".")
			}
		}
		out = append(out, strings.Join(f, "\t"))
	}
	return strings.Join(out, "\n")
}

// A wait is ended on two readings that chose it in one cycle, not on one that chose it in a cycle whose victim
// has since let go and another that chose it in the cycle that formed then (another caller took what that victim
// held and closed a new cycle through the same wait). Here A (a caller of L1 holding ka) waits for kb behind C, a
// caller of L3 that holds nothing yet; B (L2's, holding kb) waits for ka: the cycle A-B. L1's first reading of it
// ranks A least, L2's rank B least (their readings see it differently); B ends. C takes kb and waits for ka, holding
// it: the cycle A-C, in which every Locker ranks A least. L1 reads again only once that cycle formed: A must end on
// its second reading of A-C, not on its first (which, counted with the reading of A-B, made two: each of the two
// cycles then had one ErrDeadlock, one of them on one reading only, and a checker that cannot tell the cycles apart
// sees two in one).
func TestDeadlockCountsOneCycle(t *testing.T) {
	b := setup(t)
	l2 := New(pgtest.Pool(t, b.url, nil))
	defer l2.Close()
	l3 := New(pgtest.Pool(t, b.url, nil))
	defer l3.Close()
	ctx := ctxT(t, 60*time.Second)
	ka, kb, ha, hb := holdTwo(ctx, t, b.l, l2)
	pa, pb := ha.h.PID(), hb.h.PID()
	var pc atomic.Uint32 // the session C holds kb on
	var formed atomic.Bool
	var mu sync.Mutex
	readsA, readsAC := 0, 0 // L1's readings, and those that showed the cycle A-C
	kaRow := "1\t" + strconv.FormatUint(uint64(uint64(ka.id.V)>>32), 10) + "\t" + strconv.FormatUint(uint64(uint32(ka.id.V)), 10)
	rows := func(l *Locker, rows string) string {
		switch l {
		case b.l:
			mu.Lock()
			readsA++
			if p := pc.Load(); p != 0 {
				for line := range strings.SplitSeq(rows, "\n") {
					if f := strings.Split(line, "\t"); len(f) > 6 && f[5] == "w" && strings.Contains(line, kaRow) &&
						strings.Contains(f[6], "h="+strconv.FormatUint(uint64(p), 10)+".") {
						readsAC++
					}
				}
			}
			mu.Unlock()
			return raise(rows, pb, pc.Load())
		case l2:
			return raise(rows, pa)
		case l3:
			return raise(rows, pc.Load())
		}
		return rows
	}
	var seenFirst atomic.Int64 // after L1's first reading: the readings that chose A (1: it read A-B, and chose A)
	seenFirst.Store(-1)
	next := func(l *Locker, d time.Duration) { // L1 reads again after its first reading only once A-C formed
		mu.Lock()
		n := readsA
		mu.Unlock()
		if l == b.l && n == 1 {
			l.mu.Lock()
			for w := range l.waiters {
				seenFirst.Store(int64(w.seen)) // the detector's goroutine: this one
			}
			l.mu.Unlock()
		}
		for deadline := time.Now().Add(10 * time.Second); l == b.l && n >= 1 && !formed.Load() && time.Now().Before(deadline); {
			time.Sleep(time.Millisecond)
		}
	}
	testHookGraphRows.Store(&rows)
	defer testHookGraphRows.Store(nil)
	testHookNextReading.Store(&next)
	defer testHookNextReading.Store(nil)

	cErr := make(chan error, 1)
	go func() { // C: waits for kb, holding nothing; then, holding it, for ka
		lk, err := l3.Lock(ctx, kb)
		if err != nil {
			cErr <- err
			return
		}
		pc.Store(lk.h.PID())
		cErr <- takeNext(ctx, t, l3, lk, ka)
	}()
	for !b.waiting(t, kb) {
		time.Sleep(5 * time.Millisecond)
	}
	aErr := make(chan error, 1)
	go func() { aErr <- takeNext(ctx, t, b.l, ha, kb) }()
	for deadline := time.Now().Add(10 * time.Second); ; time.Sleep(5 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatal("A did not wait in the server")
		}
		if inServer(b.l) {
			break
		}
	}
	bErr := takeNext(ctx, t, l2, hb, ka)
	if !errors.Is(bErr, ErrDeadlock) {
		t.Fatalf("B ended with %v, want ErrDeadlock (L2's readings rank it least)", bErr)
	}
	for deadline := time.Now().Add(10 * time.Second); pc.Load() == 0 || !b.waiting(t, ka); time.Sleep(5 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatal("C did not take kb and wait for ka")
		}
	}
	formed.Store(true)
	if err := <-aErr; !errors.Is(err, ErrDeadlock) {
		t.Errorf("A ended with %v, want ErrDeadlock", err)
	}
	if err := <-cErr; err != nil {
		t.Errorf("C ended with %v, want the key", err)
	}
	testHookNextReading.Store(nil)
	testHookGraphRows.Store(nil)
	mu.Lock()
	defer mu.Unlock()
	t.Logf("L1's readings: %d, of them of the cycle A-C: %d", readsA, readsAC)
	if seenFirst.Load() != 1 {
		t.Errorf("L1's first reading chose A %d times (-1: none judged): the test did not make its moment", seenFirst.Load())
	}
	if readsAC < 2 {
		t.Errorf("A ended on %d reading(s) of the cycle A-C: a reading of A-B was counted with it", readsAC)
	}
	b.waitFree(t, ka)
	b.waitFree(t, kb)
}

// inServer reports whether a watched wait of l waits in the server.
func inServer(l *Locker) bool {
	l.mu.Lock()
	defer l.mu.Unlock()
	for w := range l.waiters {
		if w.tag.PID() != 0 {
			return true
		}
	}
	return false
}

// A wait of a Locker that left the server a moment ago is judged as the other clients saw it then, but their
// readings now may no longer show it: it may hold a choice back, never make one. Here L's callers: X holds k2 and
// waits for k1 (held shared by W's caller and Y's), W holds k1 shared and waits for k2; M's caller Y holds k1
// shared and waits for k2. L's readings take W for a wait that has just left its session; M's readings no longer
// show W. In M's graph the cycle is X-Y and Y ranks least; in L's, W adds a second cycle through X, which draws L's
// choice to X (the wait both cycles pass through). L must not end X while M ends Y: X ends only if chosen without W
// too. M reads a second time only once L has judged two readings (in which, without the rule, L chose X twice).
// Once Y has ended, the readings show W again, and one wait of X-W ends.
func TestDeadlockRecentWaitChoosesNothing(t *testing.T) {
	b := setup(t)
	l := New(pgtest.Pool(t, b.url, nil), WithSharedSessions(0)) // each lock on a session of its own
	defer l.Close()
	m := New(pgtest.Pool(t, b.url, nil))
	defer m.Close()
	ctx := ctxT(t, 60*time.Second)
	k1, k2 := key(t), key(t)
	hw, err := l.RLock(ctx, k1)
	if err != nil {
		t.Fatal(err)
	}
	hy, err := m.RLock(ctx, k1)
	if err != nil {
		t.Fatal(err)
	}
	hx, err := l.Lock(ctx, k2)
	if err != nil {
		t.Fatal(err)
	}
	px, pw, py := hx.h.PID(), hw.h.PID(), hy.h.PID()
	self := l
	var on atomic.Bool
	on.Store(true)
	away := func(l *Locker, w *waiter) bool {
		return on.Load() && l == self && len(w.held) == 1 && w.held[0].PID == pw
	}
	var mu sync.Mutex
	cond := sync.NewCond(&mu)
	readsL, readsM := 0, 0                     // judged while L's readings took W for a wait that had just left
	var met atomic.Bool                        // M's second reading waited for L's second
	next := func(l *Locker, d time.Duration) { // M reads again once L has judged two readings (or 5 s on)
		mu.Lock()
		defer mu.Unlock()
		if l != m || readsM != 1 {
			return
		}
		tm := time.AfterFunc(5*time.Second, cond.Broadcast)
		defer tm.Stop()
		for deadline := time.Now().Add(5 * time.Second); readsL < 2 && time.Now().Before(deadline); {
			cond.Wait()
		}
		met.Store(readsL >= 2)
	}
	rows := func(l *Locker, rows string) string {
		if on.Load() && (l == self || l == m) {
			mu.Lock()
			if l == self {
				readsL++
			} else {
				readsM++
			}
			cond.Broadcast()
			mu.Unlock()
		}
		if l != m { // Y ranks least (a Locker's own waits are left as they are)
			return repid(rows, map[uint32]uint32{py: 1})
		}
		if !on.Load() {
			return rows
		}
		var out []string // W gone from the server
		for line := range strings.SplitSeq(rows, "\n") {
			if f := strings.Split(line, "\t"); len(f) > 6 && f[5] == "w" && strings.Contains(f[6], "h="+strconv.FormatUint(uint64(pw), 10)+".") {
				continue
			}
			out = append(out, line)
		}
		return raise(strings.Join(out, "\n"), px) // X ranks greatest
	}
	testHookAway.Store(&away)
	defer testHookAway.Store(nil)
	testHookGraphRows.Store(&rows)
	defer testHookGraphRows.Store(nil)
	testHookNextReading.Store(&next)
	defer testHookNextReading.Store(nil)
	type end struct {
		who string
		err error
	}
	ends := make(chan end, 3)
	run := func(who string, l *Locker, held *Lock, k Key) {
		ends <- end{who, takeNext(ctx, t, l, held, k)}
	}
	go run("X", l, hx, k1)
	for deadline := time.Now().Add(10 * time.Second); !inServer(l); time.Sleep(5 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatal("X did not wait in the server")
		}
	}
	go run("W", l, hw, k2)
	go run("Y", m, hy, k2)
	dead := map[string]bool{}
	var order []string // the waits that ended with ErrDeadlock, in turn
	for range 3 {
		select {
		case e := <-ends:
			switch {
			case errors.Is(e.err, ErrDeadlock):
				dead[e.who] = true
				order = append(order, e.who)
				if e.who == "Y" {
					on.Store(false) // from now on the readings see the server as it is
				}
			case e.err != nil:
				t.Errorf("%s ended with %v, want ErrDeadlock or the key", e.who, e.err)
			}
		case <-ctx.Done():
			t.Fatal("the waits did not end")
		}
	}
	t.Logf("ended with ErrDeadlock, in turn: %v", order)
	if !met.Load() {
		t.Error("M read again before L had judged two readings of the cycles: the test did not make its moment")
	}
	switch {
	case len(order) == 0 || order[0] != "Y":
		t.Errorf("%v ended first: L chose X through W, which M's readings no longer showed, while M chose Y", order)
	case len(order) != 2 || order[1] == "Y":
		t.Errorf("after Y, %v ended with ErrDeadlock, want one wait of X-W", order[1:])
	}
	b.waitFree(t, k1)
	b.waitFree(t, k2)
}

// holdTwo takes two new keys, ka with l1 and kb with l2: the start of a cycle of two waits (see cross).
func holdTwo(ctx context.Context, t *testing.T, l1, l2 *Locker) (ka, kb Key, ha, hb *Lock) {
	t.Helper()
	ka, kb = key(t), key(t)
	ha, err := l1.Lock(ctx, ka)
	if err != nil {
		t.Fatal(err)
	}
	hb, err = l2.Lock(ctx, kb)
	if err != nil {
		t.Fatal(err)
	}
	return ka, kb, ha, hb
}
