package advlock

import (
	"context"
	"crypto/sha1"
	"fmt"
	"hash/crc32"
	"strconv"
	"strings"
)

// Keys other tools lock, so that a Go program can wait for their lock or share it with them. Each is a plain
// Int64Key or PairKey underneath (Key.Equal matches it against what pg_locks shows); String writes the scheme
// ("migrate:app/public/schema_migrations", "rails:app", "dotnet:name", "hashtext:name") and ParseKey reads it.

// GolangMigrateKey is the lock golang-migrate takes while it migrates: its database.GenerateAdvisoryLockId(
// databaseName, additionalNames...), the CRC-32 (IEEE) of the additional names and then the database name joined
// by NUL bytes, times 1486364155, modulo 2³², as an int8 key. Its postgres driver passes the database name, the
// migrations table's schema (current_schema() unless the URL's x-migrations-table names one) and the table name
// (schema_migrations by default), so a default setup is GolangMigrateKey("app", "public", "schema_migrations")
// (ParseKey: "migrate:app", or "migrate:app/SCHEMA/TABLE"). Versions of golang-migrate before the schema and table
// were added lock GolangMigrateKey("app"), which has no syntax of its own (String writes it as int:N).
func GolangMigrateKey(databaseName string, additionalNames ...string) Key {
	if len(additionalNames) == 0 {
		return Int64Key(int64(crc32.ChecksumIEEE([]byte(databaseName)) * 1486364155))
	}
	s := strings.Join(append(append([]string(nil), additionalNames...), databaseName), "\x00")
	k := Int64Key(int64(crc32.ChecksumIEEE([]byte(s)) * 1486364155))
	k.kind, k.name = kindScheme, "migrate:"+databaseName+"/"+strings.Join(additionalNames, "/")
	return k
}

// RailsMigrationKey is the lock Rails (ActiveRecord::Migrator) takes while it migrates a database: MIGRATOR_SALT
// (2053462845) times Zlib.crc32 of the database's name, as an int8 key (ParseKey: "rails:NAME").
func RailsMigrationKey(database string) Key {
	k := Int64Key(2053462845 * int64(crc32.ChecksumIEEE([]byte(database))))
	k.kind, k.name = kindScheme, "rails:"+database
	return k
}

// DistributedLockKey is the key the .NET DistributedLock library (Medallion.Threading.Postgres,
// PostgresAdvisoryLockKey(name, allowHashing)) locks for a name: a name of up to 9 ASCII characters is encoded
// exactly (7 bits a character, a 0 bit, 1s to fill 64 bits) as a pair of int4; 16 hex digits are an int8 key and
// "8 hex digits,8 hex digits" a pair; any other name is hashed, when allowHashing, into the int8 key of the first 8
// bytes of its SHA-1 read little-endian, and refused otherwise (as the library does). ParseKey: "dotnet:NAME"
// (hashing allowed).
func DistributedLockKey(name string, allowHashing bool) (Key, error) {
	var k Key
	if v, ok := dotnetASCII(name); ok {
		k = PairKey(int32(v>>32), int32(v))
	} else if v, pair, ok := dotnetHex(name); ok {
		k = Int64Key(v)
		if pair {
			k = PairKey(int32(v>>32), int32(v))
		}
	} else if allowHashing {
		sum := sha1.Sum([]byte(name))
		var v uint64
		for i := 7; i >= 0; i-- {
			v = v<<8 | uint64(sum[i])
		}
		k = Int64Key(int64(v))
	} else {
		return Key{}, fmt.Errorf("%w %q: DistributedLock encodes only names of up to 9 ASCII characters, 16 hex digits or 8,8 hex digits without hashing", ErrInvalidKey, name)
	}
	k.kind, k.name = kindScheme, "dotnet:"+name
	return k, nil
}

func dotnetASCII(name string) (uint64, bool) {
	if len(name) > 9 {
		return 0, false
	}
	var v uint64
	for i := 0; i < len(name); i++ {
		if name[i] > 127 {
			return 0, false
		}
		v = v<<7 | uint64(name[i])
	}
	v <<= 1
	for i := len(name); i < 9; i++ {
		v = v<<7 | 127
	}
	return v, true
}

func dotnetHex(name string) (v int64, pair, ok bool) {
	switch {
	case len(name) == 17 && name[8] == ',':
		pair = true
	case len(name) != 16:
		return 0, false, false
	}
	a, err1 := strconv.ParseUint(name[:8], 16, 32)
	b, err2 := strconv.ParseUint(name[len(name)-8:], 16, 32)
	if err1 != nil || err2 != nil || strings.ContainsAny(name, "+-") {
		return 0, false, false
	}
	return int64(a<<32 | b), pair, true
}

// decodeDotnetASCII returns the name a DistributedLock ASCII pair key encodes, if it is one.
func decodeDotnetASCII(k Key) (string, bool) {
	a, b, ok := k.Pair()
	if !ok {
		return "", false
	}
	v := uint64(uint32(a))<<32 | uint64(uint32(b))
	n := 9
	for n > 0 && v&127 == 127 {
		v >>= 7
		n--
	}
	if v&1 != 0 {
		return "", false
	}
	v >>= 1
	buf := make([]byte, n)
	for i := n - 1; i >= 0; i-- {
		buf[i] = byte(v & 127)
		v >>= 7
	}
	if v != 0 {
		return "", false
	}
	for _, c := range buf {
		if c < 0x20 || c == 0x7f { // control characters: a coincidence more likely than a name
			return "", false
		}
	}
	return string(buf), true
}

// HashTextKey asks the server for the key that hand-written lock helpers take with pg_advisory_lock(hashtext(name)):
// PostgreSQL's own (undocumented, version-stable) text hash, an int4 that pg_advisory_lock(bigint) reads as a
// sign-extended int8. It is computed by the server rather than reimplemented. ParseKey cannot make it (it needs
// the server); ResolveKey can ("hashtext:NAME").
func HashTextKey(ctx context.Context, q Querier, name string) (Key, error) {
	var v int64
	if err := queryInt(ctx, q, `SELECT hashtext($1)::bigint`, &v, name); err != nil {
		return Key{}, fmt.Errorf("advlock: hashtext(%q): %w", name, err)
	}
	k := Int64Key(v)
	k.kind, k.name = kindScheme, "hashtext:"+name
	return k, nil
}

// HashTextExtendedKey is HashTextKey for pg_advisory_lock(hashtextextended(name, seed)), an int8 hash
// ("hashtextextended:SEED:NAME" for ResolveKey).
func HashTextExtendedKey(ctx context.Context, q Querier, name string, seed int64) (Key, error) {
	var v int64
	if err := queryInt(ctx, q, `SELECT hashtextextended($1, $2)`, &v, name, seed); err != nil {
		return Key{}, fmt.Errorf("advlock: hashtextextended(%q, %d): %w", name, seed, err)
	}
	k := Int64Key(v)
	k.kind, k.name = kindScheme, "hashtextextended:"+strconv.FormatInt(seed, 10)+":"+name
	return k, nil
}

func queryInt(ctx context.Context, q Querier, sql string, v *int64, args ...any) error {
	rows, err := q.Query(ctx, sql, args...)
	if err != nil {
		return err
	}
	defer rows.Close()
	if !rows.Next() {
		if err := rows.Err(); err != nil {
			return err
		}
		return fmt.Errorf("no row")
	}
	if err := rows.Scan(v); err != nil {
		return err
	}
	rows.Close()
	return rows.Err()
}

// ResolveKey is ParseKey, plus the keys that need the server to compute them: "hashtext:NAME" and
// "hashtextextended:SEED:NAME".
func ResolveKey(ctx context.Context, q Querier, s string) (Key, error) {
	if name, ok := strings.CutPrefix(s, "hashtext:"); ok {
		return HashTextKey(ctx, q, name)
	}
	if strings.HasPrefix(s, "hashtextextended:") {
		name, seed, err := parseHashTextExtended(s)
		if err != nil {
			return Key{}, err
		}
		return HashTextExtendedKey(ctx, q, name, seed)
	}
	return ParseKey(s)
}

// parseHashTextExtended reads "hashtextextended:SEED:NAME".
func parseHashTextExtended(s string) (name string, seed int64, err error) {
	seedText, name, ok := strings.Cut(strings.TrimPrefix(s, "hashtextextended:"), ":")
	seed, err = strconv.ParseInt(seedText, 10, 64)
	if !ok || err != nil {
		return "", 0, fmt.Errorf("%w %q: hashtextextended: needs SEED:NAME (SEED a 64-bit integer)", ErrInvalidKey, s)
	}
	return name, seed, nil
}

// NeedsServer reports whether s is a key that only ResolveKey can make (computed by the server).
func NeedsServer(s string) bool {
	return strings.HasPrefix(s, "hashtext:") || strings.HasPrefix(s, "hashtextextended:")
}

// parseScheme reads the keys of other tools (see ParseKey); ok is false when s names none of them.
func parseScheme(s string) (k Key, ok bool, err error) {
	switch {
	case strings.HasPrefix(s, "migrate:"):
		parts := strings.Split(s[len("migrate:"):], "/")
		if parts[0] == "" || len(parts) > 3 {
			return Key{}, true, fmt.Errorf("%w %q: migrate: needs DATABASE, DATABASE/SCHEMA or DATABASE/SCHEMA/TABLE", ErrInvalidKey, s)
		}
		names := []string{"public", "schema_migrations"}
		copy(names, parts[1:])
		return GolangMigrateKey(parts[0], names...), true, nil
	case strings.HasPrefix(s, "rails:"):
		if s == "rails:" {
			return Key{}, true, fmt.Errorf("%w %q: rails: needs the database name", ErrInvalidKey, s)
		}
		return RailsMigrationKey(s[len("rails:"):]), true, nil
	case strings.HasPrefix(s, "dotnet:"):
		k, err := DistributedLockKey(s[len("dotnet:"):], true)
		return k, true, err
	case NeedsServer(s):
		if strings.HasPrefix(s, "hashtextextended:") {
			if _, _, err := parseHashTextExtended(s); err != nil {
				return Key{}, true, err
			}
		}
		return Key{}, true, fmt.Errorf("%w %q: computed by the server; use ResolveKey (the command does)", ErrInvalidKey, s)
	}
	return Key{}, false, nil
}

// KnownKey returns the key of another tool that k is, for a database named database, when it can tell: the
// golang-migrate (with its default schema and table) and Rails migration locks of that database, and
// DistributedLock's ASCII names. Its String names the scheme.
func KnownKey(k Key, database string) (Key, bool) {
	if name, ok := decodeDotnetASCII(k); ok {
		if dk, err := DistributedLockKey(name, false); err == nil {
			return dk, true
		}
	}
	for _, c := range []Key{GolangMigrateKey(database, "public", "schema_migrations"), RailsMigrationKey(database)} {
		if c.Equal(k) {
			return c, true
		}
	}
	return Key{}, false
}
