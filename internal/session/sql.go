package session

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"strings"

	"github.com/advlock/advlock/internal/mutant"
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

// Result codes of the lock statements. A grant is 1, or with fencing the grant's token (>= 1).
const (
	resultIntentIdle = -7 // resultIntentNow, and the statement gave the session an idle_session_timeout (intentIdle)
	resultIntentNow  = -6 // an exclusive wait's statement took the key's intent and did not wait: wait next, holding it
	resultBadUnlock  = -5 // an unlock inside a wait statement found nothing to unlock: the session is in doubt
	resultBounced    = -4 // a shared wait was granted while a writer's intent stood, and gave the key back at once
	resultStandby    = -1
	resultNotHeld    = 0
	resultAcquired   = 1
)

// FenceSeq is the sequence fencing tokens come from: one for every key, every client, every database user of the
// cluster's database. nextval never returns a value twice and never goes back, also across a crash (the server
// logs sequence values ahead of handing them out).
const FenceSeq = "public.advlock_fence"

// grant is what a statement yields for a grant: 1, or a fresh token. A token is used outside the database, so it
// must survive a crash: no value may reach a caller before the WAL record that covers it is flushed. nextval logs
// the sequence ahead of the values it hands out (one record every 32 values) and takes a transaction id when it
// logs, so the commit of the transaction that logged flushes that record. The other 31 values log nothing, and
// their commits flush nothing: they are covered only once that transaction has committed, which may be later (a
// shared session's batch still running, a transaction that drew from the sequence and is still open, one that
// aborted, one with synchronous_commit off). So a grant whose transaction has no id yet, on a server with WAL not
// yet flushed, writes a transactional logical-decoding message of its own (prefix "advlock", empty): its
// transaction then has an id and WAL, and its commit flushes everything before it. On a server whose WAL is all
// flushed (every commit that wrote flushed it) it writes nothing. The grant sets synchronous_commit to local for
// its own transaction, so that the commit flushes whatever the server's setting. Local, not on: a grant never
// waits for a synchronous standby (were one down, every fenced grant would stall, and a shared session stalled past
// its round-trip bound is closed with every lock on it). Evaluated left to right: nextval before the check, and the
// flush position read before the insert position.
//
// A token is the server's timeline in its high bits and the sequence's value in its low TokenSeqBits: a promotion
// starts a new timeline, greater than every one before it in the cluster, so a promoted standby whose sequence lags
// (asynchronous replication loses the last values the old primary handed out) still hands out only greater tokens,
// and a deposed primary that keeps running only lower ones. The timeline is read live from the name of the WAL
// file being written (the control file's lags until the next checkpoint), in the same expression: no round trip.
func grant(fenced bool) string {
	if fenced {
		draw := tokenExpr
		if mutant.On(mutant.TokenNoTimeline) {
			draw = "nextval('" + FenceSeq + "')"
		}
		return "(" + draw + " + 0 * length(set_config('synchronous_commit', 'local', true)) + " +
			"0 * length(CASE WHEN txid_current_if_assigned() IS NULL AND " +
			"pg_current_wal_flush_lsn() < pg_current_wal_insert_lsn() " +
			"THEN pg_logical_emit_message(true, 'advlock', '')::text ELSE '' END))"
	}
	return "1"
}

// tokenExpr draws a token: the timeline (at most maxTimeline) shifted by TokenSeqBits, plus the sequence's next
// value (the literal numbers are those constants: TestTokenExpr).
const tokenExpr = "(least(('x' || substr(pg_catalog.pg_walfile_name(pg_catalog.pg_current_wal_lsn()), 1, 8))::bit(32)::int8, 32767) << 48) + " +
	"nextval('" + FenceSeq + "')"

// TokenSQL is an SQL expression that draws a fencing token as a grant does, for a transaction to draw its own: a
// token drawn by a transaction is covered by that transaction's commit (its writes and the token stand or fall
// together), so it needs none of the grant's flushing.
const TokenSQL = "(" + tokenExpr + ")"

// TokenSeqBits is how many low bits of a fencing token hold the sequence's value; the bits above hold the
// server's timeline (at most maxTimeline: a timeline past it counts as maxTimeline, and tokens stop growing across
// promotions).
const (
	TokenSeqBits = 48
	maxTimeline  = 1<<(63-TokenSeqBits) - 1
)

// TokenParts splits a fencing token into the server's timeline and the sequence's value.
func TokenParts(token int64) (timeline, seq int64) {
	return token >> TokenSeqBits, token & (1<<TokenSeqBits - 1)
}

// lockFn names the advisory-lock function of a target's kind: lock(try, shared) with the key arguments args.
func lockFn(try, shared bool, args string) string {
	fn := "pg_advisory_lock"
	if try {
		fn = "pg_try_advisory_lock"
	}
	if shared {
		fn += "_shared"
	}
	return fn + "(" + args + ")"
}

var keyArgs = [2]string{"$1::int8", "$1::int4, $2::int4"} // by pair

// Statements indexed by [fenced][pair][shared]. The try statement refuses on a standby without taking the lock
// (CASE evaluates lazily), so the recovery check costs no extra round trip. A token, when fenced, is drawn only in
// the branch that granted, after the grant, in the same statement: no extra round trip, and a later grant always
// gets a larger token.
var trySQL [2][2][2]string

// Intent is the lock a writer (an exclusive wait) holds while it waits for a key that readers hold, so that new
// readers wait behind it across its slices (see WaitSQL): a key derived from the key by a fixed bijection of its
// own key space (the splitmix64 finalizer of the key xor a constant), so that no two keys share an intent, an int8
// key's intent is an int8 key and a pair's a pair (the two spaces never meet in pg_locks), and a user's key is the
// intent of another only by a 64-bit coincidence. Readers test it without waiting (noIntent); writers take it only
// with a try, in a statement that waits for nothing else, so that whether a session holds it is always known.
func (id ID) Intent() ID { return id.derived(0x6164766c6f636b49) } // "advlockI"

// derived maps id to a key of its own space: the splitmix64 finalizer of the key xor c.
func (id ID) derived(c uint64) ID {
	x := uint64(id.V) ^ c
	x ^= x >> 30
	x *= 0xbf58476d1ce4e5b9
	x ^= x >> 27
	x *= 0x94d049bb133111eb
	x ^= x >> 31
	if int64(x) == id.V {
		x ^= 1 // a key that would be its own image (a fixed point of the bijection) takes its neighbour's
	}
	return ID{Pair: id.Pair, V: int64(x)}
}

// derivedArgs renders a derived key that travels as one int8 (e, an SQL expression: a parameter or a column) as
// the arguments of an advisory-lock function of its space: e itself, or for a pair its high and low 32 bits, each
// a signed int4 (the shifts are arithmetic).
func derivedArgs(pair bool, e string) string {
	if pair {
		return "(" + e + " >> 32)::int4, (" + e + " << 32 >> 32)::int4"
	}
	return e
}

// Linger is the marker of a lock held past its work (an Unlock before the lock's minimum hold had passed): the
// session that holds the key holds this key (of the key's space) in shared mode too, until it releases the key, so
// that a reader of pg_locks (Inspect, advlock ls) can tell. Derived as Intent is, with another constant. Nobody
// takes it exclusively, so a shared try of it is granted (but for a 64-bit coincidence with a user's key held
// exclusively).
func (id ID) Linger() ID { return id.derived(0x6164766c6f636b4c) } // "advlockL"

// LingerSQL takes a marker (see Linger), its one argument (an int8; for a pair's marker, the pair packed as ID.V
// is): 1 when granted. Its text is the same for every key of a space, so that a driver that prepares statements
// prepares it once per space.
func LingerSQL(pair bool) string {
	return "SELECT pg_try_advisory_lock_shared(" + derivedArgs(pair, "$1::int8") + ")::int"
}

// UnlockLingeringSQL is UnlockSQL for a lock whose marker (that of held, the key it holds) this session holds:
// the marker goes too, and the statement answers the key's unlock.
func UnlockLingeringSQL(t Target, held ID) (string, []any) {
	sql, args := UnlockSQL(t)
	m := held.Linger()
	return sql + " + 0 * pg_advisory_unlock_shared(" + derivedArgs(m.Pair, "$"+strconv.Itoa(len(args)+1)+"::int8") + ")::int",
		append(args, m.V)
}

// noIntent is an SQL condition: true when no session holds the intent i (the arguments of a lock function, see
// derivedArgs) exclusively, tested
// with a shared try that is undone at once, so that it leaves nothing held. Writers never wait for an intent (they
// only try), so a shared try of it fails exactly when a writer holds it.
func noIntent(i string) string {
	if mutant.On(mutant.IntentIgnored) {
		return "(ROW(" + i + ") IS NOT NULL)" // always true; i stays an argument of the statement
	}
	return "CASE WHEN pg_try_advisory_lock_shared(" + i + ") THEN pg_advisory_unlock_shared(" + i + ") ELSE false END"
}

// Waiting is the flag of a key's line: every writer in the key's line (see line.go) holds it in shared mode, from
// its join to its grant or end, so that an exclusive try of the key, which tests it (noWriterWaits), does not pass a
// writer that waits in the line (one between two of its slices, or the next head before it queues for the key the
// holder is freeing). Derived as Intent is, with another constant.
func (id ID) Waiting() ID { return id.derived(0x6164766c6f636b57) } // "advlockW"

// noWriterWaits is an SQL condition: true when no writer waits in the line of the key whose flag (see Waiting) is
// f (lock function arguments), tested with an exclusive try that is undone at once. Only a session that holds the
// key exclusively (its try just passed) tests it, so two tests of one flag never meet.
func noWriterWaits(f string) string {
	return "CASE WHEN " + lockFn(true, false, f) + " THEN " + unlockFn(false, f) + " ELSE false END"
}

// exclusiveTry is a writer's try (a CASE expression): it passes only while no writer waits in the key's line (f,
// the line's flag: see Waiting), and yields a grant, 0, or -5 (an unlock that found nothing: the session is in
// doubt). The key is tried first and given back when a writer waits, as sharedTry does with the intent.
func exclusiveTry(fenced bool, key, f string) string {
	return "CASE WHEN " + lockFn(true, false, key) + " THEN CASE WHEN " + noWriterWaits(f) + " THEN " + grant(fenced) +
		" WHEN " + unlockFn(false, key) + " THEN 0 ELSE -5 END ELSE 0 END"
}

// sharedTry is a reader's try (a CASE expression): it passes only while no writer's intent stands (see Intent),
// and yields a grant, 0, or -5 (an unlock that found nothing: the session is in doubt). The key is tried first and
// given back when an intent stands: a lock-table entry that the intent's test cannot get (53200) then fails the
// statement after the key's grant, never before it, so that a shared session undoes the refused try exactly (one
// unlock of the key in that mode gives back that grant, and changes nothing when the key's own lock function
// failed, which it does only when the session did not hold the key in that mode).
func sharedTry(fenced bool, key, intent string) string {
	return "CASE WHEN " + lockFn(true, true, key) + " THEN CASE WHEN " + noIntent(intent) + " THEN " + grant(fenced) +
		" WHEN " + unlockFn(true, key) + " THEN 0 ELSE -5 END ELSE 0 END"
}

// liftTimeout is a condition that is always false and, where the server has transaction_timeout (PostgreSQL 17 and
// later), sets it to 0 for the current transaction (which also disarms its timer): a role or database default
// must not end a wait. current_setting(..., true) is NULL on servers without it, where set_config would fail.
const liftTimeout = "CASE WHEN current_setting('transaction_timeout', true) IS NULL THEN false " +
	"ELSE set_config('transaction_timeout', '0', true) IS NULL END"

// afterGrant is what a wait yields once the server granted it: the grant for an exclusive wait; for a shared one,
// the grant if no writer's intent stands now, else the key is given back at once (resultBounced: the reader was
// let through as a writer's wait was between two slices, and waits again behind it). A grant first gives back
// what leave gives back (leaveCond; "" for nothing), and yields -5 when that found something missing.
func afterGrant(shared, fenced bool, key, intent, leave string) string {
	g := grant(fenced)
	if leave != "" {
		g = "CASE WHEN " + leave + " THEN " + g + " ELSE -5 END"
	}
	if !shared {
		return g
	}
	return "CASE WHEN " + noIntent(intent) + " THEN " + g + " WHEN " + unlockFn(true, key) +
		" THEN -4 ELSE -5 END"
}

func init() {
	for f := range 2 {
		for p := range 2 {
			for sh := range 2 {
				fenced, shared, args := f == 1, sh == 1, keyArgs[p]
				trySQL[f][p][sh] = "SELECT CASE WHEN pg_is_in_recovery() THEN -1 ELSE " +
					exclusiveTry(fenced, args, derivedArgs(p == 1, "$"+strconv.Itoa(p+2)+"::int8")) + " END"
				if shared {
					trySQL[f][p][sh] = "SELECT CASE WHEN pg_is_in_recovery() THEN -1 ELSE " +
						sharedTry(fenced, args, derivedArgs(p == 1, "$"+strconv.Itoa(p+2)+"::int8")) + " END"
				}
			}
		}
	}
}

// intentIdle is an SQL expression for a session that takes an intent: 1 when it gives the session an
// idle_session_timeout of ms (a literal or parameter) because it had none, else 0. A session that holds an intent
// is never idle for long (each slice is sent again at once); should its client vanish (a network partition, a
// process killed) after giving up on the wait, the server ends it then, instead of keeping the intent, which holds
// readers back, until TCP keepalive notices (hours with the defaults). The setting is restored (to 0) with the
// intent's release (LeaveSQL, SettleSQL). Servers before PostgreSQL 14 have no such setting.
func intentIdle(ms string) string {
	return "CASE WHEN coalesce(current_setting('idle_session_timeout', true), '') = '0' THEN " +
		"0 * length(set_config('idle_session_timeout', " + ms + ", false)) + 1 ELSE 0 END"
}

// leaveCond is an SQL condition that a granted wait evaluates in the statement that granted it: it gives back the
// key's intent (intent), its place in the key's line (seq, 0 when it has none: its ticket and, for a writer, the
// line's flag; see line.go) and restores the session's idle_session_timeout when the wait set one (idle); true when
// all of it was there. It reads no pg_locks: a wait that is the head of its line holds no ticket but its own (a
// ticket in front of it, granted as a slice ended, was given back by the LineSQL that found it the head). "" when
// there is nothing to give back.
func leaveCond(t Target, n nums, line, intent, idle bool) string {
	// The intent first, the ticket last: the member behind, woken by the ticket's release, takes the intent at once
	// (a try), which must find it free. (The grant holds the key meanwhile: no reader or try passes it.)
	var parts []string
	if intent {
		parts = append(parts, unlockFn(false, n.args(n.intent)))
	}
	if line {
		if !t.Shared {
			parts = append(parts, unlockFn(true, n.args(n.flag)))
		}
		parts = append(parts, unlockFn(t.Shared, n.ticket(n.seq)))
	}
	if idle {
		parts = append(parts, "set_config('idle_session_timeout', '0', false) IS NOT NULL")
	}
	if len(parts) == 0 {
		return ""
	}
	return "(" + strings.Join(parts, " AND ") + ")"
}

// LeaveSQL is leaveCond as a statement of its own: 1 when all of it was there.
func LeaveSQL(t Target, seq int64, intent, idle bool) string {
	c := leaveCond(t, literalNums(t.ID, seq, 0, 0), seq > 0, intent, idle)
	if c == "" {
		return "SELECT 1"
	}
	return "SELECT CASE WHEN " + c + " THEN 1 ELSE 0 END"
}

var unlockSQL = [2][2]string{
	{"SELECT pg_advisory_unlock($1::int8)::int", "SELECT pg_advisory_unlock_shared($1::int8)::int"},
	{"SELECT pg_advisory_unlock($1::int4, $2::int4)::int", "SELECT pg_advisory_unlock_shared($1::int4, $2::int4)::int"},
}

func b2i(b bool) int {
	if b {
		return 1
	}
	return 0
}

// TrySQL returns the try-lock statement and its arguments (last, for a shared try the key's intent: it passes only
// while no writer's intent stands; for an exclusive one the key's line's flag: it passes only while no writer waits
// in the line). It yields a grant (1, or the token when fenced), 0 (held elsewhere, or a writer waits), -1 (the
// server is in recovery; nothing was taken) or -5 (the session is in doubt).
func TrySQL(t Target, fenced bool) (string, []any) {
	args := t.ID.args()
	if t.Shared {
		args = append(args, t.ID.Intent().V)
	} else {
		args = append(args, t.ID.Waiting().V)
	}
	return trySQL[b2i(fenced)][b2i(t.ID.Pair)][b2i(t.Shared)], args
}

// UnlockSQL returns the unlock statement and its arguments. It yields 1 (released) or 0 (this session did not hold
// the key in that mode).
func UnlockSQL(t Target) (string, []any) {
	return unlockSQL[b2i(t.ID.Pair)][b2i(t.Shared)], t.ID.args()
}

// WaitSQL is a wait in the server bounded by the server: sent as one simple-protocol query (no arguments), its
// statements run in one implicit transaction whose SET LOCAL lifts any statement_timeout (and transaction_timeout)
// that a role, database or pool default put on the session and sets lock_timeout to ms, so that a wait not granted
// in time ends with SQLSTATE 55P03 and the session stays usable; the settings revert when the implicit transaction
// ends, while the session-level lock stays. It yields a grant, -1 (standby), -4 (a shared wait granted past a writer's intent and given back: wait again), -5 (doubt), or resultIntentNow or resultIntentIdle; a wait not granted within ms fails with SQLSTATE 55P03.
//
// A wait is sent again and again, one slice at a time (see DefaultWaitSlice), so that no snapshot lives long.
// A grant can race lock_timeout (the server grants the key just as the timeout fires; the lock then survives the
// error), so a wait sent again after a timeout (requeue) first tries the key: the try passes on a session that
// holds it already (PostgreSQL's re-entrancy), as it does on a free key, and fails at once otherwise, which is
// the usual case and costs the server a few microseconds. When it passes, the session holds the key once or twice:
// one unlock, then pg_locks says which (a read of the lock table once per wait at most, as the wait ends; a wait
// in a line reads it too as it leaves the line, once it has had a slice's end: leaveHeldCond), so that the key is
// held exactly once when the statement yields a grant.
//
// An exclusive wait that holds no intent yet takes it when no other session holds it, and then yields
// resultIntentNow (or resultIntentIdle, having given the session an idle_session_timeout of idleMS: intentIdle)
// without waiting (its next statement waits); one that holds it (intent) waits at once. A shared
// wait gives the key back when granted while a writer's intent stands (afterGrant).
//
// A grant gives back, in the statement that granted it, what the wait held to get there (leaveCond: its place in
// the key's line seq, the intent, the session's idle_session_timeout when idle), so that the next member of the
// line moves up as the grant is made, and the grant costs no round trip more; an unlock there that finds nothing
// yields -5 (doubt). A requeue gives back what pg_locks says the session holds instead (leaveHeldCond): the
// statement before it may have left the line before its error (serverWait does so for every statement of a wait
// after its first 55P03).
func WaitSQL(t Target, ms int64, fenced, requeue, intent bool, idleMS, seq int64, idle bool) string {
	n := literalNums(t.ID, seq, ms, idleMS)
	leave := leaveCond(t, n, seq > 0, intent, idle)
	if requeue && leave != "" {
		leave = leaveHeldCond(n, idle)
	}
	return waitStmt(t, n, nil, ms, fenced, requeue, intent, leave).String()
}

// WaitAnySQL is WaitSQL for an exclusive wait for t that takes any of alts instead when one is free: each of its
// statements tries alts in order before it waits for t, and yields 2+i for alts[i], 1 for t (never a token: a
// fenced caller draws it next, TokenGrantSQL).
func WaitAnySQL(t Target, alts []ID, ms int64, requeue, intent bool) string {
	n := literalNums(t.ID, 0, ms, 0)
	return waitStmt(t, n, alts, ms, false, requeue, intent, leaveCond(t, n, false, intent, false)).String()
}

// TokenGrantSQL draws a grant's token (see grant) in a statement of its own, for a grant whose statement could
// not yield it (WaitAnySQL): drawn while the lock is held, after its grant, so a later grant still gets a larger
// one.
var TokenGrantSQL = "SELECT " + grant(true)

// waitStmt is WaitSQL (WaitAnySQL with alts) with the wait's numbers n (its slice also ms, which its settings name
// as a literal) and what its grant gives back, leave.
func waitStmt(t Target, n nums, alts []ID, ms int64, fenced, requeue, intent bool, leave string) stmt {
	key, ik := n.args(n.key), n.args(n.intent)
	after := afterGrant(t.Shared, fenced, key, ik, leave)
	wait := "length(" + lockFn(false, t.Shared, key) + "::text) + " + after
	var b strings.Builder
	b.WriteString("SELECT CASE WHEN " + liftTimeout + " THEN -5 WHEN pg_is_in_recovery() THEN -1")
	if requeue {
		b.WriteString(" WHEN " + lockFn(true, t.Shared, key) + " THEN CASE WHEN NOT " + unlockFn(t.Shared, key) + " THEN -5" +
			" WHEN " + ownRow(n, n.key, t.Shared) + " THEN " + after + " WHEN " + lockFn(true, t.Shared, key) + " THEN " + after +
			" ELSE " + wait + " END")
	} else if !t.Shared {
		b.WriteString(" WHEN " + lockFn(true, false, key) + " THEN " + after) // free now: no reader to wait behind
	}
	for i, a := range alts { // tries: none can race a timeout
		b.WriteString(" WHEN " + lockFn(true, false, a.literal()) + " THEN " + strconv.Itoa(2+i))
	}
	if !t.Shared && !intent && len(alts) == 0 { // a semaphore's slots are never held shared
		// A writer without the intent takes it whenever it is free, in a statement that then does not wait (so
		// that whether it holds it is known): a writer behind other writers cannot tell that readers hold the key
		// (a shared try fails while an exclusive request waits), and once the writer that held the intent lets
		// go, one of those still waiting must hold it for the readers to wait again.
		b.WriteString(" WHEN " + lockFn(true, false, ik) + " THEN -6 - " + intentIdle(n.idle+"::text"))
	}
	b.WriteString(" ELSE " + wait + " END")
	return stmt{prefix: "SET LOCAL statement_timeout = 0; SET LOCAL lock_timeout = " + strconv.FormatInt(ms, 10) + "; ", body: b.String()}
}

// SharedNowSQL tells a writer's session whether t's key could be taken in shared mode now (it is free, or readers
// alone hold it, and no other writer waits in the server's queue): 1, having given the shared hold back at once,
// else 0. It never waits.
func SharedNowSQL(t Target) string {
	key := t.ID.literal()
	return "SELECT CASE WHEN " + lockFn(true, true, key) + " THEN " + unlockFn(true, key) + "::int ELSE 0 END"
}

// heldIntentSharedNowSQL is SharedNowSQL for a writer that may hold t's intent: 1 only when it does, and t's key
// could be taken in shared mode now.
func heldIntentSharedNowSQL(t Target) string {
	n := literalNums(t.ID, 0, 0, 0)
	return "SELECT CASE WHEN " + ownRow(n, n.intent, false) + " THEN (" + SharedNowSQL(t) + ") ELSE 0 END"
}

// SettleSQL leaves a session that waited for t and was not granted holding nothing, whether or not a grant raced
// the wait's end (a try passes on a session that holds the key already; then one unlock, and pg_locks says whether
// a second is needed), with line also its place in the key's line (LineSQL) and whatever it holds of the line and
// the key's intent (leaveHeldCond), and with intent also gives the key's intent back (with idle, restoring the session's
// idle_session_timeout: intentIdle). It yields 1 when the session holds
// nothing afterwards; anything else puts the session in doubt.
func SettleSQL(t Target, intent, line, idle bool) string {
	key, n := t.ID.literal(), literalNums(t.ID, 0, 0, 0)
	s := "SELECT CASE WHEN " + lockFn(true, t.Shared, key) + " THEN CASE WHEN NOT " + unlockFn(t.Shared, key) + " THEN -5" +
		" WHEN " + ownRow(n, n.key, t.Shared) + " THEN " + unlockFn(t.Shared, key) + "::int ELSE 1 END ELSE 1 END"
	if line || intent { // what pg_locks says it holds of the line and the intent: its last error may have come late
		s += " * CASE WHEN " + leaveHeldCond(n, false) + " THEN 1 ELSE 0 END"
	}
	if idle {
		s += " + 0 * length(set_config('idle_session_timeout', '0', false))"
	}
	return s
}

// XactSQL returns the transaction-scoped lock statement for t: blocking with wait, else a try. It takes no
// arguments, so that every driver sends it over the simple protocol (pgx's Exec does whatever the connection's
// query mode; lib/pq does for a statement without arguments): the extended protocol leaves the statement's portal
// open until the next statement, and with it the statement's snapshot, which would pin the database's xmin horizon
// and hold up every CREATE INDEX CONCURRENTLY for as long as the transaction stays idle. Its outcome is the number
// of rows it returns (the command tag's, which Exec reports): see XactRows.
func XactSQL(t Target, wait bool) string {
	fn := lockFn(!wait, t.Shared, t.ID.literal())
	fn = strings.Replace(fn, "advisory_", "advisory_xact_", 1)
	outcome := "WHEN " + fn + " THEN 1 ELSE 0"
	if wait {
		outcome = "ELSE length(" + fn + "::text) + 1"
	}
	return "SELECT 1 FROM pg_catalog.generate_series(1, CASE WHEN pg_is_in_recovery() THEN 2 " + outcome + " END)"
}

// XactRows turns the number of rows an XactSQL statement returned into an error: 1 granted, 0 held elsewhere (a
// try), 2 the server is a standby (nothing taken).
func XactRows(n int64) error {
	switch n {
	case 1:
		return nil
	case 0:
		return ErrNotAcquired
	case 2:
		return ErrStandby
	}
	return errors.New("advlock: unexpected lock result: " + strconv.FormatInt(n, 10) + " rows")
}

// EnsureFence makes sure FenceSeq exists and can be used, creating it if it is missing, through one connection of
// pool. Only what an operator must fix is ErrFencing: a role that may neither create the sequence nor use it gets
// ErrFencing saying what to run. Anything else (a connection that failed, a server that did not answer within
// VerifyBound) is returned as it is, for the caller to try again. Many clients may create the sequence at the same
// moment on a database that never had it (a fleet's first deploy): CREATE SEQUENCE IF NOT EXISTS is not safe
// against a concurrent create (it fails with a duplicate key on pg_class), so such an error means "it exists now".
// With try, it does not wait for a connection (ErrPoolExhausted).
func EnsureFence(ctx context.Context, pool Pool, try bool) error {
	if try && pool.Stats().Exhausted() {
		return ErrPoolExhausted
	}
	// A try waits for a connection no longer than the checks of a new one may take; a wait, as long as ctx allows.
	actx, acancel := ctx, context.CancelFunc(func() {})
	if try {
		actx, acancel = context.WithTimeout(ctx, VerifyBound)
	}
	conn, err := pool.Acquire(actx)
	bound := ctx.Err() == nil && actx.Err() != nil
	acancel()
	if err != nil {
		if bound {
			return fmt.Errorf("check the fencing sequence: no connection within %v (%v)", VerifyBound, err)
		}
		return WithContext(ctx, fmt.Errorf("check the fencing sequence: acquire connection: %w", err))
	}
	bctx, cancel := context.WithTimeout(ctx, VerifyBound)
	defer cancel()
	err = ensureFence(bctx, conn)
	switch {
	case err == nil || errors.Is(err, ErrFencing):
		conn.Release() // it answered; nothing was locked on it
		return err
	case ctx.Err() == nil && bctx.Err() != nil:
		err = fmt.Errorf("check the fencing sequence: no answer within %v", VerifyBound)
	}
	conn.Destroy()
	return WithContext(ctx, err)
}

func ensureFence(ctx context.Context, conn Conn) error {
	for attempt := 0; ; attempt++ {
		exists, err := conn.QueryInt(ctx, "SELECT (to_regclass('"+FenceSeq+"') IS NOT NULL)::int + 2 * pg_catalog.pg_is_in_recovery()::int")
		if SQLState(err) == "42501" {
			return fmt.Errorf("%w: this role may not use schema public, where the sequence %s is; as its owner run: "+
				"GRANT USAGE ON SCHEMA public TO <role>: %v", ErrFencing, FenceSeq, err)
		}
		if err != nil {
			return fmt.Errorf("check the fencing sequence: %w", err)
		}
		if exists&1 == 1 {
			break
		}
		if exists&2 == 2 { // a standby of a database that has never seen advlock's fencing: it cannot create it
			return fmt.Errorf("%w (the fencing sequence %s is not there either: create it on the primary)", ErrStandby, FenceSeq)
		}
		// It needs CREATE on schema public.
		// Flushed before it answers whatever synchronous_commit says (set in the same transaction, read at its
		// commit): a crash that took the creation back would start the sequence again from 1.
		_, err = conn.QueryInt(ctx, "CREATE SEQUENCE IF NOT EXISTS "+FenceSeq+"; SELECT 1 + 0 * length(set_config('synchronous_commit', 'local', true))")
		switch code := SQLState(err); {
		case err == nil:
		case code == "25006":
			return fmt.Errorf("create the fencing sequence: %w", ReadOnly(err))
		case code == "42501":
			return fmt.Errorf("%w: the sequence %s does not exist and this role may not create it (it needs CREATE on "+
				"schema public); as a role that may, run: CREATE SEQUENCE %s; GRANT USAGE ON SEQUENCE %s TO <role>: %v",
				ErrFencing, FenceSeq, FenceSeq, FenceSeq, err)
		case (code == "23505" || code == "42P07" || code == "42710") && attempt < 3:
			continue // created by another client at the same moment: look again
		default:
			return fmt.Errorf("create the fencing sequence: %w", err)
		}
		break
	}
	// Tokens must come out in the order grants are made, whoever draws them: a sequence that caches values per
	// session (CACHE n > 1) hands session A 1..n and session B n+1..2n, so A's next grant gets a smaller token than
	// B's last; one that counts down or cycles hands out smaller or repeated values.
	cache, err := conn.QueryInt(ctx, "SELECT CASE WHEN seqincrement <= 0 THEN -1 WHEN seqcycle THEN -2 ELSE seqcache END "+
		"FROM pg_catalog.pg_sequence WHERE seqrelid = '"+FenceSeq+"'::regclass")
	if err != nil {
		return fmt.Errorf("check the fencing sequence: %w", err)
	}
	switch {
	case cache == -1:
		return fmt.Errorf("%w: the sequence %s does not count up (INCREMENT <= 0), so tokens would not grow; as its owner "+
			"run: ALTER SEQUENCE %s INCREMENT 1 MINVALUE 1 MAXVALUE 9223372036854775807 START WITH <n> RESTART WITH <n>, "+
			"n above every token's sequence part handed out", ErrFencing, FenceSeq, FenceSeq)
	case cache == -2:
		return fmt.Errorf("%w: the sequence %s is CYCLE, so tokens could repeat; as its owner run: ALTER SEQUENCE %s NO CYCLE",
			ErrFencing, FenceSeq, FenceSeq)
	case cache > 1:
		return fmt.Errorf("%w: the sequence %s has CACHE %d: each session draws from a block of its own, so a later grant "+
			"can get a smaller token; as its owner run: ALTER SEQUENCE %s CACHE 1", ErrFencing, FenceSeq, cache, FenceSeq)
	}
	usable, err := conn.QueryInt(ctx, "SELECT has_sequence_privilege('"+FenceSeq+"', 'USAGE')::int")
	if SQLState(err) == "42501" {
		return fmt.Errorf("%w: this role may not use the sequence %s: %v", ErrFencing, FenceSeq, err)
	}
	if err != nil {
		return fmt.Errorf("check the fencing sequence: %w", err)
	}
	if usable == 0 {
		return fmt.Errorf("%w: this role may not use the sequence %s; as its owner run: GRANT USAGE ON SEQUENCE %s TO <role>",
			ErrFencing, FenceSeq, FenceSeq)
	}
	// A grant may write a logical-decoding message to flush the WAL that covers its token (see grant). Every role
	// may by default; a hardened server may have revoked it.
	emit, err := conn.QueryInt(ctx, "SELECT COALESCE(bool_or(has_function_privilege(oid, 'EXECUTE')), false)::int "+
		"FROM pg_catalog.pg_proc WHERE proname = 'pg_logical_emit_message' AND pronamespace = 'pg_catalog'::regnamespace "+
		"AND proargtypes[2] = 'text'::regtype")
	if err != nil {
		return fmt.Errorf("check the fencing sequence: %w", err)
	}
	if emit == 0 {
		return fmt.Errorf("%w: this role may not execute pg_logical_emit_message, with which a grant flushes the WAL that "+
			"covers its token; as a superuser run: GRANT EXECUTE ON FUNCTION pg_catalog.pg_logical_emit_message(boolean, "+
			"text, text) TO <role>", ErrFencing)
	}
	return nil
}
