package advlock

import (
	"context"
	"fmt"
	"runtime"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/advlock/advlock/internal/testkit/pgtest"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
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
func BenchmarkCycleTryLock(b *testing.B) {
	benchCycle(b, func(l *Locker, ctx context.Context, k Key) (*Lock, error) { return l.TryLock(ctx, k) })
}

// BenchmarkCycleLock: Locker.Lock (the blocking statement) + Unlock, uncontended.
func BenchmarkCycleLock(b *testing.B) {
	benchCycle(b, func(l *Locker, ctx context.Context, k Key) (*Lock, error) { return l.Lock(ctx, k) })
}

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

// BenchmarkManyVsRaw: one process, 256 goroutines, each taking and releasing a key of its own (a lock per entity,
// per request): a Locker with shared sessions against raw pgx whose goroutines share 8 dedicated connections,
// interleaved in 50 ms phases. It reports both throughputs and their ratio (x-raw).
func BenchmarkManyVsRaw(b *testing.B) {
	const goroutines, conns = 256, 8
	url := pgtest.URL(b)
	raws := make([]*pgx.Conn, conns)
	var mus [conns]sync.Mutex
	for i := range raws {
		raws[i] = pgtest.Conn(b, url)
	}
	l := New(pgtest.Pool(b, url, func(c *pgxpool.Config) { c.MaxConns = 32 }))
	defer l.Close()
	ctx := context.Background()
	base := time.Now().UnixNano()
	rawCycle := func(g int) error {
		i, k := g%conns, base+int64(g)
		mus[i].Lock()
		defer mus[i].Unlock()
		var ok bool
		if err := raws[i].QueryRow(ctx, "SELECT pg_try_advisory_lock($1)", k).Scan(&ok); err != nil || !ok {
			return fmt.Errorf("lock: %v %v", ok, err)
		}
		if err := raws[i].QueryRow(ctx, "SELECT pg_advisory_unlock($1)", k).Scan(&ok); err != nil || !ok {
			return fmt.Errorf("unlock: %v %v", ok, err)
		}
		return nil
	}
	ourCycle := func(g int) error {
		lk, err := l.TryLock(ctx, Int64Key(base+goroutines+int64(g)))
		if err != nil {
			return err
		}
		return lk.Unlock(ctx)
	}
	phase := func(cycle func(int) error) (int64, time.Duration) {
		var n atomic.Int64
		var wg sync.WaitGroup
		start := time.Now()
		stop := start.Add(50 * time.Millisecond)
		for g := range goroutines {
			wg.Add(1)
			go func() {
				defer wg.Done()
				for time.Now().Before(stop) {
					if err := cycle(g); err != nil {
						b.Error(err)
						return
					}
					n.Add(1)
				}
			}()
		}
		wg.Wait()
		return n.Load(), time.Since(start)
	}
	phase(ourCycle) // warm up: shared sessions, prepared statements
	var rawN, ourN int64
	var rawT, ourT time.Duration
	for b.Loop() {
		n, d := phase(rawCycle)
		rawN, rawT = rawN+n, rawT+d
		n, d = phase(ourCycle)
		ourN, ourT = ourN+n, ourT+d
	}
	raw, ours := float64(rawN)/rawT.Seconds(), float64(ourN)/ourT.Seconds()
	b.ReportMetric(raw, "raw-cycles/s")
	b.ReportMetric(ours, "advlock-cycles/s")
	b.ReportMetric(ours/raw, "x-raw")
}

// BenchmarkHeldShared: heap and server connections for 5,000 locks held at once through one Locker (shared
// sessions), per held lock.
func BenchmarkHeldShared(b *testing.B) {
	const n = 5000
	url := pgtest.URL(b)
	pool := pgtest.Pool(b, url, nil)
	obs := pgtest.Conn(b, url)
	ctx := context.Background()
	var heap, sessions float64
	for b.Loop() {
		l := New(pool)
		warm, err := l.TryLock(ctx, Int64Key(time.Now().UnixNano()))
		if err != nil {
			b.Fatal(err)
		}
		_ = warm.Unlock(ctx)
		var before, after runtime.MemStats
		runtime.GC()
		runtime.ReadMemStats(&before)
		locks := make([]*Lock, 0, n)
		base := time.Now().UnixNano()
		for i := range n {
			lk, err := l.TryLock(ctx, Int64Key(base+int64(i)))
			if err != nil {
				b.Fatal(err)
			}
			locks = append(locks, lk)
		}
		runtime.GC()
		runtime.ReadMemStats(&after)
		heap += float64(int64(after.HeapAlloc)-int64(before.HeapAlloc)) / n
		var pids int
		if err := obs.QueryRow(ctx, `SELECT count(DISTINCT pid) FROM pg_locks WHERE locktype = 'advisory' AND granted
			AND objsubid = 1 AND ((classid::text::int8 << 32) | objid::text::int8) BETWEEN $1 AND $2`, base, base+n).Scan(&pids); err != nil {
			b.Fatal(err)
		}
		sessions += float64(pids)
		for _, lk := range locks {
			if err := lk.Unlock(ctx); err != nil {
				b.Fatal(err)
			}
		}
		l.Close()
	}
	b.ReportMetric(heap/float64(b.N), "heap-B/lock")
	b.ReportMetric(sessions/float64(b.N), "sessions/5000-locks")
}

// BenchmarkFencedVsPlain: TryLock+Unlock with WithFencing against the same without, interleaved in blocks of 32
// cycles; x-plain is fenced cycles/s over plain cycles/s. A fenced grant commits with a WAL flush.
func BenchmarkFencedVsPlain(b *testing.B) {
	url := pgtest.URL(b)
	pool := pgtest.Pool(b, url, nil)
	plain, fenced := New(pool), New(pool, WithFencing())
	defer plain.Close()
	defer fenced.Close()
	ctx := context.Background()
	k := Int64Key(time.Now().UnixNano())
	cycle := func(l *Locker) {
		lk, err := l.TryLock(ctx, k)
		if err != nil {
			b.Fatal(err)
		}
		if err := lk.Unlock(ctx); err != nil {
			b.Fatal(err)
		}
	}
	cycle(fenced) // creates the sequence if missing
	var tp, tf time.Duration
	for b.Loop() {
		t0 := time.Now()
		for range 32 {
			cycle(plain)
		}
		t1 := time.Now()
		for range 32 {
			cycle(fenced)
		}
		tp, tf = tp+t1.Sub(t0), tf+time.Since(t1)
	}
	b.ReportMetric(float64(tp)/float64(tf), "x-plain")
	b.ReportMetric(float64(tf-tp)/float64(32*b.N)/1000, "µs-per-token")
}

// BenchmarkLeaderHandoff: two Lockers campaign with Lead for one key; each term ends at once (fn returns): the
// time from a leader's fn returning to the next leader's fn starting (ms/handoff).
func BenchmarkLeaderHandoff(b *testing.B) {
	url := pgtest.URL(b)
	k := Int64Key(time.Now().UnixNano())
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	var mu sync.Mutex
	var ended time.Time
	var total time.Duration
	n := 0
	started := make(chan struct{}, 1)
	fn := func(context.Context) error {
		mu.Lock()
		if !ended.IsZero() {
			total += time.Since(ended)
			n++
		}
		mu.Unlock()
		select {
		case started <- struct{}{}:
		case <-ctx.Done():
		}
		mu.Lock()
		ended = time.Now()
		mu.Unlock()
		return nil
	}
	var wg sync.WaitGroup
	for range 2 {
		l := New(pgtest.Pool(b, url, nil))
		defer l.Close()
		wg.Add(1)
		go func() { defer wg.Done(); _ = l.Lead(ctx, k, fn) }()
	}
	for b.Loop() {
		<-started
	}
	cancel()
	wg.Wait()
	mu.Lock()
	defer mu.Unlock()
	if n > 0 {
		b.ReportMetric(float64(total.Microseconds())/1000/float64(n), "ms/handoff")
	}
}

// BenchmarkLeaseCycle: TryLock + Unlock of a lease (WithLeases): a grant and a release, each one statement.
//
//	go test -run '^$' -bench LeaseCycle -benchmem -cpuprofile /tmp/lease.prof .
func BenchmarkLeaseCycle(b *testing.B) {
	l := New(pgtest.Pool(b, pgtest.URL(b), nil), WithLeases())
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
