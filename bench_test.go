package advlock

import (
	"context"
	"testing"
	"time"

	"github.com/advlock/advlock/internal/pgtest"
)

// BenchmarkCycleRawPgx and BenchmarkCycleTryLock make the same two round trips per cycle. On a shared machine
// their ns/op drift between runs, so BenchmarkTryLockVsRaw interleaves the two in blocks of 32 cycles and reports
// the ratio of their throughputs measured side by side (x-raw: 1.0 means as fast as raw pgx):
//
//	go test -run '^$' -bench . -count 6 .

// BenchmarkTryLockVsRaw: cycles/s of TryLock+Unlock divided by cycles/s of raw pgx on a dedicated connection.
func BenchmarkTryLockVsRaw(b *testing.B) {
	url := pgtest.URL(b)
	conn := pgtest.Conn(b, url)
	l := New(pgtest.Pool(b, url, nil))
	defer l.Close()
	ctx := context.Background()
	kv := time.Now().UnixNano()
	k := Int64Key(kv + 1)
	var ok bool
	var raw, ours time.Duration
	for b.Loop() {
		t0 := time.Now()
		for range 32 {
			if err := conn.QueryRow(ctx, "SELECT pg_try_advisory_lock($1)", kv).Scan(&ok); err != nil || !ok {
				b.Fatal(ok, err)
			}
			if err := conn.QueryRow(ctx, "SELECT pg_advisory_unlock($1)", kv).Scan(&ok); err != nil || !ok {
				b.Fatal(ok, err)
			}
		}
		t1 := time.Now()
		for range 32 {
			lk, err := l.TryLock(ctx, k)
			if err != nil {
				b.Fatal(err)
			}
			if err := lk.Unlock(ctx); err != nil {
				b.Fatal(err)
			}
		}
		t2 := time.Now()
		raw += t1.Sub(t0)
		ours += t2.Sub(t1)
	}
	b.ReportMetric(float64(raw)/float64(ours), "x-raw")
	b.ReportMetric(float64(time.Second)*32*float64(b.N)/float64(raw), "raw-cycles/s")
	b.ReportMetric(float64(time.Second)*32*float64(b.N)/float64(ours), "advlock-cycles/s")
}

// BenchmarkCycleRawPgx: pg_try_advisory_lock + pg_advisory_unlock on one dedicated pgx connection.
func BenchmarkCycleRawPgx(b *testing.B) {
	conn := pgtest.Conn(b, pgtest.URL(b))
	ctx := context.Background()
	k := int64(time.Now().UnixNano())
	var ok bool
	b.ReportAllocs()
	for b.Loop() {
		if err := conn.QueryRow(ctx, "SELECT pg_try_advisory_lock($1)", k).Scan(&ok); err != nil || !ok {
			b.Fatal(ok, err)
		}
		if err := conn.QueryRow(ctx, "SELECT pg_advisory_unlock($1)", k).Scan(&ok); err != nil || !ok {
			b.Fatal(ok, err)
		}
	}
}

// BenchmarkCycleTryLock: Locker.TryLock + Lock.Unlock (pin a pooled session, lock, unlock, return the session).
func BenchmarkCycleTryLock(b *testing.B) { benchCycle(b, (*Locker).TryLock) }

// BenchmarkCycleLock: Locker.Lock (the blocking statement) + Unlock, uncontended.
func BenchmarkCycleLock(b *testing.B) { benchCycle(b, (*Locker).Lock) }

func benchCycle(b *testing.B, lock func(*Locker, context.Context, Key) (*Lock, error)) {
	l := New(pgtest.Pool(b, pgtest.URL(b), nil))
	defer l.Close()
	ctx := context.Background()
	k := Int64Key(time.Now().UnixNano())
	b.ReportAllocs()
	for b.Loop() {
		lk, err := lock(l, ctx, k)
		if err != nil {
			b.Fatal(err)
		}
		if err := lk.Unlock(ctx); err != nil {
			b.Fatal(err)
		}
	}
}

// BenchmarkLossNotice: time from pg_terminate_backend returning to Done closing (reported as ms/loss), for a lock
// held 5 ms (a lock's watcher starts within 2 ms of the grant).
func BenchmarkLossNotice(b *testing.B) {
	url := pgtest.URL(b)
	l := New(pgtest.Pool(b, url, nil), WithKeepalive(time.Minute))
	defer l.Close()
	obs := pgtest.Conn(b, url)
	ctx := context.Background()
	var total time.Duration
	n := 0
	for b.Loop() {
		k := Int64Key(time.Now().UnixNano())
		lk, err := l.TryLock(ctx, k)
		if err != nil {
			b.Fatal(err)
		}
		v, _ := k.Int64()
		pids, err := pgtest.Holders(ctx, obs, v)
		if err != nil || len(pids) != 1 {
			b.Fatal(pids, err)
		}
		time.Sleep(5 * time.Millisecond)
		pgtest.Terminate(b, obs, pids[0])
		start := time.Now()
		<-lk.Done()
		total += time.Since(start)
		n++
		_ = lk.Unlock(ctx)
	}
	b.ReportMetric(float64(total.Microseconds())/1000/float64(n), "ms/loss")
}
