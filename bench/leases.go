package main

import (
	"context"
	"errors"
	"fmt"
	"log"
	"runtime"
	"strings"
	"sync"
	"time"

	"github.com/advlock/advlock"
	"github.com/advlock/advlock/internal/pgcluster"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
)

// The lease contenders (advlock.WithLeases): advlock's leases, and the limit for a lock in a table, a raw
// grant-and-release loop of single statements on a table of the same shape; each directly and, where pgbouncer is
// installed, through PgBouncer in transaction mode (where session locks cannot live). They run when -only names
// them (go run . -only lease), beside raw pgx: with every other contender connected at once, their clients would
// take the server past max_connections=100.
const (
	leasesName   = "advlock leases"
	rawLeaseName = "raw lease loop"
	viaBouncer   = ", PgBouncer transaction"
	leasePoll    = 200 * time.Millisecond // advlock's default: waits try again about this often
)

// rawLeaseDDL makes the raw loop's table: advlock's lease table under another name, and a sequence for its terms.
var rawLeaseDDL = strings.ReplaceAll(advlock.LeaseTableSQL, "advlock_lease", "bench_lease") +
	"CREATE SEQUENCE IF NOT EXISTS public.bench_lease_term"

// The raw loop's statements: the grant a table lock needs at the least (free, or expired on the server's clock;
// a new term), and the release keyed on owner and term. Each commits without waiting for its WAL to be flushed
// (synchronous_commit off for its own transaction), as advlock's grants and releases do: the loop is what a lease
// costs the server at the least, with the same durability.
const (
	rawGrant = "INSERT INTO public.bench_lease AS l (space, key, owner, term, expires) VALUES (1, $1, $2, " +
		"nextval('public.bench_lease_term'), clock_timestamp() + interval '15 seconds') ON CONFLICT (space, key) DO UPDATE " +
		"SET owner = EXCLUDED.owner, term = EXCLUDED.term, expires = EXCLUDED.expires WHERE l.expires < clock_timestamp() " +
		"RETURNING term, " + rawLazy
	rawRelease = "DELETE FROM public.bench_lease WHERE space = 1 AND key = $1 AND owner = $2 AND term = $3 AND " +
		rawLazy + " = 'off'"
	rawLazy = "set_config('synchronous_commit', 'off', true)"
)

var errHeld = errors.New("held")

// rawLease is the raw loop on a dedicated connection: try-only (a table has no queue to wait in).
type rawLease struct {
	c     *pgx.Conn
	owner string
}

func newRawLease(ctx context.Context, url string) (*rawLease, error) {
	c, err := pgx.Connect(ctx, url)
	if err != nil {
		return nil, err
	}
	return &rawLease{c: c, owner: fmt.Sprintf("bench-%d", time.Now().UnixNano())}, nil
}

func (r *rawLease) lock(ctx context.Context, key string) (func(context.Context) error, error) {
	v := pgKey(key)
	var term int64
	var lazy string
	err := r.c.QueryRow(ctx, rawGrant, v, r.owner).Scan(&term, &lazy)
	if errors.Is(err, pgx.ErrNoRows) {
		return nil, errHeld
	}
	if err != nil {
		return nil, err
	}
	return func(ctx context.Context) error {
		tag, err := r.c.Exec(ctx, rawRelease, v, r.owner, term)
		if err == nil && tag.RowsAffected() != 1 {
			err = fmt.Errorf("release deleted %d rows", tag.RowsAffected())
		}
		return err
	}, nil
}

func (r *rawLease) cycle(ctx context.Context, key string, during func()) error {
	return lockCycle(ctx, r, key, during)
}

func (r *rawLease) close() { r.c.Close(context.Background()) }

// leaseTables are the tables the lease contenders write: advlock's and the raw loop's.
var leaseTables = []string{"advlock_lease", "advlock_lease_wait", "bench_lease", "bench_lease_wait"}

// vacuumLeases vacuums the lease tables at url before the lease workloads (when a lease contender runs), so that
// every run starts from what autovacuum leaves: a server run with autovacuum off (as this project's test server is)
// keeps every dead row version of earlier runs and tests, which each grant of a key walks past (docs/performance.md:
// a cycle a quarter slower on 268,592 of them). It logs what it found; a role that may not vacuum them leaves them
// as they are.
func vacuumLeases(ctx context.Context, url string) {
	c, err := pgx.Connect(ctx, url)
	if err != nil {
		log.Printf("leases: %v", err)
		return
	}
	defer c.Close(ctx)
	var dead int64
	var autovacuum string
	if err := c.QueryRow(ctx, "SELECT coalesce(sum(n_dead_tup), 0)::int8, current_setting('autovacuum') FROM pg_stat_user_tables "+
		"WHERE schemaname = 'public' AND relname = ANY($1)", leaseTables).Scan(&dead, &autovacuum); err != nil {
		log.Printf("leases: %v", err)
		return
	}
	if _, err := c.Exec(ctx, "VACUUM public."+strings.Join(leaseTables, ", public.")); err != nil {
		log.Printf("leases: the lease tables not vacuumed (%v): %d dead row versions in them", err, dead)
		return
	}
	log.Printf("leases: the lease tables vacuumed (%d dead row versions; autovacuum %s)", dead, autovacuum)
}

// startBouncer starts PgBouncer in transaction mode in front of url, if pgbouncer is installed, and makes the
// tables the lease contenders use (a first grant through the pooler would make them too).
func startBouncer(ctx context.Context, url string) (string, func()) {
	c, err := pgx.Connect(ctx, url)
	if err != nil {
		return "", func() {}
	}
	defer c.Close(ctx)
	if _, err := c.Exec(ctx, advlock.LeaseTableSQL+rawLeaseDDL); err != nil {
		log.Printf("leases: %v", err)
	}
	b, err := pgcluster.StartBouncer(url, "transaction")
	if err != nil {
		log.Printf("leases through PgBouncer: skipped (%v)", err)
		return "", func() {}
	}
	return b.URL, b.Stop
}

// leaseContenders are the lease contenders on e: directly, and through e.bouncerURL when it is set.
func leaseContenders(e *env) []contender {
	var cs []contender
	for _, via := range []struct{ suffix, url string }{{"", e.pgURL}, {viaBouncer, e.bouncerURL}} {
		if via.url == "" {
			continue
		}
		url := via.url
		cs = append(cs,
			contender{name: leasesName + via.suffix, blocking: true, pg: true, polls: true, optIn: true, new: func(ctx context.Context) (client, error) {
				cfg, err := pgxpool.ParseConfig(url)
				if err != nil {
					return nil, err
				}
				cfg.MaxConns = 64
				if via.suffix != "" { // no prepared statements through PgBouncer 1.18 in transaction mode
					cfg.ConnConfig.DefaultQueryExecMode = pgx.QueryExecModeSimpleProtocol
				}
				p, err := pgxpool.NewWithConfig(ctx, cfg)
				if err != nil {
					return nil, err
				}
				return &advClient{p: p, l: advlock.New(p, advlock.WithLeases())}, nil
			}},
			contender{name: rawLeaseName + via.suffix, pg: true, polls: true, optIn: true, new: func(ctx context.Context) (client, error) {
				u := url
				if via.suffix != "" {
					u = openURL(url, 0) + sepFor(url) + "default_query_exec_mode=simple_protocol"
				}
				return newRawLease(ctx, u)
			}},
		)
	}
	return cs
}

func sepFor(url string) string {
	if strings.Contains(url, "?") {
		return "&"
	}
	return "?"
}

// hasLeases reports whether cs holds the lease contenders.
func hasLeases(cs []contender) bool {
	for _, c := range cs {
		if c.name == leasesName {
			return true
		}
	}
	return false
}

// leaseLoss measures how long a lease holder takes to learn that its lease was broken (its row deleted, as
// advlock break does): it learns at its next renewal, every 5 s by default.
func leaseLoss(ctx context.Context, e *env, obs *pgx.Conn, col *collector, round int) {
	pool, err := pgxpool.New(ctx, e.poolURL)
	if err != nil {
		log.Printf("loss/leases: %v", err)
		return
	}
	defer pool.Close()
	l := advlock.New(pool, advlock.WithLeases())
	defer l.Close()
	var lat []time.Duration
	for i := range 3 {
		k := advlock.NameKey(fmt.Sprintf("bench-lease-loss-%d-%d-%d", round, i, time.Now().UnixNano()))
		lk, err := l.TryLock(ctx, k)
		if err != nil {
			log.Printf("loss/leases: %v", err)
			return
		}
		time.Sleep(time.Duration(i) * 1700 * time.Millisecond % (5 * time.Second)) // spread over the renewal period
		if ok, err := advlock.BreakLease(ctx, obs, k, lk.Token()); err != nil || !ok {
			log.Printf("loss/leases: break: %v %v", ok, err)
			return
		}
		t0 := time.Now()
		<-lk.Done()
		lat = append(lat, time.Since(t0))
	}
	col.add(wLoss, leasesName, "p50 after its row is deleted (renewed every 5s)", "ms", ms(percentile(lat, 50)), "")
}

// leaseWAL measures the WAL each acquire+release writes (the server's pg_current_wal_lsn before and after n
// cycles on one key): raw advisory locks write none; a lease writes its row and deletes it.
func leaseWAL(ctx context.Context, e *env, cs []contender, col *collector, tag string) {
	const n = 200
	obs, err := pgx.Connect(ctx, e.pgURL)
	if err != nil {
		log.Printf("%s: %v", wWAL, err)
		return
	}
	defer obs.Close(ctx)
	for _, c := range cs {
		if c.name != rawName && c.name != leasesName && c.name != rawLeaseName {
			continue
		}
		cl, closeAll, err := newClients(ctx, c, 1)
		if !check(c, wWAL, err) {
			continue
		}
		key := tag + "-" + c.name
		_ = cl[0].cycle(ctx, key, nil) // warm up
		var before, after int64
		_ = obs.QueryRow(ctx, "SELECT pg_current_wal_insert_lsn() - '0/0'").Scan(&before)
		for range n {
			if err = cl[0].cycle(ctx, key, nil); err != nil {
				break
			}
		}
		_ = obs.QueryRow(ctx, "SELECT pg_current_wal_insert_lsn() - '0/0'").Scan(&after)
		closeAll()
		if check(c, wWAL, err) {
			col.add(wWAL, c.name, "WAL per acquire+release", "B", float64(after-before)/n, "the whole server's WAL: other writers count")
		}
	}
}

const wLeasesHeld = "11. leases held by one Locker"

// leasesHeld measures what holding many leases costs one Locker and the server: n leases taken by one Locker
// (lease length ln, renewed every third of it), then, while they are held, the client's goroutines and heap per
// lease and the server's transactions a second that wrote (the transaction ids drawn, over several renewal periods;
// the renewals are nearly all of them). pg_stat_database's commits would count late: a backend reports them up to
// 10 s after it went idle, so the grants' commits fell into the window (105 a second measured that way for 2,000
// leases whose renewals were 4 statements a second by the server's log).
func leasesHeld(ctx context.Context, e *env, col *collector) {
	obs, err := pgx.Connect(ctx, e.pgURL)
	if err != nil {
		log.Printf("%s: %v", wLeasesHeld, err)
		return
	}
	defer obs.Close(ctx)
	commits := func() (int64, time.Time) {
		var n int64
		_ = obs.QueryRow(ctx, "SELECT pg_snapshot_xmax(pg_current_snapshot())::text::int8").Scan(&n)
		return n, time.Now()
	}
	for _, s := range []struct {
		n  int
		ln time.Duration
	}{{2000, 3 * time.Second}, {10000, 15 * time.Second}} {
		label := fmt.Sprintf("%d of %v", s.n, s.ln)
		pool, err := pgxpool.New(ctx, e.poolURL)
		if err != nil {
			log.Printf("%s: %v", wLeasesHeld, err)
			return
		}
		l := advlock.New(pool, advlock.WithLeases(), advlock.WithLeaseLength(s.ln))
		tag := fmt.Sprintf("bench-held-lease-%d", time.Now().UnixNano())
		// Warm up as the leases are taken (16 at a time): the pool's connections and the Locker's own state are
		// there before the heap is read, so that what is measured is what each held lease costs.
		for round := range 2 {
			_ = forEach(64, func(i int) error {
				lk, err := l.TryLock(ctx, advlock.NameKey(fmt.Sprintf("%s-warm-%d-%d", tag, round, i)))
				if err != nil {
					return err
				}
				return lk.Unlock(ctx)
			})
		}
		var before, after runtime.MemStats
		runtime.GC()
		runtime.ReadMemStats(&before)
		goroutines := runtime.NumGoroutine()
		locks := make([]*advlock.Lock, s.n)
		err = forEach(s.n, func(i int) (err error) {
			locks[i], err = l.TryLock(ctx, advlock.NameKey(fmt.Sprintf("%s-%d", tag, i)))
			return err
		})
		if err != nil {
			log.Printf("%s (%s): %v", wLeasesHeld, label, err)
		} else {
			c0, t0 := commits()
			time.Sleep(max(5*time.Second, 2*s.ln/3)) // two renewal periods at least
			c1, t1 := commits()
			runtime.GC()
			runtime.ReadMemStats(&after)
			col.add(wLeasesHeld, leasesName, "goroutines added, "+label, "goroutines",
				float64(runtime.NumGoroutine()-goroutines), "")
			col.add(wLeasesHeld, leasesName, "heap per held lease, "+label, "B",
				max(0, float64(int64(after.HeapAlloc)-int64(before.HeapAlloc))/float64(s.n)), "")
			col.add(wLeasesHeld, leasesName, "server transactions a second, "+label, "xact/s",
				float64(c1-c0)/t1.Sub(t0).Seconds(), "transaction ids drawn on the whole server: other clients' writes count")
		}
		if err := forEach(s.n, func(i int) error {
			if locks[i] == nil {
				return nil
			}
			return locks[i].Unlock(ctx)
		}); err != nil {
			log.Printf("%s (%s): unlock: %v", wLeasesHeld, label, err)
		}
		l.Close()
		pool.Close()
	}
}

// forEach runs f(0) to f(n-1), 16 at a time, and returns the first error.
func forEach(n int, f func(i int) error) error {
	var (
		wg    sync.WaitGroup
		once  sync.Once
		first error
	)
	sem := make(chan struct{}, 16)
	for i := range n {
		sem <- struct{}{}
		wg.Add(1)
		go func() {
			defer func() { <-sem; wg.Done() }()
			if err := f(i); err != nil {
				once.Do(func() { first = err })
			}
		}()
	}
	wg.Wait()
	return first
}

const wSwept = "12. rows of a holder cut off"

// leasesSwept measures how soon the tables lose the rows of a holder that stops answering: a Locker of 3 s leases
// holds 1,000 and waits for 100 keys that another Locker holds; then its pool is closed under it (no statement of
// its reaches the server again, as for a SIGKILLed process), and the other Locker's sweep deletes its rows. The
// time is counted from the cut, so it is at most the bound counted from the last renewal (a lease length and a
// sweep period for leases; the longer of a lease length and 6 s, and a period, for waits).
func leasesSwept(ctx context.Context, e *env, col *collector) {
	const n, m, ln = 1000, 100, 3 * time.Second
	obs, err := pgx.Connect(ctx, e.pgURL)
	if err != nil {
		log.Printf("%s: %v", wSwept, err)
		return
	}
	defer obs.Close(ctx)
	tag := fmt.Sprintf("bench-swept-%d", time.Now().UnixNano())
	livePool, err := pgxpool.New(ctx, e.poolURL)
	if err != nil {
		log.Printf("%s: %v", wSwept, err)
		return
	}
	defer livePool.Close()
	live := advlock.New(livePool, advlock.WithLeases(), advlock.WithLeaseLength(ln))
	defer live.Close()
	deadPool, err := pgxpool.New(ctx, e.poolURL)
	if err != nil {
		log.Printf("%s: %v", wSwept, err)
		return
	}
	dead := advlock.New(deadPool, advlock.WithLeases(), advlock.WithLeaseLength(ln), advlock.WithLeaseHolder(tag))
	defer dead.Close()
	held := make([]*advlock.Lock, m)
	if err := forEach(m, func(i int) (err error) {
		held[i], err = live.TryLock(ctx, advlock.NameKey(fmt.Sprintf("%s-w-%d", tag, i)))
		return err
	}); err != nil {
		log.Printf("%s: %v", wSwept, err)
		return
	}
	defer func() {
		for _, lk := range held {
			if lk != nil {
				_ = lk.Unlock(ctx)
			}
		}
	}()
	if err := forEach(n, func(i int) error {
		_, err := dead.TryLock(ctx, advlock.NameKey(fmt.Sprintf("%s-%d", tag, i)))
		return err
	}); err != nil {
		log.Printf("%s: %v", wSwept, err)
		return
	}
	waitCtx, stopWaits := context.WithCancel(ctx)
	defer stopWaits()
	for i := range m {
		go func() { _, _ = dead.Lock(waitCtx, advlock.NameKey(fmt.Sprintf("%s-w-%d", tag, i))) }()
	}
	rows := func() (leases, waits int) {
		_ = obs.QueryRow(ctx, "SELECT (SELECT count(*) FROM public.advlock_lease WHERE holder LIKE '%' || $1), "+
			"(SELECT count(*) FROM public.advlock_lease_wait WHERE holder LIKE '%' || $1)", tag).Scan(&leases, &waits)
		return leases, waits
	}
	for deadline := time.Now().Add(30 * time.Second); ; time.Sleep(50 * time.Millisecond) {
		if a, b := rows(); a == n && b == m {
			break
		} else if time.Now().After(deadline) {
			log.Printf("%s: the holder's rows: %d leases, %d waits; want %d and %d", wSwept, a, b, n, m)
			return
		}
	}
	deadPool.Close() // nothing of the holder's reaches the server from here on
	cut := time.Now()
	var leasesGone, waitsGone time.Duration
	for deadline := cut.Add(60 * time.Second); leasesGone == 0 || waitsGone == 0; time.Sleep(20 * time.Millisecond) {
		a, b := rows()
		if a == 0 && leasesGone == 0 {
			leasesGone = time.Since(cut)
		}
		if b == 0 && waitsGone == 0 {
			waitsGone = time.Since(cut)
		}
		if time.Now().After(deadline) {
			log.Printf("%s: 60 s after the cut, %d leases and %d waits left", wSwept, a, b)
			return
		}
	}
	col.add(wSwept, leasesName, "1,000 leases of 3s gone after the cut", "s", leasesGone.Seconds(), "bound: 4 s (a lease length and a sweep period)")
	col.add(wSwept, leasesName, "100 waits gone after the cut", "s", waitsGone.Seconds(), "bound: 7 s (6 s and a sweep period)")
}
