package lease

import (
	"strconv"
	"strings"
	"time"

	"github.com/advlock/advlock/internal/session"
)

// The tables leases live in, in schema public like the fencing sequence. A lease is a row: the key it excludes
// (space 1 an int8 key, 2 a pair, as PostgreSQL's two advisory key spaces), who holds it (owner: random per grant),
// its term (a fencing token, drawn as a session lock's is: one sequence, the timeline above it), when it ends on the
// server's clock (expires), when it was granted and a description of the holder for people (holder).
//
// Timelines remembers, for each timeline after the first, when a grant was first asked for on it: the first lease
// length of a timeline grants nothing (see GrantSQL).
//
// Waits holds a row for each waiting Lock and key it waits for (waiter: random per wait), refreshed while it waits
// (seen, at most once a second) and deleted when it is granted or gives up: a key goes to the waiter that has
// waited longest among those seen in the last WaitStale, and a try does not take a key that live waiters wait for.
const (
	Table     = "public.advlock_lease"
	Timelines = "public.advlock_lease_timeline"
	Waits     = "public.advlock_lease_wait"
)

// WaitStale is how long a wait's row counts after it was last seen: a waiter that died (or was cut off) stops
// holding back the key's tries and later waiters that long after its last poll.
const WaitStale = 3 * time.Second

const stale = "interval '3 seconds'" // WaitStale

// The functions that grant, renew and release a lease, beside the tables: each call is one short literal
// statement (any driver, any pooler), and the server plans the statements inside a function once per server
// connection and keeps the plan, where a literal statement of the same work would be planned at every call
// (cd bench && go run . -only lease: 2,141 lease cycles/s with the literal statements, 4,812 with the functions).
//
// Their names carry a version, made anew whenever a body or its arguments change: a database that has the
// functions of an earlier version gets those of this one beside them on first use (CREATE OR REPLACE of the same
// name would leave an older body in place, since first use runs DDL only where something is missing), and the
// processes of the earlier version go on calling theirs while a deploy rolls.
const (
	grantFunc   = "public.advlock_lease_grant_v2"
	renewFunc   = "public.advlock_lease_renew_v1"
	releaseFunc = "public.advlock_lease_release_v1"
)

// ddlKey is a fixed advisory key (an int8 with no meaning elsewhere): see DDL.
const ddlKey = "-4157301190483726771"

// DDL creates the tables and functions where missing. The transaction lock on ddlKey makes two first uses at one
// moment (each runs DDL as one transaction) write the functions one after the other: two CREATE OR REPLACE
// FUNCTION at once can fail with "tuple concurrently updated". It blocks no lease statement, and run outside a
// transaction (psql -f) it is taken and let go at once. Running it again replaces the functions, which only their
// owner may do.
const DDL = "CREATE TABLE IF NOT EXISTS " + Table + " (space int2 NOT NULL, key int8 NOT NULL, owner text NOT NULL, " +
	"term int8 NOT NULL, expires timestamptz NOT NULL, granted timestamptz NOT NULL DEFAULT clock_timestamp(), " +
	"holder text NOT NULL DEFAULT '', PRIMARY KEY (space, key));\n" +
	"CREATE TABLE IF NOT EXISTS " + Timelines + " (timeline int8 PRIMARY KEY, since timestamptz NOT NULL);\n" +
	"CREATE TABLE IF NOT EXISTS " + Waits + " (space int2 NOT NULL, key int8 NOT NULL, waiter text NOT NULL, " +
	"since timestamptz NOT NULL, seen timestamptz NOT NULL, holder text NOT NULL DEFAULT '', PRIMARY KEY (space, key, waiter));\n" +
	"SELECT pg_advisory_xact_lock(" + ddlKey + ");\n" +
	grantDDL + renewDDL + releaseDDL

// grantDDL: see GrantSQL. Its parameters: space, key, owner, holder, the length in milliseconds, and the waiter
// (empty for a try).
//
// The key goes to a try only when no live waiter waits for it, and to a waiter only when no live waiter has waited
// longer (the earliest since, then the least waiter id): the order a server queue would give. A waiter not granted
// enters the queue (its row, since now) or refreshes its row (seen, at most once a second: a poll writes nothing
// in between); granted, its rows are deleted, for every key it waited for.
//
// A promotion can lose the last grants and renewals (asynchronous replication): a holder may trust a lease that
// the promoted server never heard of, or one whose expiry it knows only from an older renewal. So on a timeline
// after the first, nothing is granted until one lease length after the first grant was asked for on it (recorded
// in Timelines): by then every lease granted or renewed before the promotion has ended on its holder's own clock
// (each trusts its lease for less than one length from sending the statement that granted or renewed it). A row
// whose since is not visible yet (another grant is recording it at this instant) counts as now.
//
// The term is drawn once the row is this grant's (its insert, or the update of an expired row, holds the row's
// lock until commit): a term drawn before, in the inserted values, could come out of a grant that waited for
// another grant's insert of the key, which then committed, ran and released, and so be lower than that grant's
// term. So an insert writes 0 and then draws the term in an update of its own row.
//
// A key held by a live lease is seen first and not tried at all, so that a try neither locks the holder's row nor
// draws a token nor writes anything, and a waiter's poll writes only its wait's row, at most once a second (the
// upsert's own condition decides the race of two grants that both saw none).
const grantDDL = "CREATE OR REPLACE FUNCTION " + grantFunc + "(sp int, k int8, own text, hold text, len_ms int8, wt text) " +
	"RETURNS int8 LANGUAGE plpgsql AS $f$\n" +
	"DECLARE\n" +
	"  tl int8 := " + timeline + ";\n" +
	"  began timestamptz;\n" +
	"  mine timestamptz;\n" +
	"  durable text := " + lazy + ";\n" +
	"  t int8;\n" +
	"BEGIN\n" +
	"  IF tl > 1 THEN\n" +
	"    INSERT INTO " + Timelines + " AS x (timeline, since) VALUES (tl, clock_timestamp()) ON CONFLICT (timeline) DO NOTHING " +
	"RETURNING x.since INTO began;\n" +
	"    IF began IS NULL THEN SELECT x.since INTO began FROM " + Timelines + " AS x WHERE x.timeline = tl; END IF;\n" +
	"    IF coalesce(began, clock_timestamp()) > clock_timestamp() - len_ms * interval '1 millisecond' THEN\n" +
	"      RETURN -1;\n" +
	"    END IF;\n" +
	"  END IF;\n" +
	"  IF wt <> '' THEN\n" +
	"    SELECT w.since INTO mine FROM " + Waits + " AS w WHERE w.space = sp AND w.key = k AND w.waiter = wt;\n" +
	"  END IF;\n" +
	"  IF NOT EXISTS (SELECT 1 FROM " + Table + " AS l WHERE l.space = sp AND l.key = k AND l.expires >= clock_timestamp()) " +
	"AND NOT EXISTS (SELECT 1 FROM " + Waits + " AS w WHERE w.space = sp AND w.key = k AND w.waiter <> wt " +
	"AND w.seen > clock_timestamp() - " + stale + " AND (mine IS NULL OR w.since < mine OR w.since = mine AND w.waiter < wt)) THEN\n" +
	"    durable := " + durable + ";\n" +
	"    INSERT INTO " + Table + " AS l (space, key, owner, term, expires, holder) VALUES (sp, k, own, 0" +
	", clock_timestamp() + len_ms * interval '1 millisecond', hold) " +
	"ON CONFLICT (space, key) DO UPDATE SET owner = EXCLUDED.owner, term = " + session.TokenSQL + ", expires = EXCLUDED.expires, " +
	"granted = clock_timestamp(), holder = EXCLUDED.holder WHERE l.expires < clock_timestamp() RETURNING l.term INTO t;\n" +
	"    IF t = 0 THEN\n" +
	"      UPDATE " + Table + " AS l SET term = " + session.TokenSQL + " WHERE l.space = sp AND l.key = k RETURNING l.term INTO t;\n" +
	"    END IF;\n" +
	"    IF t IS NOT NULL THEN\n" +
	"      IF wt <> '' THEN DELETE FROM " + Waits + " AS w WHERE w.waiter = wt; END IF;\n" +
	"      RETURN t;\n" +
	"    END IF;\n" +
	"  END IF;\n" +
	"  IF wt <> '' THEN\n" +
	"    INSERT INTO " + Waits + " AS w (space, key, waiter, since, seen, holder) VALUES (sp, k, wt, clock_timestamp(), " +
	"clock_timestamp(), hold) ON CONFLICT (space, key, waiter) DO UPDATE SET seen = clock_timestamp() " +
	"WHERE w.seen < clock_timestamp() - interval '1 second';\n" +
	"  END IF;\n" +
	"  RETURN 0;\n" +
	"END $f$;\n"

// renewDDL: see RenewSQL. Its parameters: space, key, owner, term, the length in milliseconds.
const renewDDL = "CREATE OR REPLACE FUNCTION " + renewFunc + "(sp int, k int8, own text, tm int8, len_ms int8) " +
	"RETURNS int8 LANGUAGE plpgsql AS $f$\n" +
	"DECLARE\n" +
	"  durable text := " + durable + ";\n" +
	"  n int8;\n" +
	"BEGIN\n" +
	"  UPDATE " + Table + " AS l SET expires = clock_timestamp() + len_ms * interval '1 millisecond' " +
	"WHERE l.space = sp AND l.key = k AND l.owner = own AND l.term = tm AND l.expires > clock_timestamp() RETURNING 1 INTO n;\n" +
	"  RETURN coalesce(n, 0);\n" +
	"END $f$;\n"

// releaseDDL: see ReleaseSQL. Its parameters: space, key, owner, term.
const releaseDDL = "CREATE OR REPLACE FUNCTION " + releaseFunc + "(sp int, k int8, own text, tm int8) " +
	"RETURNS int8 LANGUAGE plpgsql AS $f$\n" +
	"DECLARE\n" +
	"  lazy text := " + lazy + ";\n" +
	"  n int8;\n" +
	"BEGIN\n" +
	"  DELETE FROM " + Table + " AS l WHERE l.space = sp AND l.key = k AND l.owner = own AND l.term = tm RETURNING 1 INTO n;\n" +
	"  RETURN coalesce(n, 0);\n" +
	"END $f$;\n"

// CreateSQL runs DDL (a create racing another's can fail with 23505, a duplicate key on pg_type, 42710, its row type
// exists, or 42P07: the table exists now).
const CreateSQL = DDL + "SELECT 1"

// ExistsSQL yields 1 when the tables and the functions exist.
const ExistsSQL = "SELECT (to_regclass('" + Table + "') IS NOT NULL AND to_regclass('" + Timelines + "') IS NOT NULL " +
	"AND to_regclass('" + Waits + "') IS NOT NULL AND to_regproc('" + grantFunc + "') IS NOT NULL AND to_regproc('" + renewFunc + "') IS NOT NULL " +
	"AND to_regproc('" + releaseFunc + "') IS NOT NULL)::int"

// timeline is the server's timeline (see session.TokenSQL): 1 until the first promotion of the cluster.
const timeline = "least(('x' || substr(pg_catalog.pg_walfile_name(pg_catalog.pg_current_wal_lsn()), 1, 8))::bit(32)::int8, 32767)"

// durable makes the statement's commit flush its WAL before it answers (a grant, a renewal: a crash must not take
// back what a holder was told), without waiting for a synchronous standby: a promotion is covered otherwise (see
// GrantSQL).
const durable = "set_config('synchronous_commit', 'local', true)"

// lazy lets the statement's commit answer before its WAL is flushed: for what a crash may take back without harm
// (a release, whose row then expires; a wait's row, which then goes stale). A grant sets it first and durable once
// it writes the lease.
const lazy = "set_config('synchronous_commit', 'off', true)"

func space(id session.ID) string {
	if id.Pair {
		return "2"
	}
	return "1"
}

func ms(d time.Duration) string { return strconv.FormatInt(d.Milliseconds(), 10) }

// quote renders s as an SQL string literal (only printable ASCII is kept: it is a description).
func quote(s string) string {
	var b strings.Builder
	b.WriteByte('\'')
	for _, r := range s {
		switch {
		case r == '\'':
			b.WriteString("''")
		case r >= ' ' && r <= '~':
			b.WriteRune(r)
		default:
			b.WriteByte('?')
		}
	}
	b.WriteByte('\'')
	return b.String()
}

// Results of GrantSQL (grantDDL writes them as the literals -1 and 0).
const (
	resultHeld  = 0  // another lease holds the key, not yet expired
	resultQuiet = -1 // the timeline is younger than one lease length: nothing is granted yet
)

// GrantSQL takes id's lease for owner, for length on the server's clock, when no lease holds it or the one that does
// has expired (a takeover, by a conditional upsert: one statement, no lock held between statements), and no live
// waiter comes first (waiter: this wait's id, empty for a try; see grantDDL). It yields the
// new term (a fencing token, > 0), resultHeld, or resultQuiet (see grantDDL). Every statement is a literal without
// parameters, so that any driver sends it over the simple protocol and any pooler, in any mode, carries it.
func GrantSQL(id session.ID, owner, holder string, length time.Duration, waiter string) string {
	return "SELECT " + grantFunc + "(" + space(id) + ", " + strconv.FormatInt(id.V, 10) + ", " + quote(owner) + ", " +
		quote(holder) + ", " + ms(length) + ", " + quote(waiter) + ")"
}

// LeaveSQL deletes the rows of a wait that ends without a grant: 1 when it had any.
func LeaveSQL(waiter string) string {
	return "WITH d AS (DELETE FROM " + Waits + " WHERE waiter = " + quote(waiter) + " RETURNING 1) SELECT least(count(*), 1) FROM d"
}

// RenewSQL extends owner's lease of id, of term, to length from now on the server's clock, if it still holds it and
// it has not expired: 1 when renewed, 0 when not (it expired, or another lease took the key over). Keyed on the
// owner and the term, a holder that lost its lease can never renew another's.
func RenewSQL(id session.ID, owner string, term int64, length time.Duration) string {
	return "SELECT " + renewFunc + "(" + space(id) + ", " + strconv.FormatInt(id.V, 10) + ", " + quote(owner) + ", " +
		strconv.FormatInt(term, 10) + ", " + ms(length) + ")"
}

// LingerMark ends the holder of a lease held past its work: its holder unlocked it before its minimum hold had
// passed (see Lease.Confirm). Inspect reads it back.
const LingerMark = " (held past its work)"

// LingerSQL marks owner's lease of id, of term, as held past its work (LingerMark), if it still holds it and it
// has not expired on the server's clock: 1 when marked, 0 when not (it expired, or another lease took the key over).
func LingerSQL(id session.ID, owner string, term int64) string {
	return "WITH m AS (UPDATE " + Table + " SET holder = holder || " + quote(LingerMark) + " WHERE space = " + space(id) +
		" AND key = " + strconv.FormatInt(id.V, 10) + " AND owner = " + quote(owner) + " AND term = " +
		strconv.FormatInt(term, 10) + " AND expires > clock_timestamp() RETURNING 1) SELECT count(*) FROM m"
}

// renewUnkeyedSQL is the renewal of mutant.LeaseRenewUnkeyed: keyed on the key alone.
func renewUnkeyedSQL(id session.ID, length time.Duration) string {
	return "WITH r AS (UPDATE " + Table + " SET expires = clock_timestamp() + interval '" + ms(length) + " milliseconds' " +
		"WHERE space = " + space(id) + " AND key = " + strconv.FormatInt(id.V, 10) + " AND expires > clock_timestamp() " +
		"RETURNING 1) SELECT count(*) FROM r"
}

// ReleaseSQL ends owner's lease of id, of term: 1 when it held it (expired or not: nobody took it over), 0 when
// not (another lease took the key over after it expired). It is not flushed before it answers (lazy): a release a
// crash takes back leaves a row that expires.
func ReleaseSQL(id session.ID, owner string, term int64) string {
	return "SELECT " + releaseFunc + "(" + space(id) + ", " + strconv.FormatInt(id.V, 10) + ", " + quote(owner) + ", " +
		strconv.FormatInt(term, 10) + ")"
}

// UndoSQL deletes whatever lease of id owner holds, of any term: for a grant whose outcome is unknown.
func UndoSQL(id session.ID, owner string) string {
	return "WITH d AS (DELETE FROM " + Table + " WHERE space = " + space(id) + " AND key = " + strconv.FormatInt(id.V, 10) +
		" AND owner = " + quote(owner) + " RETURNING 1) SELECT count(*) FROM d"
}

// ListSQL lists the live leases (not expired on the server's clock), then, with waits, the live waits for them (seen
// within WaitStale), in one statement: granted (false for a wait), space, key, term, holder, granted, expires, the
// milliseconds left until expires on the server's clock (for a wait: 0, its since, its since, 0). Run it only where
// ReadableSQL said yes, for waits too.
func ListSQL(waits bool) string {
	q := "SELECT true, space, key, term, holder, granted, expires, " +
		"(extract(epoch FROM expires - clock_timestamp()) * 1000)::int8 FROM " + Table + " WHERE expires > clock_timestamp()"
	if waits {
		q += " UNION ALL SELECT false, space, key, 0, holder, since, since, 0 FROM " + Waits +
			" WHERE seen > clock_timestamp() - " + stale
	}
	return q + " ORDER BY 1 DESC, 2, 3, 6"
}

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
		strconv.FormatInt(id.V, 10) + " AND term = " + strconv.FormatInt(term, 10) + " RETURNING 1) SELECT count(*) FROM d"
}
