package advlock

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"slices"
	"strings"
	"sync/atomic"
	"time"

	"github.com/advlock/advlock/internal/mutant"
	"github.com/advlock/advlock/internal/session"
)

// Deadlocks the server cannot see. Each lock a Locker holds lives on one session and each wait on another, so
// PostgreSQL's deadlock detector never sees a cycle between two callers that take two keys in opposite orders.
// A Locker finds them itself:
//
//   - A caller says what it holds through its context: Do, TryDo and Lead's fn get a context that says they
//     hold their lock, and [Holding] adds locks taken with Lock. Only waits whose context holds a lock can close a
//     cycle, and only they are watched: a Locker with none of them waiting sends nothing.
//   - Such a wait never waits in the in-process gate (gate.go): it waits in the server, on a session of its own,
//     also when another caller of its Locker holds the key, so that every wait of every cycle is in pg_locks. It
//     publishes what its caller holds in a comment in front of its statements ("/*advlock w=LOCK h=REF,REF*/", as
//     pg_locks names them), which every client that may read pg_stat_activity.query (the same role, or
//     pg_read_all_stats) sees.
//   - While one of them waits, the Locker reads pg_locks and those comments about once a second (one statement on
//     a connection of its pool: a Locker from Open keeps one for it, see budget.go; when none is free, on a
//     connection of its own outside the pool) and looks for a cycle: a wait for a key whose holder's
//     caller waits, through further such waits, for what the first caller holds.
//   - A watched wait on its way to a session of its own (queued for one, waiting for a pool connection) is in no
//     server queue: its Locker adds it to the graph as a wait for its key's holders.
//   - Every client sees the same graph, and chooses the same waits to give up, as few as break every cycle
//     (victims): in one cycle the least of it, the wait whose caller holds the least lock (node.less: what a
//     caller holds stays on its sessions, so the rank of a wait is the same in every reading of every client,
//     whatever session the wait is on; a wait only its own Locker sees comes first, the youngest of them); where
//     cycles share a wait, the one most of them pass through. A Locker ends only its own waits, and only when the
//     choice stood on two readings in a row of one cycle (of the same callers: a reading that chose another wait
//     of the cycle, or chose it in another cycle, starts the count again), each judged within deadlockLate of
//     being sent; the wait then fails with an error matching ErrDeadlock.
//   - A wait that left its session a moment ago (it gave it up to another wait of its Locker) is judged for
//     deadlockRecent among the waits every client sees, as the other clients' last readings saw it, so that its
//     Locker chooses as they did (a reading that still shows it on the session it left shows this wait, not
//     another); and a wait the last reading found in a cycle gives its session up to no other wait, so that the
//     cycle stays visible to every client until it is broken. The others proceed once the caller that gave up lets
//     go of what it holds (Do does that by returning).

// deadlockRound is how often a Locker with a watched wait reads the server's lock graph, and deadlockConfirm how
// soon after a reading that found a cycle through one of its waits it reads again to confirm it.
const (
	deadlockRound   = time.Second
	deadlockConfirm = 500 * time.Millisecond
	deadlockFirst   = 500 * time.Millisecond // the first reading after a watched wait starts
	maxPublished    = 24                     // held locks a wait's comment names (pg_stat_activity.query keeps 1 kB)
	// deadlockRecent is how long a wait that left the server (on its way to another session) is still judged among
	// the waits every client sees, as the other clients' last readings of it judged it.
	deadlockRecent = time.Second
	// deadlockLate: a reading judged later than this after its query was sent counts for nothing (as one that failed):
	// what it shows may have changed since by more than the other clients' readings allow for (a victim that
	// another client ended still shows for a slice; a wait of this Locker gone from the server for deadlockRecent
	// is judged as one only it sees).
	deadlockLate = 500 * time.Millisecond
)

type holdingKey struct{}

// holding is the chain of locks a context says its caller holds, innermost first.
type holding struct {
	lk   *Lock
	next *holding
}

// Holding returns a context that says its caller holds locks (besides what ctx already says). A wait of this
// Locker made with it that would close a cycle (this caller waits for a key whose holder waits, directly or
// through others, for one of these locks) ends with an error matching ErrDeadlock instead of waiting for ever.
// Do, TryDo and Lead's fn get such a context for their own lock already; use Holding for locks taken with Lock:
//
//	a, err := locks.Lock(ctx, keyA)
//	...
//	b, err := locks.Lock(advlock.Holding(ctx, a), keyB)
//	if errors.Is(err, advlock.ErrDeadlock) { a.Unlock(ctx); ...try again later }
func Holding(ctx context.Context, locks ...*Lock) context.Context {
	for _, lk := range locks {
		if lk != nil {
			next, _ := ctx.Value(holdingKey{}).(*holding)
			ctx = context.WithValue(ctx, holdingKey{}, &holding{lk: lk, next: next})
		}
	}
	return ctx
}

// heldRefs returns what ctx says its caller holds and still holds, innermost first, at most maxPublished.
func heldRefs(ctx context.Context) []session.Ref {
	var refs []session.Ref
	for h, _ := ctx.Value(holdingKey{}).(*holding); h != nil && len(refs) < maxPublished; h = h.next {
		if h.lk.h != nil && h.lk.Err() == nil {
			refs = append(refs, session.Ref{PID: h.lk.h.PID(), ID: h.lk.key.id, Shared: h.lk.shared})
		}
	}
	for _, r := range session.HeldFrom(ctx) {
		if len(refs) < maxPublished {
			refs = append(refs, r)
		}
	}
	return refs
}

// waiter is a watched wait: a Lock, RLock or Lead campaign whose caller holds locks.
type waiter struct {
	seq   int64     // in the order the Locker's waits began
	since time.Time // when it began (the first reading of the graph comes deadlockFirst into the oldest wait)
	t     session.Target
	key   Key
	held  []session.Ref
	tag   session.WaitTag
	// ownPath, guarded by l.mu: it takes a session of its own (its key was not free on a shared session, or it
	// passed by its gate), so until it waits in the server it is a wait only its Locker sees.
	ownPath bool
	cancel  context.CancelCauseFunc
	seen    int    // read and written by the detector's goroutine only: readings that chose it, at most one miss between
	missed  int    // readings in a row that did not
	sig     string // the cycle the readings counted in seen chose it in (cycleSig)
	// cyclic: when a reading last found it in a cycle (nanoseconds on the monotonic clock since dlEpoch; 0: the
	// last reading that judged it did not). For a while after (inCycle) it keeps its session (it gives it up to no
	// other wait of its Locker), so that the cycle stays as every client's readings see it until one of its waits
	// is chosen: waits that took turns on the sessions would each be, in turn, a wait only their own Locker sees.
	cyclic atomic.Int64
}

// dlEpoch is what waiter.cyclic counts from.
var dlEpoch = time.Now()

// inCycle reports whether a reading found w in a cycle within the last two rounds: readings that fail, or that
// stopped, do not keep it from giving its session up for longer.
func (w *waiter) inCycle() bool {
	at := w.cyclic.Load()
	return at != 0 && time.Since(dlEpoch)-time.Duration(at) < 2*deadlockRound
}

type noDetectKey struct{}

// watchWait registers a wait of t whose caller holds held, and returns the context the wait goes on with: it
// publishes the wait, and the detector ends it with a *DeadlockError as its cause.
func (l *Locker) watchWait(ctx context.Context, key Key, t session.Target, held []session.Ref) (*waiter, context.Context) {
	w := &waiter{t: t, key: key, held: held, since: time.Now()}
	var b strings.Builder
	b.WriteString("w=" + session.Ref{ID: t.ID, Shared: t.Shared}.Lock() + " h=")
	for i, r := range held {
		if i > 0 {
			b.WriteByte(',')
		}
		b.WriteString(r.String())
	}
	w.tag.Comment = b.String()
	ctx, w.cancel = context.WithCancelCause(ctx)
	ctx = session.WithWaitTag(ctx, &w.tag)
	l.mu.Lock()
	l.dlSeq++
	w.seq = l.dlSeq
	l.waiters[w] = struct{}{}
	if !l.detecting && !l.closed {
		l.detecting = true
		l.detectWG.Add(1)
		go l.detect()
	}
	l.mu.Unlock()
	return w, ctx
}

func (l *Locker) endWait(w *waiter) {
	l.mu.Lock()
	delete(l.waiters, w)
	l.mu.Unlock()
	w.cancel(nil)
}

// deadlockErr returns the detector's verdict when it ended w's wait (and the caller's own ctx is still live).
func deadlockErr(parent, ctx context.Context) error {
	var de *DeadlockError
	if parent.Err() == nil && errors.As(context.Cause(ctx), &de) {
		return de
	}
	return nil
}

// DeadlockError is the error of a wait that gave up because it closed a cycle of waits that the server cannot see.
// It matches ErrDeadlock.
type DeadlockError struct {
	// Cycle describes the waits of the cycle, this one first; each waits for a lock that the caller of the next
	// holds, and the last for one this caller holds.
	Cycle []string
}

func (e *DeadlockError) Error() string {
	return "advlock: deadlock: a cycle of waits the server cannot see: " + strings.Join(e.Cycle, " -> ") +
		" -> this caller; this wait gives up: release what you hold and try again"
}

func (e *DeadlockError) Is(target error) bool { return target == ErrDeadlock }

// detect reads the lock graph while watched waits remain.
func (l *Locker) detect() {
	defer l.detectWG.Done()
	var own session.TextConn // a connection outside the pool, dialed when the pool had none free
	defer func() {
		if own != nil {
			own.Close()
		}
	}()
	t := time.NewTimer(deadlockFirst)
	defer t.Stop()
	for {
		select {
		case <-t.C:
		case <-l.closeCtx.Done():
			return
		}
		l.mu.Lock()
		if len(l.waiters) == 0 || l.closed {
			l.detecting = false
			l.mu.Unlock()
			return
		}
		var oldest time.Time
		for w := range l.waiters {
			if oldest.IsZero() || w.since.Before(oldest) {
				oldest = w.since
			}
		}
		l.mu.Unlock()
		// The timer may be a wait's that has ended, and the waits now younger (a wait granted at once, then another):
		// none is read before it has lasted deadlockFirst.
		if age := time.Since(oldest); age < deadlockFirst {
			t.Reset(deadlockFirst - age)
			continue
		}
		// Not in step with the waits' slices (which leave the queue for a moment each second): 0.75 to 1.25 s.
		next := deadlockRound*3/4 + rand.N(deadlockRound/2)
		if l.deadlockRound(&own) {
			next = deadlockConfirm
		}
		if h := testHookNextReading.Load(); h != nil {
			(*h)(l, next)
		}
		t.Reset(next)
	}
}

// textQuerier is what a backend's connection offers for reading a text result.
type textQuerier interface {
	QueryText(ctx context.Context, sql string) (string, error)
}

// graphSQL reads, from one snapshot of pg_locks, every advisory wait in this database with the comment its
// statement carries, the holders of the keys waited for (and of the keys graphQuery adds, and of those that waits'
// comments name: a wait in its key's line waits for a ticket, not for the key), and every lock held by a session
// that waits (a writer's intent, which holds readers back: see session.ID.Intent; a ticket of a key's line). One line per row: pid,
// objsubid, classid, objid, mode (S or X), g or w, comment.
const graphSQL = `WITH l AS MATERIALIZED (
  SELECT pid, objsubid, classid, objid, mode, granted FROM pg_catalog.pg_locks
  WHERE locktype = 'advisory' AND database = (SELECT oid FROM pg_catalog.pg_database WHERE datname = current_database()))
SELECT coalesce(string_agg(concat_ws(E'\t', l.pid, l.objsubid, l.classid, l.objid,
    CASE WHEN l.mode = 'ShareLock' THEN 'S' ELSE 'X' END, CASE WHEN l.granted THEN 'g' ELSE 'w' END,
    substring(a.query from '^/\*advlock ([^*]*)\*/')), E'\n'), '')
FROM l LEFT JOIN pg_catalog.pg_stat_activity a ON NOT l.granted AND a.pid = l.pid
WHERE NOT l.granted OR (l.objsubid, l.classid, l.objid) IN (SELECT objsubid, classid, objid FROM l WHERE NOT granted)
  OR l.pid IN (SELECT pid FROM l WHERE NOT granted)
  OR (l.objsubid::text, l.classid::text, l.objid::text) IN (SELECT m[1], m[2], m[3] FROM (
    SELECT regexp_match(q.query, '^/\*advlock [^*]*\m[wk]=([12])\.([0-9]+)\.([0-9]+)\.') AS m
    FROM pg_catalog.pg_stat_activity q WHERE q.query LIKE '/*advlock %') c WHERE m IS NOT NULL)`

// graphQuery is graphSQL that also returns the holders of keys (those that this Locker's waits on their way to a
// session of their own wait for: the server sees no wait for them). The keys are numbers written into the text.
func graphQuery(keys []session.ID) string {
	var b strings.Builder
	b.WriteString(graphSQL)
	for _, id := range keys {
		sub := 1
		if id.Pair {
			sub = 2
		}
		fmt.Fprintf(&b, "\n  OR (l.objsubid = %d AND l.classid = '%d'::oid AND l.objid = '%d'::oid)", sub, uint32(uint64(id.V)>>32), uint32(id.V))
	}
	return b.String()
}

// deadlockRound reads the graph once, and ends the waits of this Locker that are the least of a cycle on two
// readings in a row (one miss between them allowed). It reports whether the next reading should come sooner: a
// cycle through one of its waits was seen this time, or was seen before and is not yet confirmed or cleared (a
// reading that failed or missed it does not make the confirmation wait a whole round).
func (l *Locker) deadlockRound(own *session.TextConn) (soon bool) {
	ctx, cancel := context.WithTimeout(l.closeCtx, session.VerifyBound)
	defer cancel()
	var local []session.ID
	l.mu.Lock()
	for w := range l.waiters {
		if w.ownPath && w.tag.PID() == 0 {
			local = append(local, w.t.ID)
		}
	}
	l.mu.Unlock()
	rows, sent, err := l.readGraph(ctx, graphQuery(local), own)
	if err == nil {
		if h := testHookGraphRead.Load(); h != nil && (*h)(l) {
			err = errors.New("advlock: the reading's answer dropped by a test")
		}
	}
	if err == nil && time.Since(sent) > deadlockLate {
		err = errors.New("advlock: the reading was answered late") // see deadlockLate
	}
	if err != nil {
		// No connection free, or the server is away: the next reading tries again, soon only the first time (a
		// server away for long is not asked twice a second).
		l.readFails++
		return l.readFails == 1 && l.suspected()
	}
	l.readFails = 0
	if h := testHookGraphRows.Load(); h != nil {
		rows = (*h)(l, rows)
	}
	l.mu.Lock()
	g := l.localGraph(rows)
	l.mu.Unlock()
	judged := map[*waiter]bool{}
	victims := g.victims()
	// A wait of this Locker that left the server a moment ago is judged as the other clients saw it then; their
	// readings now may no longer show it. A wait that this Locker ends because of it must be the one they choose
	// without it too: such a wait may add edges (and weight) that their graphs lack, and draw the choice to a wait
	// of this Locker while they end another wait of the same cycle. It may hold a choice back, never make one.
	strict := victims
	for _, n := range g.nodes {
		if n.recent && !mutant.On(mutant.DeadlockRecentChooses) {
			strict = g.victimsWithout(func(n *node) bool { return n.recent })
			break
		}
	}
	// Which cycle each wait is in: a wait of this Locker in a cycle whose victim is another wait starts counting
	// again (below).
	all := map[*node]bool{}
	for _, n := range g.nodes {
		all[n] = true
	}
	comp := map[*node]int{}
	chose := map[int]bool{}
	var sigs []string // each cycle's callers, by what they hold (see cycleSig)
	for i, c := range g.components(all) {
		for _, n := range c {
			comp[n] = i + 1
			if victims[n] {
				chose[i+1] = true
			}
		}
		sigs = append(sigs, cycleSig(c))
	}
	for _, n := range g.nodes {
		w := n.w
		if w == nil {
			continue
		}
		judged[w] = true
		if comp[n] != 0 && !mutant.On(mutant.DeadlockStaleChoice) {
			w.cyclic.Store(max(int64(time.Since(dlEpoch)), 1))
		} else {
			w.cyclic.Store(0)
		}
		var cycle []string
		if victims[n] && !strict[n] && !n.recent {
			// Chosen only through a wait that left the server a moment ago: held back, as a miss (not a choice of
			// another wait), and read again soon; once that wait is back, or judged as one only this Locker sees,
			// the choice stands or falls without it.
			w.miss()
			soon = true
			continue
		}
		if victims[n] {
			cycle = g.cycleFrom(n)
		}
		if cycle == nil && len(n.out) > 0 && mutant.On(mutant.DeadlockFalse) {
			cycle = []string{n.desc}
		}
		if cycle == nil && chose[comp[n]] && comp[n] != 0 && !mutant.On(mutant.DeadlockChoiceKept) {
			// This reading chose another wait of its cycle: what earlier readings chose (the same cycle seen
			// otherwise, such as while this wait was between sessions) no longer stands. Were it counted, this
			// Locker could end its wait on a second choice while another client ends the one chosen here.
			w.seen, w.missed = 0, 0
			continue
		}
		if cycle == nil {
			w.miss()
			continue
		}
		soon = true
		w.missed = 0
		if c := comp[n]; c != 0 && sigs[c-1] != w.sig && !mutant.On(mutant.DeadlockOtherCycle) {
			// Chosen in another cycle than the one the earlier readings chose it in (a victim of that one let go,
			// and another caller took what it held and closed this one): the count starts again, so that it
			// stands on two readings of one cycle.
			w.seen, w.sig = 0, sigs[c-1]
		}
		if w.seen++; w.seen >= 2 && !mutant.On(mutant.DeadlockUndetected) {
			w.cancel(&DeadlockError{Cycle: cycle})
		}
	}
	// A wait of this Locker that was between two slices as pg_locks was read is in no row: a miss too.
	l.mu.Lock()
	for w := range l.waiters {
		if !judged[w] {
			w.miss()
		}
		if w.seen > 0 {
			soon = true
		}
	}
	l.mu.Unlock()
	return soon
}

// cycleSig names the cycle of waits c by its callers: what each of its watched waits' callers holds, sorted. It is
// the same in every reading of one cycle, whatever sessions its waits are on, and differs once one caller gave up and
// another took what it held.
func cycleSig(c []*node) string {
	var refs []string
	for _, n := range c {
		for _, r := range n.held {
			refs = append(refs, r.String())
		}
	}
	slices.Sort(refs)
	return strings.Join(refs, " ")
}

// miss counts a reading that did not find w the least of a cycle. One reading may miss a member of a cycle: a
// wait is out of the server's queue for a moment each slice, when it is sent again. Two misses in a row clear it.
func (w *waiter) miss() {
	if w.missed++; w.missed >= 2 {
		w.seen = 0
	}
}

// suspected reports whether a reading found a cycle through a wait of this Locker that is neither confirmed nor
// cleared yet.
func (l *Locker) suspected() bool {
	l.mu.Lock()
	defer l.mu.Unlock()
	for w := range l.waiters {
		if w.seen > 0 {
			return true
		}
	}
	return false
}

// testHookGraphRead, in tests only, is called by a reading once the server answered and before the answer is
// judged: what changes then, the reading cannot see. When it returns true, the answer is dropped as if the reading
// had failed.
var testHookGraphRead atomic.Pointer[func(l *Locker) bool]

// testHookGraphRows, in tests only, may change a reading's answer (one line per row of graphSQL) before it is
// judged.
var testHookGraphRows atomic.Pointer[func(l *Locker, rows string) string]

// testHookAway, in tests only, makes a reading of l take a wait of its in the server (w.ownPath) for one that left
// its session just now, on its way to another (as when it gave the session up to another wait), when it returns
// true: its rows dropped, the wait judged as its Locker judges one between sessions.
var testHookAway atomic.Pointer[func(l *Locker, w *waiter) bool]

// testHookAwayShown, in tests only, is testHookAway with the wait's rows kept: the reading shows it on the session
// it has just left (the reading was on its way as it left).
var testHookAwayShown atomic.Pointer[func(l *Locker, w *waiter) bool]

// testHookNextReading, in tests only, is told when the detector's next reading is due.
var testHookNextReading atomic.Pointer[func(l *Locker, next time.Duration)]

// readGraph runs the graph query on a connection of the pool, or, when every one of them is taken (by waits that
// may be the very cycle to find), on a connection of its own outside the pool, dialed once and kept (own) until
// detection stops. sent is when the query was sent (after the connection was had).
func (l *Locker) readGraph(ctx context.Context, sql string, own *session.TextConn) (rows string, sent time.Time, err error) {
	if *own == nil && !l.pool.Stats().Exhausted() {
		conn, err := l.pool.Acquire(ctx)
		if err != nil {
			return "", sent, err
		}
		q, ok := conn.(textQuerier)
		if !ok {
			conn.Release()
			return "", sent, errors.New("advlock: this backend cannot read the lock graph")
		}
		l.graphReadings.Add(1)
		sent = time.Now()
		s, err := q.QueryText(ctx, sql)
		if err != nil {
			conn.Destroy()
			return "", sent, err
		}
		conn.Release()
		return s, sent, nil
	}
	if *own == nil {
		d, ok := l.pool.(session.Dialer)
		if !ok {
			return "", sent, ErrPoolExhausted
		}
		c, err := d.Dial(ctx)
		if err != nil {
			return "", sent, err
		}
		*own = c
	}
	l.graphReadings.Add(1)
	sent = time.Now()
	s, err := (*own).QueryText(ctx, sql)
	if err != nil {
		(*own).Close()
		*own = nil
		return "", sent, err
	}
	return s, sent, nil
}
