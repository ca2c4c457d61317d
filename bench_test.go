package advlock

import (
	"context"
	"testing"
	"time"

	"github.com/advlock/advlock/internal/pgtest"
)

// The two benchmarks below make the same two round trips per cycle; the ratio of their ns/op is advlock's overhead
// over the physical limit:
//
//	go test -run '^$' -bench 'Cycle' -count 6 .

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

// BenchmarkCycleTryLock: Locker.TryLock + Lock.Unlock (pin a pooled session, lock, start the watcher, stop it,
// unlock, return the session).
func BenchmarkCycleTryLock(b *testing.B) {
	l := New(pgtest.Pool(b, pgtest.URL(b), nil))
	defer l.Close()
	ctx := context.Background()
	k := Int64Key(time.Now().UnixNano())
	b.ReportAllocs()
	for b.Loop() {
		lk, err := l.TryLock(ctx, k)
		if err != nil {
			b.Fatal(err)
		}
		if err := lk.Unlock(ctx); err != nil {
			b.Fatal(err)
		}
	}
}

// BenchmarkCycleLock: Locker.Lock (the blocking statement) + Unlock, uncontended.
func BenchmarkCycleLock(b *testing.B) {
	l := New(pgtest.Pool(b, pgtest.URL(b), nil))
	defer l.Close()
	ctx := context.Background()
	k := Int64Key(time.Now().UnixNano())
	b.ReportAllocs()
	for b.Loop() {
		lk, err := l.Lock(ctx, k)
		if err != nil {
			b.Fatal(err)
		}
		if err := lk.Unlock(ctx); err != nil {
			b.Fatal(err)
		}
	}
}

// BenchmarkLossNotice: time from pg_terminate_backend returning to Done closing (reported as ms/loss).
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
		pgtest.Terminate(b, obs, pids[0])
		start := time.Now()
		<-lk.Done()
		total += time.Since(start)
		n++
		_ = lk.Unlock(ctx)
	}
	b.ReportMetric(float64(total.Microseconds())/1000/float64(n), "ms/loss")
}
