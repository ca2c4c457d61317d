package conformance

import (
	"context"
	"crypto/rand"
	"encoding/binary"
	"testing"
	"time"

	"github.com/advlock/advlock"
	"github.com/advlock/advlock/internal/testkit/pgtest"
	"github.com/jackc/pgx/v5"
)

// Key returns an Int64Key no other test uses.
func Key(t testing.TB) advlock.Key {
	var b [8]byte
	if _, err := rand.Read(b[:]); err != nil {
		t.Fatal(err)
	}
	return advlock.Int64Key(int64(binary.LittleEndian.Uint64(b[:])))
}

func ctxT(t *testing.T, d time.Duration) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), d)
	t.Cleanup(cancel)
	return ctx
}

func holders(t *testing.T, obs *pgx.Conn, k advlock.Key) []uint32 {
	t.Helper()
	v, _ := k.Int64()
	pids, err := pgtest.Holders(context.Background(), obs, v)
	if err != nil {
		t.Fatal(err)
	}
	return pids
}

func pidOf(t *testing.T, obs *pgx.Conn, k advlock.Key) uint32 {
	t.Helper()
	pids := holders(t, obs, k)
	if len(pids) != 1 {
		t.Fatalf("want exactly one holder of %s, pg_locks shows %v", k, pids)
	}
	return pids[0]
}

func waitFree(t *testing.T, obs *pgx.Conn, k advlock.Key) {
	t.Helper()
	v, _ := k.Int64()
	pgtest.WaitFree(t, obs, v, 10*time.Second)
}

func waitGone(t *testing.T, obs *pgx.Conn, pid uint32) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for {
		var n int
		if err := obs.QueryRow(context.Background(), "SELECT count(*) FROM pg_stat_activity WHERE pid = $1", int32(pid)).Scan(&n); err != nil {
			t.Fatal(err)
		}
		if n == 0 {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("backend %d still alive: its session should have been closed", pid)
		}
		time.Sleep(2 * time.Millisecond)
	}
}

// waitClosed waits for the server session behind a destroyed connection to end (directly connected) or to be
// reset by the pooler (checked by the waitFree that follows).
func (s *suite) waitClosed(t *testing.T, obs *pgx.Conn, pid uint32) {
	t.Helper()
	if !s.be.Pooled {
		waitGone(t, obs, pid)
	}
}

func waitDone(t *testing.T, lk *advlock.Lock, within time.Duration) time.Duration {
	t.Helper()
	return pgtest.WaitClosed(t, lk.Done(), within, "lock "+lk.Key().String()+" reported lost")
}

// noIdleLocks fails if an idle pooled connection holds an advisory lock.
func noIdleLocks(t *testing.T, h Harness, obs *pgx.Conn) {
	t.Helper()
	pids := map[uint32]bool{}
	for _, p := range h.Idle(t) {
		pids[p] = true
	}
	rows, err := pgtest.Locks(context.Background(), obs)
	if err != nil {
		t.Fatal(err)
	}
	for _, r := range rows {
		if pids[r.PID] {
			t.Errorf("idle pooled connection (server pid %d) holds advisory lock %s", r.PID, r)
		}
	}
}

// waitQueued waits until a session waits for k in pg_locks.
func waitQueued(t *testing.T, obs *pgx.Conn, k advlock.Key) {
	t.Helper()
	v, _ := k.Int64()
	for deadline := time.Now().Add(10 * time.Second); ; time.Sleep(200 * time.Microsecond) {
		rows, err := pgtest.Locks(context.Background(), obs)
		if err != nil {
			t.Fatal(err)
		}
		for _, r := range rows {
			if r.Int64Key(v) && !r.Granted {
				return
			}
		}
		if time.Now().After(deadline) {
			t.Fatalf("no waiter for %s queued within 10s", k)
		}
	}
}
