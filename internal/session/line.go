package session

import (
	"strconv"
	"strings"
)

// A key's line keeps its waits in the order they came, across slices (see DefaultWaitSlice). A slice's end sends a
// wait to the back of the server's own queue for the key; so only one kind of wait ever stands in that queue for
// long: the line's head. Every other wait of advlock waits, sliced, for the member in front of it to leave, on a
// lock that only it (or the readers beside it) waits for, so that its slices cost it no place:
//
//   - A wait that finds its key held joins the key's line (JoinSQL): it takes a ticket, a lock of the key's own
//     space numbered one past the newest ticket held (pg_locks says which), in its own mode (a writer exclusive, a
//     reader shared), and holds it until it is granted or gives up. The numbers go round a ring of 2^20-1 (after
//     the last comes 1): a line that never empties never runs out of them. Of two tickets, the one that is less
//     than half the ring behind the other is in front of it (a line's members, whose numbers span how many waits
//     joined while its oldest waited, are far fewer than half the ring).
//   - A writer waits for the member just in front of it, a reader for the writer nearest in front of it (readers
//     in a row are granted together, as in PostgreSQL's queue): LineSQL waits for that member's ticket, gives it
//     back at once when granted (the member left), and looks again. A wait with no such member in front of it is
//     the head, and waits for the key itself (WaitSQL), as every wait did before lines.
//   - A member leaves with its grant (in the statement after it, with the intent), or as it gives up (SettleSQL),
//     or with its session.
//
// Only the line's head writer takes the key's intent (a writer behind others waits behind them anyway), and a
// head reader has no writer in front of it: so a reader in the line is never held back by a writer that came after
// it. Waits outside advlock (psql, another client) are not in the line: they queue for the key in the server and
// are granted in turn with its head.
//
// Tickets are derived from the key as intents are (a bijection of the key's own space, with a constant of their
// own), with the low lineBits of the result replaced by the ticket's number: a key's tickets are a block of 2^20
// numbers of its own space, which a user's key meets only by chance (2^-44 per pair of keys).
const (
	lineBits = 20
	lineMask = 1<<lineBits - 1
	// LineMask is the bits of a ticket that hold its place: a ticket less them is its key's lineBase.
	LineMask = lineMask
)

// ringHalf is half the ring of tickets' numbers: a ticket less than this far behind another (going round) is in
// front of it.
const ringHalf = lineMask / 2

// Result codes of the line's statements (beside those of sql.go).
const (
	resultAdvanced = -9  // LineSQL: the member waited for left (or a stray hold of a ticket was given back): look again
	resultHead     = -10 // LineSQL: no member in front: wait for the key itself
	resultHeadNow  = -11 // LineSQL: resultHead, and the writer took the key's intent (see Intent)
	resultJoined   = -1000
)

// lineBase is the first number of id's block of tickets: ticket 0, never a place, is the line's door, which a join
// holds for the moment it reads the line and takes its ticket (see JoinSQL).
func (id ID) lineBase() ID {
	d := id.derived(0x6164766c6f636b51) // "advlockQ"
	d.V &^= lineMask
	return d
}

// LineBase is what every ticket of id's line is, less its place (LineMask).
func (id ID) LineBase() ID { return id.lineBase() }

// Ticket is the lock that holds place seq (1 and up) in id's line.
func (id ID) Ticket(seq int64) ID {
	b := id.lineBase()
	b.V |= seq & lineMask
	return b
}

// InLine reports whether x is a ticket of id's line, and its place: 0 for the line's door, which a wait holds or
// waits for as it joins the line.
func (id ID) InLine(x ID) (int64, bool) {
	b := id.lineBase()
	if x.Pair != id.Pair || x.V&^lineMask != b.V {
		return 0, false
	}
	return x.V & lineMask, true
}

// lineRows is an SQL condition on a pg_locks row (alias l): an advisory lock of this database that is a ticket of
// the wait's line numbered from lo to hi.
func lineRows(n nums, lo, hi int64) string {
	return "l.locktype = 'advisory' AND l.database = (SELECT oid FROM pg_catalog.pg_database WHERE datname = current_database())" +
		" AND l.objsubid = " + n.sub() + " AND l.classid = ((" + n.door + " >> 32) & 4294967295)::oid" +
		" AND l.objid BETWEEN (" + n.doorObj() + " + " + strconv.FormatInt(lo, 10) + ")::oid AND (" + n.doorObj() + " + " + strconv.FormatInt(hi, 10) + ")::oid"
}

// places is an SQL subquery over the tickets of the wait's line that are held: each one's place p (1 to
// lineMask), its pid, mode, and d, how far behind seq (an SQL expression) it is going round the ring (0: seq
// itself; less than ringHalf: in front of seq).
func places(n nums, seq string) string {
	m := strconv.Itoa(lineMask)
	return "(SELECT x.p, x.pid, x.mode, (((" + seq + ") - x.p) % " + m + " + " + m + ") % " + m + " AS d FROM (SELECT l.objid::text::int8 - " +
		n.doorObj() + " AS p, l.pid, l.mode FROM pg_catalog.pg_locks l WHERE l.granted AND " + lineRows(n, 1, lineMask) + ") x)"
}

// rowTicketArgs renders the lock of a pg_locks row (alias l) as lock function arguments.
func rowTicketArgs(n nums) string {
	return n.args("((l.classid::text::int8 << 32) | l.objid::text::int8)")
}

// JoinSQL is a wait's statement when its first try did not pass (or, for a wait that publishes its start, its first
// statement): a try of the key (a reader's passes only while no writer's intent stands), and when it fails the wait
// joins the key's line: it takes the ticket one past the newest held (1 when none is), in its own mode. It waits
// only for what other joins hold for a moment (the line's door, its flag). It yields a grant, -1 (standby), -5 (doubt), 0 (other waits took every one of the joinSpan tickets past
// the newest at the same moment: send it again), or resultJoined less 8*seq + 4 (a head writer took the key's intent too) + 2 (the head: no member in
// front of it) + 1 (the session got an idle_session_timeout of idleMS, see intentIdle: a member that stays silent
// holds up every wait behind it).
//
// The newest ticket held is the greatest number, but when the numbers went round the ring (the greatest and the
// least are more than half the ring apart): then it is the greatest of those in the ring's first half.
func JoinSQL(t Target, fenced bool, idleMS int64) string {
	return joinStmt(t, literalNums(t.ID, 0, 0, idleMS), fenced).String()
}

// joinStmt is JoinSQL with the wait's numbers n.
func joinStmt(t Target, n nums, fenced bool) stmt {
	key, ik := n.args(n.key), n.args(n.intent)
	head := "count(*) = 0"
	if t.Shared {
		head = "count(*) FILTER (WHERE x.mode = 'ExclusiveLock') = 0"
	}
	intent := "0"
	if !t.Shared {
		intent = "CASE WHEN j.head THEN CASE WHEN " + lockFn(true, false, ik) + " THEN 4 ELSE 0 END ELSE 0 END"
	}
	half, ring := strconv.Itoa(ringHalf), strconv.Itoa(lineMask)
	newest := "CASE WHEN count(*) = 0 THEN 0 WHEN max(x.p) - min(x.p) > " + half + " THEN max(x.p) FILTER (WHERE x.p <= " + half +
		") ELSE max(x.p) END"
	flag := "" // a writer holds the line's flag while it is in the line; a try that holds it exclusively for a moment is waited for
	if !t.Shared {
		flag = "length(" + lockFn(false, true, n.args(n.flag)) + "::text) + "
	}
	// The ticket one past the newest, or when another wait took it at the same moment (joins that came together),
	// the first free of the next joinSpan: those in between joined in front of it. Only a wait that took the very
	// next one is the head, when the line was empty.
	seq := "(m.newest + g.s - 1) % " + ring + " + 1"
	join := "(SELECT CASE WHEN j.seq IS NULL THEN 0 ELSE " + flag + strconv.Itoa(resultJoined) +
		" - 8 * j.seq - 2 * j.head::int - " + intentIdle(n.idle+"::text") + " - " + intent + " END" +
		" FROM (SELECT " + seq + " AS seq, m.head AND g.s = 1 AS head FROM (SELECT " + newest + " AS newest, " + head + " AS head FROM " +
		places(n, "0") + " x) m LEFT JOIN LATERAL (SELECT s FROM generate_series(1, " + strconv.Itoa(joinSpan) + ") s WHERE " +
		lockFn(true, t.Shared, n.ticket("(m.newest + s - 1) % "+ring+" + 1")) + " LIMIT 1) g ON true) j)"
	// Joins of one key pass its line's door one at a time (a lock of the transaction, held from before the join's
	// read of pg_locks until its statement ends): otherwise a join's read could be stale by the time it takes its
	// ticket (another wait joined at 1, was granted and left while a third joined at 2 and became the head, and
	// place 1, read empty, was a second head in front of it). Joins that come together pass in the order the
	// server queued them for the door.
	join = "(CASE WHEN length(pg_advisory_xact_lock(" + n.args(n.door) + ")::text) = 0 THEN " + join + " END)"
	var b strings.Builder
	b.WriteString("SELECT CASE WHEN pg_is_in_recovery() THEN -1")
	if t.Shared {
		b.WriteString(" WHEN " + lockFn(true, true, key) + " THEN CASE WHEN " + noIntent(ik) + " THEN " + grant(fenced) +
			" WHEN " + unlockFn(true, key) + " THEN " + join + " ELSE -5 END")
	} else {
		wf := n.args(n.flag)
		b.WriteString(" WHEN " + lockFn(true, false, key) + " THEN CASE WHEN " + noWriterWaits(wf) + " THEN " + grant(fenced) +
			" WHEN " + unlockFn(false, key) + " THEN " + join + " ELSE -5 END")
	}
	b.WriteString(" ELSE " + join + " END")
	// The join waits only for what other joins hold for a moment: a role's or a pool's lock_timeout must not end it
	// after the ticket was taken (the wait would be settled without its place).
	return stmt{prefix: "SET LOCAL lock_timeout = 0; ", body: b.String()}
}

// joinSpan is how many tickets past the newest a join tries, in order, in one statement: waits that join together
// take the next ones in turn instead of sending their joins again.
const joinSpan = 16

// joined decodes JoinSQL's result for a wait that joined: its place, whether it is the head, whether it took the
// intent, and whether it set the session's idle_session_timeout.
func joined(r int64) (seq int64, head, intent, idle bool) {
	v := resultJoined - r
	return v >> 3, v&2 != 0, v&4 != 0, v&1 != 0
}

// LineSQL is one slice of a member's wait in its key's line (seq its place): it finds the member in front of it
// (for a writer the nearest, for a reader the nearest writer; nearest going round the ring, see JoinSQL) and waits, under a lock_timeout of ms as WaitSQL
// does, for that member's ticket, in the wait's own mode; granted, it gives the ticket back at once and yields
// resultAdvanced, or when no other member is in front of it now, what it yields with none in front. With no member
// in front it yields resultHead at once, or for a writer that took the key's intent
// with it (it had none: JoinSQL takes it only for a wait that joins as the head; the session's
// idle_session_timeout was set as it joined) resultHeadNow. A ticket granted as a slice ended
// survives the timeout error: the next statement finds the session holding a ticket in front of its own and gives
// it back (resultAdvanced) before it looks again. A wait sends LineWaitSQL, which goes on to wait for the key where
// this yields the head; LineSQL is the line's logic alone, which tests take statement by statement.
func LineSQL(t Target, seq, ms int64) string { return lineSQL(t, seq, ms, false, nil) }

// LineWaitSQL is LineSQL for a member that, once no member is in front of it, goes on to wait for the key itself in
// the same statement, as WaitSQL does (fenced: its grant draws a token; idle: the join gave the session an
// idle_session_timeout, which the grant restores): the head queues for the key the moment the member in front of
// it is granted (and leaves the line), not a round trip later, so that the key passes to it inside the server when
// its holder lets go. The key's wait gets what is left of the statement's lock_timeout of ms (at least 1 ms), so
// the statement runs no longer than a slice. It yields what LineSQL does before the head is found, and then what
// WaitSQL does: a grant (it left the line: leaveCond, or after a slice's end leaveHeldCond), -4 (a reader granted
// past a writer's intent gave the key back, and keeps its place) or -5; resultHead when a head writer could not
// take the key's intent (another session holds it: the wait goes on with WaitSQL). Not granted within ms, it fails
// with 55P03, and the wait does not know whether it was the head by then (or took the intent): its next statement
// is sent with again.
func LineWaitSQL(t Target, seq, ms int64, fenced, idle bool) string {
	return lineSQL(t, seq, ms, false, &lineWait{fenced, idle})
}

// lineWait says that a line statement goes on to wait for the key once its member is the head (LineWaitSQL).
type lineWait struct{ fenced, idle bool }

// keyWait is what a line statement that found its member the head does with lw: wait for the key under what is left
// of the statement's lock_timeout of n.ms, then what a grant does (afterGrant, leaving the line). With lw nil it
// yields head (resultHead or resultHeadNow) instead.
func (lw *lineWait) keyWait(t Target, n nums, again bool, head int) string {
	if lw == nil {
		return strconv.Itoa(head)
	}
	leave := leaveCond(t, n, true, !t.Shared, lw.idle) // a writer took the intent as it found itself the head
	if again {
		leave = leaveHeldCond(n, lw.idle)
	}
	key := n.args(n.key)
	// The server's wall clock, read twice within the statement, may step between: never more than the slice (a step
	// back would lengthen it past the client's bound for its answer), at least 1 ms (0 would mean no timeout).
	left := "least(" + n.ms + ", greatest(1, " + n.ms + " - (extract(epoch FROM clock_timestamp() - statement_timestamp()) * 1000)::int8))"
	return "CASE WHEN set_config('lock_timeout', " + left + "::text, true) IS NULL THEN -5 ELSE length(" + lockFn(false, t.Shared, key) +
		"::text) + " + afterGrant(t.Shared, lw.fenced, key, n.args(n.intent), leave) + " END"
}

// lineSQL is LineSQL; again says that a statement of the wait before it ended at a slice's end (55P03), which may
// have been raised only after that statement found the wait the head and took the intent (a lock_timeout that fired as the
// ticket in front was granted surfaces at the statement's next check for interrupts): then the intent is taken only
// when pg_locks says the session does not hold it already, which a try would take a second time (and the grant's
// leave give back once); and with lw, a session that holds the key already (a grant of the statement before, see
// lineStmt) is granted at once.
func lineSQL(t Target, seq, ms int64, again bool, lw *lineWait) string {
	return lineStmt(t, literalNums(t.ID, seq, ms, 0), ms, again, lw).String()
}

// lineStmt is lineSQL with the wait's numbers n (its slice also ms, which its settings name as a literal).
func lineStmt(t Target, n nums, ms int64, again bool, lw *lineWait) stmt {
	takeIntent := lockFn(true, false, n.args(n.intent))
	if again {
		takeIntent = "CASE WHEN " + ownRow(n, n.intent, false) + " THEN true ELSE " + takeIntent + " END"
	}
	writers := ""
	if t.Shared {
		writers = " AND x.mode = 'ExclusiveLock'"
	}
	inFront := " x.d > 0 AND x.d < " + strconv.Itoa(ringHalf)
	var b strings.Builder
	b.WriteString("SELECT CASE WHEN " + liftTimeout + " THEN -5 WHEN pg_is_in_recovery() THEN -1")
	if again && lw != nil {
		// The statement before may have been granted the key just as its slice ended (the lock survives the
		// error), or granted it, left the line and then failed (a late lock_timeout, a fenced nextval): then the
		// wait is granted now, without waiting in the line (it holds no place in front of which another member
		// would wait for it, or holds one that the member behind waits for).
		b.WriteString(" WHEN " + ownRow(n, n.key, t.Shared) + " THEN " + afterGrant(t.Shared, lw.fenced, n.args(n.key), n.args(n.intent), leaveHeldCond(n, lw.idle)))
	}
	b.WriteString(" WHEN p.mine > 0 THEN CASE WHEN " + straysGiven(n) + " THEN " + strconv.Itoa(resultAdvanced) + " ELSE -5 END")
	if t.Shared {
		b.WriteString(" WHEN p.o IS NULL THEN " + lw.keyWait(t, n, again, resultHead))
	} else { // the head writer takes the intent in the statement that found it the head: no reader's try between
		b.WriteString(" WHEN p.o IS NULL THEN CASE WHEN " + takeIntent + " THEN " +
			lw.keyWait(t, n, again, resultHeadNow) + " ELSE " + strconv.Itoa(resultHead) + " END")
	}
	// Granted the ticket in front, the wait gives it back and looks again at once (pg_locks, read anew): with no
	// member left in front it is the head now (for a writer, with the intent), which saves the round trip of
	// another statement before it queues for the key the member that left holds.
	front := n.ticket("p.o")
	head := lw.keyWait(t, n, again, resultHead)
	if !t.Shared {
		head = "CASE WHEN " + takeIntent + " THEN " + lw.keyWait(t, n, again, resultHeadNow) + " ELSE " + strconv.Itoa(resultHead) + " END"
	}
	stillFront := "EXISTS (SELECT 1 FROM " + places(n, n.seq) + " x WHERE" + inFront + " AND x.pid <> pg_backend_pid()" + writers + ")"
	b.WriteString(" ELSE length(" + lockFn(false, t.Shared, front) + "::text) + CASE WHEN NOT " + unlockFn(t.Shared, front) +
		" THEN -5 WHEN " + stillFront + " THEN " + strconv.Itoa(resultAdvanced) + " ELSE " + head + " END END")
	b.WriteString(" FROM (SELECT (array_agg(x.p ORDER BY x.d) FILTER (WHERE x.pid <> pg_backend_pid()" + writers + "))[1] AS o," +
		" count(*) FILTER (WHERE x.pid = pg_backend_pid()) AS mine FROM " + places(n, n.seq) + " x WHERE" + inFront + ") p")
	return stmt{prefix: "SET LOCAL statement_timeout = 0; SET LOCAL lock_timeout = " + strconv.FormatInt(ms, 10) + "; ", body: b.String()}
}

// straysGiven is true when the session holds no ticket in front of its place n.seq (see LineSQL), having given back
// each one it held: true when every unlock found its lock.
func straysGiven(n nums) string {
	m := strconv.Itoa(lineMask)
	d := "(((" + n.seq + " - (l.objid::text::int8 - " + n.doorObj() + ")) % " + m + " + " + m + ") % " + m + ")"
	return "coalesce((SELECT bool_and(CASE WHEN l.mode = 'ShareLock' THEN " + unlockFn(true, rowTicketArgs(n)) +
		" ELSE " + unlockFn(false, rowTicketArgs(n)) + " END) FROM pg_catalog.pg_locks l WHERE l.pid = pg_backend_pid() AND l.granted AND " +
		lineRows(n, 1, lineMask) + " AND " + d + " > 0 AND " + d + " < " + strconv.Itoa(ringHalf) + "), true)"
}

// leaveHeldCond is leaveCond for a grant in a statement sent after a slice's end (WaitSQL's requeue, and every
// later statement of that wait: serverWait.timedOut): a statement before it may have been granted and left the
// line already, its error raised only after (a lock_timeout
// that fired as the grant was made surfaces at the statement's next check for interrupts; with fencing, nextval
// waits for its sequence under the same lock_timeout), and an unlock there rolls nothing back. So it gives back
// whichever of the line's locks the session holds, as pg_locks says (its tickets, the line's flag, the key's
// intent: each held once), and restores the session's idle_session_timeout (a set_config that the error rolled
// back); true when every unlock found its lock.
func leaveHeldCond(n nums, idle bool) string {
	rows := "(" + lineRows(n, 1, lineMask) + " OR " + n.row(n.flag) + " OR " + n.row(n.intent) + ")"
	// The intent first, the tickets last, as leaveCond does; a volatile output is computed after its query's sort,
	// and the subquery (sorted, OFFSET 0) is not merged into the aggregate's.
	s := "coalesce((SELECT bool_and(u.ok) FROM (SELECT CASE WHEN l.mode = 'ShareLock' THEN " + unlockFn(true, rowTicketArgs(n)) +
		" ELSE " + unlockFn(false, rowTicketArgs(n)) + " END AS ok FROM pg_catalog.pg_locks l WHERE l.pid = pg_backend_pid() AND l.granted AND " +
		rows + " ORDER BY CASE WHEN " + n.row(n.intent) + " THEN 0 WHEN " + n.row(n.flag) + " THEN 1 ELSE 2 END OFFSET 0) u), true)"
	if idle {
		s = "(" + s + " AND set_config('idle_session_timeout', '0', false) IS NOT NULL)"
	}
	return s
}

// ownRow is an SQL condition: the session holds the lock e (an int8 expression of the wait's key space) in the
// mode shared says.
func ownRow(n nums, e string, shared bool) string {
	mode := "ExclusiveLock"
	if shared {
		mode = "ShareLock"
	}
	return "EXISTS (SELECT 1 FROM pg_catalog.pg_locks l WHERE l.pid = pg_backend_pid() AND l.granted AND l.mode = '" + mode + "' AND " + n.row(e) + ")"
}
