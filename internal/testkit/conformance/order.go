package conformance

import (
	"context"
	"errors"
	"sync"
	"testing"
	"time"

	"github.com/advlock/advlock"
	"github.com/advlock/advlock/internal/session"
	"github.com/advlock/advlock/internal/testkit/pgtest"
	"github.com/jackc/pgx/v5"
)

// intentOf returns the intent of int8 key k (the lock a waiting writer holds so that new readers wait behind it).
func intentOf(k advlock.Key) int64 {
	v, _ := k.Int64()
	return session.ID{V: v}.Intent().V
}

// waitRow reports whether r is a wait for int8 key v: for the key itself, or in its line, for the ticket of the
// member in front of it.
func waitRow(r pgtest.Row, v int64) bool {
	_, inLine := session.ID{V: v}.InLine(session.LockID(r.ObjSubID == 2, r.ClassID, r.ObjID))
	return !r.Granted && (r.Int64Key(v) || inLine)
}

// awaitRow polls pg_locks until a row matches, and fails the test after 10 s.
func awaitRow(t *testing.T, obs *pgx.Conn, what string, match func(pgtest.Row) bool) pgtest.Row {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for {
		rows, err := pgtest.Locks(context.Background(), obs)
		if err != nil {
			t.Fatal(err)
		}
		for _, r := range rows {
			if match(r) {
				return r
			}
		}
		if time.Now().After(deadline) {
			t.Fatalf("pg_locks never showed %s: %v", what, rows)
		}
		time.Sleep(5 * time.Millisecond)
	}
}

// cycleThroughIntent: a cycle one of whose edges is a writer's intent, not a lock the server queues for. X holds
// K1 and waits to write K2, which Y reads (X takes K2's intent); Y holds K2 and waits for K3; Z holds K3 and waits to
// read K2, which X's intent holds back (in PostgreSQL's own queue Z would wait behind X). Exactly one of the three
// ends with ErrDeadlock, as in a plain cycle, and the others are then granted.
func (s *suite) cycleThroughIntent(t *testing.T, oneLocker bool) {
	obs := s.observer(t)
	ctx := ctxT(t, 60*time.Second)
	lx := s.open(t).L
	ly, lz := lx, lx
	if !oneLocker {
		ly, lz = s.open(t).L, s.open(t).L
	}
	k1, k2, k3 := Key(t), Key(t), Key(t)
	y2, err := ly.RLock(ctx, k2)
	if err != nil {
		t.Fatal(err)
	}
	z3, err := lz.Lock(ctx, k3)
	if err != nil {
		t.Fatal(err)
	}
	x1, err := lx.Lock(ctx, k1)
	if err != nil {
		t.Fatal(err)
	}
	const bound = 20 * time.Second // a cycle left alone waits this long
	errs := make([]error, 3)
	var wg sync.WaitGroup
	wait := func(i int, held *advlock.Lock, take func() (*advlock.Lock, error)) {
		wg.Add(1)
		go func() {
			defer wg.Done()
			lk, err := take()
			errs[i] = err
			if err == nil {
				if err := lk.Unlock(context.Background()); err != nil {
					t.Errorf("caller %d: unlock what it waited for: %v", i, err)
				}
			}
			if err := held.Unlock(context.Background()); err != nil {
				t.Errorf("caller %d: unlock what it held: %v", i, err)
			}
		}()
	}
	v2, _ := k2.Int64()
	ik := intentOf(k2)
	wait(0, x1, func() (*advlock.Lock, error) {
		return lx.Lock(advlock.Holding(ctx, x1), k2, advlock.Wait(bound))
	})
	awaitRow(t, obs, "the writer's intent", func(r pgtest.Row) bool { return r.Int64Key(ik) && r.Granted })
	wait(1, y2, func() (*advlock.Lock, error) {
		return ly.Lock(advlock.Holding(ctx, y2), k3, advlock.Wait(bound))
	})
	wait(2, z3, func() (*advlock.Lock, error) {
		return lz.RLock(advlock.Holding(ctx, z3), k2, advlock.Wait(bound))
	})
	awaitRow(t, obs, "the reader behind the writer", func(r pgtest.Row) bool { // in K2's line, behind X
		return waitRow(r, v2) && r.Mode == "ShareLock"
	})
	formed := time.Now()
	wg.Wait()
	v := oneVictim(t, errs)
	t.Logf("caller %d gave up %v after the cycle formed: %v", v, time.Since(formed).Round(time.Millisecond), errs[v])
	noneHeld(t, obs, k1, k2, k3)
	if !errors.Is(errs[v], advlock.ErrDeadlock) {
		t.Fatal(errs[v])
	}
}

// keysApart: the keys advlock derives from a key (a writer's intent, a lock's marker) are of the key's own space:
// a writer of a pair, and a pair lock held past its work, lock no int8 key (pg_locks shows the pair space only
// for their sessions), so the int8 key that once shared a pair's intent stays free to readers while the pair's
// writer waits; and the pair's intent still holds the pair's new readers back.
func (s *suite) keysApart(t *testing.T) {
	obs := s.observer(t)
	ctx := ctxT(t, 30*time.Second)
	reader, writer, other := s.open(t).L, s.open(t).L, s.open(t).L
	n, _ := Key(t).Int64()
	a, b := int32(n>>32), int32(n)
	pk := advlock.PairKey(a, b)
	alias := advlock.Int64Key((int64(a)<<32 | int64(uint32(b))) ^ 0x7061697273706163)
	r, err := reader.RLock(ctx, pk)
	if err != nil {
		t.Fatal(err)
	}
	wctx, cancel := context.WithCancel(ctx)
	done := make(chan error, 1)
	go func() {
		lk, err := writer.Lock(wctx, pk)
		if err == nil {
			err = lk.Unlock(context.Background())
		}
		done <- err
	}()
	w := awaitRow(t, obs, "the pair's writer waiting", func(r pgtest.Row) bool { // for pk itself: the line's head
		return r.ObjSubID == 2 && !r.Granted && r.ClassID == uint32(a) && r.ObjID == uint32(b)
	})
	// The writer finds readers and takes the pair's intent (a pair too), before or during its first slice.
	in := session.ID{Pair: true, V: int64(a)<<32 | int64(uint32(b))}.Intent()
	awaitRow(t, obs, "the pair's intent", func(r pgtest.Row) bool {
		return r.PID == w.PID && r.Granted && r.ObjSubID == 2 && r.ClassID == uint32(uint64(in.V)>>32) && r.ObjID == uint32(in.V)
	})
	if lk, err := other.TryRLock(ctx, pk); !errors.Is(err, advlock.ErrNotAcquired) {
		t.Errorf("a new reader of the pair passed its writer's intent: %v", err)
		if lk != nil {
			lk.Unlock(ctx)
		}
	}
	lk, err := other.TryRLock(ctx, alias)
	if err != nil {
		t.Errorf("the int8 key %s, which once shared the pair's intent, is refused while the pair's writer waits: %v", alias, err)
	} else if err := lk.Unlock(ctx); err != nil {
		t.Error(err)
	}
	rows, err := pgtest.Locks(ctx, obs)
	if err != nil {
		t.Fatal(err)
	}
	for _, row := range rows {
		if (row.PID == w.PID || row.PID == r.PID()) && row.ObjSubID != 2 {
			t.Errorf("a session of the pair's reader or writer locks an int8 key: %v", row)
		}
	}
	if err := r.Unlock(ctx); err != nil {
		t.Fatal(err)
	}
	if err := <-done; err != nil {
		t.Fatalf("the pair's writer: %v", err)
	}
	cancel()
	// A pair lock held past its work marks itself with a pair.
	lk, err = writer.Lock(ctx, pk, advlock.HoldAtLeast(3*time.Second))
	if err != nil {
		t.Fatal(err)
	}
	if err := lk.Unlock(ctx); err != nil {
		t.Fatal(err)
	}
	m := session.ID{Pair: true, V: int64(a)<<32 | int64(uint32(b))}.Linger()
	awaitRow(t, obs, "the pair's marker", func(r pgtest.Row) bool {
		return r.PID == lk.PID() && r.Granted && r.ObjSubID == 2 && r.ClassID == uint32(uint64(m.V)>>32) && r.ObjID == uint32(m.V)
	})
	rows, err = pgtest.Locks(ctx, obs)
	if err != nil {
		t.Fatal(err)
	}
	for _, row := range rows {
		if row.PID == lk.PID() && row.ObjSubID != 2 && !s.shared {
			t.Errorf("the session of a lingering pair lock locks an int8 key: %v", row)
		}
	}
}
