package session

import (
	"crypto/sha256"
	"encoding/hex"
	"strconv"
	"strings"
)

// nums is how a wait's statement names the numbers of its wait, each an int8 SQL expression: literals, for a
// statement sent as it is, or the parameters of a statement prepared once per session (see stmt.prepared), whose
// text is then the same for every key and every wait of its kind, so that the server parses and plans it once.
type nums struct {
	pair bool
	// key, its intent, its line's flag and its line's door (ticket 0: a ticket is the door plus its place), each as
	// one int8 (a pair packed as ID.V is).
	key, intent, flag, door string
	seq, ms, idle           string // the wait's place in its line, its slice in ms, the idle_session_timeout a join sets (ms)
}

// numParams is nums as a prepared statement's parameters: numValues are their values, in that order.
var numParams = nums{key: "$1", intent: "$2", flag: "$3", door: "$4", seq: "$5", ms: "$6", idle: "$7"}

// numValues are the values of numParams for the wait of id at place seq, with slice ms and idle_session_timeout
// idleMS.
func numValues(id ID, seq, ms, idleMS int64) []int64 {
	return []int64{id.V, id.Intent().V, id.Waiting().V, id.lineBase().V, seq, ms, idleMS}
}

// literalNums is nums as literals, for the wait of id at place seq, with slice ms and idle_session_timeout idleMS.
// The base of a literal is parenthesized before its cast: -9223372036854775808::int8 would cast the positive
// number first, which overflows.
func literalNums(id ID, seq, ms, idleMS int64) nums {
	v := numValues(id, seq, ms, idleMS)
	s := make([]string, len(v))
	for i, x := range v {
		s[i] = "(" + strconv.FormatInt(x, 10) + ")::int8"
	}
	return nums{pair: id.Pair, key: s[0], intent: s[1], flag: s[2], door: s[3], seq: s[4], ms: s[5], idle: s[6]}
}

// params is numParams for a key of id's space.
func params(id ID) nums {
	n := numParams
	n.pair = id.Pair
	return n
}

// args renders an int8 expression as the arguments of an advisory-lock function of the wait's key space.
func (n nums) args(e string) string { return derivedArgs(n.pair, e) }

// ticket renders the ticket numbered by the SQL expression seq as lock function arguments.
func (n nums) ticket(seq string) string { return n.args("(" + n.door + " + " + seq + ")") }

// sub is pg_locks.objsubid of the wait's key space.
func (n nums) sub() string {
	if n.pair {
		return "2"
	}
	return "1"
}

// row is an SQL condition on a pg_locks row (alias l): the advisory lock e (an int8 expression) of the wait's key
// space, in this database.
func (n nums) row(e string) string {
	return "(l.locktype = 'advisory' AND l.objsubid = " + n.sub() + " AND l.classid = ((" + e + " >> 32) & 4294967295)::oid" +
		" AND l.objid = (" + e + " & 4294967295)::oid AND l.database = (SELECT oid FROM pg_catalog.pg_database WHERE datname = current_database()))"
}

// doorObj is the door's pg_locks.objid as an int8 expression (a line's tickets share its classid, their objid is
// its plus their place).
func (n nums) doorObj() string { return "(" + n.door + " & 4294967295)" }

// stmt is a wait's statement: the settings of its transaction, and the statement itself (a SELECT).
type stmt struct{ prefix, body string }

func (s stmt) String() string { return s.prefix + s.body }

// prepared returns the query that runs s, whose body names its numbers as numParams, as a statement prepared on
// the session (with the parameters' values vals), the statement that prepares it (sent in front of run, in the same
// query, on a session that has not prepared it yet), and its name: its text's hash, so that two texts never share
// one, and a session that prepared it earlier (a connection back from its pool, a server connection PgBouncer hands
// on) prepared this very text. Its plan is generic (planned once, with the parameters unknown): the parameters
// change only which rows of pg_locks match.
func (s stmt) prepared(vals []int64) (run, prepare, name string) {
	h := sha256.Sum256([]byte(s.body))
	name = "advlock_" + hex.EncodeToString(h[:8])
	var b strings.Builder
	b.WriteString(s.prefix + "SET LOCAL plan_cache_mode = force_generic_plan; EXECUTE " + name + "(")
	for i, v := range vals {
		if i > 0 {
			b.WriteString(", ")
		}
		b.WriteString(strconv.FormatInt(v, 10))
	}
	b.WriteString(")")
	types := strings.TrimSuffix(strings.Repeat("int8, ", len(vals)), ", ")
	return b.String(), "PREPARE " + name + "(" + types + ") AS " + s.body, name
}
