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
const (
	Table     = "public.advlock_lease"
	Timelines = "public.advlock_lease_timeline"
)

// DDL creates the tables where missing.
const DDL = "CREATE TABLE IF NOT EXISTS " + Table + " (space int2 NOT NULL, key int8 NOT NULL, owner text NOT NULL, " +
	"term int8 NOT NULL, expires timestamptz NOT NULL, granted timestamptz NOT NULL DEFAULT clock_timestamp(), " +
	"holder text NOT NULL DEFAULT '', PRIMARY KEY (space, key));\n" +
	"CREATE TABLE IF NOT EXISTS " + Timelines + " (timeline int8 PRIMARY KEY, since timestamptz NOT NULL);\n"

// CreateSQL runs DDL (a create racing another's can fail with 23505, a duplicate key on pg_type, 42710, its row type
// exists, or 42P07: the table exists now).
const CreateSQL = DDL + "SELECT 1"

// ExistsSQL yields 1 when both tables exist.
const ExistsSQL = "SELECT (to_regclass('" + Table + "') IS NOT NULL AND to_regclass('" + Timelines + "') IS NOT NULL)::int"

// timeline is the server's timeline (see session.TokenSQL): 1 until the first promotion of the cluster.
const timeline = "least(('x' || substr(pg_catalog.pg_walfile_name(pg_catalog.pg_current_wal_lsn()), 1, 8))::bit(32)::int8, 32767)"

// durable makes the statement's commit flush its WAL before it answers (a grant, a renewal: a crash must not take
// back what a holder was told), without waiting for a synchronous standby: a promotion is covered otherwise (see
// GrantSQL). It is a term of a sum that adds 0.
const durable = "0 * length(set_config('synchronous_commit', 'local', true))"

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

// Results of GrantSQL.
const (
	resultHeld  = 0  // another lease holds the key, not yet expired
	resultQuiet = -1 // the timeline is younger than one lease length: nothing is granted yet
)

// GrantSQL takes id's lease for owner, for length on the server's clock, when no lease holds it or the one that does
// has expired (a takeover, by a conditional upsert: one statement, no lock held between statements). A key held by a
// live lease is seen first and not tried at all, so that a waiter's tries neither lock the holder's row nor draw a
// token nor write anything (the upsert's own condition decides the race of two grants that both saw none). It yields
// the new term (a fencing token, > 0), resultHeld, or resultQuiet. Every statement is a literal without parameters,
// so that any driver sends it over the simple protocol and any pooler, in any mode, carries it.
//
// A promotion can lose the last grants and renewals (asynchronous replication): a holder may trust a lease that
// the promoted server never heard of, or one whose expiry it knows only from an older renewal. So on a timeline
// after the first, nothing is granted until one lease length after the first grant was asked for on it (recorded
// in Timelines): by then every lease granted or renewed before the promotion has ended on its holder's own clock
// (each trusts its lease for less than one length from sending the statement that granted or renewed it). A row
// whose since is not visible yet (another grant is recording it at this instant) counts as now.
func GrantSQL(id session.ID, owner, holder string, length time.Duration) string {
	l := "interval '" + ms(length) + " milliseconds'"
	return "WITH tl AS (SELECT " + timeline + " AS t), " +
		"ep AS (INSERT INTO " + Timelines + " (timeline, since) SELECT t, clock_timestamp() FROM tl WHERE t > 1 " +
		"ON CONFLICT (timeline) DO NOTHING RETURNING since), " +
		"q AS (SELECT (SELECT t FROM tl) > 1 AND coalesce((SELECT since FROM ep), (SELECT since FROM " + Timelines +
		" WHERE timeline = (SELECT t FROM tl)), clock_timestamp()) > clock_timestamp() - " + l + " AS quiet), " +
		"g AS (INSERT INTO " + Table + " AS l (space, key, owner, term, expires, holder) " +
		"SELECT " + space(id) + ", " + strconv.FormatInt(id.V, 10) + ", " + quote(owner) + ", " + session.TokenSQL +
		", clock_timestamp() + " + l + ", " + quote(holder) + " WHERE NOT (SELECT quiet FROM q) " +
		"AND NOT EXISTS (SELECT 1 FROM " + Table + " WHERE space = " + space(id) + " AND key = " + strconv.FormatInt(id.V, 10) +
		" AND expires >= clock_timestamp()) " +
		"ON CONFLICT (space, key) DO UPDATE SET owner = EXCLUDED.owner, term = EXCLUDED.term, " +
		"expires = EXCLUDED.expires, granted = clock_timestamp(), holder = EXCLUDED.holder " +
		"WHERE l.expires < clock_timestamp() RETURNING term) " +
		"SELECT " + durable + " + CASE WHEN (SELECT quiet FROM q) THEN " + strconv.Itoa(resultQuiet) +
		" ELSE coalesce((SELECT term FROM g), " + strconv.Itoa(resultHeld) + ") END"
}

// RenewSQL extends owner's lease of id, of term, to length from now on the server's clock, if it still holds it and
// it has not expired: 1 when renewed, 0 when not (it expired, or another lease took the key over). Keyed on the
// owner and the term, a holder that lost its lease can never renew another's.
func RenewSQL(id session.ID, owner string, term int64, length time.Duration) string {
	return "WITH r AS (UPDATE " + Table + " SET expires = clock_timestamp() + interval '" + ms(length) + " milliseconds' " +
		"WHERE " + which(id, owner, term) + " AND expires > clock_timestamp() RETURNING 1) " +
		"SELECT " + durable + " + count(*) FROM r"
}

// ReleaseSQL ends owner's lease of id, of term: 1 when it held it (expired or not: nobody took it over), 0 when
// not (another lease took the key over after it expired). It need not be durable: a release a crash takes back
// leaves a row that expires.
func ReleaseSQL(id session.ID, owner string, term int64) string {
	return "WITH d AS (DELETE FROM " + Table + " WHERE " + which(id, owner, term) + " RETURNING 1) SELECT count(*) FROM d"
}

func which(id session.ID, owner string, term int64) string {
	return "space = " + space(id) + " AND key = " + strconv.FormatInt(id.V, 10) + " AND owner = " + quote(owner) +
		" AND term = " + strconv.FormatInt(term, 10)
}

// UndoSQL deletes whatever lease of id owner holds, of any term: for a grant whose outcome is unknown.
func UndoSQL(id session.ID, owner string) string {
	return "WITH d AS (DELETE FROM " + Table + " WHERE space = " + space(id) + " AND key = " + strconv.FormatInt(id.V, 10) +
		" AND owner = " + quote(owner) + " RETURNING 1) SELECT count(*) FROM d"
}
