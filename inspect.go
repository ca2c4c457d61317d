package advlock

import (
	"context"
	"encoding/json"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"
)

// Querier is what Inspect needs: a *pgxpool.Pool, *pgx.Conn or pgx.Tx.
type Querier interface {
	Query(ctx context.Context, sql string, args ...any) (pgx.Rows, error)
}

// LockInfo is one advisory lock held or waited for, as the server sees it: a pg_locks row joined with
// pg_stat_activity.
type LockInfo struct {
	Key             Key        // decoded from classid/objid/objsubid; a NameKey shows as the Int64Key of its hash
	Shared          bool       // ShareLock (RLock) rather than ExclusiveLock
	Granted         bool       // held; false means waiting
	WaitStart       *time.Time // when the wait began (nil while held)
	BlockedBy       []int32    // pids the waiter waits for (pg_blocking_pids); empty while held
	PID             int32      // server process id of the session
	ApplicationName string
	ClientAddr      string // IP address, or "local" for a Unix socket
	BackendStart    time.Time
	State           string // pg_stat_activity.state: idle, active, ...
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
       coalesce(a.state, ''), a.pid IS NOT NULL
FROM l LEFT JOIN pg_stat_activity a ON a.pid = l.pid
ORDER BY l.classid, l.objid, l.objsubid, l.granted DESC, l.waitstart NULLS FIRST, l.pid`

// Inspect lists every advisory lock in the current database, holders first, then waiters in the order they
// started waiting. It needs PostgreSQL 14 or later (pg_locks.waitstart). Rows of other users' sessions show
// their application name and address only to roles allowed to see them (pg_read_all_stats).
//
// pg_locks and pg_stat_activity cannot be read at one instant: when the activity read says a waiter is not
// waiting (its wait ended between the two reads) or a session is gone, Inspect reads both again (up to 3 times),
// so that what it returns is one consistent picture.
func Inspect(ctx context.Context, q Querier) ([]LockInfo, error) {
	var out []LockInfo
	for range 3 {
		var consistent bool
		var err error
		out, consistent, err = inspectOnce(ctx, q)
		if err != nil {
			return nil, fmt.Errorf("advlock: inspect: %w", err)
		}
		if consistent {
			break
		}
	}
	return out, nil
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
		if err := r.Scan(&cls, &obj, &sub, &li.Shared, &li.Granted, &li.WaitStart, &li.BlockedBy, &li.PID,
			&li.ApplicationName, &li.ClientAddr, &start, &li.State, &live); err != nil {
			return li, err
		}
		if !live || !li.Granted && li.State != "active" {
			consistent = false
		}
		if start != nil {
			li.BackendStart = *start
		}
		k, err := KeyFromPgLocks(uint32(cls), uint32(obj), sub)
		li.Key = k
		return li, err
	})
	return out, consistent, err
}

// Mode is "shared" or "exclusive".
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
	}{li.Key.String(), li.Mode(), li.Granted, li.WaitStart, blocked, li.PID, li.ApplicationName, li.ClientAddr,
		start, li.State})
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
