package advlocktest_test

import (
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/advlock/advlock"
	"github.com/advlock/advlock/advlocktest"
	"github.com/jackc/pgx/v5"
	"go.uber.org/goleak"
)

func TestMain(m *testing.M) {
	if os.Getenv(helperEnv) != "" { // a child of TestThrowawayRemoved
		dsn := advlocktest.DSN(&recorder{}, advlocktest.Env(helperEnv+"_UNSET"))
		cfg, err := pgx.ParseConfig(dsn)
		if err != nil {
			fmt.Println("no server:", err)
			os.Exit(1)
		}
		fmt.Println(cfg.Port)
		os.Exit(0)
	}
	code := m.Run()
	if code == 0 {
		if err := goleak.Find(); err != nil {
			fmt.Fprintln(os.Stderr, "goleak:", err)
			code = 1
		}
	}
	os.Exit(code)
}

const helperEnv = "ADVLOCKTEST_HELPER"

// recorder is a TB that records what a helper reports, so that a test can see a check fail; its cleanups run when
// the test says.
type recorder struct {
	mu       sync.Mutex
	errs     []string
	cleanups []func()
	skipped  string
}

func (r *recorder) Helper()      {}
func (r *recorder) Name() string { return "recorder" }
func (r *recorder) Cleanup(f func()) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.cleanups = append(r.cleanups, f)
}
func (r *recorder) Logf(string, ...any) {}
func (r *recorder) Errorf(format string, args ...any) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.errs = append(r.errs, fmt.Sprintf(format, args...))
}
func (r *recorder) Fatalf(format string, args ...any) {
	r.Errorf(format, args...)
	panic("recorder: Fatalf: " + fmt.Sprintf(format, args...))
}
func (r *recorder) Skipf(format string, args ...any) {
	r.skipped = fmt.Sprintf(format, args...)
	panic("recorder: Skipf: " + r.skipped)
}

// end runs the cleanups, last first, as testing does, and returns what was reported.
func (r *recorder) end() []string {
	for i := len(r.cleanups) - 1; i >= 0; i-- {
		r.cleanups[i]()
	}
	r.cleanups = nil
	return r.errs
}

func ctxT(t *testing.T) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	t.Cleanup(cancel)
	return ctx
}

func open(t *testing.T, dsn string, opts ...advlock.Option) *advlock.Locker {
	t.Helper()
	l, err := advlock.Open(ctxT(t), dsn, opts...)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(l.Close)
	return l
}

var keySeq = time.Now().UnixNano()

func newKey() advlock.Key {
	keySeq++
	return advlock.Int64Key(keySeq)
}

// holders reads, through a connection of the test's own, the server sessions granted key.
func holders(t *testing.T, dsn string, key advlock.Key) []uint32 {
	t.Helper()
	conn, err := pgx.Connect(ctxT(t), dsn)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close(context.Background())
	v, _ := key.Int64()
	var pids []uint32
	err = conn.QueryRow(ctxT(t), `SELECT coalesce(array_agg(pid), '{}') FROM pg_locks WHERE locktype = 'advisory'
		AND granted AND objsubid = 1 AND classid = ($1::int8 >> 32)::oid AND objid = ($1::int8 & 4294967295)::oid`, v).Scan(&pids)
	if err != nil {
		t.Fatal(err)
	}
	return pids
}

// A held key makes the code under test meet ErrNotAcquired; released, the key is free; the holder's session is the
// server's holder.
func TestHold(t *testing.T) {
	dsn := advlocktest.DSN(t)
	l := open(t, dsn)
	key := newKey()
	h := advlocktest.Hold(t, dsn, key)
	if got := holders(t, dsn, key); len(got) != 1 || got[0] != h.PID() {
		t.Fatalf("holders %v, want the holder's session %d", got, h.PID())
	}
	if _, err := l.TryLock(ctxT(t), key); !errors.Is(err, advlock.ErrNotAcquired) {
		t.Fatalf("TryLock while held elsewhere: %v, want ErrNotAcquired", err)
	}
	if _, err := l.TryRLock(ctxT(t), key); !errors.Is(err, advlock.ErrNotAcquired) {
		t.Fatalf("TryRLock while held elsewhere: %v, want ErrNotAcquired", err)
	}
	got := waiting(t, l, key, 300*time.Millisecond, "Lock while held elsewhere")
	h.Release()
	if err := <-got; err != nil {
		t.Fatalf("Lock after Release: %v", err)
	}

	s := advlocktest.HoldShared(t, dsn, key)
	rl, err := l.TryRLock(ctxT(t), key)
	if err != nil {
		t.Fatalf("TryRLock beside a shared holder: %v", err)
	}
	if _, err := l.TryLock(ctxT(t), key); !errors.Is(err, advlock.ErrNotAcquired) {
		t.Fatalf("TryLock beside a shared holder: %v, want ErrNotAcquired", err)
	}
	if err := rl.Unlock(ctxT(t)); err != nil {
		t.Fatal(err)
	}
	s.Release()
	if got := holders(t, dsn, key); len(got) != 0 {
		t.Fatalf("holders after Release: %v", got)
	}
}

// Hold and HoldShared hold the key against a Locker of leases too (the lease table's row, server truth): its try
// fails and its Lock waits while held, and both pass once released; the lease goes with Release.
func TestHoldLeases(t *testing.T) {
	dsn := advlocktest.DSN(t)
	l := open(t, dsn, advlock.WithLeases())
	for _, shared := range []bool{false, true} {
		key := newKey()
		var h *advlocktest.Holder
		if shared {
			h = advlocktest.HoldShared(t, dsn, key)
		} else {
			h = advlocktest.Hold(t, dsn, key)
		}
		if _, err := l.TryLock(ctxT(t), key); !errors.Is(err, advlock.ErrNotAcquired) {
			t.Fatalf("shared=%v: a lease's TryLock while held: %v, want ErrNotAcquired", shared, err)
		}
		if n := leaseRows(t, dsn, key); n != 1 {
			t.Fatalf("shared=%v: %d rows of the key in the lease table while held, want the holder's 1", shared, n)
		}
		got := waiting(t, l, key, 500*time.Millisecond, fmt.Sprintf("shared=%v: a lease's Lock while held", shared))
		h.Release()
		if err := <-got; err != nil {
			t.Fatalf("shared=%v: a lease's Lock after Release: %v", shared, err)
		}
		if n := leaseRows(t, dsn, key); n != 0 {
			t.Fatalf("shared=%v: %d rows of the key in the lease table after Release", shared, n)
		}
	}
}

// waiting starts l.Lock(key) (unlocking once granted), fails the test if it returns within d, and returns where
// its outcome arrives.
func waiting(t *testing.T, l *advlock.Locker, key advlock.Key, d time.Duration, what string) <-chan error {
	t.Helper()
	got := make(chan error, 1)
	go func() {
		lk, err := l.Lock(ctxT(t), key)
		if err == nil {
			err = lk.Unlock(context.Background())
		}
		got <- err
	}()
	select {
	case err := <-got:
		t.Fatalf("%s returned: %v, want a wait", what, err)
	case <-time.After(d):
	}
	return got
}

// leaseRows counts the lease table's rows of key.
func leaseRows(t *testing.T, dsn string, key advlock.Key) int {
	t.Helper()
	conn, err := pgx.Connect(ctxT(t), dsn)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close(context.Background())
	space, v := int16(1), int64(0)
	if n, ok := key.Int64(); ok {
		v = n
	} else {
		a, b, _ := key.Pair()
		space, v = 2, int64(a)<<32|int64(uint32(b))
	}
	var exists bool
	if err := conn.QueryRow(ctxT(t), "SELECT to_regclass('public.advlock_lease') IS NOT NULL").Scan(&exists); err != nil {
		t.Fatal(err)
	}
	if !exists { // no Locker of leases has used this server yet
		return 0
	}
	var n int
	if err := conn.QueryRow(ctxT(t), "SELECT count(*) FROM public.advlock_lease WHERE space = $1 AND key = $2",
		space, v).Scan(&n); err != nil {
		t.Fatal(err)
	}
	return n
}

// A kind of session, and the options that give it.
type kind struct {
	name string
	opts []advlock.Option
}

var sessionKinds = []kind{
	{"shared session", nil},
	{"session per lock", []advlock.Option{advlock.WithSharedSessions(0)}},
}

// What Lose does to a lock is what pg_terminate_backend does: for each kind of session, the lock lost through Lose
// and the lock lost through a terminate of its session by hand report the same (Done, Err, Unlock, Do's ctx).
func TestLoseIsTerminate(t *testing.T) {
	for _, kind := range sessionKinds {
		t.Run(kind.name, func(t *testing.T) {
			dsn := advlocktest.DSN(t)
			l := open(t, dsn, kind.opts...)
			outcome := func(lose func(lk *advlock.Lock)) string {
				key := newKey()
				lk, err := l.TryLock(ctxT(t), key)
				if err != nil {
					t.Fatal(err)
				}
				if got := holders(t, dsn, key); len(got) != 1 || got[0] != lk.PID() {
					t.Fatalf("holders %v, want %d", got, lk.PID())
				}
				lose(lk)
				select {
				case <-lk.Done():
				case <-time.After(10 * time.Second):
					t.Fatal("Done not closed")
				}
				if got := holders(t, dsn, key); len(got) != 0 {
					t.Fatalf("holders after the loss: %v", got)
				}
				unlockErr := lk.Unlock(ctxT(t))
				doErr := l.Do(ctxT(t), key, func(context.Context) error { return nil }) // the key is free again
				return fmt.Sprintf("Err is ErrLockLost: %v; Unlock is ErrLockLost: %v; Do after: %v",
					errors.Is(lk.Err(), advlock.ErrLockLost), errors.Is(unlockErr, advlock.ErrLockLost), doErr)
			}
			byKit := outcome(func(lk *advlock.Lock) { advlocktest.Lose(t, lk) })
			byHand := outcome(func(lk *advlock.Lock) {
				conn, err := pgx.Connect(ctxT(t), dsn)
				if err != nil {
					t.Fatal(err)
				}
				defer conn.Close(context.Background())
				if _, err := conn.Exec(ctxT(t), "SELECT pg_terminate_backend($1)", int64(lk.PID())); err != nil {
					t.Fatal(err)
				}
			})
			want := "Err is ErrLockLost: true; Unlock is ErrLockLost: true; Do after: <nil>"
			if byKit != want || byHand != want {
				t.Fatalf("Lose: %s\nterminate by hand: %s\nwant both: %s", byKit, byHand, want)
			}
		})
	}
}

// Do's fn sees its ctx end with ErrLockLost when Lose ends its lock; for a lease too.
func TestLoseDuringDo(t *testing.T) {
	for _, kind := range append(sessionKinds, kind{"lease", []advlock.Option{advlock.WithLeases(), advlock.WithLeaseLength(3 * time.Second)}}) {
		t.Run(kind.name, func(t *testing.T) {
			dsn := advlocktest.DSN(t)
			l := open(t, dsn, kind.opts...)
			key := newKey()
			lk, err := l.TryLock(ctxT(t), key)
			if err != nil {
				t.Fatal(err)
			}
			inFn := make(chan struct{})
			done := make(chan error, 1)
			other := newKey()
			go func() {
				done <- l.Do(ctxT(t), other, func(ctx context.Context) error {
					close(inFn)
					<-ctx.Done()
					return context.Cause(ctx)
				})
			}()
			<-inFn
			advlocktest.Lose(t, lk)
			if !errors.Is(lk.Err(), advlock.ErrLockLost) {
				t.Fatalf("Err after Lose: %v", lk.Err())
			}
			if kind.name == "shared session" { // Do's lock is on the same shared session: lost with it
				if err := <-done; !errors.Is(err, advlock.ErrLockLost) {
					t.Fatalf("Do on the same shared session: %v, want ErrLockLost", err)
				}
				return
			}
			select {
			case err := <-done:
				t.Fatalf("Do of another key ended with the loss of a lock on another session: %v", err)
			case <-time.After(200 * time.Millisecond):
			}
			// Lose the Do's own lock through its key, as for a leader's.
			advlocktest.LoseKey(t, dsn, other)
			select {
			case err := <-done:
				if !errors.Is(err, advlock.ErrLockLost) {
					t.Fatalf("Do after LoseKey: %v, want ErrLockLost", err)
				}
			case <-time.After(20 * time.Second):
				t.Fatal("Do's fn not told of LoseKey")
			}
		})
	}
}

// LoseKey ends a leader's term: Lead's fn sees its ctx end, and Lead campaigns and leads again.
func TestLoseKeyLeader(t *testing.T) {
	dsn := advlocktest.DSN(t)
	l := open(t, dsn)
	key := newKey()
	terms := make(chan context.Context, 4)
	ctx, cancel := context.WithCancel(ctxT(t))
	led := make(chan error, 1)
	go func() {
		led <- l.Lead(ctx, key, func(ctx context.Context) error {
			terms <- ctx
			<-ctx.Done()
			return nil
		})
	}()
	first := <-terms
	advlocktest.LoseKey(t, dsn, key)
	select {
	case <-first.Done():
	case <-time.After(10 * time.Second):
		t.Fatal("the leader's term did not end")
	}
	if !errors.Is(context.Cause(first), advlock.ErrLockLost) {
		t.Fatalf("the term ended with %v, want ErrLockLost", context.Cause(first))
	}
	select {
	case <-terms:
	case <-time.After(10 * time.Second):
		t.Fatal("no second term")
	}
	cancel()
	if err := <-led; err != nil && !errors.Is(err, context.Canceled) {
		t.Fatal(err)
	}
}

// The check for locks left held fails a test that ends holding one (server truth: pg_locks, the lease table),
// names the key, and ends the session or breaks the lease; a test that unlocks passes it. A lease is the test's
// when its holder names the test's application_name (a Locker opened on the test's DSN).
func TestLeftHeldCheck(t *testing.T) {
	leases := []advlock.Option{advlock.WithLeases()}
	for _, c := range []struct {
		kind  string
		leave bool
		opts  []advlock.Option
		dsn   []advlocktest.Option
	}{
		{"session lock", true, nil, nil}, {"session lock", false, nil, nil},
		{"lease", true, leases, nil}, {"lease", false, leases, nil},
		{"named lease", true, []advlock.Option{advlock.WithLeases(), advlock.WithLeaseHolder("pod-1")}, nil},
		{"lease in a fresh database", true, []advlock.Option{advlock.WithLeases(), advlock.WithLeaseLength(3 * time.Second)},
			[]advlocktest.Option{advlocktest.FreshDatabase()}},
	} {
		leave := c.leave
		t.Run(fmt.Sprintf("%s left held %v", c.kind, leave), func(t *testing.T) {
			r := &recorder{}
			dsn := advlocktest.DSN(r, c.dsn...)
			l, err := advlock.Open(ctxT(t), dsn, c.opts...)
			if err != nil {
				t.Fatal(err)
			}
			key := newKey()
			lk, err := l.TryLock(ctxT(t), key)
			if err != nil {
				t.Fatal(err)
			}
			if !leave {
				if err := lk.Unlock(ctxT(t)); err != nil {
					t.Fatal(err)
				}
			}
			errs := r.end()
			switch {
			case leave && (len(errs) != 1 || !strings.Contains(errs[0], key.String())):
				t.Fatalf("a lock left held: reported %q, want one error naming %s", errs, key)
			case !leave && len(errs) != 0:
				t.Fatalf("nothing left held: reported %q", errs)
			}
			if leave && c.dsn == nil { // (a fresh database is dropped by now)
				if got := holders(t, dsn, key); len(got) != 0 {
					t.Fatalf("the session left holding %s was not ended: %v", key, got)
				}
				if n := leaseRows(t, dsn, key); n != 0 {
					t.Fatalf("the lease left held of %s was not broken: %d rows", key, n)
				}
			}
			if leave {
				select {
				case <-lk.Done():
				case <-time.After(30 * time.Second):
					t.Fatal("the lock left held was not told it ended")
				}
			}
			l.Close()
		})
	}
}

// VerifyNoGoroutines fails a test that leaves a Locker open (holding a lock, or holding nothing: its pool runs),
// and passes one that closes it.
func TestVerifyNoGoroutines(t *testing.T) {
	dsn := advlocktest.DSN(t)
	for _, c := range []struct{ closeIt, unlock bool }{{false, false}, {false, true}, {true, false}} {
		closeIt := c.closeIt
		r := &recorder{}
		advlocktest.VerifyNoGoroutines(r)
		l, err := advlock.Open(ctxT(t), dsn, advlock.WithSharedSessions(0))
		if err != nil {
			t.Fatal(err)
		}
		lk, err := l.TryLock(ctxT(t), newKey())
		if err != nil {
			t.Fatal(err)
		}
		time.Sleep(20 * time.Millisecond) // its watcher runs
		if c.unlock {
			if err := lk.Unlock(ctxT(t)); err != nil {
				t.Fatal(err)
			}
		}
		if closeIt {
			l.Close()
		}
		errs := r.end()
		switch {
		case !closeIt && (len(errs) != 1 || !strings.Contains(errs[0], "github.com/")):
			t.Fatalf("a Locker left open (unlocked: %v): reported %q, want its goroutines", c.unlock, errs)
		case closeIt && len(errs) != 0:
			t.Fatalf("a Locker closed: reported %q", errs)
		}
		if !closeIt {
			if !c.unlock {
				_ = lk.Unlock(ctxT(t))
			}
			l.Close()
		}
	}
}

// A Server of the test's own restarts: its sessions end, and their locks are told lost; it takes locks again after.
func TestServerRestart(t *testing.T) {
	s := advlocktest.StartServer(t, nil)
	dsn := s.DSN(t)
	l := open(t, dsn)
	lk, err := l.TryLock(ctxT(t), newKey())
	if err != nil {
		t.Fatal(err)
	}
	s.Restart(t)
	select {
	case <-lk.Done():
	case <-time.After(10 * time.Second):
		t.Fatal("a restart not told")
	}
	if !errors.Is(lk.Err(), advlock.ErrLockLost) {
		t.Fatalf("Err: %v", lk.Err())
	}
	lk, err = l.TryLock(ctxT(t), newKey())
	if err != nil {
		t.Fatalf("TryLock after the restart: %v", err)
	}
	advlocktest.Lose(t, lk) // Lose finds a lock on a Server of the test's own
	s.Crash(t)
	if _, err := l.TryLock(ctxT(t), newKey()); err != nil {
		t.Fatalf("TryLock after a crash: %v", err)
	}
}

// The throwaway server of a test binary is removed once the binary has exited, with no TestMain to do it.
func TestThrowawayRemoved(t *testing.T) {
	cmd := exec.Command(os.Args[0], "-test.run=^$")
	cmd.Env = append(os.Environ(), helperEnv+"=1")
	out, err := cmd.Output()
	if err != nil {
		t.Fatalf("helper: %v: %s", err, out)
	}
	port := strings.TrimSpace(string(out))
	dsn := "postgres://postgres@127.0.0.1:" + port + "/postgres?sslmode=disable&connect_timeout=2"
	deadline := time.Now().Add(30 * time.Second)
	for {
		conn, err := pgx.Connect(context.Background(), dsn)
		if err != nil {
			return // gone
		}
		conn.Close(context.Background())
		if time.Now().After(deadline) {
			t.Fatalf("the throwaway server on port %s still answers 30 s after its test binary exited", port)
		}
		time.Sleep(200 * time.Millisecond)
	}
}

// FreshDatabase gives a database that has never seen advlock, dropped when the test ends.
func TestFreshDatabase(t *testing.T) {
	r := &recorder{}
	dsn := advlocktest.DSN(r, advlocktest.FreshDatabase())
	conn, err := pgx.Connect(ctxT(t), dsn)
	if err != nil {
		t.Fatal(err)
	}
	var name string
	var seen bool
	if err := conn.QueryRow(ctxT(t), `SELECT current_database(), to_regclass('public.advlock_lease') IS NOT NULL
		OR EXISTS (SELECT FROM pg_class WHERE relname LIKE 'advlock%')`).Scan(&name, &seen); err != nil {
		t.Fatal(err)
	}
	conn.Close(context.Background())
	if !strings.HasPrefix(name, "advlocktest_") || seen {
		t.Fatalf("database %q, advlock objects there: %v", name, seen)
	}
	l, err := advlock.Open(ctxT(t), dsn, advlock.WithFencing())
	if err != nil {
		t.Fatal(err)
	}
	lk, err := l.TryLock(ctxT(t), newKey())
	if err != nil {
		t.Fatal(err)
	}
	if err := lk.Unlock(ctxT(t)); err != nil {
		t.Fatal(err)
	}
	l.Close()
	if errs := r.end(); len(errs) != 0 {
		t.Fatal(errs)
	}
	if _, err := pgx.Connect(ctxT(t), dsn); err == nil || !strings.Contains(err.Error(), "does not exist") {
		t.Fatalf("connect to the dropped database: %v", err)
	}
}

// fatal runs f with r and reports the message of the Fatalf that ended it, or "".
func fatal(f func()) (msg string) {
	defer func() {
		if v := recover(); v != nil {
			msg = fmt.Sprint(v)
		}
	}()
	f()
	return ""
}

// Lose of a lock that has ended refuses, and ends nothing: its session's pid and key may now be another lock's.
func TestLoseStaleLock(t *testing.T) {
	dsn := advlocktest.DSN(t)
	l := open(t, dsn)
	key := newKey()
	old, err := l.TryLock(ctxT(t), key)
	if err != nil {
		t.Fatal(err)
	}
	if err := old.Unlock(ctxT(t)); err != nil {
		t.Fatal(err)
	}
	now, err := l.TryLock(ctxT(t), key) // on the same shared session
	if err != nil {
		t.Fatal(err)
	}
	if now.PID() != old.PID() {
		t.Logf("the second lock went to another session (%d, %d): the test shows less", old.PID(), now.PID())
	}
	if msg := fatal(func() { advlocktest.Lose(&recorder{}, old) }); !strings.Contains(msg, "already ended") {
		t.Fatalf("Lose of an unlocked lock: %q, want a refusal", msg)
	}
	time.Sleep(100 * time.Millisecond)
	if now.Err() != nil {
		t.Fatalf("the live lock of the same key was ended: %v", now.Err())
	}
	if err := now.Unlock(ctxT(t)); err != nil {
		t.Fatal(err)
	}
}

// LoseKey ends the key in its DSN's database only; Lose finds a lease in a fresh database; Lose passes over a
// server of the kit that is stopped; a test that ends with its Server stopped is not failed by the left-held check.
func TestLoseWhereItIs(t *testing.T) {
	r := &recorder{}
	one, two := advlocktest.DSN(r, advlocktest.FreshDatabase()), advlocktest.DSN(r, advlocktest.FreshDatabase())
	key := newKey()
	var locks []*advlock.Lock
	for _, dsn := range []string{one, two} {
		l := open(t, dsn)
		lk, err := l.TryLock(ctxT(t), key)
		if err != nil {
			t.Fatal(err)
		}
		locks = append(locks, lk)
	}
	advlocktest.LoseKey(t, one, key)
	<-locks[0].Done()
	time.Sleep(100 * time.Millisecond)
	if err := locks[1].Err(); err != nil {
		t.Fatalf("LoseKey on one database ended the key in another: %v", err)
	}
	if err := locks[1].Unlock(ctxT(t)); err != nil {
		t.Fatal(err)
	}

	srv := advlocktest.StartServer(r, nil)
	_ = srv.DSN(r)
	srv.Stop(r)
	leases := open(t, two, advlock.WithLeases(), advlock.WithLeaseLength(3*time.Second))
	lk, err := leases.TryLock(ctxT(t), newKey())
	if err != nil {
		t.Fatal(err)
	}
	advlocktest.Lose(t, lk)
	if !errors.Is(lk.Err(), advlock.ErrLockLost) {
		t.Fatalf("Err: %v", lk.Err())
	}
	leases.Close()
	if errs := r.end(); len(errs) != 0 {
		t.Fatalf("reported: %q", errs)
	}
}

// Release from another goroutine as the test ends runs once (no race).
func TestHolderReleaseRace(t *testing.T) {
	dsn := advlocktest.DSN(t)
	for range 5 {
		r := &recorder{}
		h := advlocktest.Hold(r, dsn, newKey())
		done := make(chan struct{})
		time.AfterFunc(time.Millisecond, func() { h.Release(); close(done) })
		r.end()
		<-done
		if len(r.errs) != 0 {
			t.Fatal(r.errs)
		}
	}
}
