package main

import (
	"cmp"
	"context"
	"errors"
	"math/rand/v2"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"github.com/advlock/advlock"
	"github.com/jackc/pgx/v5"
)

// The workers' operations: what step runs, and the critical sections they hold, each write to the ledger fenced.

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
	case "hold_wait": // the same, after a wait of up to 5 s (not in the usual mix: a campaign asks for it)
		err = w.sessionLock(op, key, "x", 6*time.Second, within(5*time.Second, func(ctx context.Context) (*advlock.Lock, error) {
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
	case "crowd":
		err = w.crowd(stop)
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
	switch {
	case err != nil && !errors.Is(err, advlock.ErrNotAcquired):
		sleepRand(rng, 5*time.Millisecond, 50*time.Millisecond)
	case err != nil && time.Since(start) < time.Millisecond:
		// Refused in the process (another goroutine of this Locker holds the key): without a pause the goroutine
		// would spin, millions of operations a campaign when holds are few.
		sleepRand(rng, time.Millisecond, 5*time.Millisecond)
	}
}

type opWeight struct {
	op string
	p  int
}

// opWeights is the workers' mix of operations (percent). A reader's operation is several rounds, seconds in all:
// 1 percent of the draws keeps about a tenth of the goroutines reading the queue key. A crowd (4 more Lockers a
// worker, each with its connections) runs only when asked for (-ops crowd): in the mix, on a loaded machine, it
// slowed the deadlock detection of the pairs past its bound.
var opWeights = []opWeight{{"hold", 3}, {"hold_try", 2}, {"trylock", 11}, {"crowd", 0}, {"lock_deadline", 15}, {"lock_cancel", 11}, {"rlock", 11}, {"do", 11}, {"dotx", 9},
	{"semaphore", 7}, {"pair", 10}, {"reader", 1}, {"writer", 1}, {"lead", 8}, {"hold_wait", 0}}

// leaseOps are the operations of a lease campaign: those leases offer (no shared mode, no transaction lock, no wait
// without a bound whose caller holds a lock), each as likely as in the usual mix.
var leaseOps = []string{"hold", "hold_try", "hold_wait", "trylock", "lock_deadline", "lock_cancel", "do", "semaphore", "lead"}

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
	case "hold", "hold_try", "hold_wait": // 2.5 to 5 s; with leases 5 to 10 s, past the faults that outlast a lease
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
	releasing := time.Now().UnixNano()
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
		Clean: uerr == nil && t == 0, Session: w.obs.sessionOf(canon(lk.Key())), Start: releasing})
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

// crowd is many writers of the queue key at once: crowdSize goroutines, each the only caller of a Locker of its
// own (as writers in as many services), each taking the key crowdRounds times in a row and holding it briefly.
// With the crowds of other workers, a writer waits behind many others, across several slices: the checker judges
// that none of them is overtaken (see queue).
func (w *worker) crowd(stop context.Context) error {
	ls, err := w.crowdLockers(stop)
	if err != nil {
		return err
	}
	errs := make([]error, len(ls))
	var wg sync.WaitGroup
	for i, l := range ls {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for range crowdRounds {
				if errs[i] = w.queued(l, "crowd", "x"); errs[i] != nil || stop.Err() != nil {
					return
				}
			}
		}()
	}
	wg.Wait()
	return errors.Join(errs...)
}

const (
	crowdSize   = 4
	crowdRounds = 3
)

// crowdWarmKey is the key a crowd's new Locker makes its first call on (see crowdLockers).
var crowdWarmKey = advlock.Int64Key(71301)

// crowdLockers returns the crowd's Lockers, opened with the first crowd.
func (w *worker) crowdLockers(ctx context.Context) ([]*advlock.Locker, error) {
	w.writerMu.Lock()
	defer w.writerMu.Unlock()
	for len(w.crowdLs) < crowdSize {
		l, err := w.open(ctx)
		if err != nil {
			return nil, err
		}
		// Its first call opens its shared session and checks the fencing sequence, which a loaded machine takes
		// hundreds of milliseconds for: made here, on a key nobody else takes, before any wait is recorded.
		if lk, err := l.TryLock(ctx, crowdWarmKey); err == nil {
			_ = lk.Unlock(ctx)
		}
		w.crowdLs = append(w.crowdLs, l)
	}
	return w.crowdLs, nil
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
	var t, releasing int64
	ctx, pid := withPIDBox(ctx)
	err := l.Do(ctx, key, func(fctx context.Context) error {
		cs = w.csID()
		w.emit(event{T: "begin", Op: "do", Key: canon(key), Mode: "x", CS: cs, Token: advlock.FenceToken(fctx), PID: pid.Load()})
		told := watchTold(fctx.Done())
		r := rngFor(cs)
		w.critical(canon(key), "x", advlock.FenceToken(fctx), cs, fctx.Done(), r, 2+r.IntN(3), 40*time.Millisecond)
		t = lockEnded(told(), ctx, fctx)
		releasing = time.Now().UnixNano() // Do releases once fn returns
		return nil
	})
	if cs != "" {
		by := toldBy(t)
		if t == 0 && errors.Is(err, advlock.ErrLockLost) {
			t, by = time.Now().UnixNano(), "unlock" // told by Do's release
		}
		w.emit(event{T: "end", CS: cs, Key: canon(key), Told: t, ToldBy: by, Cause: causeOf(t, err), Unlock: classify(err),
			Session: w.obs.sessionOf(canon(key)), Start: releasing,
			Clean: err == nil && t == 0})
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
	wait := cmp.Or(w.cfg.PairWait, pairWait)
	done := w.track("pair", wait+4*time.Second)
	defer done()
	ctx, cancel := context.WithTimeout(context.Background(), wait+3*time.Second)
	defer cancel()
	var cs string
	var t, releasing int64
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
			lk, err := within(wait, func(ctx context.Context) (*advlock.Lock, error) { return l.Lock(ctx, next) })(actx)
			w.emit(event{T: "waited", Op: "pair", CS: cs, Key: canon(next), Mode: "x", Result: classify(err), Err: errString(err)})
			werr = err
			return lk, err
		})
		if werr == nil {
			w.critical(canon(first), "x", token, cs, fctx.Done(), r, 1, time.Millisecond) // the last write, then Do releases
		}
		t = lockEnded(told(), ctx, fctx)
		releasing = time.Now().UnixNano()
		return nil // Do's error is then its own lock's and release's alone
	})
	if cs != "" {
		by := toldBy(t)
		if t == 0 && errors.Is(err, advlock.ErrLockLost) {
			t, by = time.Now().UnixNano(), "unlock"
		}
		w.emit(event{T: "end", CS: cs, Key: canon(first), Told: t, ToldBy: by, Cause: causeOf(t, err), Unlock: classify(err),
			Session: w.obs.sessionOf(canon(first)), Start: releasing,
			Clean: err == nil && t == 0})
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
		w.obs.returned(token, event{T: "end", CS: cs, Key: canon(leadKey), Told: t, ToldBy: toldBy(t), Cause: cause, Unlock: "ok",
			Start: time.Now().UnixNano()})
		return nil
	})
	if errors.Is(err, context.DeadlineExceeded) || errors.Is(err, context.Canceled) {
		return nil
	}
	return err
}
