package lease

import (
	"strconv"
	"strings"
	"time"

	"github.com/advlock/advlock/internal/session"
)

// The tables leases live in, in schema public like the fencing sequence. A lease is a row: the key it excludes
// (space 1 an int8 key, 2 a pair, as PostgreSQL's two advisory key spaces), who holds it (owner: its Client's id and a random
// part, per grant, with the holder's lease length after a '/'), its term (a fencing token, drawn as a session lock's is: one
// sequence, the timeline above it), its expiry on the server's clock (expires: a later one at every grant and
// renewal of the row, whatever the clock does), when it was granted and a description of the holder for people
// (holder).
//
// Timelines remembered, for each timeline after the first, when a grant was first asked for on it (the quiet period
// after a promotion of earlier versions; this one waits after a promotion as after a crash, see restartCheck). Its
// row of timeline 0 is the longest lease length ever granted, as a time after the Unix epoch (see restartCheck): a
// logged table, which the quiet period after a crash reads once the unlogged Boot has been emptied.
//
// Boot is an unlogged table of one row: when this server, since its last crash (or promotion, or restore), was first
// asked for a grant, and the longest lease length it knows to have been granted (longest, in milliseconds). PostgreSQL empties an unlogged table whenever it starts from anything but a clean shutdown, so
// an empty table says that a crash may have taken back grants and renewals that their holders were told of (they
// commit without waiting for their WAL to be flushed): see restartCheck.
//
// Waits holds a row for each waiting Lock and key it waits for (waiter: its Client's id and a
// random part, per wait), refreshed while it waits
// (seen, at most once a second) and deleted when it is granted or gives up: a key goes to the waiter that has
// waited longest among those seen in the last WaitStale, and a try does not take a key that live waiters wait for.
const (
	Table     = "public.advlock_lease"
	Timelines = "public.advlock_lease_timeline"
	Waits     = "public.advlock_lease_wait"
	Boot      = "public.advlock_lease_restart"
)

// WaitStale is how long a wait's row counts after it was last seen: a waiter that died (or was cut off) stops
// holding back the key's tries and later waiters that long after its last poll.
const WaitStale = 3 * time.Second

// LiveWait is the condition on a wait's row w that it counts: seen within WaitStale on the server's clock, and not
// more than that ahead of it (a row seen before the server's clock stepped back is seen again, now, at its waiter's
// next poll; a dead waiter's row does not hold the queue back for as long as the step).
const LiveWait = "w.seen > clock_timestamp() - interval '3 seconds' AND w.seen < clock_timestamp() + interval '3 seconds'"

// The functions that grant, renew and release a lease, beside the tables: each call is one short literal
// statement (any driver, any pooler), and the server plans the statements inside a function once per server
// connection and keeps the plan, where a literal statement of the same work would be planned at every call
// (cd bench && go run . -only lease: 2,141 lease cycles/s with the literal statements, 4,812 with the functions).
//
// Their names carry a version, made anew whenever a body or its arguments change: a database that has the
// functions of an earlier version gets those of this one beside them on first use, which never replaces a
// function that exists (it may be another role's), and the processes of the earlier version go on calling theirs
// while a deploy rolls. Earlier versions: advlock_lease_grant_v1 and _v2 (a takeover decided by the server's clock)
// and advlock_lease_renew_v1 and _v2 (one lease a call), advlock_lease_grant_v3 and advlock_lease_renew_many_v1
// (each commit flushed its WAL), advlock_lease_grant_v4 (its wait after a crash was the asker's lease length, in a
// table of another shape), advlock_lease_grant_v5 (it failed on a row whose expiry is infinity, see rowExp).
const (
	grantFunc   = "public.advlock_lease_grant_v6"
	renewFunc   = "public.advlock_lease_renew_many_v2"
	releaseFunc = "public.advlock_lease_release_v1"
)

// ddlKey is a fixed advisory key (an int8 with no meaning elsewhere): see DDL.
const ddlKey = "-4157301190483726771"

// tablesDDL creates the tables where missing.
const tablesDDL = "CREATE TABLE IF NOT EXISTS " + Table + " (space int2 NOT NULL, key int8 NOT NULL, owner text NOT NULL, " +
	"term int8 NOT NULL, expires timestamptz NOT NULL, granted timestamptz NOT NULL DEFAULT clock_timestamp(), " +
	"holder text NOT NULL DEFAULT '', PRIMARY KEY (space, key));\n" +
	"CREATE TABLE IF NOT EXISTS " + Timelines + " (timeline int8 PRIMARY KEY, since timestamptz NOT NULL);\n" +
	"CREATE TABLE IF NOT EXISTS " + Waits + " (space int2 NOT NULL, key int8 NOT NULL, waiter text NOT NULL, " +
	"since timestamptz NOT NULL, seen timestamptz NOT NULL, holder text NOT NULL DEFAULT '', PRIMARY KEY (space, key, waiter));\n" +
	bootDDL

// bootDDL creates Boot where missing, with its row saying that no grant was lost before it: no function that
// commits a grant or renewal without flushing it could have run before the table existed (each reads it), and a
// crash cannot take back the table's creation and keep a later grant. Where the table exists (empty after a crash)
// it writes nothing.
// Its commit (the tables' creation's) waits for the flush whatever the session's synchronous_commit says (a server
// or role that sets it off): a crash that took the creation back would let the next run create the table anew, with
// that row, after grants the crash took back too.
const bootDDL = "DO $boot$ BEGIN IF to_regclass('" + Boot + "') IS NULL THEN\n" +
	"  PERFORM set_config('synchronous_commit', 'local', true);\n" +
	"  CREATE UNLOGGED TABLE " + Boot + " (one bool PRIMARY KEY DEFAULT true CHECK (one), since timestamptz NOT NULL, " +
	"longest int8 NOT NULL DEFAULT 0);\n" +
	"  INSERT INTO " + Boot + " (since) VALUES ('-infinity');\n" +
	"END IF; END $boot$;\n"

// DDL creates the tables where missing and the functions, replacing them where they exist (which only their owner
// may do): what a migration runs (advlock.LeaseTableSQL). The transaction lock on ddlKey makes two runs at one
// moment (each runs as one transaction) write the functions one after the other: two CREATE OR REPLACE FUNCTION
// at once can fail with "tuple concurrently updated". It blocks no lease statement, and run outside a transaction
// (psql -f) it is taken and let go at once.
const DDL = tablesDDL + "SELECT pg_advisory_xact_lock(" + ddlKey + ");\n" +
	"CREATE OR REPLACE " + grantDDL + "CREATE OR REPLACE " + renewDDL + "CREATE OR REPLACE " + releaseDDL

// createDDL is what first use runs where something is missing: the tables where missing, and each function only
// where it is missing (never CREATE OR REPLACE: a function of this name that exists may be owned by another role,
// which only that role may replace, and it is the same function).
var createDDL = tablesDDL + "SELECT pg_advisory_xact_lock(" + ddlKey + ");\n" + "DO $do$ BEGIN\n" +
	ifMissing(grantFunc, grantDDL) + ifMissing(renewFunc, renewDDL) + ifMissing(releaseFunc, releaseDDL) + "END $do$;\n"

func ifMissing(name, ddl string) string {
	return "IF to_regproc('" + name + "') IS NULL THEN EXECUTE $ddl$CREATE " + ddl + "$ddl$; END IF;\n"
}

// usNow is the server's clock, in microseconds since the Unix epoch: what every answer carries, so that the client
// knows the server's clock as of its last answer (serverClock). Expiries are read the same way (extract returns
// numeric: exact).
const usNow = "(extract(epoch FROM clock_timestamp()) * 1000000)::int8"

// grantDDL: see GrantSQL. Its parameters: space, key, owner, holder, the length in milliseconds, the waiter (empty
// for a try), the record the caller has seen unchanged for a whole lease length (seen_term and seen_exp, its term
// and expiry in microseconds; 0 for none), and until, the latest moment on the server's clock at which the grant
// may still be made (microseconds since the epoch; 0 for no limit).
//
// Its answer is text, a letter and numbers, the last of them always the server's clock (usNow) as the function
// began: "g TERM" granted; "h TERM EXP LEN LEFT" held: the key's record (its term, its expiry in microseconds, the
// holder's lease length in milliseconds from its owner, 0 when its owner does not say, and the milliseconds left
// until its expiry on the server's clock); "w" not granted: live waiters come first, or another grant took it at
// this instant; "r" the quiet period after a crash or a promotion; "l" too late: the server's clock had passed until; "s" a
// standby.
//
// Which clock decides. A key with a row is held, whatever the row's expiry says on the server's clock: the
// server's clock may step (an NTP step, a resumed VM) and expire every lease at once while each holder still trusts
// its own on its monotonic clock. A caller takes over a row only by naming the record it has seen unchanged for a
// whole lease length on its own monotonic clock (Client.matured): the upsert's condition is that the row is still
// that record. Every grant and renewal of a row makes its expiry later (greatest), so a record does not come back,
// but after a crash that took back the renewals that followed it, within the quiet period (restartCheck).
//
// The key goes to a try only when no live waiter waits for it, and to a waiter only when no live waiter has waited
// longer (the earliest since, then the least waiter id): the order a server queue would give. A waiter not granted
// enters the queue (its row, since now) or refreshes its row (seen, at most once a second: a poll writes nothing
// in between); granted, its rows are deleted, for every key it waited for.
//
// A grant that reaches the server after until grants nothing ("l"): its caller gave up on it at until (a pooler
// stopped and continued, a link that held the request back), and a lease granted then would be held by nobody. The
// check runs as the function begins, again on the row's lock for a takeover, and once more as the grant is about to
// answer, which then fails (SQLSTATE errLateGrant, its writes rolled back) when the function ran past until (its
// waits for row locks are bounded by lock_timeout, 1 s): what remains after until is its commit (Client.retire
// counts on a commit within retireGrace of it).
//
// A grant commits without waiting for its WAL to be flushed (lazy), as a renewal does: a crash may take either
// back, and a promotion may lose them too (asynchronous replication). restartCheck makes both safe: a promoted
// standby's Boot is empty as a crashed server's is. It is the one place a lease relies on a server's clock to
// measure time.
//
// The term is drawn once the row is this grant's (its insert, or the update of a takeover, holds the row's lock
// until commit): a term drawn before, in the inserted values, could come out of a grant that waited for another
// grant's insert of the key, which then committed, ran and released, and so be lower than that grant's term. So an
// insert writes 0 and then draws the term in an update of its own row.
//
// A key held is seen first and not written at all, so that a try neither locks the holder's row nor draws a token
// nor writes anything, and a waiter's poll writes only its wait's row, at most once a second (the upsert's own
// condition decides the race of two grants that both saw none).
const grantDDL = "FUNCTION " + grantFunc + "(sp int, k int8, own text, hold text, len_ms int8, wt text, " +
	"seen_term int8, seen_exp int8, until_us int8) RETURNS text LANGUAGE plpgsql AS $f$\n" +
	"DECLARE\n" +
	"  now_us int8 := " + usNow + ";\n" +
	"  booted timestamptz;\n" +
	"  longest int8;\n" +
	"  mine timestamptz;\n" +
	"  durable text := " + lazy + ";\n" +
	"  bounded text := set_config('lock_timeout', '1000', true);\n" +
	"  r_far bool;\n" +
	"  r_term int8;\n" +
	"  r_exp int8;\n" +
	"  r_len int8;\n" +
	"  r_left int8;\n" +
	"  res text;\n" +
	"  t int8;\n" +
	"BEGIN\n" +
	"  IF pg_catalog.pg_is_in_recovery() THEN RETURN 's ' || now_us; END IF;\n" +
	"  IF until_us > 0 AND now_us > until_us THEN RETURN 'l ' || now_us; END IF;\n" +
	restartCheck +
	"  IF wt <> '' THEN\n" +
	"    SELECT w.since INTO mine FROM " + Waits + " AS w WHERE w.space = sp AND w.key = k AND w.waiter = wt;\n" +
	"  END IF;\n" +
	"  SELECT " + farExp + ", l.term, " + rowExp + ", CASE WHEN " + farExp + " THEN 0 WHEN l.owner ~ '/[0-9]{1,12}$' THEN substring(l.owner FROM '/([0-9]+)$')::int8 ELSE 0 END, " +
	"CASE WHEN " + farExp + " THEN " + maxLeftMS + " ELSE greatest(least(extract(epoch FROM l.expires - clock_timestamp()) * 1000, " +
	maxLeftMS + "), -" + maxLeftMS + ")::int8 END INTO r_far, r_term, r_exp, r_len, r_left FROM " + Table +
	" AS l WHERE l.space = sp AND l.key = k;\n" +
	"  IF " + heldCheck + " THEN\n" +
	"    res := 'h ' || r_term || ' ' || r_exp || ' ' || r_len || ' ' || r_left;\n" +
	"  ELSIF EXISTS (SELECT 1 FROM " + Waits + " AS w WHERE w.space = sp AND w.key = k AND w.waiter <> wt AND " + LiveWait +
	" AND (mine IS NULL OR w.since < mine OR w.since = mine AND w.waiter < wt)) THEN\n" +
	"    res := 'w';\n" +
	"  ELSE\n" +
	"    INSERT INTO " + Table + " AS l (space, key, owner, term, expires, holder) VALUES (sp, k, own, 0" +
	", clock_timestamp() + len_ms * interval '1 millisecond', hold) " +
	"ON CONFLICT (space, key) DO UPDATE SET owner = EXCLUDED.owner, term = " + session.TokenSQL + ", " +
	"expires = greatest(EXCLUDED.expires, l.expires + interval '1 microsecond'), granted = clock_timestamp(), holder = EXCLUDED.holder " +
	"WHERE " + takeoverCheck + " AND (until_us = 0 OR " + usNow + " <= until_us) RETURNING l.term INTO t;\n" +
	"    IF t = 0 THEN\n" +
	"      UPDATE " + Table + " AS l SET term = " + session.TokenSQL + " WHERE l.space = sp AND l.key = k RETURNING l.term INTO t;\n" +
	"    END IF;\n" +
	"    IF t IS NOT NULL THEN\n" +
	"      IF wt <> '' THEN DELETE FROM " + Waits + " AS w WHERE w.waiter = wt; END IF;\n" +
	raiseLongest +
	"      IF until_us > 0 AND " + usNow + " > until_us THEN\n" +
	"        RAISE EXCEPTION 'advlock: the grant ran past the latest moment its caller gave it' USING ERRCODE = '" + errLateGrant + "';\n" +
	"      END IF;\n" +
	"      RETURN 'g ' || t || ' ' || now_us;\n" +
	"    END IF;\n" +
	"    res := 'w';\n" +
	"  END IF;\n" +
	"  IF wt <> '' THEN\n" +
	"    INSERT INTO " + Waits + " AS w (space, key, waiter, since, seen, holder) VALUES (sp, k, wt, clock_timestamp(), " +
	"clock_timestamp(), hold) ON CONFLICT (space, key, waiter) DO UPDATE SET seen = clock_timestamp() " +
	"WHERE w.seen < clock_timestamp() - interval '1 second' OR w.seen > clock_timestamp();\n" +
	"  END IF;\n" +
	"  RETURN res || ' ' || now_us;\n" +
	"END $f$;\n"

// restartCheck is the quiet period after a crash in grantDDL. A grant or renewal commits without waiting for its
// WAL to be flushed, so a crash may take back the last of them (those of the last few hundred milliseconds), and a
// promotion those the standby had not received: a holder may trust a lease that the server never heard of, or
// whose expiry it knows only from an older renewal; and the fencing sequence may hand out again the terms of grants
// it took back. PostgreSQL empties Boot at every start that follows a crash (and on a promoted standby, and in a
// restored backup), so the first grant asked for after one finds it empty. That grant records the moment (later
// ones wait for its row, then read it) and moves the fencing sequence 2^32 past its value, further than any server
// can draw between two flushes of its WAL; its commit waits for the flush (durable), so that nobody sees the row
// before the move is on disk. Then nothing is granted until the longest lease length ever granted has passed ('r'):
// by then every lease granted or renewed before the crash has ended on its holder's own clock, whatever the
// lengths of the Lockers that share the keys. That length is kept in a logged table (Timelines, timeline 0), raised
// by the first grant of a longer length (raiseLongest), whose commit then waits for the flush: a new longest length
// is on disk before any grant of it is told. (It waits for no standby: a promotion that lost a grant of a longer
// length than any before may have lost that length too.) A row ahead of the server's clock (the
// clock stepped back since) is set to now: the wait starts again rather than lasting as long as the step.
const restartCheck = "  SELECT b.since, b.longest INTO booted, longest FROM " + Boot + " AS b;\n" +
	"  IF booted IS NULL THEN\n" +
	"    SELECT (extract(epoch FROM x.since) * 1000)::int8 INTO longest FROM " + Timelines + " AS x WHERE x.timeline = 0;\n" +
	"    INSERT INTO " + Boot + " AS b (since, longest) VALUES (clock_timestamp(), coalesce(longest, 0)) ON CONFLICT DO NOTHING " +
	"RETURNING b.since, b.longest INTO booted, longest;\n" +
	"    IF booted IS NULL THEN\n" +
	"      SELECT b.since, b.longest INTO booted, longest FROM " + Boot + " AS b;\n" +
	"    ELSE\n" +
	termJump +
	"      durable := " + durable + ";\n" +
	"    END IF;\n" +
	"  ELSIF booted > clock_timestamp() THEN\n" +
	"    UPDATE " + Boot + " AS b SET since = clock_timestamp() RETURNING b.since INTO booted;\n" +
	"  END IF;\n" +
	restartQuiet

// raiseLongest records, in a grant of a longer lease length than any before, its length as the longest (see
// restartCheck), and makes the grant's commit wait for the flush.
const raiseLongest = "      IF len_ms > coalesce(longest, 0) THEN\n" +
	"        INSERT INTO " + Timelines + " AS x (timeline, since) VALUES (0, 'epoch'::timestamptz + len_ms * interval '1 millisecond') " +
	"ON CONFLICT (timeline) DO UPDATE SET since = greatest(x.since, EXCLUDED.since);\n" +
	"        UPDATE " + Boot + " AS b SET longest = greatest(b.longest, len_ms);\n" +
	"        durable := " + durable + ";\n" +
	"      END IF;\n"

// termJump moves the fencing sequence past every term a crash may have taken back (see restartCheck).
const termJump = "      PERFORM setval('" + session.FenceSeq + "', nextval('" + session.FenceSeq + "') + " + termJumpBy + ");\n"

// termJumpBy is how far termJump moves the sequence: 2^32, of the 2^48 a token's sequence part has.
const termJumpBy = "4294967296"

// restartQuiet refuses a grant within the longest lease length of the moment recorded in Boot ('r').
const restartQuiet = "  IF coalesce(booted, clock_timestamp()) > clock_timestamp() - greatest(len_ms, longest) * interval '1 millisecond' THEN\n" +
	"    RETURN 'r ' || now_us;\n" +
	"  END IF;\n"

// errLateGrant is the SQLSTATE of a grant that ran past its until (grantDDL): nothing was granted.
const errLateGrant = "AL001"

// heldCheck: the key has a row other than the record the caller has seen unchanged for a lease length, or one whose
// expiry no Locker writes (farExp), which nobody takes over.
const heldCheck = "r_term IS NOT NULL AND (r_term <> seen_term OR r_exp <> seen_exp OR r_far)"

// takeoverCheck: the row found on conflict is the record the caller has seen unchanged for a lease length.
const takeoverCheck = "l.term = seen_term AND " + rowExp + " = seen_exp AND NOT (" + farExp + ")"

// rowExp is a row's expiry in microseconds as grants name it: within listTime's years, so that an expiry no Locker
// writes (infinity, a year past 9999, written by hand) is a number too, where extract's would not fit an int8 (the
// grants of earlier versions failed on it). Expiries a Locker writes are as they are.
const rowExp = "(extract(epoch FROM " + listedExp + ") * 1000000)::int8"

// listedExp is column l.expires within the years every driver reads (see ListSQL); listTime is any column's.
const listedExp = "least(greatest(l.expires, " + firstListed + "), " + lastListed + ")"

// farExp: the row's expiry is one no Locker writes (outside listTime's years). A grant answers such a row as held
// by a holder of unknown length with the longest time left (r_len 0, r_left maxLeftMS), so that no caller's
// sighting of it ever matures into a takeover, and refuses a takeover that names it anyway (heldCheck,
// takeoverCheck): it holds its key until someone deletes it, as the sweep leaves it.
const farExp = "l.expires <> " + listedExp

// renewDDL: see RenewManySQL. Its parameters: for each lease renewed, its space, key, owner, term and until (as for
// a grant: the end of the holder's trust on the server's clock as the holder knows it, 0 for no limit), each an
// array in the same order, and the length in milliseconds. Its answer: a letter for each lease, in order, "1"
// renewed, "0" not (the row is gone or another's), "l" too late, "b" busy (another transaction has the row locked
// at this instant: a grant taking it over, a sweep, a release; try again), then a space and the server's clock.
//
// Rows are locked with SKIP LOCKED, so the statement never waits for a row lock: one statement renewing many rows
// can neither deadlock with another that locks several (a sweep, another of its holder's renewals) nor wait behind
// one. A row locked and then updated by another transaction after the statement's snapshot is not renewed either
// (its update finds no version it can see): "b", and the next try sees what became of it.
const renewDDL = "FUNCTION " + renewFunc + "(sp int2[], k int8[], own text[], tm int8[], until_us int8[], len_ms int8) " +
	"RETURNS text LANGUAGE plpgsql AS $f$\n" +
	"DECLARE\n" +
	"  now_us int8 := " + usNow + ";\n" +
	"  lazy text := " + lazy + ";\n" +
	"  res text;\n" +
	"BEGIN\n" +
	"  WITH a AS (SELECT * FROM unnest(sp, k, own, tm, until_us) WITH ORDINALITY AS a(sp, k, own, tm, until_us, i)),\n" +
	"  c AS (SELECT a.i, l.ctid AS row FROM a JOIN " + Table + " AS l ON l.space = a.sp AND l.key = a.k AND l.owner = a.own " +
	"AND l.term = a.tm WHERE a.until_us = 0 OR now_us <= a.until_us FOR UPDATE OF l SKIP LOCKED),\n" +
	"  u AS (UPDATE " + Table + " AS l SET expires = greatest(clock_timestamp() + len_ms * interval '1 millisecond', " +
	"l.expires + interval '1 microsecond') FROM c WHERE l.ctid = c.row RETURNING c.i)\n" +
	"  SELECT string_agg(CASE WHEN u.i IS NOT NULL THEN '1' WHEN a.until_us > 0 AND now_us > a.until_us THEN 'l' " +
	"WHEN EXISTS (SELECT 1 FROM " + Table + " AS l WHERE l.space = a.sp AND l.key = a.k AND l.owner = a.own AND l.term = a.tm) " +
	"THEN 'b' ELSE '0' END, '' ORDER BY a.i) INTO res FROM a LEFT JOIN u ON u.i = a.i;\n" +
	"  RETURN coalesce(res, '') || ' ' || now_us;\n" +
	"END $f$;\n"

// releaseDDL: see ReleaseSQL. Its parameters: space, key, owner, term.
const releaseDDL = "FUNCTION " + releaseFunc + "(sp int, k int8, own text, tm int8) " +
	"RETURNS int8 LANGUAGE plpgsql AS $f$\n" +
	"DECLARE\n" +
	"  lazy text := " + lazy + ";\n" +
	"  n int8;\n" +
	"BEGIN\n" +
	"  DELETE FROM " + Table + " AS l WHERE l.space = sp AND l.key = k AND l.owner = own AND l.term = tm RETURNING 1 INTO n;\n" +
	"  RETURN coalesce(n, 0);\n" +
	"END $f$;\n"

// CreateSQL runs createDDL (a create racing another's can fail with 23505, a duplicate key on pg_type, 42710, its
// row type exists, 42P07: the table exists now, or 42723: the function exists now).
var CreateSQL = createDDL + "SELECT 1"

// ExistsSQL yields "E R NOW U B": E 1 when the tables and the functions exist, R 1 when the server is in recovery
// (a standby), the server's clock, U 1 when this role may move the fencing sequence (UPDATE on it: the first grant
// after a crash moves it, see restartCheck), B 1 when it may read and write Boot and Timelines (which grants do),
// M 1 when the sequence may grow past its value and 2^32 more (the move; one made by hand AS integer, or with a small
// MAXVALUE, may not), and L 1 when Boot is unlogged (one made logged by hand would never be emptied by a crash).
const ExistsSQL = "SELECT (to_regclass('" + Table + "') IS NOT NULL AND to_regclass('" + Timelines + "') IS NOT NULL " +
	"AND to_regclass('" + Waits + "') IS NOT NULL AND to_regclass('" + Boot + "') IS NOT NULL " +
	"AND to_regproc('" + grantFunc + "') IS NOT NULL AND to_regproc('" + renewFunc + "') IS NOT NULL " +
	"AND to_regproc('" + releaseFunc + "') IS NOT NULL)::int || ' ' || pg_catalog.pg_is_in_recovery()::int || ' ' || " + usNow +
	" || ' ' || coalesce(CASE WHEN to_regclass('" + session.FenceSeq + "') IS NOT NULL THEN has_sequence_privilege('" +
	session.FenceSeq + "', 'UPDATE') END, true)::int" +
	" || ' ' || coalesce(CASE WHEN to_regclass('" + Boot + "') IS NOT NULL THEN has_table_privilege('" + Boot +
	"', 'SELECT, INSERT, UPDATE') AND has_table_privilege('" + Timelines + "', 'SELECT, INSERT, UPDATE') END, true)::int" +
	" || ' ' || coalesce((SELECT s.seqmax >= 4611686018427387904 FROM pg_catalog.pg_sequence AS s WHERE s.seqrelid = to_regclass('" +
	session.FenceSeq + "')), true)::int" +
	" || ' ' || coalesce((SELECT c.relpersistence = 'u' FROM pg_catalog.pg_class AS c WHERE c.oid = to_regclass('" + Boot + "')), true)::int"

// durable makes the statement's commit flush its WAL before it answers (the first grant after a crash, which moves
// the fencing sequence: see restartCheck), without waiting for a synchronous standby: a promotion is covered
// otherwise (see grantDDL).
const durable = "set_config('synchronous_commit', 'local', true)"

// lazy lets the statement's commit answer before its WAL is flushed: for what a crash may take back without harm
// (a release, whose row a taker then takes over; a wait's row, which then goes stale), and for grants and
// renewals, whose loss the quiet period after a crash covers (restartCheck): a WAL flush is most of what a grant
// cost, and the WAL writer flushes what they wrote within a few hundred milliseconds.
const lazy = "set_config('synchronous_commit', 'off', true)"

func space(id session.ID) string {
	if id.Pair {
		return "2"
	}
	return "1"
}

func spaceOf(id session.ID) int {
	if id.Pair {
		return 2
	}
	return 1
}

func ms(d time.Duration) string { return strconv.FormatInt(d.Milliseconds(), 10) }

func i64(v int64) string { return strconv.FormatInt(v, 10) }

// quote renders s as an SQL string literal that reads the same whatever the server's settings: an escape string
// (E'...'), in which a backslash is an escape under standard_conforming_strings on and off alike, with each
// backslash and each quote doubled (never \', which backslash_quote may refuse). Only printable ASCII is kept (it
// is a description, or a hex id), so no client encoding can hide a quote inside a multibyte character.
func quote(s string) string {
	var b strings.Builder
	b.Grow(len(s) + 8)
	quoteTo(&b, s)
	return b.String()
}

// quoteTo writes quote(s) to b.
func quoteTo(b *strings.Builder, s string) {
	b.WriteString("E'")
	for _, r := range s {
		switch {
		case r == '\'':
			b.WriteString("''")
		case r == '\\':
			b.WriteString(`\\`)
		case r >= ' ' && r <= '~':
			b.WriteByte(byte(r))
		default:
			b.WriteByte('?')
		}
	}
	b.WriteByte('\'')
}

// callSQL renders a statement that calls one of the lease functions, "SELECT fn(space, key, args...)", in one
// allocation (each a cycle's statement, built at every grant, renewal and release): begin, then each argument in
// order, then String.
type callSQL struct {
	b   strings.Builder
	num [20]byte
}

// begin starts the call of fn for id; size is what the arguments' strings add, before quoting.
func (c *callSQL) begin(fn string, id session.ID, size int) *callSQL {
	c.b.Grow(len(fn) + 160 + size + size/8)
	c.b.WriteString("SELECT ")
	c.b.WriteString(fn)
	c.b.WriteByte('(')
	c.b.WriteString(space(id))
	c.b.WriteString(", ")
	c.b.Write(strconv.AppendInt(c.num[:0], id.V, 10))
	return c
}

func (c *callSQL) str(s string) *callSQL {
	c.b.WriteString(", ")
	quoteTo(&c.b, s)
	return c
}

func (c *callSQL) int(v int64) *callSQL {
	c.b.WriteString(", ")
	c.b.Write(strconv.AppendInt(c.num[:0], v, 10))
	return c
}

func (c *callSQL) String() string {
	c.b.WriteByte(')')
	return c.b.String()
}

// record is a lease's row as a grant saw it: its term and its expiry in microseconds. A row changes its record at
// every grant and renewal (terms are never drawn twice; each expiry is later than the one before), so a record seen
// twice was the row's throughout.
type record struct{ term, exp int64 }

// GrantSQL takes id's lease for owner, for length on the server's clock, when no row holds the key or the row is
// the record seen (which the caller has seen unchanged for a whole lease length), and no live waiter comes first
// (waiter: this wait's id, empty for a try), unless the server's clock has passed until (microseconds since the
// epoch, 0 for no limit). See grantDDL for its answer. Every statement is a literal without parameters, so that
// any driver sends it over the simple protocol and any pooler, in any mode, carries it.
func GrantSQL(id session.ID, owner, holder string, length time.Duration, waiter string, seen record, until int64) string {
	var c callSQL
	return c.begin(grantFunc, id, len(owner)+len(holder)+len(waiter)).str(owner).str(holder).int(length.Milliseconds()).
		str(waiter).int(seen.term).int(seen.exp).int(until).String()
}

// LeaveSQL deletes the rows of a wait that ends without a grant: 1 when it had any.
func LeaveSQL(waiter string) string {
	return "WITH d AS (DELETE FROM " + Waits + " WHERE waiter = " + quote(waiter) + " RETURNING 1) SELECT least(count(*), 1) FROM d"
}

// Renewal is one lease's part of a renewal statement (RenewManySQL).
type Renewal struct {
	ID    session.ID
	Owner string
	Term  int64
	Until int64 // the latest moment on the server's clock at which it may still renew (microseconds; 0: no limit)
}

// RenewManySQL extends each owner's lease of its id, of its term, to length from now on the server's clock (and past
// its expiry so far), if it still holds it, unless the server's clock has passed its until: see renewDDL. Keyed on
// the owner and the term, a holder that lost its lease can never renew another's. The server's clock does not
// decide whether a lease may be renewed: a row that is still its holder's has not been taken over. One statement
// (one commit) renews them all; its answer has a letter for each, in order.
func RenewManySQL(rs []Renewal, length time.Duration) string {
	size := len(renewFunc) + 64
	for _, r := range rs {
		size += len(r.Owner) + len(r.Owner)/8 + 72
	}
	var b strings.Builder
	b.Grow(size)
	var num [20]byte
	ints := func(f func(Renewal) int64) {
		b.WriteString("'{")
		for i, r := range rs {
			if i > 0 {
				b.WriteByte(',')
			}
			b.Write(strconv.AppendInt(num[:0], f(r), 10))
		}
		b.WriteString("}', ")
	}
	b.WriteString("SELECT ")
	b.WriteString(renewFunc)
	b.WriteByte('(')
	ints(func(r Renewal) int64 { return int64(spaceOf(r.ID)) })
	ints(func(r Renewal) int64 { return r.ID.V })
	b.WriteString("ARRAY[")
	for i, r := range rs {
		if i > 0 {
			b.WriteByte(',')
		}
		quoteTo(&b, r.Owner)
	}
	b.WriteString("]::text[], ")
	ints(func(r Renewal) int64 { return r.Term })
	ints(func(r Renewal) int64 { return r.Until })
	b.Write(strconv.AppendInt(num[:0], length.Milliseconds(), 10))
	b.WriteByte(')')
	return b.String()
}

// RenewSQL is RenewManySQL of one lease.
func RenewSQL(id session.ID, owner string, term int64, length time.Duration, until int64) string {
	return RenewManySQL([]Renewal{{ID: id, Owner: owner, Term: term, Until: until}}, length)
}

// LingerMark ends the holder of a lease held past its work: its holder unlocked it before its minimum hold had
// passed (see Lease.Confirm). Inspect reads it back.
const LingerMark = " (held past its work)"

// LingerSQL marks owner's lease of id, of term, as held past its work (LingerMark), if it still holds it: 1 when
// marked, 0 when not (another lease took the key over, or it was broken). The holder text is not part of the
// record, so a taker's watch of it goes on.
func LingerSQL(id session.ID, owner string, term int64) string {
	return "WITH m AS (UPDATE " + Table + " SET holder = holder || " + quote(LingerMark) + " WHERE space = " + space(id) +
		" AND key = " + i64(id.V) + " AND owner = " + quote(owner) + " AND term = " + i64(term) +
		" RETURNING 1) SELECT count(*) FROM m"
}

// renewUnkeyedSQL is the renewal of mutant.LeaseRenewUnkeyed: keyed on the key alone.
func renewUnkeyedSQL(rs []Renewal, length time.Duration) string {
	var in strings.Builder
	for i, r := range rs {
		if i > 0 {
			in.WriteString(", ")
		}
		in.WriteString("(" + strconv.Itoa(i+1) + ", " + space(r.ID) + ", " + i64(r.ID.V) + ")")
	}
	return "WITH a (i, sp, k) AS (VALUES " + in.String() + "), r AS (UPDATE " + Table + " AS l SET expires = " +
		"greatest(clock_timestamp() + interval '" + ms(length) + " milliseconds', l.expires + interval '1 microsecond') " +
		"FROM a WHERE l.space = a.sp AND l.key = a.k RETURNING a.i) SELECT string_agg(CASE WHEN r.i IS NULL THEN '0' " +
		"ELSE '1' END, '' ORDER BY a.i) || ' ' || " + usNow + " FROM a LEFT JOIN r ON r.i = a.i"
}

// ReleaseSQL ends owner's lease of id, of term: 1 when it held it (nobody took it over), 0 when not. It is not
// flushed before it answers (lazy): a release a crash takes back leaves a row that a taker takes over.
func ReleaseSQL(id session.ID, owner string, term int64) string {
	var c callSQL
	return c.begin(releaseFunc, id, len(owner)).str(owner).int(term).String()
}

// RetireSQL deletes whatever lease of ids owner holds, of any term: for a grant whose outcome is unknown, one given
// back, a release not confirmed, a lease lost. It yields how many it deleted and the server's clock.
func RetireSQL(ids []session.ID, owner string) string {
	var in strings.Builder
	for i, id := range ids {
		if i > 0 {
			in.WriteString(", ")
		}
		in.WriteString("(" + space(id) + ", " + i64(id.V) + ")")
	}
	return "WITH d AS (DELETE FROM " + Table + " WHERE owner = " + quote(owner) + " AND (space, key) IN (" + in.String() +
		") RETURNING 1) SELECT count(*) || ' ' || " + usNow + " FROM d"
}

// ListSQL lists the live leases (not expired on the server's clock), then, with waits, the live waits for them,
// in one statement: granted (false for a wait), space, key, term, holder, granted, expires, the milliseconds left
// until expires on the server's clock (for a wait: 0, its since, its since, 0). Run it only where ReadableSQL said
// yes, for waits too. The server's clock decides nothing here: it is what advlock ls shows.
//
// A time no Locker writes (infinity, -infinity, or a year no driver reads, written by hand) is listed as the nearest
// of 0001-01-02 and 9999-12-30 (UTC: years 1 to 9999 in every time zone, as Go's JSON encoding of a time
// requires), so that one such row does not fail the whole list. A lease whose expiry is such a time holds its key
// until deleted (see farExp; the sweep leaves it alone): it is listed, whatever the sign of its expiry, as held
// until 9999-12-30 with the longest time.Duration left, so that advlock ls shows it and advlock break can delete it.
func ListSQL(waits bool) string {
	q := "SELECT true, space, key, term, holder, " + listTime("granted") + ", CASE WHEN " + far("expires") + " THEN " +
		lastListed + " ELSE expires END, CASE WHEN " + far("expires") + " THEN " + maxLeftMS +
		" ELSE least(extract(epoch FROM expires - clock_timestamp()) * 1000, " + maxLeftMS + ")::int8 END FROM " +
		Table + " WHERE expires > clock_timestamp() OR " + far("expires")
	if waits {
		q += " UNION ALL SELECT false, space, key, 0, holder, " + listTime("since") + ", " + listTime("since") + ", 0 FROM " +
			Waits + " AS w WHERE " + LiveWait
	}
	return q + " ORDER BY 1 DESC, 2, 3, 6"
}

// far is farExp for column c.
func far(c string) string { return strings.ReplaceAll(farExp, "l.expires", c) }

// listTime is listedExp for column c.
func listTime(c string) string { return strings.ReplaceAll(listedExp, "l.expires", c) }

// The first and last times listed (see ListSQL).
const (
	firstListed = "'0001-01-02 00:00:00+00'::timestamptz"
	lastListed  = "'9999-12-30 00:00:00+00'::timestamptz"
)

// maxLeftMS is the longest time.Duration in whole milliseconds.
const maxLeftMS = "9223372036854"

// ReadableSQL yields whether the lease table, and the table of waits, exist and the current role may read them (no
// error either way, even for a role that may not use schema public: a read inside the caller's transaction must
// not abort it).
var ReadableSQL = "SELECT " + readable("advlock_lease") + ", " + readable("advlock_lease_wait")

func readable(table string) string {
	return "coalesce((SELECT has_schema_privilege(n.oid, 'USAGE') AND has_table_privilege(c.oid, 'SELECT') " +
		"FROM pg_catalog.pg_class c JOIN pg_catalog.pg_namespace n ON n.oid = c.relnamespace " +
		"WHERE n.nspname = 'public' AND c.relname = '" + table + "'), false)"
}

// BreakSQL deletes id's lease if its term is term (whoever holds it): 1 when deleted, 0 when that lease was gone
// (released, or taken over by a newer term). Its holder learns at its next renewal.
func BreakSQL(id session.ID, term int64) string {
	return "WITH d AS (DELETE FROM " + Table + " WHERE space = " + space(id) + " AND key = " +
		i64(id.V) + " AND term = " + i64(term) + " RETURNING 1) SELECT count(*) FROM d"
}
