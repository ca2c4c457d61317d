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
	// PairWait, when not zero, bounds a pair operation's wait for its second key in place of pairWait.
	PairWait time.Duration `json:"pair_wait,omitempty"`
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
// DeadlockBound), so that only the Locker's detection, or a fault, ends a cycle in time. A campaign with a longer
// bound makes its pairs wait twice that (see pairWaitFor).
const pairWait = 8 * time.Second

// pairWaitFor is the pairs' wait for a campaign whose cycles may last bound: at least twice the bound, so that a
// cycle nothing detects outlasts it also when its first wait began well before the last.
func pairWaitFor(bound time.Duration) time.Duration { return max(pairWait, 2*bound) }

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
	Start  int64  `json:"start,omitempty"` // unix ns, this machine's clock (the server's too: same host); an end's: its release began
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
	crowdLs  []*advlock.Locker // the crowd's (see crowd)

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
	for _, l := range w.crowdLs {
		l.Close()
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
