package advlock

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/advlock/advlock/internal/lease"
	"github.com/advlock/advlock/internal/session"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/puddle/v2"
)

// Querier is what Inspect, Leader and LockTable need: a *pgxpool.Pool, *pgx.Conn or pgx.Tx. The methods of the same
// names on [Locker] read through the Locker's own pool, whichever its driver.
type Querier interface {
	Query(ctx context.Context, sql string, args ...any) (pgx.Rows, error)
}

// LockInfo is one advisory lock held or waited for, as the server sees it: a pg_locks row joined with
// pg_stat_activity; or a lease held ([WithLeases]): a row of the lease table, with Lease set.
type LockInfo struct {
	Key     Key  // decoded from classid/objid/objsubid; a NameKey shows as the Int64Key of its hash
	Shared  bool // ShareLock (RLock) rather than ExclusiveLock
	Granted bool // held; false means waiting
	// WaitStart is when the wait began (nil while held): for a wait of advlock, which is sent again every slice,
	// when its first statement was sent (what its statements publish); for any other, pg_locks.waitstart, or, in the
	// moment after a wait begins when that is still null, the start of the statement that waits.
	WaitStart       *time.Time
	BlockedBy       []int32 // pids the waiter waits for (pg_blocking_pids); empty while held
	PID             int32   // server process id of the session
	ApplicationName string
	ClientAddr      string // IP address, or "local" for a Unix socket
	BackendStart    time.Time
	State           string // pg_stat_activity.state: idle, active, ...
	// CallerHolds, for a wait of advlock whose caller holds locks (see [Holding]), is what that caller holds, as
	// the wait publishes it for deadlock detection: each lock by the pid of the session that holds it.
	CallerHolds []HeldLock
	// InCycle marks a wait in a cycle of waits that can be seen from the server: it waits for a holder whose
	// caller waits (through the CallerHolds of further waits) for what this wait's caller holds. The wait of the
	// cycle that advlock ends (ErrDeadlock) does so within about 2 s; a cycle that lasts passes through a caller
	// advlock cannot end (another tool's session, or a process that does not detect deadlocks).
	InCycle bool
	// Intent marks a waiting writer (an exclusive wait) that holds the key's intent: it found the key held by
	// readers, or has waited a whole slice, and new shared requests of advlock wait behind it (see "Waits and the
	// database" in docs/locks.md). The intent's own pg_locks row is not listed.
	Intent bool
	// Lingering marks a lock held past its work: its holder unlocked it (or Do's fn returned) before its
	// [HoldAtLeast] had passed, and it is released when that has. The marker's own pg_locks row is not listed.
	// pg_locks shows a session's holds of one key in one mode as one row: a key held in shared mode by several
	// callers of one Locker on one shared session shows Lingering while any of them lingers.
	Lingering bool

	advlockWait bool         // a wait whose statement is advlock's own (its comment says so)
	line        *session.Ref // the key and mode of the line this row's lock is a ticket of (its session's comment says so)
	queryHidden bool         // the reading role may not see the session's statement (pg_read_all_stats)
	// ClientSessions is how many server sessions of this row's client (the same ClientAddr and ApplicationName:
	// one process, when each process names its sessions) hold or wait for advisory locks in this database, as the
	// listing shows: a Locker from [Open] uses at most [DefaultOpenConns], its shared sessions included.
	ClientSessions int
	// Lease is set for a lease (a lock of a Locker [WithLeases]): its row, or a wait's. A lease is exclusive, has
	// no server session (PID 0, no application name, address or state) and excludes only other leases of its key,
	// not session locks of the same number. A wait for a lease (Granted false) has its Holder and WaitStart (the
	// server's clock), no Token, Expires or Left.
	Lease *LeaseInfo
}

// LeaseInfo is a lease's row, as the server sees it at the read.
type LeaseInfo struct {
	Token   int64         // its term: the fencing token its holder holds
	Holder  string        // who holds it, for people: host and process id (advlock run adds its KEY)
	Granted time.Time     // when it was granted (the server's clock)
	Expires time.Time     // when it ends unless renewed (the server's clock)
	Left    time.Duration // until Expires, on the server's clock at the read
	// A row no Locker writes (written by hand: an expiry at infinity, a year past 9999) holds its key until it is
	// deleted (BreakLease): its times are listed as the nearest of 0001-01-02 and 9999-12-30 (UTC), Left at most
	// the longest Duration.
}

// HeldLock is one lock a waiting caller holds.
type HeldLock struct {
	PID    int32
	Key    Key
	Shared bool
}

// inspectSQL reads pg_locks once (the CTE, referenced twice, is materialized: one snapshot), and computes each
// waiter's blockers from that snapshot (the holders of its key in a conflicting mode, and the conflicting waiters
// queued before it, as PostgreSQL's queue orders them), so that holders and waiters agree with each other.
const inspectSQL = `
WITH l AS (
  SELECT pid, classid, objid, objsubid, mode, granted, waitstart FROM pg_locks
  WHERE locktype = 'advisory' AND database = (SELECT oid FROM pg_database WHERE datname = current_database()))
SELECT l.classid::text::int8, l.objid::text::int8, l.objsubid, l.mode = 'ShareLock', l.granted, l.waitstart,
       CASE WHEN l.granted THEN '{}'::int4[] ELSE ARRAY(
         SELECT h.pid FROM l h WHERE h.pid <> l.pid AND h.classid = l.classid AND h.objid = l.objid
           AND h.objsubid = l.objsubid AND (l.mode = 'ExclusiveLock' OR h.mode = 'ExclusiveLock')
           AND (h.granted OR h.waitstart < l.waitstart) ORDER BY h.pid) END,
       l.pid, coalesce(a.application_name, ''), coalesce(host(a.client_addr), 'local'), a.backend_start,
       coalesce(a.state, ''), a.pid IS NOT NULL,
       coalesce(substring(a.query from '^/\*advlock ([^*]*)\*/'), ''),
       coalesce(a.query = '<insufficient privilege>', false),
       CASE WHEN NOT l.granted THEN a.query_start END,
       coalesce(a.wait_event_type = 'Lock' AND a.wait_event = 'advisory', false)
FROM l LEFT JOIN pg_stat_activity a ON a.pid = l.pid
ORDER BY l.classid, l.objid, l.objsubid, l.granted DESC, l.waitstart NULLS FIRST, l.pid`

// Inspect lists every advisory lock in the current database, holders first, then waiters in the order they
// started waiting, and after them the live leases ([WithLeases]) by key, then the waits for leases, where the
// lease tables exist and the role may read them. It needs PostgreSQL 14 or later (pg_locks.waitstart). Rows of
// other users' sessions show their application name and address only to roles allowed to see them
// (pg_read_all_stats).
//
// pg_locks and pg_stat_activity cannot be read at one instant: when the activity read says a waiter is not
// waiting or runs a statement begun after its wait began (its wait ended between the two reads), or a session is
// gone, Inspect reads both again (up to 10 times), so that what it returns is one consistent picture; so it does
// when a wait in its key's line is between two of its statements (a wait in a line is listed as a wait for its
// key; the locks that hold its place are not listed). Each read after the first, and every read through a pgx.Tx,
// reads pg_stat_activity afresh: within a transaction it is otherwise what the transaction's first read of it saw
// (so this discards the transaction's snapshot of the statistics too).
func Inspect(ctx context.Context, q Querier) ([]LockInfo, error) {
	var out []LockInfo
	for i := range 10 {
		var consistent bool
		var err error
		if _, tx := q.(pgx.Tx); tx || i > 0 {
			// Inside a transaction, pg_stat_activity is what its first read saw (an earlier Inspect's, or the
			// caller's): read it afresh.
			if err := clearStatsSnapshot(ctx, q); err != nil {
				return nil, fmt.Errorf("advlock: inspect: %w", err)
			}
		}
		out, consistent, err = inspectOnce(ctx, q)
		if err != nil {
			return nil, fmt.Errorf("advlock: inspect: %w", err)
		}
		if consistent {
			break
		}
	}
	leases, err := inspectLeases(ctx, q)
	if err != nil {
		return nil, fmt.Errorf("advlock: inspect the leases: %w", err)
	}
	return append(out, leases...), nil
}

// clearStatsSnapshot discards what the session's transaction has read of pg_stat_activity (and of the cumulative
// statistics), so that its next read is of now (pg_stat_clear_snapshot; outside a transaction each statement reads
// afresh anyway).
func clearStatsSnapshot(ctx context.Context, q Querier) error {
	rows, err := q.Query(ctx, "SELECT pg_catalog.pg_stat_clear_snapshot()")
	if err != nil {
		return err
	}
	rows.Close()
	return rows.Err()
}

// inspectLeases lists the live leases, then the live waits for them, none where the tables do not exist or the role
// may not read them.
func inspectLeases(ctx context.Context, q Querier) ([]LockInfo, error) {
	rows, err := q.Query(ctx, lease.ReadableSQL)
	if err != nil {
		return nil, err
	}
	type can struct{ leases, waits bool }
	ok, err := pgx.CollectExactlyOneRow(rows, func(r pgx.CollectableRow) (can, error) {
		var c can
		return c, r.Scan(&c.leases, &c.waits)
	})
	if err != nil || !ok.leases {
		return nil, err
	}
	if rows, err = q.Query(ctx, lease.ListSQL(ok.waits)); err != nil {
		return nil, err
	}
	return pgx.CollectRows(rows, func(r pgx.CollectableRow) (LockInfo, error) {
		var sp int16
		var v, left int64
		li := LockInfo{Lease: &LeaseInfo{}}
		err := r.Scan(&li.Granted, &sp, &v, &li.Lease.Token, &li.Lease.Holder, &li.Lease.Granted, &li.Lease.Expires, &left)
		li.Key = keyOf(session.ID{Pair: sp == 2, V: v})
		if h, ok := strings.CutSuffix(li.Lease.Holder, lease.LingerMark); ok && li.Granted {
			li.Lease.Holder, li.Lingering = h, true
		}
		if li.Granted {
			li.Lease.Left = time.Duration(left) * time.Millisecond
		} else { // a wait: since, in place of granted and expires
			since := li.Lease.Granted
			li.WaitStart, li.Lease.Granted, li.Lease.Expires = &since, time.Time{}, time.Time{}
		}
		return li, err
	})
}

// Inspect is the package's [Inspect] through the Locker's own pool: its *pgxpool.Pool, or with advsql the *sql.DB
// it locks through (either driver). It takes a connection for each query and gives it back. ErrNoPool for a Locker
// without a pool, ErrClosed after Close (also when Close is called during it).
func (l *Locker) Inspect(ctx context.Context) ([]LockInfo, error) {
	var out []LockInfo
	err := l.query(ctx, func(ctx context.Context, q Querier) error {
		var err error
		out, err = Inspect(ctx, q)
		return err
	})
	return out, err
}

// LockTable is the package's [LockTable] through the Locker's own pool (see [Locker.Inspect]).
func (l *Locker) LockTable(ctx context.Context) (LockTableUse, error) {
	var use LockTableUse
	err := l.query(ctx, func(ctx context.Context, q Querier) error {
		var err error
		use, err = LockTable(ctx, q)
		return err
	})
	return use, err
}

// query runs f with what the Locker reads the server through (its backend's Querier, else its *pgxpool.Pool), as
// a call that Close cuts short and waits for.
func (l *Locker) query(ctx context.Context, f func(ctx context.Context, q Querier) error) error {
	if l == nil || l.pool == nil {
		return ErrNoPool
	}
	var q Querier
	switch {
	case l.opts.Querier != nil:
		q = l.opts.Querier
	case l.pgxPool != nil:
		q = l.pgxPool
	default:
		return errNoQuerier
	}
	cctx, done, err := l.begin(ctx, true)
	if err != nil {
		return err
	}
	defer done()
	if cp, ok := l.pool.(countingPool); ok {
		q = countingQuerier{q: q, pool: cp}
	}
	err = f(cctx, q)
	switch {
	case err == nil:
		return nil
	case ctx.Err() == nil && errors.Is(context.Cause(cctx), ErrClosed):
		return ErrClosed
	case errors.Is(err, puddle.ErrClosedPool):
		return fmt.Errorf("%w: its pool was closed (close the Locker before its pool): %w", ErrNoPool, err)
	}
	return session.WithContext(ctx, err)
}

var errNoQuerier = errors.New("advlock: this Locker's backend cannot run queries")

// countingQuerier counts, in the Locker's Stats, the connection each query holds from when it answers until its
// rows are closed (a query through a pool takes a connection and gives it back when its rows are closed).
type countingQuerier struct {
	q    Querier
	pool countingPool
}

func (c countingQuerier) Query(ctx context.Context, sql string, args ...any) (pgx.Rows, error) {
	rows, err := c.q.Query(ctx, sql, args...)
	if err != nil {
		return nil, err
	}
	c.pool.add(1)
	return &countedRows{Rows: rows, pool: c.pool}, nil
}

type countedRows struct {
	pgx.Rows
	pool countingPool
	once sync.Once
}

func (r *countedRows) Close() {
	r.Rows.Close()
	r.once.Do(func() { r.pool.add(-1) })
}

func inspectOnce(ctx context.Context, q Querier) ([]LockInfo, bool, error) {
	rows, err := q.Query(ctx, inspectSQL)
	if err != nil {
		return nil, false, err
	}
	consistent := true
	out, err := pgx.CollectRows(rows, func(r pgx.CollectableRow) (LockInfo, error) {
		var li LockInfo
		var cls, obj int64
		var sub int16
		var start *time.Time
		var live bool
		var comment string
		var queryStart *time.Time
		var advisoryWait bool
		if err := r.Scan(&cls, &obj, &sub, &li.Shared, &li.Granted, &li.WaitStart, &li.BlockedBy, &li.PID,
			&li.ApplicationName, &li.ClientAddr, &start, &li.State, &live, &comment, &li.queryHidden, &queryStart, &advisoryWait); err != nil {
			return li, err
		}
		if !waitShown(li.Granted, li.WaitStart, queryStart, advisoryWait && comment == "") {
			consistent = false // the statement that waited had ended when pg_stat_activity was read
		}
		// A wait of advlock is sent again every slice (pg_locks.waitstart is the current slice's start); each of
		// its statements says how long the wait has waited, so it began that long before the statement started
		// (on the server's clock).
		if !li.Granted && li.WaitStart == nil {
			// pg_locks.waitstart is null for a moment after a wait begins: the statement began it.
			li.WaitStart = queryStart
		}
		li.advlockWait = !li.Granted && comment != ""
		if waited, ok := commentWaited(comment); ok && queryStart != nil && li.WaitStart != nil {
			if began := queryStart.Add(-waited); began.Before(*li.WaitStart) {
				li.WaitStart = &began
			}
		}
		id := session.LockID(sub == 2, uint32(cls), uint32(obj))
		if k, ok := commentKey(comment); ok {
			if _, in := k.ID.InLine(id); in || id == k.ID.Waiting() && li.Granted && li.Shared {
				li.line = &k // a ticket of k's line, or a writer's hold of its flag: see foldLines
			}
		}
		if wait, held, ok := parseComment(comment); ok && !li.Granted && (wait.ID == id && wait.Shared == li.Shared || li.line != nil) {
			for _, h := range held {
				li.CallerHolds = append(li.CallerHolds, HeldLock{PID: int32(h.PID), Key: keyOf(h.ID), Shared: h.Shared})
			}
		}
		if !live || !li.Granted && li.State != "active" || li.line != nil && li.State != "active" {
			consistent = false // a member of a line between two of its statements is read again, waiting
		}
		if start != nil {
			li.BackendStart = *start
		}
		k, err := KeyFromPgLocks(uint32(cls), uint32(obj), sub)
		li.Key = k
		return li, err
	})
	if err == nil {
		out = foldLingering(foldIntents(foldLines(out)))
	}
	markCycles(out)
	countClients(out)
	return out, consistent, err
}

// waitShown reports whether pg_stat_activity's statement of a waiting session (begun at queryStart) can be the one
// that waits in pg_locks (since waitstart): a statement begins before it waits. pg_locks is read first (the join
// reads it before pg_stat_activity, whichever way it joins them), so a wait that ended between the two reads shows
// the session's next statement, begun after the wait: a wait of advlock that ended at its slice's end and the
// statement sent next (a try, which publishes no start) would list the slice's start as the wait's, and a wait's
// next statement for another key would list that wait's start. Granted rows, waits not yet stamped with their
// start, and sessions shown waiting for an advisory lock in a statement not of advlock (untaggedWait) pass: a
// server clock stepped back between such a statement's start and its wait's must not make every reading fail for
// as long as the wait lasts, which may be for ever (a statement of advlock waits a slice at most).
func waitShown(granted bool, waitstart, queryStart *time.Time, untaggedWait bool) bool {
	return granted || untaggedWait || waitstart == nil || queryStart == nil || !queryStart.After(*waitstart)
}

// pidLock is a lock of one session, as the folds below match them.
type pidLock struct {
	pid int32
	id  session.ID
}

// foldLines drops the tickets that waits hold in their keys' lines (see "Waits and the database" in docs/locks.md),
// and the writers' holds of their lines' flags,
// and lists a wait for the ticket of the member in front of it as the wait for its key that it is, blocked by that
// member and by the key's holders in a conflicting mode. A ticket is a lock of a session whose statement (a wait
// of advlock, or the statement with which it joined the line) names the key whose line it is in: any other lock
// on that number is listed as the lock it is. The rows are then in Inspect's order again.
func foldLines(out []LockInfo) []LockInfo {
	folded := false
	kept := out[:0]
	for _, li := range out {
		if li.line == nil {
			kept = append(kept, li)
			continue
		}
		folded = true
		if li.Granted {
			continue // its place in the line
		}
		li.Key, li.Shared, li.advlockWait = keyOf(li.line.ID), li.line.Shared, true
		kept = append(kept, li)
	}
	if !folded {
		return kept
	}
	for i, w := range kept {
		if w.line == nil || w.Granted {
			continue
		}
		for _, h := range kept {
			if h.Granted && h.PID != w.PID && h.Key.Equal(w.Key) && conflicts(w.Shared, h.Shared) && !slices.Contains(kept[i].BlockedBy, h.PID) {
				kept[i].BlockedBy = append(kept[i].BlockedBy, h.PID)
			}
		}
		slices.Sort(kept[i].BlockedBy)
	}
	pos := func(li LockInfo) [3]uint64 {
		sub := uint64(1)
		if li.Key.id.Pair {
			sub = 2
		}
		return [3]uint64{uint64(li.Key.id.V) >> 32, uint64(uint32(li.Key.id.V)), sub}
	}
	slices.SortStableFunc(kept, func(a, b LockInfo) int {
		if pa, pb := pos(a), pos(b); pa != pb {
			return slices.Compare(pa[:], pb[:])
		}
		if a.Granted != b.Granted {
			if a.Granted {
				return -1
			}
			return 1
		}
		if a.WaitStart != nil && b.WaitStart != nil && !a.WaitStart.Equal(*b.WaitStart) {
			return a.WaitStart.Compare(*b.WaitStart)
		}
		if (a.WaitStart == nil) != (b.WaitStart == nil) {
			if a.WaitStart == nil {
				return -1
			}
			return 1
		}
		return int(a.PID) - int(b.PID)
	})
	return kept
}

// foldIntents drops the intents of writers from out (a waiting writer holds its key's intent, see docs/locks.md,
// "Waits and the database") and marks the rows of their keys instead: an intent is the exclusive lock, held by a
// session whose wait for a key in exclusive mode is advlock's own statement (its comment says so), that is that
// key's intent. Any other lock on that number (a session that waits for nothing, or whose wait is not advlock's:
// psql, another client) is listed as the lock it is. A role that may not read another role's statements
// (pg_read_all_stats) cannot tell: for it, an exclusive wait's session that holds the key's intent is a writer's.
func foldIntents(out []LockInfo) []LockInfo {
	intents := map[pidLock]bool{}
	for _, li := range out {
		if !li.Shared && !li.Granted && (li.advlockWait || li.queryHidden) {
			intents[pidLock{li.PID, li.Key.id.Intent()}] = true
		}
	}
	if len(intents) == 0 {
		return out
	}
	isIntent := func(li LockInfo) bool {
		return li.Granted && !li.Shared && intents[pidLock{li.PID, li.Key.id}]
	}
	held := map[pidLock]bool{}
	kept := out[:0]
	for _, li := range out {
		if isIntent(li) {
			held[pidLock{li.PID, li.Key.id}] = true
			continue
		}
		kept = append(kept, li)
	}
	writers := map[session.ID][]int32{} // key -> pids of the writers that hold its intent
	for i, li := range kept {
		if !li.Shared && !li.Granted && (li.advlockWait || li.queryHidden) && held[pidLock{li.PID, li.Key.id.Intent()}] {
			kept[i].Intent = true
			writers[li.Key.id] = append(writers[li.Key.id], li.PID)
		}
	}
	for i, li := range kept { // a reader waiting behind a writer's intent waits for that writer
		if li.Shared && !li.Granted {
			for _, pid := range writers[li.Key.id] {
				if !slices.Contains(li.BlockedBy, pid) {
					kept[i].BlockedBy = append(kept[i].BlockedBy, pid)
				}
			}
			slices.Sort(kept[i].BlockedBy)
		}
	}
	return kept
}

// foldLingering drops the markers of locks held past their work (the shared lock a session holds beside a
// key it holds, that is that key's marker: see Lock.Unlock under HoldAtLeast) and marks the rows of their keys
// instead. A marker whose session holds no such key is listed as the lock it is.
func foldLingering(out []LockInfo) []LockInfo {
	markers := map[pidLock]bool{}
	for _, li := range out {
		if li.Granted && li.Shared {
			markers[pidLock{li.PID, li.Key.id}] = true
		}
	}
	if len(markers) == 0 {
		return out
	}
	folded := map[pidLock]bool{}
	for i, li := range out {
		if m := (pidLock{li.PID, li.Key.id.Linger()}); li.Granted && markers[m] {
			out[i].Lingering = true
			folded[m] = true
		}
	}
	kept := out[:0]
	for _, li := range out {
		if !(li.Granted && li.Shared && folded[pidLock{li.PID, li.Key.id}]) {
			kept = append(kept, li)
		}
	}
	return kept
}

// countClients sets ClientSessions on every row of out: the distinct pids of rows with its client address and
// application name.
func countClients(out []LockInfo) {
	type client struct{ addr, app string }
	pids := map[client]map[int32]bool{}
	for _, li := range out {
		c := client{li.ClientAddr, li.ApplicationName}
		if pids[c] == nil {
			pids[c] = map[int32]bool{}
		}
		pids[c][li.PID] = true
	}
	for i, li := range out {
		out[i].ClientSessions = len(pids[client{li.ClientAddr, li.ApplicationName}])
	}
}

// markCycles sets InCycle on the waits of out that are in a cycle: a wait leads to the waits whose caller holds a
// lock that blocks it (a holder of its key in a conflicting mode).
func markCycles(out []LockInfo) {
	type hk struct {
		pid int32
		key Key
	}
	owners := map[hk][]int{}
	for i, li := range out {
		for _, h := range li.CallerHolds {
			owners[hk{h.PID, h.Key}] = append(owners[hk{h.PID, h.Key}], i)
		}
	}
	next := make([][]int, len(out))
	for i, w := range out {
		if w.Granted {
			continue
		}
		for j, h := range out {
			if h.Granted && h.PID != w.PID && h.Key.Equal(w.Key) && conflicts(w.Shared, h.Shared) {
				next[i] = append(next[i], owners[hk{h.PID, keyOf(h.Key.id)}]...)
			}
			// A reader waits behind the writer whose wait holds its key's intent (foldIntents marked that wait), as
			// the deadlock detection links them.
			if w.Shared && !h.Granted && h.Intent && h.PID != w.PID && h.Key.Equal(w.Key) {
				next[i] = append(next[i], j)
			}
		}
	}
	for i := range out {
		seen := map[int]bool{}
		stack := slices.Clone(next[i])
		for len(stack) > 0 && !out[i].InCycle {
			j := stack[len(stack)-1]
			stack = stack[:len(stack)-1]
			if j == i {
				out[i].InCycle = true
			}
			if !seen[j] {
				seen[j] = true
				stack = append(stack, next[j]...)
			}
		}
	}
}

type heldJSON struct {
	Key  string `json:"key"`
	Mode string `json:"mode"`
	PID  int32  `json:"pid"`
}

type leaseJSON struct {
	Token   int64     `json:"token"`
	Holder  string    `json:"holder"`
	Granted time.Time `json:"granted"`
	Expires time.Time `json:"expires"`
	LeftMS  int64     `json:"left_ms"`
}

// Mode is "shared" or "exclusive" (a lease is exclusive).
func (li LockInfo) Mode() string {
	if li.Shared {
		return "shared"
	}
	return "exclusive"
}

// MarshalJSON writes the stable form advlock ls --json prints.
func (li LockInfo) MarshalJSON() ([]byte, error) {
	blocked := li.BlockedBy
	if blocked == nil {
		blocked = []int32{}
	}
	var start *time.Time
	if !li.BackendStart.IsZero() {
		start = &li.BackendStart
	}
	var holds []heldJSON
	var ls *leaseJSON
	if li.Lease != nil {
		ls = &leaseJSON{Token: li.Lease.Token, Holder: li.Lease.Holder, Granted: li.Lease.Granted,
			Expires: li.Lease.Expires, LeftMS: li.Lease.Left.Milliseconds()}
	}
	for _, h := range li.CallerHolds {
		holds = append(holds, heldJSON{Key: h.Key.String(), Mode: modeName(h.Shared), PID: h.PID})
	}
	return json.Marshal(struct {
		Key             string     `json:"key"`
		Mode            string     `json:"mode"`
		Granted         bool       `json:"granted"`
		WaitStart       *time.Time `json:"wait_start"`
		BlockedBy       []int32    `json:"blocked_by"`
		PID             int32      `json:"pid"`
		ApplicationName string     `json:"application_name"`
		ClientAddr      string     `json:"client_addr"`
		BackendStart    *time.Time `json:"backend_start"`
		State           string     `json:"state"`
		CallerHolds     []heldJSON `json:"caller_holds,omitempty"`
		InCycle         bool       `json:"in_cycle,omitempty"`
		Intent          bool       `json:"intent,omitempty"`
		Lingering       bool       `json:"lingering,omitempty"`
		ClientSessions  int        `json:"client_sessions"`
		Lease           *leaseJSON `json:"lease,omitempty"`
	}{li.Key.String(), li.Mode(), li.Granted, li.WaitStart, blocked, li.PID, li.ApplicationName, li.ClientAddr,
		start, li.State, holds, li.InCycle, li.Intent, li.Lingering, li.ClientSessions, ls})
}

// LockTableUse is how full the server's shared lock table is. Every advisory lock takes an entry, in a table that
// all databases and all lock types share; when it is full, every lock call fails with ErrLockTableFull and new
// connections to the server fail too.
type LockTableUse struct {
	Advisory int // advisory locks held or awaited, in every database
	Used     int // entries in use: every lock in pg_locks outside the per-backend fast path
	// Capacity is the approximate size: max_locks_per_transaction * (max_connections + max_prepared_transactions +
	// autovacuum_max_workers + max_worker_processes + max_wal_senders + 1). PostgreSQL sizes the table from this
	// and can exceed it a little from spare shared memory.
	Capacity int
}

const lockTableSQL = `
SELECT count(*) FILTER (WHERE locktype = 'advisory'), count(*) FILTER (WHERE NOT fastpath),
       current_setting('max_locks_per_transaction')::int * (current_setting('max_connections')::int +
         current_setting('max_prepared_transactions')::int + current_setting('autovacuum_max_workers')::int +
         current_setting('max_worker_processes')::int + current_setting('max_wal_senders')::int + 1)
FROM pg_locks`

// LockTable reads the server's lock-table use through conn (any role can read pg_locks). Reading pg_locks takes
// every lock-partition lock for a moment: do not poll it in a tight loop.
func LockTable(ctx context.Context, conn Querier) (LockTableUse, error) {
	rows, err := conn.Query(ctx, lockTableSQL)
	if err != nil {
		return LockTableUse{}, fmt.Errorf("advlock: read the lock table: %w", err)
	}
	u, err := pgx.CollectExactlyOneRow(rows, func(r pgx.CollectableRow) (LockTableUse, error) {
		var u LockTableUse
		return u, r.Scan(&u.Advisory, &u.Used, &u.Capacity)
	})
	if err != nil {
		return LockTableUse{}, fmt.Errorf("advlock: read the lock table: %w", err)
	}
	return u, nil
}
