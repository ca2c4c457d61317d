package advlock

import (
	"context"
	"errors"
	"sync"
	"testing"
	"time"

	"github.com/advlock/advlock/internal/pgtest"
	"github.com/jackc/pgx/v5/pgxpool"
)

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
