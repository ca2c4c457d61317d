package main

import (
	"context"
	"errors"
	"fmt"
	"log"
	"runtime"
	"slices"
	"sort"
	"sync"
	"sync/atomic"
	"time"

	"github.com/advlock/advlock"
	"github.com/go-redsync/redsync/v4"
	"github.com/go-redsync/redsync/v4/redis/goredis/v9"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	clientv3 "go.etcd.io/etcd/client/v3"
	"go.etcd.io/etcd/client/v3/concurrency"
	"go.uber.org/zap"
)

const (
	wUncontended = "1. uncontended, 1 goroutine"
	wDistinct    = "2. 8 goroutines, distinct keys"
	wOneKey      = "3. 8 goroutines, one key"
	wHandoff     = "4. handoff latency"
	wLoss        = "5. loss noticed"
	wMemory      = "6. client memory"
	wMany        = "7. 256 goroutines, one process, distinct keys"
	wManyOneKey  = "8. 256 goroutines, one process, one key"
	wWAL         = "9. WAL written"
	wWriters     = "10. 20 writers holding 100 ms, one key"
)

const rawName = "raw pgx (dedicated conn)"

// collector gathers one value per round for each (workload, contender, metric).
type collector struct {
	mu      sync.Mutex
	order   []string
	samples map[string]*result
}

func (c *collector) add(w, who, metric, unit string, v float64, note string) {
	c.mu.Lock()
	defer c.mu.Unlock()
	id := w + "|" + who + "|" + metric + "|" + unit
	r := c.samples[id]
	if r == nil {
		r = &result{Workload: w, Contender: who, Metric: metric, Unit: unit, Note: note}
		c.samples[id] = r
		c.order = append(c.order, id)
	}
	r.values = append(r.values, v)
}

func run(ctx context.Context, e *env, cs []contender) *results {
	col := &collector{samples: map[string]*result{}}
	for round := 1; round <= *flagRounds; round++ {
		log.Printf("round %d of %d", round, *flagRounds)
		// Each round starts with a different contender, so that no one always runs first (or last).
		order := append(slices.Clone(cs[(round-1)%len(cs):]), cs[:(round-1)%len(cs)]...)
		tag := fmt.Sprintf("r%d-%d", round, time.Now().UnixNano())
		for _, w := range []struct {
			name    string
			n       int
			sameKey bool
		}{{wUncontended, 1, false}, {wDistinct, 8, false}, {wOneKey, 8, true}} {
			for name, tp := range throughput(ctx, order, w.n, w.sameKey, tag+"-"+w.name[:1]) {
				col.add(w.name, name, "throughput", "cycles/s", tp.ops, "")
				if w.sameKey {
					col.add(w.name, name, "fairness (max/min per goroutine)", "x", tp.fair, "")
				}
			}
		}
		for name, lat := range handoffs(ctx, order, tag+"-w4") {
			col.add(wHandoff, name, "p50", "ms", ms(percentile(lat, 50)), "")
			col.add(wHandoff, name, "p99", "ms", ms(percentile(lat, 99)), "")
		}
		for _, c := range order {
			tag := fmt.Sprintf("r%d-%s-%d", round, c.name, time.Now().UnixNano())
			if b, a, err := memory(ctx, c, tag+"-w6"); check(c, wMemory, err) {
				col.add(wMemory, c.name, "per acquire+release", "B/op", b, "")
				col.add(wMemory, c.name, "per acquire+release", "allocs/op", a, "")
			}
		}
		loss(ctx, e, col, round, hasLeases(cs))
		if hasLeases(cs) {
			leaseWAL(ctx, e, cs, col, tag+"-wal")
		}
		for name, ops := range many(ctx, e, cs, 256, tag+"-m") {
			col.add(wMany, name, "throughput", "cycles/s", ops, manyNotes[name])
		}
		for name, r := range writers(ctx, cs, tag+"-q") {
			col.add(wWriters, name, "fairness (max/min grants per writer)", "x", r.fair, "")
			col.add(wWriters, name, "longest wait", "ms", ms(r.longest), "")
		}
		for name, tp := range oneKeyMany(ctx, e, cs, 256, tag+"-o") {
			col.add(wManyOneKey, name, "throughput", "cycles/s", tp.ops, oneKeyNotes[name])
			col.add(wManyOneKey, name, "fairness (max/min per goroutine)", "x", tp.fair, "")
		}
	}
	held(ctx, e, cs, col)
	if hasLeases(cs) {
		leasesHeld(ctx, e, col)
		leasesSwept(ctx, e, col)
	}
	return collate(col, cs)
}

func check(c contender, w string, err error) bool {
	if err != nil {
		log.Printf("%s / %s: %v", w, c.name, err)
		return false
	}
	return true
}

func ms(d time.Duration) float64 { return float64(d.Microseconds()) / 1000 }

func percentile(d []time.Duration, p int) time.Duration {
	if len(d) == 0 {
		return 0
	}
	s := slices.Clone(d)
	slices.Sort(s)
	i := (len(s)*p + 99) / 100
	if i > 0 {
		i--
	}
	return s[i]
}

func newClients(ctx context.Context, c contender, n int) ([]client, func(), error) {
	var cl []client
	closeAll := func() {
		for _, x := range cl {
			x.close()
		}
	}
	for range n {
		x, err := c.new(ctx)
		if err != nil {
			closeAll()
			return nil, nil, err
		}
		cl = append(cl, x)
	}
	return cl, closeAll, nil
}

type tput struct{ ops, fair float64 }

// throughput measures every contender on one workload: n goroutines each, each its own client (a separate
// process, say), taking and releasing a lock; one key for all with sameKey (blocking contenders only), else one
// key each. The contenders take turns in 50 ms slices until each has run *flagDur, so that they share the
// machine's weather. It returns cycles/s and max/min cycles per goroutine.
func throughput(ctx context.Context, cs []contender, n int, sameKey bool, tag string) map[string]tput {
	type runner struct {
		c      contender
		cl     []client
		close  func()
		counts []int64
		spent  time.Duration
		err    error
	}
	var rs []*runner
	for _, c := range cs {
		if sameKey && !c.blocking {
			continue
		}
		cl, closeAll, err := newClients(ctx, c, n)
		if !check(c, "throughput", err) {
			continue
		}
		rs = append(rs, &runner{c: c, cl: cl, close: closeAll, counts: make([]int64, n)})
	}
	defer func() {
		for _, r := range rs {
			r.close()
		}
	}()
	key := func(r *runner, g int) string {
		if sameKey {
			return tag + "-" + r.c.name
		}
		return fmt.Sprintf("%s-%s-%d", tag, r.c.name, g)
	}
	cycle := func(r *runner, g int) error { return r.cl[g].cycle(ctx, key(r, g), nil) }
	for _, r := range rs { // warm up: connections, prepared statements
		for g := range r.cl {
			for range 3 {
				if err := cycle(r, g); err != nil && r.err == nil {
					r.err = err
				}
			}
		}
		if sameKey && r.err == nil {
			// and one uncounted turn of the workload itself, so that every client has opened what waiting takes (a
			// session of its own for advlock) before the counting starts: a client that connects while the others
			// cycle is counted as starved by its own start.
			if _, err := runTurn(len(r.cl), func(g int) error { return cycle(r, g) }, 100*time.Millisecond); err != nil {
				r.err = err
			}
		}
	}
	turns := make([]turn, len(rs))
	for i, r := range rs {
		turns[i] = turn{n: len(r.cl), spent: &r.spent, err: &r.err, cycle: func(g int) error {
			err := cycle(r, g)
			if err == nil {
				r.counts[g]++
			}
			return err
		}}
	}
	takeTurns(turns)
	out := map[string]tput{}
	for _, r := range rs {
		if !check(r.c, "throughput", r.err) {
			continue
		}
		var total int64
		lo, hi := r.counts[0], r.counts[0]
		for _, v := range r.counts {
			total += v
			lo, hi = min(lo, v), max(hi, v)
		}
		fair := 0.0
		if lo > 0 {
			fair = float64(hi) / float64(lo)
		}
		out[r.c.name] = tput{float64(total) / r.spent.Seconds(), fair}
	}
	return out
}

// handoffWarmup is how many handoffs each contender makes, uncounted, before its samples: a fresh client opens its
// connections (raw pgx's is connected before it starts; advlock opens its shared session on the first call and a
// session of its own for the first wait), which is a client's start, not a handoff.
const handoffWarmup = 2

// handoffs measures workload 4 for every blocking contender: each with a holder and a waiter of its own, the
// contenders taking turns one sample at a time, so that all of them share the machine's weather.
func handoffs(ctx context.Context, cs []contender, tag string) map[string][]time.Duration {
	type pair struct {
		c              contender
		holder, waiter client
		n              int
		lat            []time.Duration
		err            error
	}
	var ps []*pair
	for _, c := range cs {
		if !c.blocking {
			continue
		}
		cl, closeAll, err := newClients(ctx, c, 2)
		if !check(c, wHandoff, err) {
			continue
		}
		defer closeAll()
		n := *flagHandoffs
		if !c.pg || c.polls {
			n = 20
		}
		ps = append(ps, &pair{c: c, holder: cl[0], waiter: cl[1], n: n + handoffWarmup})
	}
	for i := 0; ; i++ {
		more := false
		for _, p := range ps {
			if p.err != nil || i >= p.n {
				continue
			}
			more = true
			d, err := handoff(ctx, p.holder, p.waiter, fmt.Sprintf("%s-%s-%d", tag, p.c.name, i))
			if err != nil {
				p.err = err
				check(p.c, wHandoff, err)
				continue
			}
			if i >= handoffWarmup {
				p.lat = append(p.lat, d)
			}
		}
		if !more {
			break
		}
	}
	out := map[string][]time.Duration{}
	for _, p := range ps {
		if p.err == nil {
			out[p.c.name] = p.lat
		}
	}
	return out
}

// handoff is one sample of workload 4: the time from the holder's release call to the blocked waiter's grant.
func handoff(ctx context.Context, holder, waiter client, key string) (time.Duration, error) {
	un, err := holder.lock(ctx, key)
	if err != nil {
		return 0, err
	}
	type grant struct {
		at  time.Time
		err error
	}
	got := make(chan grant, 1)
	go func() { // the waiter takes the key as its API is called (one Do for advlock Do) and releases it
		var at time.Time
		err := waiter.cycle(ctx, key, func() { at = time.Now() })
		got <- grant{at, err}
	}()
	time.Sleep(10 * time.Millisecond) // the waiter is queued (or polling) by now
	t0 := time.Now()
	if err := un(ctx); err != nil {
		return 0, err // the waiter may wait on: the run reports the error and ends this contender's samples
	}
	g := <-got
	if g.err != nil {
		return 0, g.err
	}
	return g.at.Sub(t0), nil
}

// memory measures heap bytes and allocations per acquire+release on one client.
func memory(ctx context.Context, c contender, tag string) (float64, float64, error) {
	cl, closeAll, err := newClients(ctx, c, 1)
	if err != nil {
		return 0, 0, err
	}
	defer closeAll()
	n := 2000
	if !c.pg {
		n = 300
	}
	cycle := func() error { return cl[0].cycle(ctx, tag, nil) }
	for range 20 {
		if err := cycle(); err != nil {
			return 0, 0, err
		}
	}
	var before, after runtime.MemStats
	runtime.GC()
	runtime.ReadMemStats(&before)
	for range n {
		if err := cycle(); err != nil {
			return 0, 0, err
		}
	}
	runtime.ReadMemStats(&after)
	return float64(after.TotalAlloc-before.TotalAlloc) / float64(n), float64(after.Mallocs-before.Mallocs) / float64(n), nil
}

// loss measures how long a holder takes to learn that its lock is gone: advlock after pg_terminate_backend of its
// session, etcd after its session's lease is revoked, redsync (which has no notification) by a watchdog polling
// Valid every 100 ms after the key disappears (as on expiry).
func loss(ctx context.Context, e *env, col *collector, round int, leases bool) {
	obs, err := pgx.Connect(ctx, e.pgURL)
	if err != nil {
		log.Printf("loss: %v", err)
		return
	}
	defer obs.Close(ctx)

	// advlock
	pool, err := pgxpool.New(ctx, e.poolURL)
	if err == nil {
		l := advlock.New(pool)
		var lat []time.Duration
		for i := range 10 {
			k := advlock.NameKey(fmt.Sprintf("bench-loss-%d-%d-%d", round, i, time.Now().UnixNano()))
			lk, err := l.Lock(ctx, k)
			if err != nil {
				log.Printf("loss/advlock: %v", err)
				break
			}
			time.Sleep(5 * time.Millisecond)
			v, _ := k.Int64()
			var pid int32
			if err := obs.QueryRow(ctx, `SELECT pid FROM pg_locks WHERE locktype = 'advisory' AND granted AND objsubid = 1
				AND ((classid::text::int8 << 32) | objid::text::int8) = $1`, v).Scan(&pid); err != nil {
				log.Printf("loss/advlock: %v", err)
				break
			}
			if _, err := obs.Exec(ctx, "SELECT pg_terminate_backend($1)", pid); err != nil {
				log.Printf("loss/advlock: %v", err)
				break
			}
			t0 := time.Now()
			<-lk.Done()
			lat = append(lat, time.Since(t0))
			_ = lk.Unlock(ctx)
		}
		l.Close()
		pool.Close()
		if len(lat) > 0 {
			col.add(wLoss, "advlock Lock", "p50 after pg_terminate_backend", "ms", ms(percentile(lat, 50)), "")
		}
	}

	// etcd
	if c, err := clientv3.New(clientv3.Config{Endpoints: e.etcdURLs, DialTimeout: 5 * time.Second, Logger: zap.NewNop()}); err == nil {
		var lat []time.Duration
		for i := range 5 {
			s, err := concurrency.NewSession(c, concurrency.WithTTL(5))
			if err != nil {
				log.Printf("loss/etcd: %v", err)
				break
			}
			m := concurrency.NewMutex(s, fmt.Sprintf("/bench/loss-%d-%d", round, i))
			if err := m.Lock(ctx); err != nil {
				log.Printf("loss/etcd: %v", err)
				s.Close()
				break
			}
			t0 := time.Now()
			if _, err := c.Revoke(ctx, s.Lease()); err != nil {
				log.Printf("loss/etcd: %v", err)
			}
			<-s.Done()
			lat = append(lat, time.Since(t0))
			s.Close()
		}
		c.Close()
		if len(lat) > 0 {
			col.add(wLoss, "etcd concurrency.Mutex", "p50 after lease revoke (TTL 5s)", "ms", ms(percentile(lat, 50)), "")
		}
	}

	// redsync
	rs := redsync.New(goredis.NewPool(e.redis))
	var lat []time.Duration
	for i := range 10 {
		name := fmt.Sprintf("bench-loss-%d-%d-%d", round, i, time.Now().UnixNano())
		m := rs.NewMutex(name, redsync.WithExpiry(30*time.Second))
		if err := m.LockContext(ctx); err != nil {
			log.Printf("loss/redsync: %v", err)
			break
		}
		noticed := make(chan time.Time, 1)
		stop := make(chan struct{})
		go func() { // the watchdog a redsync user has to write
			t := time.NewTicker(100 * time.Millisecond)
			defer t.Stop()
			for {
				select {
				case <-stop:
					return
				case <-t.C:
					if ok, err := m.ValidContext(ctx); !ok || err != nil {
						noticed <- time.Now()
						return
					}
				}
			}
		}()
		time.Sleep(time.Duration(i*7%100) * time.Millisecond) // spread the loss over the polling period
		t0 := time.Now()
		e.redis.Del(ctx, name)
		select {
		case at := <-noticed:
			lat = append(lat, at.Sub(t0))
		case <-time.After(5 * time.Second):
			log.Printf("loss/redsync: not noticed in 5s")
		}
		close(stop)
	}
	if len(lat) > 0 {
		col.add(wLoss, "redsync (Redis)", "p50 after key expiry, 100ms watchdog", "ms", ms(percentile(lat, 50)), "")
	}
	col.add(wLoss, rawName, "p50", "ms", -1, "never: learns at its next statement")
	if leases {
		leaseLoss(ctx, e, obs, col, round)
	}
}

// held measures memory per held lock and the server connections used to hold locks at once.
func held(ctx context.Context, e *env, cs []contender, col *collector) {
	obs, err := pgx.Connect(ctx, e.pgURL)
	if err != nil {
		return
	}
	defer obs.Close(ctx)
	// pgHolders counts the server sessions holding the keys of a held() run (their names start with tag).
	pgHolders := func(tag string) int {
		var n int
		var keys []int64
		for i := range 5000 {
			keys = append(keys, pgKey(fmt.Sprintf("%s-%d", tag, i)))
		}
		_ = obs.QueryRow(ctx, `SELECT count(DISTINCT pid) FROM pg_locks WHERE locktype = 'advisory' AND granted
			AND objsubid = 1 AND ((classid::text::int8 << 32) | objid::text::int8) = ANY($1)`, keys).Scan(&n)
		return n
	}
	redisConns := func() int {
		info, _ := e.redis.Info(ctx, "clients").Result()
		var n int
		for _, line := range splitLines(info) {
			if _, err := fmt.Sscanf(line, "connected_clients:%d", &n); err == nil {
				return n
			}
		}
		return 0
	}
	for _, c := range cs {
		if c.name == "advlock TryLock" || c.name == "advlock Do" {
			continue // same sessions as advlock Lock
		}
		m := 1000
		switch {
		case c.shares:
			m = 5000 // shared sessions: thousands on a few connections
		case c.pg && c.name != rawName:
			m = 50 // one connection per held lock; 1,000 would exceed max_connections
		}
		connsBefore := 0
		if !c.pg {
			connsBefore = redisConns()
		}
		cl, closeAll, err := newClients(ctx, c, 1)
		if err != nil {
			log.Printf("held/%s: %v", c.name, err)
			continue
		}
		var before, after runtime.MemStats
		runtime.GC()
		runtime.ReadMemStats(&before)
		var unlocks []func(context.Context) error
		tag := fmt.Sprintf("held-%d", time.Now().UnixNano())
		for i := range m {
			un, err := cl[0].lock(ctx, fmt.Sprintf("%s-%d", tag, i))
			if err != nil {
				log.Printf("held/%s: %v", c.name, err)
				break
			}
			unlocks = append(unlocks, un)
		}
		runtime.GC()
		runtime.ReadMemStats(&after)
		conns := pgHolders(tag)
		note := fmt.Sprintf("%d connections for %d locks", conns, len(unlocks))
		switch {
		case c.name == "etcd concurrency.Mutex":
			note = "one gRPC connection per client"
			conns = -1
		case !c.pg:
			conns = redisConns() - connsBefore
			note = fmt.Sprintf("%d new connections for %d locks", conns, len(unlocks))
		}
		if len(unlocks) > 0 {
			perLock := max(0, float64(int64(after.HeapAlloc)-int64(before.HeapAlloc))/float64(len(unlocks)))
			col.add(wMemory, c.name, "heap per held lock", "B", perLock, "")
			per := float64(conns) / float64(len(unlocks))
			if conns < 0 {
				per = -1
			}
			col.add(wMemory, c.name, "server connections per held lock", "conns", per, note)
		}
		for _, un := range unlocks {
			_ = un(ctx)
		}
		closeAll()
	}
}

func splitLines(s string) []string {
	var out []string
	start := 0
	for i := 0; i < len(s); i++ {
		if s[i] == '\n' {
			out = append(out, trimCR(s[start:i]))
			start = i + 1
		}
	}
	return append(out, trimCR(s[start:]))
}

func trimCR(s string) string {
	if len(s) > 0 && s[len(s)-1] == '\r' {
		return s[:len(s)-1]
	}
	return s
}

func median(v []float64) float64 {
	s := slices.Clone(v)
	sort.Float64s(s)
	if len(s)%2 == 1 {
		return s[len(s)/2]
	}
	return (s[len(s)/2-1] + s[len(s)/2]) / 2
}

var manyNotes = map[string]string{
	rawName:                 "8 dedicated connections shared by the goroutines",
	"raw pgxpool":           "pool of 32",
	"advlock TryLock":       "shared sessions (default 4), pool of 32",
	sessionPerLock:          "TryLock, pool of 32",
	openDefault:             "TryLock, Open's default pool",
	open24:                  "TryLock, Open with a pool of 24",
	leasesName:              "TryLock, leases, pool of 64",
	leasesName + viaBouncer: "TryLock, leases, pool of 64",
}

// many measures one process whose n goroutines each take and release a lock on a key of their own (a lock per
// entity, per request) through one client: raw pgx over 8 dedicated connections (the baseline), raw pgxpool,
// advlock with shared sessions and advlock with a session per lock, and leases (with -only lease). The contenders take turns in 50 ms slices
// until each has run *flagDur. It returns cycles/s.
func many(ctx context.Context, e *env, cs []contender, n int, tag string) map[string]float64 {
	type runner struct {
		name  string
		cycle func(g int) error
		close func()
		count atomic.Int64
		spent time.Duration
		err   error
	}
	var rs []*runner
	raw, err := newRawConns(ctx, e.pgURL, 8)
	if err != nil {
		log.Printf("%s: %v", wMany, err)
		return nil
	}
	rs = append(rs, &runner{name: rawName, close: raw.close, cycle: func(g int) error {
		return raw.cycle(ctx, g, pgKey(fmt.Sprintf("%s-raw-%d", tag, g)))
	}})
	for _, c := range cs {
		if c.name != "raw pgxpool" && c.name != "advlock TryLock" && c.name != sessionPerLock && c.name != openDefault &&
			c.name != open24 && c.name != leasesName && c.name != leasesName+viaBouncer {
			continue
		}
		// Pools of 32 here: every contender is connected at once, within max_connections (100 by default).
		cl, err := c.new(context.WithValue(ctx, poolSizeKey{}, 32))
		if !check(c, wMany, err) {
			continue
		}
		rs = append(rs, &runner{name: c.name, close: cl.close, cycle: func(g int) error {
			var un func(context.Context) error
			var err error
			if a, ok := cl.(*advClient); ok { // TryLock for both advlock contenders
				var lk *advlock.Lock
				lk, err = a.l.TryLock(ctx, advlock.NameKey(fmt.Sprintf("bench-%s-%s-%d", tag, c.name, g)))
				if errors.Is(err, advlock.ErrPoolExhausted) {
					// A session per lock: 256 goroutines over 32 connections. A try does not wait for a
					// connection; the attempt is not a cycle.
					return errNoCycle
				}
				if lk != nil {
					un = lk.Unlock
				}
			} else {
				un, err = cl.lock(ctx, fmt.Sprintf("%s-%s-%d", tag, c.name, g))
			}
			if err == nil {
				err = un(ctx)
			}
			return err
		}})
	}
	defer func() {
		for _, r := range rs {
			r.close()
		}
	}()
	for _, r := range rs { // warm up: connections, shared sessions, prepared statements
		var wg sync.WaitGroup
		for g := range n {
			wg.Add(1)
			go func() {
				defer wg.Done()
				if err := r.cycle(g); err != nil && err != errNoCycle && r.err == nil {
					r.err = err
				}
			}()
		}
		wg.Wait()
	}
	turns := make([]turn, len(rs))
	for i, r := range rs {
		turns[i] = turn{n: n, spent: &r.spent, err: &r.err, cycle: func(g int) error {
			err := r.cycle(g)
			if err == nil {
				r.count.Add(1)
			}
			if err == errNoCycle {
				return nil
			}
			return err
		}}
	}
	takeTurns(turns)
	out := map[string]float64{}
	for _, r := range rs {
		if r.err != nil {
			log.Printf("%s / %s: %v", wMany, r.name, r.err)
			continue
		}
		out[r.name] = float64(r.count.Load()) / r.spent.Seconds()
	}
	return out
}

var oneKeyNotes = map[string]string{
	rawName:        "8 dedicated connections shared by the goroutines, pg_advisory_lock",
	"raw pgxpool":  "pool of 32, pg_advisory_lock",
	"advlock Lock": "Lock, pool of 32",
	"advlock Do":   "Do, pool of 32",
	openDefault:    "Lock, Open's default pool",
	open24:         "Lock, Open with a pool of 24",
}

// oneKeyMany measures one process whose n goroutines all take and release one key, waiting for it, through one
// client: raw pgx over 8 dedicated connections (the baseline: each goroutine waits for its connection, then in
// the server), raw pgxpool, and the blocking advlock contenders that share sessions (in-process hand-off
// behind the Locker's gate). The contenders take turns in 50 ms slices until each has run *flagDur. It returns
// cycles/s and max/min cycles per goroutine.
func oneKeyMany(ctx context.Context, e *env, cs []contender, n int, tag string) map[string]tput {
	type runner struct {
		name   string
		cycle  func(g int) error
		close  func()
		counts []atomic.Int64
		spent  time.Duration
		err    error
	}
	var rs []*runner
	raw, err := newRawConns(ctx, e.pgURL, 8)
	if err != nil {
		log.Printf("%s: %v", wManyOneKey, err)
		return nil
	}
	rawKey := pgKey(tag + "-raw")
	rs = append(rs, &runner{name: rawName, close: raw.close, cycle: func(g int) error { return raw.cycleWait(ctx, g, rawKey) }})
	for _, c := range cs {
		if _, ok := oneKeyNotes[c.name]; !ok || c.name == rawName {
			continue
		}
		cl, err := c.new(context.WithValue(ctx, poolSizeKey{}, 32))
		if !check(c, wManyOneKey, err) {
			continue
		}
		k := tag + "-" + c.name
		rs = append(rs, &runner{name: c.name, close: cl.close, cycle: func(g int) error { return cl.cycle(ctx, k, nil) }})
	}
	defer func() {
		for _, r := range rs {
			r.close()
		}
	}()
	for _, r := range rs {
		r.counts = make([]atomic.Int64, n)
		var wg sync.WaitGroup
		for g := range n { // warm up
			wg.Add(1)
			go func() {
				defer wg.Done()
				if err := r.cycle(g); err != nil && r.err == nil {
					r.err = err
				}
			}()
		}
		wg.Wait()
	}
	turns := make([]turn, len(rs))
	for i, r := range rs {
		turns[i] = turn{n: n, spent: &r.spent, err: &r.err, cycle: func(g int) error {
			err := r.cycle(g)
			if err == nil {
				r.counts[g].Add(1)
			}
			return err
		}}
	}
	takeTurns(turns)
	out := map[string]tput{}
	for _, r := range rs {
		if r.err != nil {
			log.Printf("%s / %s: %v", wManyOneKey, r.name, r.err)
			continue
		}
		var total int64
		lo, hi := r.counts[0].Load(), r.counts[0].Load()
		for i := range r.counts {
			v := r.counts[i].Load()
			total += v
			lo, hi = min(lo, v), max(hi, v)
		}
		fair := 0.0
		if lo > 0 {
			fair = float64(hi) / float64(lo)
		}
		out[r.name] = tput{float64(total) / r.spent.Seconds(), fair}
	}
	return out
}

// errNoCycle marks an attempt that did no work and is not counted (and is no failure).
var errNoCycle = errors.New("no cycle")

// turn is one contender's part in takeTurns: n goroutines running cycle.
type turn struct {
	n     int
	cycle func(g int) error // one cycle of goroutine g; counts its own successes
	spent *time.Duration    // time run so far
	err   *error            // the first failure; the contender then sits out
}

// takeTurns runs the contenders in 50 ms slices, one after another, until each has run *flagDur, so that they
// share the machine's weather.
func takeTurns(ts []turn) {
	const slice = 50 * time.Millisecond
	for spent := time.Duration(0); spent < *flagDur; spent += slice {
		for _, t := range ts {
			if *t.err != nil {
				continue
			}
			d, err := runTurn(t.n, t.cycle, slice)
			*t.spent += d
			if err != nil {
				*t.err = err
			}
		}
	}
}

// runTurn runs cycle on n goroutines at once until d has passed, and returns how long that took (the last cycle
// ends past d) and the first error.
func runTurn(n int, cycle func(g int) error, d time.Duration) (time.Duration, error) {
	var wg sync.WaitGroup
	var failed atomic.Value
	start := time.Now()
	stop := start.Add(d)
	for g := range n {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for time.Now().Before(stop) {
				if err := cycle(g); err != nil {
					failed.Store(err)
					return
				}
			}
		}()
	}
	wg.Wait()
	err, _ := failed.Load().(error)
	return time.Since(start), err
}

// writersOf are the contenders of the writers workload: PostgreSQL's own queue and advlock's sliced waits.
var writersOf = map[string]bool{rawName: true, "advlock Lock": true, openDefault: true}

const (
	writersN    = 20
	writersHold = 100 * time.Millisecond
	writersRun  = 10 * time.Second // five turns of every writer: counts one apart are 1.2x
)

type writersResult struct {
	fair    float64
	longest time.Duration
}

// writers measures writersN writers, each through a client of its own (as writers in as many processes), taking
// one key in turn and holding it writersHold, for writersRun: max/min grants per writer, and the longest wait
// (each writer's first, behind the start, not counted). Waits longer than advlock's slice (0.9 s) must keep their
// place across slices for these to match PostgreSQL's queue.
func writers(ctx context.Context, cs []contender, tag string) map[string]writersResult {
	out := map[string]writersResult{}
	for _, c := range cs {
		if !writersOf[c.name] {
			continue
		}
		clients := make([]client, writersN)
		var err error
		for i := range clients {
			if clients[i], err = c.new(ctx); err != nil {
				break
			}
		}
		closeAll := func() {
			for _, cl := range clients {
				if cl != nil {
					cl.close()
				}
			}
		}
		if !check(c, wWriters, err) {
			closeAll()
			continue
		}
		key := tag + "-" + c.name
		// Warm up, uncounted: every client takes the key in turn once, each waiting for the others, so that each has
		// opened what waiting takes (connections, checks, a session of its own for advlock) before the counting
		// starts, as raw pgx's connections are made: a client that connects while the others take turns joins the
		// line late, and is counted as passed over by its own start.
		warmErrs := make([]error, writersN)
		var warm sync.WaitGroup
		for i, cl := range clients {
			warm.Add(1)
			go func() {
				defer warm.Done()
				warmErrs[i] = cl.cycle(ctx, key+"-warm", func() { time.Sleep(5 * time.Millisecond) })
			}()
		}
		warm.Wait()
		if err == nil {
			err = errors.Join(warmErrs...)
		}
		if !check(c, wWriters, err) {
			closeAll()
			continue
		}
		counts := make([]int, writersN)
		longest := make([]time.Duration, writersN)
		errs := make([]error, writersN)
		stop := time.Now().Add(writersRun)
		var wg sync.WaitGroup
		for i, cl := range clients {
			wg.Add(1)
			go func() {
				defer wg.Done()
				for first := true; time.Now().Before(stop); first = false {
					began := time.Now()
					un, err := cl.lock(ctx, key)
					if err != nil {
						errs[i] = err
						return
					}
					if !first {
						longest[i] = max(longest[i], time.Since(began))
					}
					counts[i]++
					time.Sleep(writersHold)
					if err := un(ctx); err != nil {
						errs[i] = err
						return
					}
				}
			}()
		}
		wg.Wait()
		closeAll()
		if err := errors.Join(errs...); !check(c, wWriters, err) {
			continue
		}
		fair := 0.0
		if lo := slices.Min(counts); lo > 0 {
			fair = float64(slices.Max(counts)) / float64(lo)
		}
		out[c.name] = writersResult{fair, slices.Max(longest)}
	}
	return out
}
