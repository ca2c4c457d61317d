package session

import (
	"errors"
	"strconv"
)

// ID is a lock key as PostgreSQL sees it: one int8, or a pair of int4 (the two key spaces never overlap).
type ID struct {
	Pair bool
	// V is the int8 key, or for a pair the first int4 in the high 32 bits and the second in the low 32 bits.
	V int64
}

// Target is what one session holds: a key in a mode.
type Target struct {
	ID     ID
	Shared bool
}

// args returns the statement arguments for $1 (and $2 for a pair).
func (id ID) args() []any {
	if id.Pair {
		return []any{int32(id.V >> 32), int32(id.V)}
	}
	return []any{id.V}
}

// literal renders the key as SQL function arguments; it only ever formats integers.
func (id ID) literal() string {
	if id.Pair {
		return strconv.FormatInt(int64(int32(id.V>>32)), 10) + "," + strconv.FormatInt(int64(int32(id.V)), 10)
	}
	return strconv.FormatInt(id.V, 10)
}

// Result codes of the lock statements.
const (
	resultStandby  = -1
	resultNotHeld  = 0
	resultAcquired = 1
	resultTimeouts = 2 // LockSQL: held elsewhere, and a statement_timeout or lock_timeout is set: use WaitSQL
)

// Statements indexed by [pair][shared]. The try statement refuses on a standby without taking the lock (CASE
// evaluates lazily), so the recovery check costs no extra round trip.
var (
	trySQL = [2][2]string{
		{
			"SELECT CASE WHEN pg_is_in_recovery() THEN -1 WHEN pg_try_advisory_lock($1::int8) THEN 1 ELSE 0 END",
			"SELECT CASE WHEN pg_is_in_recovery() THEN -1 WHEN pg_try_advisory_lock_shared($1::int8) THEN 1 ELSE 0 END",
		},
		{
			"SELECT CASE WHEN pg_is_in_recovery() THEN -1 WHEN pg_try_advisory_lock($1::int4, $2::int4) THEN 1 ELSE 0 END",
			"SELECT CASE WHEN pg_is_in_recovery() THEN -1 WHEN pg_try_advisory_lock_shared($1::int4, $2::int4) THEN 1 ELSE 0 END",
		},
	}
	unlockSQL = [2][2]string{
		{"SELECT pg_advisory_unlock($1::int8)::int", "SELECT pg_advisory_unlock_shared($1::int8)::int"},
		{"SELECT pg_advisory_unlock($1::int4, $2::int4)::int", "SELECT pg_advisory_unlock_shared($1::int4, $2::int4)::int"},
	}
)

func b2i(b bool) int {
	if b {
		return 1
	}
	return 0
}

// The blocking functions return void; length(void::text) + 1 turns the grant into 1 without a subquery, whose
// InitPlan costs about 20 µs per call.

// lockSQL blocks in the server when the session has no statement_timeout and no lock_timeout, as one prepared
// statement (the cheapest wait there is). When one is set it only tries, and yields 2 if the key is held, so that
// the caller waits with WaitSQL, which lifts them. CASE evaluates lazily: the branch not taken takes no lock.
var lockSQL = [2][2]string{
	{lockCase("pg_advisory_lock($1::int8)", "pg_try_advisory_lock($1::int8)"),
		lockCase("pg_advisory_lock_shared($1::int8)", "pg_try_advisory_lock_shared($1::int8)")},
	{lockCase("pg_advisory_lock($1::int4, $2::int4)", "pg_try_advisory_lock($1::int4, $2::int4)"),
		lockCase("pg_advisory_lock_shared($1::int4, $2::int4)", "pg_try_advisory_lock_shared($1::int4, $2::int4)")},
}

func lockCase(lock, try string) string {
	return "SELECT CASE WHEN pg_is_in_recovery() THEN -1 " +
		"WHEN current_setting('statement_timeout') = '0' AND current_setting('lock_timeout') = '0' " +
		"THEN length(" + lock + "::text) + 1 WHEN " + try + " THEN 1 ELSE 2 END"
}

// LockSQL returns the blocking lock statement and its arguments: it yields 1, -1 (standby) or 2 (see lockSQL).
func LockSQL(t Target) (string, []any) { return lockSQL[b2i(t.ID.Pair)][b2i(t.Shared)], t.ID.args() }

// TrySQL returns the try-lock statement and its arguments. It yields 1 (acquired), 0 (held elsewhere) or -1 (the
// server is in recovery; nothing was taken).
func TrySQL(t Target) (string, []any) { return trySQL[b2i(t.ID.Pair)][b2i(t.Shared)], t.ID.args() }

// UnlockSQL returns the unlock statement and its arguments. It yields 1 (released) or 0 (this session did not hold
// the key in that mode).
func UnlockSQL(t Target) (string, []any) {
	return unlockSQL[b2i(t.ID.Pair)][b2i(t.Shared)], t.ID.args()
}

// WaitSQL returns the blocking lock statements, to be sent as one simple-protocol query (no arguments). They run in
// one implicit transaction whose SET LOCAL lifts any statement_timeout or lock_timeout that a role, database or
// pool default put on the session, so that only the caller's context bounds the wait; the settings revert when the
// implicit transaction ends, while the session-level lock stays. It yields 1 or -1 like TrySQL.
func WaitSQL(t Target) string {
	fn := "pg_advisory_lock"
	if t.Shared {
		fn = "pg_advisory_lock_shared"
	}
	return "SET LOCAL statement_timeout = 0; SET LOCAL lock_timeout = 0; " +
		"SELECT CASE WHEN pg_is_in_recovery() THEN -1 ELSE length(" + fn + "(" + t.ID.literal() + ")::text) + 1 END"
}

// TimedWaitSQL is WaitSQL bounded by the server: lock_timeout is set to ms for the statement's implicit
// transaction, so that a wait not granted in time ends with SQLSTATE 55P03 and the session stays usable.
func TimedWaitSQL(t Target, ms int64) string {
	fn := "pg_advisory_lock"
	if t.Shared {
		fn = "pg_advisory_lock_shared"
	}
	return "SET LOCAL statement_timeout = 0; SET LOCAL lock_timeout = " + strconv.FormatInt(ms, 10) + "; " +
		"SELECT CASE WHEN pg_is_in_recovery() THEN -1 ELSE length(" + fn + "(" + t.ID.literal() + ")::text) + 1 END"
}

// Transaction-scoped statements, indexed by [pair][shared]. They yield 1, 0 (try only) or -1 (standby).
var (
	xactTrySQL = [2][2]string{
		{
			"SELECT CASE WHEN pg_is_in_recovery() THEN -1 WHEN pg_try_advisory_xact_lock($1::int8) THEN 1 ELSE 0 END",
			"SELECT CASE WHEN pg_is_in_recovery() THEN -1 WHEN pg_try_advisory_xact_lock_shared($1::int8) THEN 1 ELSE 0 END",
		},
		{
			"SELECT CASE WHEN pg_is_in_recovery() THEN -1 WHEN pg_try_advisory_xact_lock($1::int4, $2::int4) THEN 1 ELSE 0 END",
			"SELECT CASE WHEN pg_is_in_recovery() THEN -1 WHEN pg_try_advisory_xact_lock_shared($1::int4, $2::int4) THEN 1 ELSE 0 END",
		},
	}
	xactWaitSQL = [2][2]string{
		{
			"SELECT CASE WHEN pg_is_in_recovery() THEN -1 ELSE length(pg_advisory_xact_lock($1::int8)::text) + 1 END",
			"SELECT CASE WHEN pg_is_in_recovery() THEN -1 ELSE length(pg_advisory_xact_lock_shared($1::int8)::text) + 1 END",
		},
		{
			"SELECT CASE WHEN pg_is_in_recovery() THEN -1 ELSE length(pg_advisory_xact_lock($1::int4, $2::int4)::text) + 1 END",
			"SELECT CASE WHEN pg_is_in_recovery() THEN -1 ELSE length(pg_advisory_xact_lock_shared($1::int4, $2::int4)::text) + 1 END",
		},
	}
)

// XactSQL returns the transaction-scoped lock statement and its arguments: blocking with wait, else a try.
func XactSQL(t Target, wait bool) (string, []any) {
	if wait {
		return xactWaitSQL[b2i(t.ID.Pair)][b2i(t.Shared)], t.ID.args()
	}
	return xactTrySQL[b2i(t.ID.Pair)][b2i(t.Shared)], t.ID.args()
}

// XactResult turns an xact statement's result into an error.
func XactResult(r int64) error {
	switch r {
	case resultAcquired:
		return nil
	case resultNotHeld:
		return ErrNotAcquired
	case resultStandby:
		return ErrStandby
	}
	return errors.New("advlock: unexpected lock result " + strconv.FormatInt(r, 10))
}
