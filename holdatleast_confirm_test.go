package advlock

import (
	"context"
	"errors"
	"math/rand/v2"
	"runtime"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/advlock/advlock/internal/lease"
	"github.com/advlock/advlock/internal/session"
	"github.com/advlock/advlock/internal/testkit/pgtest"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
)

// An Unlock before the lock's HoldAtLeast has passed asks the server whether the lock is still held (a round trip
// on its own session or shared session, a statement on a lease's row) and marks it held past its work: Inspect
// and advlock ls show it so, and the marker goes with the key.

func haModesAndLeases() []struct {
	name string
	opts []Option
} {
	return append(haModes(), struct {
		name string
		opts []Option
	}{"leases", []Option{WithLeases()}})
}

// advisoryOf lists the advisory locks the server shows for pid, as "key/mode" of int8 keys.
func advisoryOf(t *testing.T, b *bundle, pid uint32) []Row {
	t.Helper()
	rows, err := pgtest.Locks(context.Background(), b.obs)
	if err != nil {
		t.Fatal(err)
	}
	var out []Row
	for _, r := range rows {
		if r.PID == pid {
			out = append(out, r)
		}
	}
	return out
}

// Row is a pg_locks row of the tests.
type Row = pgtest.Row

// heldRow is Inspect's row of k's holder; it fails t unless there is exactly one.
func heldRow(t *testing.T, b *bundle, k Key) LockInfo {
	t.Helper()
	rows, err := Inspect(context.Background(), b.obs)
	if err != nil {
		t.Fatal(err)
	}
	var out []LockInfo
	for _, r := range rows {
		if r.Key.Equal(k) && r.Granted {
			out = append(out, r)
		}
	}
	if len(out) != 1 {
		t.Fatalf("Inspect shows %d holders of %s, want one: %+v", len(out), k, out)
	}
	return out[0]
}

func TestHoldAtLeastMarksLingering(t *testing.T) {
	b := setup(t)
	ctx := ctxT(t, time.Minute)
	for _, mode := range haModesAndLeases() {
		t.Run(mode.name, func(t *testing.T) {
			l := New(b.pool, mode.opts...)
			defer l.Close()
			k := key(t)
			v, _ := k.Int64()
			lk, err := l.TryLock(ctx, k, HoldAtLeast(1500*time.Millisecond))
			if err != nil {
				t.Fatal(err)
			}
			if r := heldRow(t, b, k); r.Lingering {
				t.Errorf("Inspect marks the lock lingering before its Unlock: %+v", r)
			}
			if err := lk.Unlock(ctx); err != nil {
				t.Fatalf("Unlock during the hold: %v", err)
			}
			r := heldRow(t, b, k)
			if !r.Lingering {
				t.Errorf("Inspect does not mark the lock lingering after an early Unlock: %+v", r)
			}
			marker := k.id.Linger().V
			if mode.name == "leases" {
				if r.Lease == nil || strings.Contains(r.Lease.Holder, "past its work") {
					t.Errorf("the lease's row: %+v, want its holder without the mark", r.Lease)
				}
				var holder string
				if err := b.obs.QueryRow(ctx, "SELECT holder FROM "+lease.Table+" WHERE key = $1", v).Scan(&holder); err != nil {
					t.Fatal(err)
				}
				if !strings.HasSuffix(holder, lease.LingerMark) {
					t.Errorf("the lease table's holder %q, want it marked", holder)
				}
				pgtest.WaitClosed(t, lk.Done(), 10*time.Second, "the lingering lease's end")
				return
			}
			pid := lk.PID()
			got := advisoryOf(t, b, pid)
			if len(got) != 2 || !slicesHave(got, func(r Row) bool { return r.Int64Key(v) && r.Mode == "ExclusiveLock" }) ||
				!slicesHave(got, func(r Row) bool { return r.Int64Key(marker) && r.Mode == "ShareLock" }) {
				t.Errorf("pg_locks of the holder's session %d: %v, want the key exclusive and its marker shared", pid, got)
			}
			rows, err := Inspect(ctx, b.obs)
			if err != nil {
				t.Fatal(err)
			}
			for _, r := range rows {
				if r.PID == int32(pid) && !r.Key.Equal(k) {
					t.Errorf("Inspect lists the marker (or another lock) of the lingering session: %+v", r)
				}
			}
			pgtest.WaitClosed(t, lk.Done(), 10*time.Second, "the lingering lock's end")
			if !errors.Is(lk.Err(), ErrNotHeld) {
				t.Errorf("Err after the hold: %v, want ErrNotHeld", lk.Err())
			}
			if got := advisoryOf(t, b, pid); len(got) != 0 {
				t.Errorf("after the hold the session %d still holds %v, want nothing (the marker goes with the key)", pid, got)
			}
			pgtest.NoIdleLocks(t, b.pool, b.obs)
		})
	}
}

// pidOfKey is the pid of k's only holder, as the server sees it.
func (b *bundle) pidOfKey(t *testing.T, k Key) uint32 {
	t.Helper()
	pids := b.holders(t, k)
	if len(pids) != 1 {
		t.Fatalf("want exactly one holder of %s, pg_locks shows %v", k, pids)
	}
	return pids[0]
}

func slicesHave(rows []Row, f func(Row) bool) bool {
	for _, r := range rows {
		if f(r) {
			return true
		}
	}
	return false
}

// A loss at the moment of an early Unlock: the holder's backend is terminated and Unlock is called at once, before
// the watcher can have read the server's FATAL. Unlock asks the session, so it says the loss (it returned nil before
// it asked: the lock lingered, lost); so does Do whose fn ends its own session and returns nil.
func TestHoldAtLeastUnlockConfirms(t *testing.T) {
	b := setup(t)
	ctx := ctxT(t, 2*time.Minute)
	for _, mode := range haModes() {
		t.Run(mode.name, func(t *testing.T) {
			l := New(b.pool, mode.opts...)
			defer l.Close()
			for i := range 10 {
				k := key(t)
				lk, err := l.TryLock(ctx, k, HoldAtLeast(time.Hour))
				if err != nil {
					t.Fatal(err)
				}
				pgtest.Terminate(t, b.obs, lk.PID())
				if err := lk.Unlock(ctx); !errors.Is(err, ErrLockLost) {
					t.Errorf("round %d: Unlock right after the holder's session was terminated: %v, want ErrLockLost", i, err)
				}
				kd := key(t)
				err = l.TryDo(ctx, kd, func(context.Context) error {
					pgtest.Terminate(t, b.obs, b.pidOfKey(t, kd))
					return nil
				}, HoldAtLeast(time.Hour))
				if !errors.Is(err, ErrLockLost) {
					t.Errorf("round %d: Do whose fn's session was terminated: %v, want ErrLockLost", i, err)
				}
			}
		})
	}
}

// The question an early Unlock asks, at each moment it can meet: before the watcher of a session of its own has
// started, while a keepalive is on the wire, as the hold's own release fires, and as Close runs. Each time Unlock
// says what happened (nil, or ErrClosed when Close came first), and once the lock has ended its session holds
// nothing: the marker never outlives the key, on a pooled session least of all.
// missedBound says that err is the loss of a session that missed its keepalive's bound, by the client's count or
// by the server's idle_session_timeout on a session silent that long (57P05, FrozenAfter: 30 ms).
func missedBound(err error) bool {
	return strings.Contains(err.Error(), "within") || strings.Contains(err.Error(), "keepalive") || strings.Contains(err.Error(), "57P05")
}

func TestHoldAtLeastConfirmRaces(t *testing.T) {
	b := setup(t)
	ctx := ctxT(t, 3*time.Minute)
	// A lock lost by the client's bound ends with its session closed by the client: the server lets go once its
	// backend has read the close, which on a loaded machine took longer than the check once. What is left held
	// then stays: waiting up to 5 s for nothing to be held still fails on a marker that outlives its key.
	leftNothing := func(t *testing.T, pid uint32, round int) {
		t.Helper()
		got := advisoryOf(t, b, pid)
		for deadline := time.Now().Add(5 * time.Second); len(got) != 0 && time.Now().Before(deadline); got = advisoryOf(t, b, pid) {
			time.Sleep(10 * time.Millisecond)
		}
		if len(got) != 0 {
			t.Errorf("round %d: 5 s after the lock ended its session %d holds %v, want nothing", round, pid, got)
		}
	}
	for _, mode := range haModes() {
		t.Run(mode.name, func(t *testing.T) {
			t.Run("before the watcher starts, and during keepalives", func(t *testing.T) {
				// A keepalive every 10 ms, which is also the bound of its round trip (and of a shared session's): a
				// loaded machine may miss it, and the lock is then lost (by the client's bound, or by the server's
				// idle_session_timeout of 30 ms on a session silent that long), which Unlock must then say.
				confirmed := 0
				for i := range 30 {
					l := New(b.pool, append(mode.opts, WithKeepalive(10*time.Millisecond))...)
					k := key(t)
					v, _ := k.Int64()
					lk, err := l.TryLock(ctx, k, HoldAtLeast(time.Hour))
					if err != nil && missedBound(err) && session.Ended(err) {
						// The shared session the try went out on missed the bound first: it ended with the try on the
						// wire, which holds nothing then and says so (a CI run failed here).
						t.Logf("round %d: TryLock's session missed its 10 ms bound: %v", i, err)
						l.Close()
						continue
					}
					if err != nil {
						t.Fatal(err)
					}
					if i%2 == 1 { // odd rounds: among the keepalives
						time.Sleep(time.Duration(rand.IntN(20000)) * time.Microsecond)
					}
					err = lk.Unlock(ctx)
					switch {
					case err == nil:
						confirmed++
						got := advisoryOf(t, b, lk.PID())
						if !slicesHave(got, func(r Row) bool { return r.Int64Key(v) }) ||
							!slicesHave(got, func(r Row) bool { return r.Int64Key(k.id.Linger().V) && r.Mode == "ShareLock" }) {
							t.Errorf("round %d: the lingering lock's session holds %v, want the key and its marker", i, got)
						}
					case errors.Is(err, ErrLockLost) && missedBound(err):
						t.Logf("round %d: a keepalive missed its 10 ms bound: %v", i, err)
						if !errors.Is(lk.Err(), ErrLockLost) {
							t.Errorf("round %d: Unlock said %v, Err says %v", i, err, lk.Err())
						}
					default:
						t.Errorf("round %d: Unlock: %v", i, err)
					}
					l.Close()
					leftNothing(t, lk.PID(), i)
				}
				if confirmed == 0 {
					t.Errorf("no Unlock of 30 was confirmed: every keepalive missed its bound, the test proves nothing")
				}
				pgtest.NoIdleLocks(t, b.pool, b.obs)
			})
			t.Run("as the hold's release fires", func(t *testing.T) {
				l := New(b.pool, mode.opts...)
				defer l.Close()
				pids := map[uint32]bool{}
				for i := range 300 {
					k := key(t)
					lk, err := l.TryLock(ctx, k, HoldAtLeast(time.Duration(rand.IntN(1500))*time.Microsecond))
					if err != nil {
						t.Fatal(err)
					}
					if err := lk.Unlock(ctx); err != nil {
						t.Errorf("round %d: Unlock: %v", i, err)
					}
					pgtest.WaitClosed(t, lk.Done(), 10*time.Second, "the lock's end")
					pids[lk.PID()] = true
				}
				for pid := range pids { // the sessions of every round, shared or pooled: the marker went with each key
					leftNothing(t, pid, -1)
				}
				pgtest.NoIdleLocks(t, b.pool, b.obs)
			})
			t.Run("as Close runs", func(t *testing.T) {
				for i := range 30 {
					l := New(b.pool, mode.opts...)
					k := key(t)
					lk, err := l.TryLock(ctx, k, HoldAtLeast(time.Hour))
					if err != nil {
						t.Fatal(err)
					}
					var wg sync.WaitGroup
					wg.Add(1)
					go func() {
						defer wg.Done()
						if err := lk.Unlock(ctx); err != nil && !errors.Is(err, ErrClosed) {
							t.Errorf("round %d: Unlock racing Close: %v, want nil or ErrClosed", i, err)
						}
					}()
					time.Sleep(time.Duration(rand.IntN(1500)) * time.Microsecond)
					l.Close()
					wg.Wait()
					leftNothing(t, lk.PID(), i)
				}
				pgtest.NoIdleLocks(t, b.pool, b.obs)
			})
		})
	}
}

// goroutinesGone waits up to d for the goroutines whose stack shows fn to be no more than want, and returns their
// count then.
func goroutinesGone(fn string, want int, d time.Duration) int {
	deadline := time.Now().Add(d)
	for {
		n := goroutinesIn(fn)
		if n <= want || time.Now().After(deadline) {
			return n
		}
		time.Sleep(5 * time.Millisecond)
	}
}

// goroutinesIn counts the goroutines whose stack shows fn.
func goroutinesIn(fn string) int {
	buf := make([]byte, 1<<22)
	n := runtime.Stack(buf, true)
	c := 0
	for _, g := range strings.Split(string(buf[:n]), "\n\n") {
		if strings.Contains(g, fn) {
			c++
		}
	}
	return c
}

// A lease broken during its hold (its row deleted), then an early Unlock: the question finds the loss and says
// ErrLockLost, and the lease's renewer has stopped by the time Unlock returns (nothing releases a lost lease, so
// its renewer ran on after Close before: up to its next renewal, or its whole trust window against a closed pool).
func TestHoldAtLeastLeaseLostAtUnlock(t *testing.T) {
	b := setup(t)
	ctx := ctxT(t, time.Minute)
	for _, open := range []bool{false, true} {
		l := New(b.pool, WithLeases())
		if open {
			var err error
			if l, err = Open(ctx, b.url, WithLeases()); err != nil {
				t.Fatal(err)
			}
		}
		before := goroutinesIn("(*Lease).renew")
		k := key(t)
		v, _ := k.Int64()
		lk, err := l.TryLock(ctx, k, HoldAtLeast(time.Hour))
		if err != nil {
			t.Fatal(err)
		}
		if _, err := b.obs.Exec(ctx, "DELETE FROM "+lease.Table+" WHERE key = $1", v); err != nil {
			t.Fatal(err)
		}
		if err := lk.Unlock(ctx); !errors.Is(err, ErrLockLost) {
			t.Errorf("Open %v: Unlock of a lease broken during its hold: %v, want ErrLockLost", open, err)
		}
		// The renewer's last act is to say it has stopped; its goroutine may still be on its way out an instant
		// later on a busy machine. Without the stop it would run on to its next renewal, 5 s after the grant.
		if n := goroutinesGone("(*Lease).renew", before, time.Second); n != before {
			t.Errorf("Open %v: %d lease renewers run 1 s after Unlock said the loss, %d before the lock", open, n, before)
		}
		l.Close()
	}
}

// The statements an early Unlock and the lingering release send have one text for every key: a pool that prepares
// and caches statements (pgx's default) caches each once, not once per key.
func TestHoldAtLeastPreparesOnce(t *testing.T) {
	b := setup(t)
	ctx := ctxT(t, time.Minute)
	pool := pgtest.Pool(t, b.url, func(c *pgxpool.Config) { c.MaxConns = 1 })
	l := New(pool, WithSharedSessions(0))
	defer l.Close()
	for range 20 {
		lk, err := l.TryLock(ctx, key(t), HoldAtLeast(20*time.Millisecond))
		if err != nil {
			t.Fatal(err)
		}
		if err := lk.Unlock(ctx); err != nil {
			t.Fatal(err)
		}
		<-lk.Done()
	}
	c, err := pool.Acquire(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Release()
	var unlocks, markers, all int
	if err := c.QueryRow(ctx, "SELECT count(*) FILTER (WHERE statement LIKE '%pg_advisory_unlock_shared(%'), "+
		"count(*) FILTER (WHERE statement LIKE '%pg_try_advisory_lock_shared(%'), count(*) FROM pg_prepared_statements",
		pgx.QueryExecModeSimpleProtocol).Scan(&unlocks, &markers, &all); err != nil {
		t.Fatal(err)
	}
	if unlocks > 1 || markers > 1 {
		t.Errorf("after 20 lingering locks the pooled connection has %d prepared statements: %d lingering unlocks and %d marker tries, want one of each at most",
			all, unlocks, markers)
	}
}
