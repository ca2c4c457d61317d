package advlock

import (
	"context"
	"errors"
	"testing"
	"time"
)

// The documented NameKey hash, checked against vectors and against the same hash computed by PostgreSQL.
func TestNameKeyVectors(t *testing.T) {
	b := setup(t)
	for name, want := range map[string]int64{
		"billing-sync": 6451652757638753977,
		"advlock":      1247212045153279134,
		"日本語":          8606672379249086371,
	} {
		got, ok := NameKey(name).Int64()
		if !ok || got != want {
			t.Errorf("NameKey(%q) = %d, want %d", name, got, want)
		}
		var sql int64
		err := b.obs.QueryRow(context.Background(),
			"SELECT ('x' || left(encode(sha256(convert_to($1, 'UTF8')), 'hex'), 16))::bit(64)::bigint", name).Scan(&sql)
		if err != nil {
			t.Fatal(err)
		}
		if sql != want {
			t.Errorf("SQL hash of %q = %d, want %d", name, sql, want)
		}
	}
}

func TestKeyString(t *testing.T) {
	for _, tc := range []struct {
		k    Key
		want string
	}{
		{Int64Key(42), "int:42"},
		{Int64Key(-1), "int:-1"},
		{PairKey(1, -2), "pair:1,-2"},
		{NameKey("billing-sync"), "billing-sync"},
		{NameKey("int:5"), "name:int:5"},
		{NameKey("42"), "name:42"},
		{NameKey("-7"), "name:-7"},
		{NameKey("99999999999999999999"), "name:99999999999999999999"},
		{NameKey("Int:5"), "name:Int:5"},
		{NameKey("PAIR:1,2"), "name:PAIR:1,2"},
		{NameKey("4 2"), "4 2"},
		{Key{}, "<invalid key>"},
		{NameKey(""), "<invalid key: empty name>"},
	} {
		if got := tc.k.String(); got != tc.want {
			t.Errorf("%#v.String() = %q, want %q", tc.k, got, tc.want)
		}
		if tc.k.invalid() {
			if err := tc.k.valid(); !errors.Is(err, ErrInvalidKey) {
				t.Errorf("%s: valid() = %v, want ErrInvalidKey", tc.want, err)
			}
			continue
		}
		back, err := ParseKey(tc.want)
		if err != nil || back != tc.k {
			t.Errorf("ParseKey(%q) = %#v, %v; want %#v", tc.want, back, err, tc.k)
		}
	}
}

// A bare integer is the int8 key PostgreSQL users mean by it (pg_advisory_lock(42)), not a name.
func TestParseKeyInteger(t *testing.T) {
	for in, want := range map[string]Key{
		"42":                   Int64Key(42),
		"-7":                   Int64Key(-7),
		"+3":                   Int64Key(3),
		"0":                    Int64Key(0),
		"007":                  Int64Key(7),
		"9223372036854775807":  Int64Key(1<<63 - 1),
		"-9223372036854775808": Int64Key(-1 << 63),
		"int:+3":               Int64Key(3),
		"name:42":              NameKey("42"),
		"42a":                  NameKey("42a"),
		"4 2":                  NameKey("4 2"),
		"-":                    NameKey("-"),
		"1.5":                  NameKey("1.5"),
	} {
		got, err := ParseKey(in)
		if err != nil || got != want {
			t.Errorf("ParseKey(%q) = %s (%#v), %v; want %s", in, got, got, err, want)
		}
	}
}

func TestParseKeyErrors(t *testing.T) {
	for in, part := range map[string]string{
		"Int:42":                  "did you mean int:42?",
		"INT:42":                  "did you mean int:42?",
		"PAIR:1,2":                "did you mean pair:1,2?",
		"Name:x":                  "did you mean name:x?",
		"Migrate:app":             "did you mean migrate:app?",
		"RAILS:app":               "did you mean rails:app?",
		"DotNet:x":                "did you mean dotnet:x?",
		"HashText:x":              "did you mean hashtext:x?",
		"hashTextExtended:1:x":    "did you mean hashtextextended:1:x?",
		"9223372036854775808":     "not within 64 bits (name:9223372036854775808 for a name)",
		"-9223372036854775809":    "not within 64 bits",
		"hashtextextended:x":      "needs SEED:NAME",
		"hashtextextended:seed:x": "needs SEED:NAME",
		"hashtextextended:1:x":    "use ResolveKey",
		"":                        "empty key",
		"int:":                    `"" after int:`,
		"int:x1":                  `"x1" after int:`,
		"int:9223372036854775808": "not a 64-bit integer",
		"pair:1":                  "separated by a comma",
		"pair:a,2":                `first number "a"`,
		"pair:1,2147483648":       `second number "2147483648"`,
	} {
		_, err := ParseKey(in)
		if !errors.Is(err, ErrInvalidKey) {
			t.Errorf("ParseKey(%q) = %v, want ErrInvalidKey", in, err)
			continue
		}
		if !contains(err.Error(), part) {
			t.Errorf("ParseKey(%q) error %q does not name %q", in, err, part)
		}
	}
}

func contains(s, sub string) bool {
	return len(sub) == 0 || len(s) >= len(sub) && (s[:len(sub)] == sub || contains(s[1:], sub))
}

func FuzzParseKey(f *testing.F) {
	for _, s := range []string{"int:1", "pair:1,2", "name:x", "billing", "int:-9223372036854775808", "pair:,", "42", "-7",
		"+3", "name:42", "Int:1", "name:PAIR:1"} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, s string) {
		k, err := ParseKey(s)
		if err != nil {
			return
		}
		back, err := ParseKey(k.String())
		if err != nil || back != k {
			t.Fatalf("ParseKey(%q).String() = %q does not read back: %#v, %v", s, k.String(), back, err)
		}
	})
}

// Every kind of key decodes back from the server's pg_locks row.
func TestKeyFromPgLocks(t *testing.T) {
	b := setup(t)
	ctx := ctxT(t, 10e9)
	for _, k := range []Key{Int64Key(-5), Int64Key(1<<40 + 7), Int64Key(-1 << 63), PairKey(-1, 7), PairKey(2147483647, -2147483648), NameKey("decode-" + key(t).String())} {
		lk, err := b.l.TryLock(ctx, k)
		if err != nil {
			t.Fatal(err)
		}
		var cls, obj int64
		var sub int16
		err = b.obs.QueryRow(ctx, `SELECT classid::text::int8, objid::text::int8, objsubid FROM pg_locks
			WHERE locktype = 'advisory' AND granted AND
			((objsubid = 1 AND ((classid::text::int8 << 32) | objid::text::int8) = $1) OR
			 (objsubid = 2 AND classid::text::int8 = $2 AND objid::text::int8 = $3))`,
			k.id.V, int64(uint32(k.id.V>>32)), int64(uint32(k.id.V))).Scan(&cls, &obj, &sub)
		if err != nil {
			t.Fatalf("%s: pg_locks row: %v", k, err)
		}
		got, err := KeyFromPgLocks(uint32(cls), uint32(obj), sub)
		if err != nil || !got.Equal(k) {
			t.Errorf("KeyFromPgLocks(%d,%d,%d) = %s, %v; want %s", cls, obj, sub, got, err, k)
		}
		if err := lk.Unlock(ctx); err != nil {
			t.Fatal(err)
		}
	}
	if _, err := KeyFromPgLocks(1, 2, 3); !errors.Is(err, ErrInvalidKey) {
		t.Errorf("objsubid 3: %v, want ErrInvalidKey", err)
	}
}

func TestKeyFromPgLocksEqualsNameKey(t *testing.T) {
	n := NameKey("billing-sync")
	v, _ := n.Int64()
	k, err := KeyFromPgLocks(uint32(uint64(v)>>32), uint32(v), 1)
	if err != nil {
		t.Fatal(err)
	}
	if !k.Equal(n) {
		t.Errorf("KeyFromPgLocks(...).Equal(NameKey) = false, want true")
	}
	if k == n {
		t.Errorf("== is true; the doc comment says to use Equal because == is false")
	}
}

// TickKey names a run by its nearest tick: replicas whose clocks differ by less than half a period agree, ticks
// differ, and gocron's tick keys are the same keys.
func TestTickKey(t *testing.T) {
	at := time.Date(2026, 12, 3, 12, 0, 0, 0, time.UTC)
	want := NameKey("reports@2026-12-03T12:00:00Z")
	for _, off := range []time.Duration{-29 * time.Second, -time.Millisecond, 0, 250 * time.Millisecond, 29 * time.Second} {
		if got := TickKey("reports", at.Add(off), time.Minute); !got.Equal(want) {
			t.Errorf("clock off by %v: %v, want %v", off, got, want)
		}
	}
	if TickKey("reports", at.Add(31*time.Second), time.Minute).Equal(want) {
		t.Error("the next tick has the same key")
	}
	paris := time.FixedZone("CET", 3600)
	if got := TickKey("reports", at.In(paris), time.Minute); !got.Equal(want) {
		t.Errorf("a clock in another zone: %v, want %v", got, want)
	}
	if got := TickKey("reports", at, 0); !got.Equal(NameKey("reports")) {
		t.Errorf("period 0: %v, want the name's key", got)
	}
	if err := TickKey("", at, time.Minute).valid(); err == nil {
		t.Error("an empty name makes a key")
	}
}
