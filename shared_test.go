package advlock

import (
	"context"
	"errors"
	neturl "net/url"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/advlock/advlock/internal/config"
	"github.com/advlock/advlock/internal/session"
	"github.com/advlock/advlock/internal/testkit/faults"
	"github.com/advlock/advlock/internal/testkit/pgtest"
	"github.com/jackc/pgx/v5/pgxpool"
)

// proxiedPool is a pool of conns connections that reach url's server through a fault proxy.
func proxiedPool(t *testing.T, url string, conns int32) (*faults.Proxy, *pgxpool.Pool) {
	t.Helper()
	u, err := neturl.Parse(url)
	if err != nil {
		t.Fatal(err)
	}
	p := faults.Start(t, u.Host)
	u.Host = p.Addr()
	return p, pgtest.Pool(t, u.String(), func(c *pgxpool.Config) { c.MaxConns = conns })
}

// heldBy returns, from pg_locks, the server pid holding each int8 key granted in the current database.
func heldBy(t *testing.T, b *bundle) map[int64]uint32 {
	t.Helper()
	rows, err := pgtest.Locks(context.Background(), b.obs)
	if err != nil {
		t.Fatal(err)
	}
	m := map[int64]uint32{}
	for _, r := range rows {
		if r.Granted && r.ObjSubID == 1 {
			m[int64(uint64(r.ClassID)<<32|uint64(r.ObjID))] = r.PID
		}
	}
	return m
}

// 5,000 keys held at once by 64 goroutines through one Locker sit on at most 4 server sessions. When one of those
// sessions is terminated, exactly the locks on it are reported lost, the others stay held, and the Locker goes on
// working.
func TestSharedThousands(t *testing.T) {
	const n, workers = 5000, 64
	url := pgtest.URL(t)
	pool := pgtest.Pool(t, url, func(c *pgxpool.Config) { c.MaxConns = 8 })
	l := New(pool)
	defer l.Close()
	b := &bundle{url: url, pool: pool, l: l, obs: pgtest.Conn(t, url)}
	ctx := ctxT(t, 60*time.Second)

	locks := make([]*Lock, n)
	var wg sync.WaitGroup
	for w := range workers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := w; i < n; i += workers {
				lk, err := l.TryLock(ctx, key(t))
				if err != nil {
					t.Error(err)
					return
				}
				locks[i] = lk
			}
		}()
	}
	wg.Wait()
	if t.Failed() {
		t.FailNow()
	}
	held := heldBy(t, b)
	perPID := map[uint32][]*Lock{}
	for _, lk := range locks {
		v, _ := lk.Key().Int64()
		pid, ok := held[v]
		if !ok {
			t.Fatalf("%s reported held, pg_locks does not show it", lk.Key())
		}
		perPID[pid] = append(perPID[pid], lk)
	}
	t.Logf("%d locks on %d server sessions", n, len(perPID))
	if len(perPID) > 4 {
		t.Errorf("%d locks on %d server sessions, want at most 4", n, len(perPID))
	}
	if got := int(pool.Stat().AcquiredConns()); got > 4 {
		t.Errorf("%d pool connections pinned for %d locks, want at most 4", got, n)
	}

	var victim uint32
	for pid, lks := range perPID {
		if victim == 0 || len(lks) > len(perPID[victim]) {
			victim = pid
		}
	}
	start := time.Now()
	pgtest.Terminate(t, b.obs, victim)
	var last time.Duration
	for _, lk := range perPID[victim] {
		last = max(last, waitDone(t, lk, 10*time.Second))
		if !errors.Is(lk.Err(), ErrLockLost) {
			t.Fatalf("a lock on the terminated session: Err = %v, want ErrLockLost", lk.Err())
		}
	}
	t.Logf("all %d locks of the terminated session reported lost %v after pg_terminate_backend returned (%v from the call)",
		len(perPID[victim]), last, time.Since(start))
	if last > 2*time.Second {
		t.Errorf("the locks of a terminated shared session were reported lost after %v", last)
	}
	held = heldBy(t, b)
	for pid, lks := range perPID {
		if pid == victim {
			continue
		}
		for _, lk := range lks {
			v, _ := lk.Key().Int64()
			if lk.Err() != nil || held[v] != pid {
				t.Fatalf("a lock on another session was disturbed: Err %v, pg_locks pid %d (was %d)", lk.Err(), held[v], pid)
			}
		}
	}

	again, err := l.TryLock(ctx, key(t)) // the Locker replaces the lost session
	if err != nil {
		t.Fatalf("TryLock after a shared session was lost: %v", err)
	}
	for _, lk := range append(locks, again) {
		err := lk.Unlock(ctx)
		if lk.Err() != nil && errors.Is(err, ErrLockLost) {
			continue // one of the victim's
		}
		if err != nil {
			t.Fatal(err)
		}
	}
	if rest := heldBy(t, b); len(rest) > 0 {
		for _, lk := range locks {
			v, _ := lk.Key().Int64()
			if _, ok := rest[v]; ok {
				t.Fatalf("%s still held after every Unlock", lk.Key())
			}
		}
	}
}

// Pair keys go through shared sessions as two int4 halves, negative ones included, and stay a key space of their
// own: an Int64Key with the same 64 bits is a different lock.
func TestSharedPairKeys(t *testing.T) {
	b := setup(t)
	ctx := ctxT(t, 10*time.Second)
	a := int32(time.Now().UnixNano() % 1e6)
	keys := []Key{PairKey(-a, 7), PairKey(7, -a), PairKey(-1, -a)}
	var held []*Lock
	for i, k := range keys {
		var lk *Lock
		var err error
		if i == 2 {
			lk, err = b.l.TryRLock(ctx, k)
		} else {
			lk, err = b.l.TryLock(ctx, k)
		}
		if err != nil {
			t.Fatal(err)
		}
		held = append(held, lk)
		hi, lo, _ := k.Pair() // the same bits as an int8 key: another lock
		other, err := b.l.TryLock(ctx, Int64Key(int64(hi)<<32|int64(uint32(lo))))
		if err != nil {
			t.Fatalf("Int64Key with the bits of %s: %v, want it free (another key space)", k, err)
		}
		held = append(held, other)
	}
	rows, err := pgtest.Locks(ctx, b.obs)
	if err != nil {
		t.Fatal(err)
	}
	for i, k := range keys {
		hi, lo, _ := k.Pair()
		mode := "ExclusiveLock"
		if i == 2 {
			mode = "ShareLock"
		}
		found := false
		for _, r := range rows {
			found = found || r.Granted && r.ObjSubID == 2 && int32(r.ClassID) == hi && int32(r.ObjID) == lo && r.Mode == mode
		}
		if !found {
			t.Errorf("pg_locks has no %s row for %s", mode, k)
		}
	}
	for _, lk := range held {
		if err := lk.Unlock(ctx); err != nil {
			t.Fatal(err)
		}
	}
	rows, err = pgtest.Locks(ctx, b.obs)
	if err != nil {
		t.Fatal(err)
	}
	for _, r := range rows {
		for _, k := range keys {
			if hi, lo, _ := k.Pair(); r.ObjSubID == 2 && int32(r.ClassID) == hi && int32(r.ObjID) == lo {
				t.Errorf("%s still in pg_locks after Unlock: %v", k, r)
			}
		}
	}
}

// A caller that arrives just as the quiet socket passes to the background reader (after session.WatchDelay) is
// answered at once: its round trip goes out, and the reader, once started, reads the answer and hands the socket
// back. (When a caller took the socket back by a past read deadline, the reader set its own deadline after letting
// go of the Mux's lock, and a caller that asked in between had its "yield now" deadline overwritten and waited for
// the keepalive bound: a call stalled for a whole keepalive interval, seen as 5 s stalls under contention.) The
// hook holds the reader at that moment until the caller's round trip is out.
func TestSharedNoStallAfterQuiet(t *testing.T) {
	url := pgtest.URL(t)
	pool := pgtest.Pool(t, url, func(c *pgxpool.Config) { c.MaxConns = 4 })
	l := New(pool, WithKeepalive(3*time.Second))
	defer l.Close()
	ctx := ctxT(t, 60*time.Second)
	k := Int64Key(time.Now().UnixNano())
	cycle := func() {
		lk, err := l.TryLock(ctx, k)
		if err != nil {
			t.Error(err)
			return
		}
		if err := lk.Unlock(ctx); err != nil {
			t.Error(err)
		}
	}
	cycle() // the shared session is open; its socket goes quiet and the background reader will start
	var once sync.Once
	took := make(chan time.Duration, 1)
	session.SetTestHookReaderStarting(func(asked func() bool) {
		once.Do(func() {
			go func() {
				t0 := time.Now()
				cycle()
				took <- time.Since(t0)
			}()
			for deadline := time.Now().Add(5 * time.Second); !asked() && time.Now().Before(deadline); {
				time.Sleep(time.Millisecond)
			}
		})
	})
	defer session.SetTestHookReaderStarting(nil)
	time.Sleep(50 * session.WatchDelay)
	select {
	case d := <-took:
		if d > 1500*time.Millisecond {
			t.Fatalf("the call took %v: it waited for the keepalive bound", d)
		}
		t.Logf("the call took %v", d)
	case <-time.After(10 * time.Second):
		t.Fatal("the background reader never started, or the call never returned")
	}
}

// The first shared session of a Locker over an application's pool (one idle connection, pinged before it is
// handed out since it has been idle a while) opened into a network that drops every packet: TryLock under a
// context without a deadline fails within the default bound (session.VerifyBound), and Close does not wait behind
// it. It hung for as long as the network did.
func TestSharedOpenDefaultBound(t *testing.T) {
	t.Parallel()
	url := pgtest.URL(t)
	p, pool := proxiedPool(t, url, 2)
	if err := pool.Ping(context.Background()); err != nil {
		t.Fatal(err)
	}
	l := New(pool)
	time.Sleep(1200 * time.Millisecond)
	p.Blackhole(true)
	start := time.Now()
	done := make(chan error, 1)
	go func() {
		_, err := l.TryLock(context.Background(), key(t))
		done <- err
	}()
	select {
	case err := <-done:
		took := time.Since(start)
		t.Logf("TryLock failed after %v: %v", took.Round(time.Millisecond), err)
		if err == nil || took < session.VerifyBound-time.Second {
			t.Errorf("TryLock into a blackhole: %v after %v, want a failure at the bound (%v)", err, took, session.VerifyBound)
		}
	case <-time.After(session.VerifyBound + 10*time.Second):
		p.Cut()
		p.Blackhole(false)
		<-done
		t.Fatal("TryLock hung opening a shared session in a blackhole")
	}
	closed := make(chan struct{})
	go func() { l.Close(); close(closed) }()
	pgtest.WaitClosed(t, closed, 3*time.Second, "Close after the failed open returned")
	p.Cut()
	p.Blackhole(false)
}

// failOpen is a connection on which the setup of a shared session fails after a moment (as a server might refuse
// it), everything else working.
type failOpen struct {
	session.Conn
	opens *atomic.Int64
}

func (c *failOpen) QueryInt(ctx context.Context, sql string, args ...any) (int64, error) {
	// The shared session's own setting (frozenSQL), not a wait's statement that may give its session one while it
	// holds a key's intent (a Lock whose wait starts later than publishAfter sends that one).
	if strings.HasPrefix(sql, "SELECT CASE WHEN current_setting('server_version_num')") && strings.Contains(sql, "idle_session_timeout") {
		c.opens.Add(1)
		time.Sleep(30 * time.Millisecond)
		return 0, errors.New("shared session refused by the test")
	}
	return c.Conn.QueryInt(ctx, sql, args...)
}

// When shared sessions cannot be opened, callers get the failure, each after the open it waited for (tries), and
// no caller starts opens in a loop; a Lock, which may wait, takes a session of its own and gets the key. Two
// callers used to restart each other's opens until their contexts ended (565 failed opens in 5 s).
func TestSharedOpenFails(t *testing.T) {
	url := pgtest.URL(t)
	var opens atomic.Int64
	l := New(pgtest.Pool(t, url, func(c *pgxpool.Config) { c.MaxConns = 8 }), option(func(o *config.Options) {
		o.Wrap = func(c session.Conn) session.Conn { return &failOpen{Conn: c, opens: &opens} }
	}))
	defer l.Close()
	ctx := ctxT(t, 20*time.Second)
	start := time.Now()
	var wg sync.WaitGroup
	for range 4 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			if _, err := l.TryLock(ctx, key(t)); err == nil || !strings.Contains(err.Error(), "refused by the test") {
				t.Errorf("TryLock with shared sessions failing to open: %v, want the open's error", err)
			}
		}()
	}
	wg.Wait()
	t.Logf("4 tries failed after %v, %d opens", time.Since(start).Round(time.Millisecond), opens.Load())
	if opens.Load() > 8 || time.Since(start) > 5*time.Second {
		t.Errorf("4 tries took %v and %d opens", time.Since(start), opens.Load())
	}
	lk, err := l.Lock(ctx, key(t))
	if err != nil {
		t.Fatalf("Lock with shared sessions failing to open: %v, want the key on a session of its own", err)
	}
	if err := lk.Unlock(ctx); err != nil {
		t.Fatal(err)
	}
}

// A pool of 1 gets no shared session (it would pin the only connection for the Locker's life): every lock takes
// the connection for as long as it is held, and the application has it back after the Unlock.
func TestPoolOfOne(t *testing.T) {
	pool := pgtest.Pool(t, pgtest.URL(t), func(c *pgxpool.Config) { c.MaxConns = 1 })
	l := New(pool)
	defer l.Close()
	ctx := ctxT(t, 10*time.Second)
	for range 3 {
		lk, err := l.TryLock(ctx, key(t))
		if err != nil {
			t.Fatal(err)
		}
		if err := lk.Unlock(ctx); err != nil {
			t.Fatal(err)
		}
		qctx, cancel := context.WithTimeout(ctx, time.Second)
		err = pool.QueryRow(qctx, "SELECT 1").Scan(new(int))
		cancel()
		if err != nil {
			t.Fatalf("the application's query after an Unlock: %v", err)
		}
	}
	if st := l.Stats(); st.SharedSessions != 0 {
		t.Errorf("Stats %+v: a shared session on a pool of 1", st)
	}
}

// A try on a shared session whose round trip goes unanswered (the network drops every packet) fails when the
// keepalive bound ends the session, with an error that says the session ended, as a server's termination would;
// the lock the session held is lost; nothing stays held once the server sees the socket go. The try's error was a
// bare "keepalive: no answer" before, which no documented outcome matched.
func TestSharedTryUnansweredEndsSession(t *testing.T) {
	t.Parallel()
	url := pgtest.URL(t)
	p, pool := proxiedPool(t, url, 4)
	l := New(pool, WithKeepalive(300*time.Millisecond))
	t.Cleanup(l.Close)
	obs := pgtest.Conn(t, url)
	b := &bundle{url: url, pool: pool, l: l, obs: obs}
	k1, k2 := key(t), key(t)
	lk, err := l.TryLock(ctxT(t, 10*time.Second), k1)
	if err != nil {
		t.Fatal(err)
	}
	if _, ok := lk.h.(*session.Held); !ok {
		t.Fatal("the first lock is not on a shared session")
	}
	p.Blackhole(true)
	start := time.Now()
	_, err = l.TryLock(ctxT(t, 10*time.Second), k2)
	took := time.Since(start)
	t.Logf("try into a blackhole: %v after %v", err, took.Round(time.Millisecond))
	if err == nil || !session.Ended(err) || errors.Is(err, ErrNotAcquired) {
		t.Errorf("try on a shared session that stopped answering: %v, want an error that says the session ended", err)
	}
	if took > 5*time.Second {
		t.Errorf("the unanswered try took %v (keepalive 300ms)", took)
	}
	waitDone(t, lk, 5*time.Second)
	if !errors.Is(lk.Err(), ErrLockLost) {
		t.Errorf("the held lock's Err after its session ended: %v, want ErrLockLost", lk.Err())
	}
	p.Cut()
	p.Blackhole(false)
	b.waitFree(t, k1)
	b.waitFree(t, k2)
}

// A Lock whose first try goes out on a shared session that dies while the try is on the wire (the network cut as
// the answer crawls back) goes on waiting, and gets the key, instead of failing: the try's grant, if any, ended with
// the session. It returned the session's end before.
func TestLockTryOnDyingSharedSession(t *testing.T) {
	t.Parallel()
	url := pgtest.URL(t)
	p, pool := proxiedPool(t, url, 4)
	l := New(pool)
	t.Cleanup(l.Close)
	obs := pgtest.Conn(t, url)
	b := &bundle{url: url, pool: pool, l: l, obs: obs}
	ctx := ctxT(t, 20*time.Second)
	warm, err := l.TryLock(ctx, key(t)) // the shared session is open
	if err != nil {
		t.Fatal(err)
	}
	if err := warm.Unlock(ctx); err != nil {
		t.Fatal(err)
	}
	k := key(t)
	p.Latency(300 * time.Millisecond)
	done := make(chan error, 1)
	var lk *Lock
	go func() {
		var err error
		lk, err = l.Lock(ctx, k)
		done <- err
	}()
	time.Sleep(150 * time.Millisecond) // the try is on its way
	p.Cut()
	p.Latency(0)
	select {
	case err := <-done:
		if err != nil {
			t.Fatalf("Lock whose try died with its shared session: %v, want the key", err)
		}
	case <-time.After(15 * time.Second):
		t.Fatal("Lock whose try died with its shared session did not return")
	}
	if pid := b.pidOf(t, lk); pid != lk.PID() {
		t.Errorf("the lock is on pid %d, pg_locks says %d", lk.PID(), pid)
	}
	if err := lk.Unlock(ctx); err != nil {
		t.Fatal(err)
	}
	b.waitFree(t, k)
}

// A wait that found its key held marks it contended: for a second after (while waits for it keep coming), a wait
// for that key goes straight to a session of its own, whose one statement tries and queues, instead of first
// trying on a shared session (a round trip that fails under contention, and in which the server's queue may run
// empty for a later caller to take the key first). Afterwards a wait tries on a shared session again.
func TestContendedKeySkipsSharedTry(t *testing.T) {
	t.Parallel()
	b := setup(t)
	other := New(pgtest.Pool(t, b.url, nil))
	t.Cleanup(other.Close)
	ctx := ctxT(t, 20*time.Second)
	k := key(t)
	onShared := func(lk *Lock) bool { _, ok := lk.h.(*session.Held); return ok }
	first, err := b.l.Lock(ctx, k) // free: a shared session's try takes it
	if err != nil {
		t.Fatal(err)
	}
	if !onShared(first) {
		t.Fatal("an uncontended Lock is not on a shared session")
	}
	if err := first.Unlock(ctx); err != nil {
		t.Fatal(err)
	}
	held, err := other.Lock(ctx, k)
	if err != nil {
		t.Fatal(err)
	}
	go func() { time.Sleep(100 * time.Millisecond); _ = held.Unlock(ctx) }()
	waited, err := b.l.Lock(ctx, k) // held elsewhere: tries, then waits on a session of its own
	if err != nil {
		t.Fatal(err)
	}
	if onShared(waited) {
		t.Fatal("a Lock that waited is on a shared session")
	}
	if err := waited.Unlock(ctx); err != nil {
		t.Fatal(err)
	}
	again, err := b.l.Lock(ctx, k) // free, but contended a moment ago: straight to a session of its own
	if err != nil {
		t.Fatal(err)
	}
	if onShared(again) {
		t.Error("a Lock of a key contended a moment ago tried on a shared session first")
	}
	if pid := b.pidOf(t, again); pid != again.PID() {
		t.Errorf("the lock is on pid %d, pg_locks says %d", again.PID(), pid)
	}
	if err := again.Unlock(ctx); err != nil {
		t.Fatal(err)
	}
	time.Sleep(contendedFor + 100*time.Millisecond)
	later, err := b.l.Lock(ctx, k)
	if err != nil {
		t.Fatal(err)
	}
	if !onShared(later) {
		t.Error("a Lock of a key contended more than a second ago did not take it on a shared session")
	}
	if err := later.Unlock(ctx); err != nil {
		t.Fatal(err)
	}
	b.waitFree(t, k)
}

// The contention map forgets keys no longer contended once it holds many.
func TestContentionForgets(t *testing.T) {
	var c contention
	for i := range 1024 {
		c.mark(session.ID{V: int64(i)})
	}
	for id := range c.at {
		c.at[id] = time.Now().Add(-2 * contendedFor)
	}
	c.mark(session.ID{V: -1})
	if len(c.at) != 1 || !c.recent(session.ID{V: -1}) || c.recent(session.ID{V: 5}) {
		t.Errorf("after 1024 stale keys and a new one the map has %d entries", len(c.at))
	}
}
