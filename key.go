package advlock

import (
	"crypto/sha256"
	"encoding/binary"
	"fmt"
	"strconv"
	"strings"
	"time"

	"github.com/advlock/advlock/internal/session"
)

// Key names an advisory lock. PostgreSQL has two key spaces that never overlap: one int8 ([Int64Key], and
// [NameKey], which hashes a name into it) and a pair of int4 ([PairKey]). The zero Key is invalid.
//
// A key's text form ([Key.String], [ParseKey], the advlock command's KEY) writes integers as PostgreSQL users do:
// "42" is the lock pg_advisory_lock(42) takes. A name that is a number is therefore written "name:42".
//
// Keys are comparable, but == also compares how a key was made; [Key.Equal] says whether two keys name the same
// server lock.
type Key struct {
	id   session.ID
	kind keyKind
	name string
}

type keyKind uint8

const (
	kindInvalid   keyKind = iota
	kindEmptyName         // NameKey(""): invalid, as the zero Key is, with a message of its own
	kindInt64
	kindPair
	kindName
	kindScheme // a key another tool locks (keys_other.go); name is its ParseKey text
)

// Int64Key is the lock PostgreSQL writes as pg_advisory_lock(n::bigint).
func Int64Key(n int64) Key { return Key{id: session.ID{V: n}, kind: kindInt64} }

// PairKey is the lock PostgreSQL writes as pg_advisory_lock(a::int, b::int). It never conflicts with any Int64Key.
func PairKey(a, b int32) Key {
	return Key{id: session.ID{Pair: true, V: int64(a)<<32 | int64(uint32(b))}, kind: kindPair}
}

// NameKey hashes name into the int8 key space. The hash is stable and documented so that other programs and SQL
// can compute the same lock: the first 8 bytes of SHA-256(name), read as a big-endian two's-complement int64.
// In SQL:
//
//	SELECT ('x' || left(encode(sha256(convert_to('billing-sync', 'UTF8')), 'hex'), 16))::bit(64)::bigint;
//
// NameKey("billing-sync") is Int64Key(6451652757638753977). Two names collide with probability about n²/2⁶⁵
// for n names in use. NameKey("") is no key (an unset name, almost always): every call refuses it with
// ErrInvalidKey, as it does the zero Key.
func NameKey(name string) Key {
	if name == "" {
		return Key{kind: kindEmptyName} // an unset name, almost always: refused by every call (ErrInvalidKey)
	}
	sum := sha256.Sum256([]byte(name))
	return Key{id: session.ID{V: int64(binary.BigEndian.Uint64(sum[:8]))}, kind: kindName, name: name}
}

// TickKey is the key of one run of a scheduled job: NameKey(name + "@" + tick), tick being t rounded to the nearest
// multiple of period (time.Time.Round), in UTC and RFC 3339 with nanoseconds, as in
// "reports@2026-12-03T12:00:00Z". Replicas whose clocks differ by less than half a period name a run by the same
// tick, so with [HoldAtLeast] longer than that difference only one of them runs each tick, and ticks never share a
// key (see docs/locks.md, Scheduled jobs). A period <= 0 gives NameKey(name); an empty name is no key, as
// NameKey("") is.
func TickKey(name string, t time.Time, period time.Duration) Key {
	if name == "" || period <= 0 {
		return NameKey(name)
	}
	return NameKey(name + "@" + t.Round(period).UTC().Format(time.RFC3339Nano))
}

// Int64 returns the int8 key and true, or 0 and false for a PairKey.
func (k Key) Int64() (int64, bool) {
	if k.invalid() || k.id.Pair {
		return 0, false
	}
	return k.id.V, true
}

// Pair returns the two int4 keys and true for a PairKey.
func (k Key) Pair() (a, b int32, ok bool) {
	if !k.id.Pair {
		return 0, 0, false
	}
	return int32(k.id.V >> 32), int32(k.id.V), true
}

// Name returns the name of a NameKey, or "" and false.
func (k Key) Name() (string, bool) { return k.name, k.kind == kindName }

// String renders the key in the syntax [ParseKey] reads: "int:42", "pair:1,2", or the name of a NameKey, prefixed
// "name:" when the name would not read back as itself: an empty name, a name that is an integer ("name:42"), or
// one that starts with a scheme in any letter case ("name:int:5", "name:Pair:x").
func (k Key) String() string {
	switch k.kind {
	case kindInt64:
		return "int:" + strconv.FormatInt(k.id.V, 10)
	case kindPair:
		a, b, _ := k.Pair()
		return "pair:" + strconv.FormatInt(int64(a), 10) + "," + strconv.FormatInt(int64(b), 10)
	case kindName:
		if _, scheme := schemePrefix(k.name); scheme || isInteger(k.name) {
			return "name:" + k.name
		}
		return k.name
	case kindScheme:
		return k.name
	case kindEmptyName:
		return "<invalid key: empty name>"
	}
	return "<invalid key>"
}

// schemes are the prefixes ParseKey reads; they are lower case.
var schemes = []string{"int:", "pair:", "name:", "migrate:", "rails:", "dotnet:", "hashtext:", "hashtextextended:"}

// schemePrefix returns the scheme s starts with, compared without regard to letter case.
func schemePrefix(s string) (string, bool) {
	for _, p := range schemes {
		if len(s) >= len(p) && strings.EqualFold(s[:len(p)], p) {
			return p, true
		}
	}
	return "", false
}

// isInteger reports whether s is a decimal integer with an optional sign ("42", "-7", "+3"), of any size.
func isInteger(s string) bool {
	if s != "" && (s[0] == '+' || s[0] == '-') {
		s = s[1:]
	}
	if s == "" {
		return false
	}
	for i := 0; i < len(s); i++ {
		if s[i] < '0' || s[i] > '9' {
			return false
		}
	}
	return true
}

// ParseKey reads the syntax [Key.String] writes, which is also the advlock command's KEY:
//   - an integer, decimal with an optional sign ("42", "-7", "+3") and within int64, is Int64Key(N), the lock
//     pg_advisory_lock(42) takes; so is "int:N";
//   - "pair:A,B" is PairKey(A, B), the lock pg_advisory_lock(A, B) takes;
//   - "name:S" is NameKey(S), and so is any other non-empty text that is neither an integer nor starts with a
//     scheme: a name that is an integer must be written "name:42" (a bare 42 is Int64Key(42)), and so must a name
//     that starts with a scheme;
//   - the keys of other tools: "migrate:DB[/SCHEMA[/TABLE]]" is [GolangMigrateKey] (schema public and table
//     schema_migrations unless given), "rails:DB" is [RailsMigrationKey], "dotnet:NAME" is [DistributedLockKey]
//     (hashing allowed); "hashtext:NAME" and "hashtextextended:SEED:NAME" need the server ([ResolveKey]).
//
// Schemes are lower case: "Int:42" or "PAIR:1,2" is an error that names the key meant ("did you mean int:42?"),
// not a name. An integer beyond int64 is an error too. Errors match [ErrInvalidKey] and name the bad part.
func ParseKey(s string) (Key, error) {
	if p, ok := schemePrefix(s); ok && s[:len(p)] != p {
		return Key{}, fmt.Errorf("%w %q: schemes are lower case; did you mean %s? (name:%s for a name)", ErrInvalidKey,
			s, p+s[len(p):], s)
	}
	if isInteger(s) {
		n, err := strconv.ParseInt(s, 10, 64)
		if err != nil {
			return Key{}, fmt.Errorf("%w %q: the integer is not within 64 bits (name:%s for a name)", ErrInvalidKey, s, s)
		}
		return Int64Key(n), nil
	}
	if k, ok, err := parseScheme(s); ok {
		return k, err
	}
	switch {
	case strings.HasPrefix(s, "int:"):
		n, err := strconv.ParseInt(s[len("int:"):], 10, 64)
		if err != nil {
			return Key{}, fmt.Errorf("%w %q: %q after int: is not a 64-bit integer", ErrInvalidKey, s, s[len("int:"):])
		}
		return Int64Key(n), nil
	case strings.HasPrefix(s, "pair:"):
		as, bs, ok := strings.Cut(s[len("pair:"):], ",")
		if !ok {
			return Key{}, fmt.Errorf("%w %q: pair: needs two 32-bit integers separated by a comma", ErrInvalidKey, s)
		}
		a, err := strconv.ParseInt(as, 10, 32)
		if err != nil {
			return Key{}, fmt.Errorf("%w %q: first number %q is not a 32-bit integer", ErrInvalidKey, s, as)
		}
		b, err := strconv.ParseInt(bs, 10, 32)
		if err != nil {
			return Key{}, fmt.Errorf("%w %q: second number %q is not a 32-bit integer", ErrInvalidKey, s, bs)
		}
		return PairKey(int32(a), int32(b)), nil
	case s == "name:":
		return Key{}, fmt.Errorf("%w %q: an empty name (a name needs at least one character)", ErrInvalidKey, s)
	case strings.HasPrefix(s, "name:"):
		return NameKey(s[len("name:"):]), nil
	case s == "":
		return Key{}, fmt.Errorf("%w: empty key (use N, name:NAME, int:N or pair:A,B)", ErrInvalidKey)
	}
	return NameKey(s), nil
}

// KeyFromPgLocks decodes the classid, objid and objsubid columns of a pg_locks row whose locktype is 'advisory'.
// objsubid 1 is an int8 key ((classid << 32) | objid); objsubid 2 is a pair (classid, objid). A NameKey comes back
// as the Int64Key of its hash, since a hash cannot be reversed: compare it with NameKey(name) using [Key.Equal]
// (== is false, since the two keep different names).
func KeyFromPgLocks(classid, objid uint32, objsubid int16) (Key, error) {
	switch objsubid {
	case 1:
		return Int64Key(int64(uint64(classid)<<32 | uint64(objid))), nil
	case 2:
		return PairKey(int32(classid), int32(objid)), nil
	}
	return Key{}, fmt.Errorf("%w: pg_locks objsubid %d is not an advisory key (want 1 or 2)", ErrInvalidKey, objsubid)
}

// Equal reports whether k and o name the same server lock (a NameKey equals the Int64Key of its hash).
func (k Key) Equal(o Key) bool { return !k.invalid() && !o.invalid() && k.id == o.id }

func (k Key) invalid() bool { return k.kind == kindInvalid || k.kind == kindEmptyName }

func (k Key) valid() error {
	switch k.kind {
	case kindInvalid:
		return fmt.Errorf("%w: the zero Key; use Int64Key, PairKey or NameKey", ErrInvalidKey)
	case kindEmptyName:
		return fmt.Errorf("%w: NameKey(\"\"): an empty name (a name needs at least one character)", ErrInvalidKey)
	}
	return nil
}
