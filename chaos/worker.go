package main

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"math/rand/v2"
	"os"
	"os/signal"
	"runtime"
	"slices"
	"strconv"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/advlock/advlock"
	"github.com/advlock/advlock/internal/config"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"go.uber.org/goleak"
)

// envWorker carries a worker's configuration (JSON) to the re-executed binary.
const envWorker = "ADVLOCK_CHAOS_WORKER"

// workerConfig is what the campaign tells one worker process.
type workerConfig struct {
	ID         int           `json:"id"`
	Inc        int           `json:"inc"` // incarnation: 0, then one more per restart after SIGKILL
	Name       string        `json:"name"`
	DSN        string        `json:"dsn"`             // where its Locker connects: the server, a proxy or PgBouncer
	Ledger     string        `json:"ledger"`          // the protected resource: the server, directly (a server of its own with failover)
	Locks      string        `json:"locks,omitempty"` // where its own look at pg_locks goes, when not the ledger's server
	Shared     bool          `json:"shared"`
	Broken     bool          `json:"broken"` // a deliberately wrong locker (the checker's own test)
	Seed       uint64        `json:"seed"`
	Keepalive  time.Duration `json:"keepalive"`
	History    string        `json:"history"`
	Goroutines int           `json:"goroutines"`
	Ops        []string      `json:"ops,omitempty"` // only these operations, drawn evenly (default: the mix)
	WaitSlice  time.Duration `json:"wait_slice,omitempty"`
	// LeaseLength, when not zero: the worker's locks are leases of this length (Options.Leases).
	LeaseLength time.Duration `json:"lease_length,omitempty"`
}

// Keys the workers contend for.
var (
	lockKeys = []advlock.Key{advlock.Int64Key(71001), advlock.Int64Key(71002), advlock.Int64Key(71003)}
	leadKey  = advlock.Int64Key(71100)
	// pairKeys are taken two at a time in a random order (the pair operation): cycles of waits form, across
	// processes and inside one, which the Lockers must break with exactly one ErrDeadlock each.
	pairKeys = []advlock.Key{advlock.Int64Key(71201), advlock.Int64Key(71202), advlock.Int64Key(71203)}
	// queueKey is the readers' and writers' key (the reader and writer operations, and no other): readers that
	// come and go keep it held in shared mode, and a writer must still be granted in PostgreSQL's queue order.
	// Every wait for it is recorded, so the checker knows its whole queue.
	queueKey = advlock.Int64Key(71300)
)

// queueWait bounds a reader's or writer's wait (advlock.Wait; the caller sets no deadline): far longer than the
// checker's StarveBound, so that a starved wait shows as one, and a slow link has time to end it wrongly.
const queueWait = 8 * time.Second

// pairWait bounds a pair operation's wait for its second key: far longer than a cycle may last (History's
// DeadlockBound), so that only the Locker's detection, or a fault, ends a cycle in time.
const pairWait = 8 * time.Second

const (
	semName = "chaos"
	semN    = 2
)

// event is one line of a worker's history file.
type event struct {
	T     string `json:"t"` // op, begin, end, wait, waited, exit, hang
	W     int    `json:"w"`
	Inc   int    `json:"inc"`
	At    int64  `json:"at,omitempty"` // unix ns when written (this machine's clock, which is the server's)
	Op    string `json:"op,omitempty"`
	Key   string `json:"key,omitempty"`
	Mode  string `json:"mode,omitempty"` // x or s
	CS    string `json:"cs,omitempty"`
	Token int64  `json:"token,omitempty"`
	PID   uint32 `json:"pid,omitempty"` // begin: the server session that holds the lock (LockOutcome.PID)
	// wait, waited: a reader's or writer's wait (a pair's is named by its CS, the section it holds); begin: the
	// wait that was granted this section
	Wait string `json:"wait,omitempty"`
	// op
	Result string `json:"result,omitempty"`
	Err    string `json:"err,omitempty"`
	Start  int64  `json:"start,omitempty"` // unix ns, this machine's clock (the server's too: same host)
	End    int64  `json:"end,omitempty"`
	// end of a critical section
	Told    int64  `json:"told,omitempty"`    // when the library told of the lock's end (Done, fn's ctx), 0 if never
	Cause   string `json:"cause,omitempty"`   // lost, closed, ...
	Unlock  string `json:"unlock,omitempty"`  // what Unlock (or Do, Lead, DoTx) returned: ok, lost, closed, error: ...
	Clean   bool   `json:"clean,omitempty"`   // held from grant to a confirmed release, never told of an end
	ToldBy  string `json:"told_by,omitempty"` // done: the lock's Done (fn's ctx) closed; unlock: only its release said so
	Session string `json:"session,omitempty"` // where the lock was held: shared or dedicated (the Locker's LockEnd)
	// exit
	Leaks      []string `json:"leaks,omitempty"`
	Goroutines string   `json:"goroutines,omitempty"`
	Counts     *counts  `json:"counts,omitempty"`
}

type counts struct {
	Cancels int64 `json:"cancels"` // ctx cancellations fired at a random moment of a wait
}

type worker struct {
	cfg    workerConfig
	hist   *os.File
	histMu sync.Mutex
	ledger *pgxpool.Pool
	locker atomic.Pointer[advlock.Locker]
	broken *pgxpool.Pool
	seq    atomic.Int64
	counts struct{ cancels atomic.Int64 }

	// The writers' Locker (see writerLocker), opened with the first writer.
	writerMu sync.Mutex
	writer   *advlock.Locker

	opsMu sync.Mutex
	ops   map[int64]opTrack
	opSeq int64

	obs lockObserver
}

// lockObserver is the worker's hook on its Locker. It learns how each Lead term's lock ended (Lead releases it
// after fn returns, out of fn's sight), so that a term released cleanly counts as a clean section like any other;
// terms are matched to their locks by fencing token (every grant has its own). It tells each call, through its
// context, which server session holds what it was granted, and remembers where each key's last lock was held.
type lockObserver struct {
	w       *worker
	mu      sync.Mutex
	pending map[int64]event   // token -> the end of a term whose fn returned, waiting for its lock's end
	ended   map[int64]string  // token -> where a lead lock that ended before its term's fn returned was held
	session map[string]string // key -> where its last lock that ended was held
}

// pidBox, put in a lock call's context, receives the pid of the server session that holds what it was granted.
type pidBox struct{}

func withPIDBox(ctx context.Context) (context.Context, *atomic.Uint32) {
	b := new(atomic.Uint32)
	return context.WithValue(ctx, pidBox{}, b), b
}

// maps makes the maps on first use; o.mu is held.
func (o *lockObserver) maps() {
	if o.session == nil {
		o.session, o.pending, o.ended = map[string]string{}, map[int64]event{}, map[int64]string{}
	}
}

// sessionOf says where the last lock of key that ended was held (one exclusive holder per key in a worker).
func (o *lockObserver) sessionOf(key string) string {
	o.mu.Lock()
	defer o.mu.Unlock()
	return o.session[key]
}

func (o *lockObserver) LockStart(ctx context.Context, _ advlock.LockCall) (context.Context, func(advlock.LockOutcome)) {
	b, _ := ctx.Value(pidBox{}).(*atomic.Uint32)
	return ctx, func(r advlock.LockOutcome) {
		if b != nil && r.Result == advlock.ResultAcquired {
			b.Store(r.PID)
		}
	}
}

func (o *lockObserver) Session(advlock.SessionEvent) {}

func (o *lockObserver) LockEnd(e advlock.LockEnd) {
	o.mu.Lock()
	defer o.mu.Unlock()
	o.maps()
	o.session[canon(e.Key)] = e.Session
	if e.Key != leadKey {
		return
	}
	end, ok := o.pending[e.Token]
	if !ok {
		o.ended[e.Token] = e.Session // its term's fn has not returned yet
		return
	}
	delete(o.pending, e.Token)
	end.Clean = end.Told == 0 && e.Cause == advlock.CauseReleased && errors.Is(e.Err, advlock.ErrNotHeld) // released by its holder, confirmed
	end.Session = e.Session
	if e.Cause != advlock.CauseReleased {
		end.Unlock = e.Cause
	}
	o.w.emit(end)
}

// returned records the end of the term (its token) whose fn returns: at once when its lock has ended already,
// else when it ends.
func (o *lockObserver) returned(token int64, end event) {
	o.mu.Lock()
	defer o.mu.Unlock()
	o.maps()
	if s, ok := o.ended[token]; ok {
		delete(o.ended, token)
		end.Session = s
		o.w.emit(end)
		return
	}
	o.pending[token] = end
}

type opTrack struct {
	name     string
	deadline time.Time
	reported bool
}

// hangBound is how long past its own planned end an operation may take before it counts as hung.
const hangBound = 30 * time.Second

func (w *worker) emit(e event) {
	e.W, e.Inc = w.cfg.ID, w.cfg.Inc
	if e.At == 0 {
		e.At = time.Now().UnixNano()
	}
	b, _ := json.Marshal(e)
	w.histMu.Lock()
	defer w.histMu.Unlock()
	_, _ = w.hist.Write(append(b, '\n')) // one write per line: a SIGKILL loses at most the line being written
}

// runWorker is the worker process: it loops over the operations until SIGTERM, then unlocks, closes, checks for
// leaks and exits 0.
func runWorker(raw string) int {
	var cfg workerConfig
	if err := json.Unmarshal([]byte(raw), &cfg); err != nil {
		fmt.Fprintln(os.Stderr, "chaos worker: bad config:", err)
		return 2
	}
	stopCtx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM)
	defer stop()
	usr1 := make(chan os.Signal, 1)
	signal.Notify(usr1, syscall.SIGUSR1)
	defer signal.Stop(usr1)

	h, err := os.OpenFile(cfg.History, os.O_APPEND|os.O_CREATE|os.O_WRONLY, 0o644)
	if err != nil {
		fmt.Fprintln(os.Stderr, "chaos worker:", err)
		return 2
	}
	defer h.Close()
	w := &worker{cfg: cfg, hist: h, ops: map[int64]opTrack{}}
	w.obs.w = w
	pcfg, err := pgxpool.ParseConfig(cfg.Ledger)
	if err != nil {
		fmt.Fprintln(os.Stderr, "chaos worker:", err)
		return 2
	}
	pcfg.ConnConfig.RuntimeParams["application_name"] = cfg.Name + "-ledger"
	pcfg.MaxConns = int32(cfg.Goroutines + 2)
	if w.ledger, err = pgxpool.NewWithConfig(context.Background(), pcfg); err != nil {
		fmt.Fprintln(os.Stderr, "chaos worker:", err)
		return 2
	}
	if cfg.Broken {
		bcfg, _ := pgxpool.ParseConfig(cfg.DSN)
		bcfg.ConnConfig.RuntimeParams["application_name"] = cfg.Name
		bcfg.MaxConns = 3
		if w.broken, err = pgxpool.NewWithConfig(context.Background(), bcfg); err != nil {
			fmt.Fprintln(os.Stderr, "chaos worker:", err)
			return 2
		}
	} else {
		// A service keeps trying: the server may be restarting, or PgBouncer refusing logins for a while.
		for {
			l, err := w.open(stopCtx)
			if err == nil {
				w.locker.Store(l)
				break
			}
			if stopCtx.Err() != nil {
				w.ledger.Close()
				w.emit(event{T: "exit"})
				return 0
			}
			fmt.Fprintln(os.Stderr, "chaos worker: open (will retry):", err)
			time.Sleep(200 * time.Millisecond)
		}
	}

	watchdogDone := make(chan struct{})
	go w.watchdog(watchdogDone)
	var wg sync.WaitGroup
	for g := range cfg.Goroutines {
		wg.Add(1)
		go func() {
			defer wg.Done()
			rng := rand.New(rand.NewPCG(cfg.Seed, uint64(cfg.Inc)<<16|uint64(g)))
			for stopCtx.Err() == nil {
				w.step(stopCtx, rng)
			}
		}()
	}
	// SIGUSR1: close the Locker while operations are in flight, then open a new one.
	wg.Add(1)
	go func() {
		defer wg.Done()
		for {
			select {
			case <-stopCtx.Done():
				return
			case <-usr1:
				if cfg.Broken {
					continue
				}
				old := w.locker.Load()
				old.Close()
				for stopCtx.Err() == nil {
					l, err := w.open(stopCtx)
					if err == nil {
						w.locker.Store(l)
						break
					}
					time.Sleep(100 * time.Millisecond)
				}
			}
		}
	}()
	wg.Wait()

	exit := event{T: "exit", Counts: &counts{Cancels: w.counts.cancels.Load()}}
	exit.Leaks = w.heldByMe()
	if l := w.locker.Load(); l != nil {
		l.Close()
	}
	if w.writer != nil {
		w.writer.Close()
	}
	if w.broken != nil {
		w.broken.Close()
	}
	w.ledger.Close()
	close(watchdogDone)
	stop()
	// pgx closes a connection it gave up on in the background: a cancel request, then the socket, within 15 s
	// (through a blackhole it takes all of them). A goroutine still there after 20 s is a leak.
	for deadline := time.Now().Add(20 * time.Second); ; {
		err := goleak.Find(goleak.IgnoreTopFunction("os/signal.signal_recv"), goleak.IgnoreTopFunction("os/signal.loop"))
		if err == nil {
			break
		}
		if time.Now().After(deadline) {
			exit.Goroutines = err.Error()
			break
		}
		time.Sleep(500 * time.Millisecond)
	}
	w.emit(exit)
	return 0
}

func (w *worker) open(ctx context.Context) (*advlock.Locker, error) {
	n := 0
	if w.cfg.Shared {
		n = 4
	}
	ctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	opts := []advlock.Option{advlock.WithFencing(), advlock.WithKeepalive(w.cfg.Keepalive), advlock.WithSharedSessions(n),
		advlock.WithObserver(&w.obs)}
	if d := w.cfg.WaitSlice; d > 0 {
		opts = append(opts, option(func(o *config.Options) { o.WaitSlice = d })) // a test knob of the library's
	}
	if d := w.cfg.LeaseLength; d > 0 {
		opts = append(opts, advlock.WithLeases(), advlock.WithLeaseLength(d), advlock.WithLeaseHolder(w.cfg.Name),
			option(func(o *config.Options) { o.LeasePoll = 20 * time.Millisecond })) // a test knob of the library's
	}
	return advlock.Open(ctx, w.cfg.DSN+"&application_name="+w.cfg.Name, opts...)
}

// heldByMe lists the advisory locks that backends named after this worker hold once every operation has ended:
// each one is a lock left behind (on an idle pooled connection, or a session nobody watches). A session that the
// client gave up on behind a blackhole may linger until the server's idle_session_timeout, so it asks for a while.
func (w *worker) heldByMe() []string {
	var rows []string
	for deadline := time.Now().Add(3*w.cfg.Keepalive + 5*time.Second); ; time.Sleep(200 * time.Millisecond) {
		rows = rows[:0]
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		var q interface {
			Query(context.Context, string, ...any) (pgx.Rows, error)
		} = w.ledger
		if w.cfg.Locks != "" {
			c, err := pgx.Connect(ctx, w.cfg.Locks)
			if err != nil {
				cancel()
				if time.Now().After(deadline) {
					return append(rows, "could not read pg_locks: "+err.Error())
				}
				continue
			}
			q = c
		}
		r, err := q.Query(ctx, `SELECT l.classid, l.objid, l.objsubid, l.pid, l.granted,
				l.mode || coalesce(' in ' || a.state, '') || CASE WHEN l.virtualtransaction IS NOT NULL AND a.xact_start IS NOT NULL
					THEN ' (transaction since ' || a.xact_start::text || ')' ELSE '' END
			FROM pg_locks l JOIN pg_stat_activity a ON a.pid = l.pid
			WHERE l.locktype = 'advisory' AND a.application_name = $1`, w.cfg.Name)
		if err == nil {
			for r.Next() {
				var classid, objid uint32
				var sub int16
				var pid int32
				var granted bool
				var what string
				if r.Scan(&classid, &objid, &sub, &pid, &granted, &what) == nil {
					k, _ := advlock.KeyFromPgLocks(classid, objid, sub)
					rows = append(rows, fmt.Sprintf("%s pid %d granted %v, %s", canon(k), pid, granted, what))
				}
			}
			err = r.Err()
		}
		if err == nil && w.cfg.LeaseLength > 0 { // and the leases this process still renews
			var renewed []string
			if renewed, err = w.leasesRenewed(ctx, q); err == nil {
				rows = append(rows, renewed...)
			}
		}
		if c, ok := q.(*pgx.Conn); ok {
			c.Close(context.Background()) // one connection at a time, whatever the loop's length
		}
		cancel()
		if (err == nil && len(rows) == 0) || time.Now().After(deadline) {
			if err != nil {
				rows = append(rows, "could not read pg_locks: "+err.Error())
			}
			return rows
		}
	}
}

// leasesRenewed lists the leases of this process that something renews after its operations ended: read twice, a
// renewal period apart, their records changed. A lease of this process that is not renewed is no leak of its
// own: a release a crash took back, or one whose deletion goes on apart (the campaign's rules judge those).
func (w *worker) leasesRenewed(ctx context.Context, q interface {
	Query(context.Context, string, ...any) (pgx.Rows, error)
}) ([]string, error) {
	read := func() (map[int64]string, error) {
		r, err := q.Query(ctx, `SELECT term, expires::text || ' on key ' || key FROM public.advlock_lease
			WHERE holder LIKE '% pid ' || $1 || ' ' || $2`, fmt.Sprint(os.Getpid()), w.cfg.Name)
		if err != nil {
			return nil, err
		}
		out := map[int64]string{}
		for r.Next() {
			var term int64
			var rec string
			if err := r.Scan(&term, &rec); err != nil {
				return nil, err
			}
			out[term] = rec
		}
		return out, r.Err()
	}
	before, err := read()
	if err != nil || len(before) == 0 {
		return nil, err
	}
	time.Sleep(w.cfg.LeaseLength/3 + 300*time.Millisecond)
	after, err := read()
	if err != nil {
		return nil, err
	}
	var out []string
	for term, rec := range after {
		if b, ok := before[term]; ok && b != rec {
			out = append(out, fmt.Sprintf("lease of term %d still renewed: expires %s, then %s", term, b, rec))
		}
	}
	return out, nil
}

func (w *worker) track(name string, planned time.Duration) func() {
	w.opsMu.Lock()
	w.opSeq++
	id := w.opSeq
	w.ops[id] = opTrack{name: name, deadline: time.Now().Add(planned + hangBound)}
	w.opsMu.Unlock()
	return func() {
		w.opsMu.Lock()
		delete(w.ops, id)
		w.opsMu.Unlock()
	}
}

// watchdog reports an operation that has not returned within its bound, once, with every goroutine's stack.
func (w *worker) watchdog(done <-chan struct{}) {
	t := time.NewTicker(time.Second)
	defer t.Stop()
	for {
		select {
		case <-done:
			return
		case now := <-t.C:
			w.opsMu.Lock()
			var hung []string
			for id, o := range w.ops {
				if !o.reported && now.After(o.deadline) {
					o.reported = true
					w.ops[id] = o
					hung = append(hung, o.name)
				}
			}
			w.opsMu.Unlock()
			for _, name := range hung {
				buf := make([]byte, 1<<20)
				buf = buf[:runtime.Stack(buf, true)]
				fmt.Fprintf(os.Stderr, "chaos worker %d: %s did not return within its bound\n%s\n", w.cfg.ID, name, buf)
				w.emit(event{T: "hang", Op: name})
			}
		}
	}
}

func (w *worker) csID() string {
	return fmt.Sprintf("%d.%d.%d", w.cfg.ID, w.cfg.Inc, w.seq.Add(1))
}

func classify(err error) string {
	switch {
	case err == nil:
		return "ok"
	case errors.Is(err, advlock.ErrNotAcquired):
		return "not_acquired"
	case errors.Is(err, advlock.ErrDeadlock):
		return "deadlock"
	case errors.Is(err, advlock.ErrLockLost):
		return "lost"
	case errors.Is(err, advlock.ErrClosed):
		return "closed"
	case errors.Is(err, context.Canceled):
		return "canceled"
	case errors.Is(err, context.DeadlineExceeded):
		return "timeout"
	}
	return "error"
}

func sleepRand(rng *rand.Rand, lo, hi time.Duration) {
	time.Sleep(lo + time.Duration(rng.Int64N(int64(hi-lo)+1)))
}

// step runs one operation picked at random.
func (w *worker) step(stop context.Context, rng *rand.Rand) {
	if w.cfg.Broken {
		w.brokenStep(rng)
		return
	}
	l := w.locker.Load()
	key := lockKeys[rng.IntN(len(lockKeys))]
	op := w.pick(rng)
	var err error
	start := time.Now()
	switch op {
	case "pair":
		err = w.pair(l, rng)
	case "hold":
		// A holder that stays in its section for seconds: the faults (aimed at holders) land inside sections.
		err = w.sessionLock(op, key, "x", 6*time.Second, within(time.Second, func(ctx context.Context) (*advlock.Lock, error) {
			return l.Lock(ctx, key)
		}))
	case "hold_try": // the same, taken only when free at once (with shared sessions: on a shared session)
		err = w.sessionLock(op, key, "x", 6*time.Second, func(ctx context.Context) (*advlock.Lock, error) {
			return l.TryLock(ctx, key)
		})
	case "trylock":
		err = w.sessionLock(op, key, "x", 2*time.Second, func(ctx context.Context) (*advlock.Lock, error) {
			return l.TryLock(ctx, key)
		})
	case "lock_deadline":
		d := time.Duration(20+rng.IntN(500)) * time.Millisecond
		err = w.sessionLock(op, key, "x", d, within(d, func(ctx context.Context) (*advlock.Lock, error) { return l.Lock(ctx, key) }))
	case "lock_cancel":
		if rng.IntN(2) == 0 {
			// A key of this worker's own, hardly ever contended: the wait's first try goes to a shared session (a
			// contended key's waits skip it for a while) and is granted in one round trip, which the cancel races.
			key = advlock.Int64Key(72000 + int64(w.cfg.ID)*64 + int64(rng.IntN(64)))
		}
		d := time.Duration(rng.IntN(30_000)) * time.Microsecond
		switch rng.IntN(4) {
		case 0, 1:
			d = time.Duration(rng.IntN(2_000)) * time.Microsecond // within the first round trips: a grant races it
		case 2:
			// Late enough that a loaded machine (the race detector, every package's tests at once) still grants
			// some: a campaign whose every Lock was cancelled before its grant tests no grant racing a cancel.
			d = time.Duration(rng.IntN(300)) * time.Millisecond
		}
		err = w.sessionLock(op, key, "x", d, func(ctx context.Context) (*advlock.Lock, error) {
			ctx, cancel := context.WithCancel(ctx)
			t := time.AfterFunc(d, func() { w.counts.cancels.Add(1); cancel() })
			defer t.Stop()
			defer cancel()
			return l.Lock(ctx, key)
		})
	case "rlock":
		d := time.Duration(20+rng.IntN(500)) * time.Millisecond
		err = w.sessionLock(op, key, "s", d, within(d, func(ctx context.Context) (*advlock.Lock, error) { return l.RLock(ctx, key) }))
	case "do":
		err = w.do(l, key, rng)
	case "dotx":
		err = w.doTx(l, key, rng)
	case "reader":
		err = w.readers(stop, l, rng)
	case "writer":
		// A writer comes now and then (readers outnumber writers): a pause first, then a wait behind the readers.
		sleepRand(rng, 500*time.Millisecond, 2*time.Second)
		var wl *advlock.Locker
		if wl, err = w.writerLocker(stop); err == nil {
			err = w.queued(wl, "writer", "x")
		}
	case "semaphore":
		d := time.Duration(20+rng.IntN(500)) * time.Millisecond
		sem := l.Semaphore(semName, semN)
		err = w.sessionLock(op, advlock.Key{}, "x", d, within(d, func(ctx context.Context) (*advlock.Lock, error) {
			return sem.Acquire(ctx)
		}))
	default:
		err = w.lead(stop, l, rng)
	}
	w.emit(event{T: "op", Op: op, Result: classify(err), Err: errString(err), Start: start.UnixNano(), End: time.Now().UnixNano()})
	if err != nil && !errors.Is(err, advlock.ErrNotAcquired) {
		sleepRand(rng, 5*time.Millisecond, 50*time.Millisecond)
	}
}

type opWeight struct {
	op string
	p  int
}

// opWeights is the workers' mix of operations (percent). A reader's operation is several rounds, seconds in all:
// 1 percent of the draws keeps about a tenth of the goroutines reading the queue key.
var opWeights = []opWeight{{"hold", 3}, {"hold_try", 2}, {"trylock", 11}, {"lock_deadline", 15}, {"lock_cancel", 11}, {"rlock", 11}, {"do", 11}, {"dotx", 9},
	{"semaphore", 7}, {"pair", 10}, {"reader", 1}, {"writer", 1}, {"lead", 8}}

// leaseOps are the operations of a lease campaign: those leases offer (no shared mode, no transaction lock, no wait
// without a bound whose caller holds a lock), each as likely as in the usual mix.
var leaseOps = []string{"hold", "hold_try", "trylock", "lock_deadline", "lock_cancel", "do", "semaphore", "lead"}

// pick draws the next operation: from the mix, or evenly from the worker's own list.
func (w *worker) pick(rng *rand.Rand) string {
	if len(w.cfg.Ops) > 0 {
		return w.cfg.Ops[rng.IntN(len(w.cfg.Ops))]
	}
	if w.cfg.LeaseLength > 0 {
		for {
			if op := w.pickMix(rng); slices.Contains(leaseOps, op) {
				return op
			}
		}
	}
	return w.pickMix(rng)
}

// pickMix draws from the usual mix.
func (w *worker) pickMix(rng *rand.Rand) string {
	p := rng.IntN(100)
	for _, o := range opWeights {
		if p < o.p {
			return o.op
		}
		p -= o.p
	}
	return "lead"
}

// within bounds acquire by a deadline d away.
func within(d time.Duration, acquire func(context.Context) (*advlock.Lock, error)) func(context.Context) (*advlock.Lock, error) {
	return func(ctx context.Context) (*advlock.Lock, error) {
		ctx, cancel := context.WithTimeout(ctx, d)
		defer cancel()
		return acquire(ctx)
	}
}

func errString(err error) string {
	if err == nil || errors.Is(err, advlock.ErrNotAcquired) {
		return ""
	}
	return err.Error()
}

// sessionLock takes a session lock with acquire, runs a critical section on it, and unlocks.
func (w *worker) sessionLock(op string, key advlock.Key, mode string, planned time.Duration,
	acquire func(context.Context) (*advlock.Lock, error)) error {
	return w.sessionLockIn(context.Background(), op, key, mode, planned, acquire)
}

// sessionLockIn is sessionLock with acquire's context derived from parent (the pair operation's inner lock waits
// under its outer lock's context, which says what it holds).
func (w *worker) sessionLockIn(parent context.Context, op string, key advlock.Key, mode string, planned time.Duration,
	acquire func(context.Context) (*advlock.Lock, error)) error {
	done := w.track(op, planned+time.Second)
	defer done()
	actx, pid := withPIDBox(parent)
	lk, err := acquire(actx)
	if err != nil {
		return err
	}
	return w.section(op, lk, mode, w.csID(), "", pid.Load())
}

// section records a critical section on the session lock lk (granted through the recorded wait named wait, if
// any), writes to the ledger inside it as long as op holds, and unlocks.
func (w *worker) section(op string, lk *advlock.Lock, mode, cs, wait string, pid uint32) error {
	w.emit(event{T: "begin", Op: op, Key: canon(lk.Key()), Mode: mode, CS: cs, Token: lk.Token(), PID: pid, Wait: wait})
	told := watchTold(lk.Done())
	r := rngFor(cs)
	switch op {
	case "hold", "hold_try": // 2.5 to 5 s; with leases 5 to 10 s, past the faults that outlast a lease
		gap := 250 * time.Millisecond
		if w.cfg.LeaseLength > 0 {
			gap = 500 * time.Millisecond
		}
		w.critical(canon(lk.Key()), mode, lk.Token(), cs, lk.Done(), r, 20+r.IntN(20), gap)
		if mode == "x" && r.IntN(2) == 0 {
			select {
			case <-lk.Done():
				// Told of the loss, half the time it writes once more a moment later, as a holder paused past the
				// loss would before it knew: the resource must refuse it once a later holder wrote.
				time.Sleep(time.Duration(200+r.IntN(500)) * time.Millisecond)
				ctx, cancel := context.WithTimeout(context.Background(), 3*time.Second)
				_ = w.write(ctx, w.ledger, canon(lk.Key()), mode, lk.Token(), cs)
				cancel()
			default:
			}
		}
	case "reader": // long enough that readers overlap, and the key is never free of them
		w.criticalFor(canon(lk.Key()), mode, lk.Token(), cs, lk.Done(), time.Duration(300+r.IntN(600))*time.Millisecond)
	default:
		w.critical(canon(lk.Key()), mode, lk.Token(), cs, lk.Done(), r, 2+r.IntN(3), 40*time.Millisecond)
	}
	t := told() // before Unlock, which ends Done too
	by := toldBy(t)
	uctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	uerr := lk.Unlock(uctx)
	cancel()
	if t == 0 && errors.Is(uerr, advlock.ErrLockLost) {
		t, by = time.Now().UnixNano(), "unlock"
	}
	cause := ""
	if t != 0 || uerr != nil {
		cause = classify(lk.Err())
		if lk.Err() == nil {
			cause = classify(uerr)
		}
	}
	w.emit(event{T: "end", CS: cs, Key: canon(lk.Key()), Told: t, ToldBy: by, Cause: cause, Unlock: classify(uerr),
		Clean: uerr == nil && t == 0, Session: w.obs.sessionOf(canon(lk.Key()))})
	return uerr
}

// readers is a reader that comes and goes: 5 to 10 rounds, each an RLock of the queue key held 300 to 900 ms and
// taken again at once after its release, so that readers of several goroutines and workers overlap and the key
// is never free of them. It stops at the first round that fails, or when the worker is told to stop.
func (w *worker) readers(stop context.Context, l *advlock.Locker, rng *rand.Rand) error {
	for range 5 + rng.IntN(6) {
		if err := w.queued(l, "reader", "s"); err != nil || stop.Err() != nil {
			return err
		}
	}
	return nil
}

// writerLocker returns the Locker the writers take the queue key through: one of their own in this process, as a
// writer in another service would have. Through the worker's Locker a writer would wait in its in-process queue,
// where this process's readers queue behind it: they would let go of the key for it whatever the server does.
func (w *worker) writerLocker(ctx context.Context) (*advlock.Locker, error) {
	w.writerMu.Lock()
	defer w.writerMu.Unlock()
	if w.writer == nil {
		l, err := w.open(ctx)
		if err != nil {
			return nil, err
		}
		w.writer = l
	}
	return w.writer, nil
}

// queued takes the queue key in mode (s: RLock, x: Lock) bounded by Wait(queueWait), under a context without a
// deadline, and holds it (a reader 300 to 900 ms, a writer briefly). The wait is recorded as it starts and as it
// returns, under an id of its own that its section's begin names: the checker rebuilds the key's queue from these
// records (every wait for this key is one) and judges each wait by PostgreSQL's queue order.
func (w *worker) queued(l *advlock.Locker, op, mode string) error {
	done := w.track(op, queueWait+2*time.Second)
	defer done()
	ctx, pid := withPIDBox(context.Background())
	id := w.csID()
	w.emit(event{T: "wait", Op: op, Wait: id, Key: canon(queueKey), Mode: mode})
	var lk *advlock.Lock
	var err error
	if mode == "s" {
		lk, err = l.RLock(ctx, queueKey, advlock.Wait(queueWait))
	} else {
		lk, err = l.Lock(ctx, queueKey, advlock.Wait(queueWait))
	}
	w.emit(event{T: "waited", Op: op, Wait: id, Key: canon(queueKey), Mode: mode, Result: classify(err), Err: errString(err)})
	if err != nil {
		return err
	}
	return w.section(op, lk, mode, w.csID(), id, pid.Load())
}

func toldBy(t int64) string {
	if t == 0 {
		return ""
	}
	return "done"
}

func rngFor(cs string) *rand.Rand {
	var h uint64 = 14695981039346656037
	for i := 0; i < len(cs); i++ {
		h = (h ^ uint64(cs[i])) * 1099511628211
	}
	return rand.New(rand.NewPCG(h, 7))
}

// watchTold records when ch closes; the returned func reports that time (0: not closed).
func watchTold(ch <-chan struct{}) func() int64 {
	var at atomic.Int64
	select {
	case <-ch:
		at.Store(time.Now().UnixNano())
		return at.Load
	default:
	}
	stop := make(chan struct{})
	exited := make(chan struct{})
	go func() {
		defer close(exited)
		select {
		case <-ch:
			at.Store(time.Now().UnixNano())
		case <-stop:
		}
	}()
	return func() int64 {
		select {
		case <-ch: // closed by now: wait for the goroutine's stamp
			<-exited
		default:
			close(stop)
			<-exited
		}
		return at.Load()
	}
}

// critical writes to the ledger n times, gap apart at most, guarded by the token, checking before each write that
// the lock has not been reported ended. Its first write follows the grant at once and its last one precedes the
// release at once, so that the ledger shows the whole held interval.
func (w *worker) critical(key, mode string, token int64, cs string, done <-chan struct{}, rng *rand.Rand, n int, gap time.Duration) {
	for i := range n {
		select {
		case <-done:
			return
		default:
		}
		ctx, cancel := context.WithTimeout(context.Background(), 3*time.Second)
		_ = w.write(ctx, w.ledger, key, mode, token, cs)
		cancel()
		if i < n-1 {
			select {
			case <-done:
				return
			case <-time.After(5*time.Millisecond + time.Duration(rng.Int64N(int64(gap)))):
			}
		}
	}
}

// criticalFor is critical for a held span of d: a write about every 100 ms, the first one right after the grant
// and the last one right before d is up.
func (w *worker) criticalFor(key, mode string, token int64, cs string, done <-chan struct{}, d time.Duration) {
	end := time.Now().Add(d)
	for {
		select {
		case <-done:
			return
		default:
		}
		ctx, cancel := context.WithTimeout(context.Background(), 3*time.Second)
		_ = w.write(ctx, w.ledger, key, mode, token, cs)
		cancel()
		left := time.Until(end)
		if left <= 0 {
			return
		}
		select {
		case <-done:
			return
		case <-time.After(min(left, 100*time.Millisecond)):
		}
	}
}

type execer interface {
	QueryRow(ctx context.Context, sql string, args ...any) pgx.Row
}

// write is the protected resource's fenced write: it sets the key's fence to token when the fence is not greater
// (the same holder writes several times with one token) and records the attempt, accepted or refused, with the
// server's clock. A shared holder only reads.
func (w *worker) write(ctx context.Context, q execer, key, mode string, token int64, cs string) error {
	var accepted *bool
	if mode == "s" {
		return q.QueryRow(ctx, `INSERT INTO chaos_writes(key, token, cs, worker, mode, accepted, at)
			VALUES ($1, $2, $3, $4, 's', NULL, clock_timestamp()) RETURNING accepted`, key, token, cs, w.cfg.ID).Scan(&accepted)
	}
	return q.QueryRow(ctx, `WITH f AS (
			INSERT INTO chaos_fence(key, fence) VALUES ($1, $2)
			ON CONFLICT (key) DO UPDATE SET fence = EXCLUDED.fence WHERE chaos_fence.fence <= EXCLUDED.fence
			RETURNING 1)
		INSERT INTO chaos_writes(key, token, cs, worker, mode, accepted, at)
		SELECT $1, $2, $3, $4, 'x', EXISTS (SELECT 1 FROM f), clock_timestamp() RETURNING accepted`,
		key, token, cs, w.cfg.ID).Scan(&accepted)
}

func (w *worker) do(l *advlock.Locker, key advlock.Key, rng *rand.Rand) error {
	done := w.track("do", 2*time.Second)
	defer done()
	ctx, cancel := context.WithTimeout(context.Background(), time.Duration(20+rng.IntN(500))*time.Millisecond)
	defer cancel()
	var cs string
	var t int64
	ctx, pid := withPIDBox(ctx)
	err := l.Do(ctx, key, func(fctx context.Context) error {
		cs = w.csID()
		w.emit(event{T: "begin", Op: "do", Key: canon(key), Mode: "x", CS: cs, Token: advlock.FenceToken(fctx), PID: pid.Load()})
		told := watchTold(fctx.Done())
		r := rngFor(cs)
		w.critical(canon(key), "x", advlock.FenceToken(fctx), cs, fctx.Done(), r, 2+r.IntN(3), 40*time.Millisecond)
		t = lockEnded(told(), ctx, fctx)
		return nil
	})
	if cs != "" {
		by := toldBy(t)
		if t == 0 && errors.Is(err, advlock.ErrLockLost) {
			t, by = time.Now().UnixNano(), "unlock" // told by Do's release
		}
		w.emit(event{T: "end", CS: cs, Key: canon(key), Told: t, ToldBy: by, Cause: causeOf(t, err), Unlock: classify(err),
			Session: w.obs.sessionOf(canon(key)),
			Clean:   err == nil && t == 0})
	}
	return err
}

// pair takes two of the pair keys in a random order: Do on the first, and inside it a Lock of the second under
// Do's context (which says that its caller holds the first), so that two callers taking them in opposite orders
// form a cycle of waits that the server cannot see. The wait is recorded as it starts and as it returns, with the
// outer section's id: the checker rebuilds every cycle from these records and requires exactly one ErrDeadlock
// per cycle within its bound, and none without a cycle. An ErrDeadlock is returned from fn, so that Do lets go of
// the first key and the others go on.
func (w *worker) pair(l *advlock.Locker, rng *rand.Rand) error {
	i := rng.IntN(len(pairKeys))
	first, next := pairKeys[i], pairKeys[(i+1+rng.IntN(len(pairKeys)-1))%len(pairKeys)]
	done := w.track("pair", pairWait+4*time.Second)
	defer done()
	ctx, cancel := context.WithTimeout(context.Background(), pairWait+3*time.Second)
	defer cancel()
	var cs string
	var t int64
	var ierr error // the inner lock's
	ctx, pid := withPIDBox(ctx)
	err := l.Do(ctx, first, func(fctx context.Context) error {
		cs = w.csID()
		token := advlock.FenceToken(fctx)
		w.emit(event{T: "begin", Op: "pair", Key: canon(first), Mode: "x", CS: cs, Token: token, PID: pid.Load()})
		told := watchTold(fctx.Done())
		r := rngFor(cs)
		w.critical(canon(first), "x", token, cs, fctx.Done(), r, 1+r.IntN(2), 40*time.Millisecond)
		var werr error
		ierr = w.sessionLockIn(fctx, "pair_inner", next, "x", 200*time.Millisecond, func(actx context.Context) (*advlock.Lock, error) {
			w.emit(event{T: "wait", Op: "pair", CS: cs, Key: canon(next), Mode: "x"})
			lk, err := within(pairWait, func(ctx context.Context) (*advlock.Lock, error) { return l.Lock(ctx, next) })(actx)
			w.emit(event{T: "waited", Op: "pair", CS: cs, Key: canon(next), Mode: "x", Result: classify(err), Err: errString(err)})
			werr = err
			return lk, err
		})
		if werr == nil {
			w.critical(canon(first), "x", token, cs, fctx.Done(), r, 1, time.Millisecond) // the last write, then Do releases
		}
		t = lockEnded(told(), ctx, fctx)
		return nil // Do's error is then its own lock's and release's alone
	})
	if cs != "" {
		by := toldBy(t)
		if t == 0 && errors.Is(err, advlock.ErrLockLost) {
			t, by = time.Now().UnixNano(), "unlock"
		}
		w.emit(event{T: "end", CS: cs, Key: canon(first), Told: t, ToldBy: by, Cause: causeOf(t, err), Unlock: classify(err),
			Session: w.obs.sessionOf(canon(first)),
			Clean:   err == nil && t == 0})
	}
	if err == nil {
		return ierr
	}
	return err
}

// lockEnded is told unless fn's ctx ended because the caller's own ctx did (a deadline, not the lock's end).
func lockEnded(told int64, ctx, fctx context.Context) int64 {
	if told != 0 && ctx.Err() != nil && !errors.Is(context.Cause(fctx), advlock.ErrLockLost) &&
		!errors.Is(context.Cause(fctx), advlock.ErrClosed) {
		return 0
	}
	return told
}

func causeOf(told int64, err error) string {
	if told == 0 && err == nil {
		return ""
	}
	return classify(err)
}

// doTx takes a transaction lock; its token is drawn as a grant's is (advlock.FenceTokenSQL), inside the transaction
// after the grant, and its writes commit with the release.
func (w *worker) doTx(l *advlock.Locker, key advlock.Key, rng *rand.Rand) error {
	done := w.track("dotx", 2*time.Second)
	defer done()
	ctx, cancel := context.WithTimeout(context.Background(), time.Duration(20+rng.IntN(500))*time.Millisecond)
	defer cancel()
	var cs string
	err := l.DoTx(ctx, key, func(ctx context.Context, tx pgx.Tx) error {
		cs = w.csID()
		var token int64
		var pid int32
		if err := tx.QueryRow(ctx, `SELECT `+advlock.FenceTokenSQL+`, pg_backend_pid()`).Scan(&token, &pid); err != nil {
			return err
		}
		w.emit(event{T: "begin", Op: "dotx", Key: canon(key), Mode: "x", CS: cs, Token: token, PID: uint32(pid)})
		r := rngFor(cs)
		for range 2 + r.IntN(2) {
			if err := w.write(ctx, tx, canon(key), "x", token, cs); err != nil {
				return err
			}
			time.Sleep(time.Duration(5+r.IntN(30)) * time.Millisecond)
		}
		return nil
	})
	if cs != "" {
		// A transaction lock cannot be lost without the transaction failing: its writes count only if it
		// committed (the checker reads committed rows only).
		w.emit(event{T: "end", CS: cs, Key: canon(key), Unlock: classify(err), Clean: err == nil, Cause: causeOf(0, err)})
	}
	return err
}

func (w *worker) lead(stop context.Context, l *advlock.Locker, rng *rand.Rand) error {
	d := time.Duration(300+rng.IntN(1500)) * time.Millisecond
	done := w.track("lead", d+2*time.Second)
	defer done()
	ctx, cancel := context.WithTimeout(stop, d)
	defer cancel()
	ctx, pid := withPIDBox(ctx)
	err := l.Lead(ctx, leadKey, func(fctx context.Context) error {
		cs := w.csID()
		token := advlock.FenceToken(fctx)
		w.emit(event{T: "begin", Op: "lead", Key: canon(leadKey), Mode: "x", CS: cs, Token: token, PID: pid.Load()})
		told := watchTold(fctx.Done())
		r := rngFor(cs)
		termLen := time.Duration(50+r.IntN(300)) * time.Millisecond
		if r.IntN(5) == 0 {
			termLen = time.Duration(1000+r.IntN(1500)) * time.Millisecond // a long term: faults land inside it
		}
		term := time.After(termLen)
		write := func() {
			wctx, wcancel := context.WithTimeout(context.Background(), 3*time.Second)
			_ = w.write(wctx, w.ledger, canon(leadKey), "x", token, cs)
			wcancel()
		}
	loop:
		for {
			select {
			case <-fctx.Done():
				break loop
			default:
			}
			write()
			select {
			case <-fctx.Done():
				break loop
			case <-term:
				select {
				case <-fctx.Done():
				default:
					write() // the term's last write, right before Lead releases
				}
				break loop
			case <-time.After(time.Duration(5+r.IntN(40)) * time.Millisecond):
			}
		}
		t := lockEnded(told(), ctx, fctx)
		cause := ""
		if t != 0 {
			cause = classify(context.Cause(fctx))
		}
		// Lead releases after fn returns: the term is clean when that release went through, never told of an end.
		w.obs.returned(token, event{T: "end", CS: cs, Key: canon(leadKey), Told: t, ToldBy: toldBy(t), Cause: cause, Unlock: "ok"})
		return nil
	})
	if errors.Is(err, context.DeadlineExceeded) || errors.Is(err, context.Canceled) {
		return nil
	}
	return err
}

// brokenStep is the classic wrong pattern: lock and unlock on whatever pooled connection comes, ignore what
// pg_advisory_unlock returns. Locks stay on pooled connections; the next caller on that connection "acquires" a
// held lock again through re-entrancy.
func (w *worker) brokenStep(rng *rand.Rand) {
	key := lockKeys[rng.IntN(len(lockKeys))]
	n, _ := key.Int64()
	start := time.Now()
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
	defer cancel()
	var ok bool
	err := w.broken.QueryRow(ctx, `SELECT pg_try_advisory_lock($1)`, n).Scan(&ok)
	res := "not_acquired"
	if err != nil {
		res = "error"
	}
	if ok {
		res = "ok"
		cs := w.csID()
		w.emit(event{T: "begin", Op: "broken", Key: canon(key), Mode: "x", CS: cs})
		r := rngFor(cs)
		w.critical(canon(key), "x", 0, cs, nil, r, 2+r.IntN(3), 40*time.Millisecond)
		_, _ = w.broken.Exec(ctx, `SELECT pg_advisory_unlock($1)`, n)
		w.emit(event{T: "end", CS: cs, Key: canon(key), Unlock: "ok", Clean: true})
	}
	w.emit(event{T: "op", Op: "broken", Result: res, Start: start.UnixNano(), End: time.Now().UnixNano()})
	sleepRand(rng, time.Millisecond, 10*time.Millisecond)
}

func semSlotKey(i int) string {
	return canon(advlock.NameKey(fmt.Sprintf("advlock.semaphore/%s/%d", semName, i)))
}

// canon is how the history names a key: the number (or pair) that pg_locks shows, whatever its kind.
func canon(k advlock.Key) string {
	if n, ok := k.Int64(); ok {
		return strconv.FormatInt(n, 10)
	}
	if a, b, ok := k.Pair(); ok {
		return fmt.Sprintf("%d,%d", a, b)
	}
	return k.String()
}

// option makes an advlock.Option of f (see config.NewOption).
func option(f func(*config.Options)) advlock.Option { return config.NewOption(f).(advlock.Option) }
