package advlock

import (
	"errors"
	"strings"
	"testing"
	"time"
)

// Vectors from golang-migrate's own test (database/util_test.go, TestGenerateAdvisoryLockId).
func TestGolangMigrateKey(t *testing.T) {
	for _, tc := range []struct {
		db         string
		additional []string
		want       int64
	}{
		{"database_name", nil, 1764327054},
		{"database_name", []string{"schema_name_1"}, 2453313553},
		{"database_name", []string{"schema_name_2"}, 235207038},
		{"database_name", []string{"schema_name_1", "schema_name_2"}, 3743845847},
	} {
		k := GolangMigrateKey(tc.db, tc.additional...)
		if v, _ := k.Int64(); v != tc.want {
			t.Errorf("GolangMigrateKey(%q, %q) = %d, want %d", tc.db, tc.additional, v, tc.want)
		}
	}
	if s := GolangMigrateKey("app").String(); strings.HasPrefix(s, "migrate:") {
		t.Errorf("the pre-schema key writes %q, which ParseKey reads as another key", s)
	}
	k, err := ParseKey("migrate:app")
	if err != nil || !k.Equal(GolangMigrateKey("app", "public", "schema_migrations")) || k.String() != "migrate:app/public/schema_migrations" {
		t.Errorf("ParseKey(migrate:app) = %v (%s), %v", k, k, err)
	}
	if k, err := ParseKey("migrate:app/tenant"); err != nil || !k.Equal(GolangMigrateKey("app", "tenant", "schema_migrations")) {
		t.Errorf("ParseKey(migrate:app/tenant) = %s, %v", k, err)
	}
	for _, bad := range []string{"migrate:", "migrate:/x", "migrate:a/b/c/d"} {
		if _, err := ParseKey(bad); !errors.Is(err, ErrInvalidKey) {
			t.Errorf("ParseKey(%q) = %v, want ErrInvalidKey", bad, err)
		}
	}
}

// Rails (activerecord/lib/active_record/migration.rb): MIGRATOR_SALT * Zlib.crc32(current_database); its own test
// (test_generate_migrator_advisory_lock_id) checks that formula and that the id fits 63 bits. The vectors are that
// formula computed with zlib (which Ruby's Zlib wraps) for Rails' test database and another name.
func TestRailsMigrationKey(t *testing.T) {
	for db, want := range map[string]int64{"activerecord_unittest": 2582488309082152590, "app_production": 4615154450383096620} {
		if v, _ := RailsMigrationKey(db).Int64(); v != want {
			t.Errorf("RailsMigrationKey(%q) = %d, want %d", db, v, want)
		}
		if k, err := ParseKey("rails:" + db); err != nil || !k.Equal(RailsMigrationKey(db)) || k.String() != "rails:"+db {
			t.Errorf("ParseKey(rails:%s) = %s, %v", db, k, err)
		}
	}
}

// Vectors and properties from DistributedLock's own test (PostgresAdvisoryLockKeyTest.cs).
func TestDistributedLockKey(t *testing.T) {
	k, err := DistributedLockKey(strings.Repeat("漢", 18), true) // TestNameHashing
	if v, ok := k.Int64(); err != nil || !ok || v != -5707277204051710361 {
		t.Errorf("hashed name = %v %v, want Int64 -5707277204051710361", k, err)
	}
	if k, _ := DistributedLockKey(strings.Repeat("\x00", 9), false); !k.Equal(PairKey(0, 0)) { // TestEquality
		t.Errorf("9 NULs = %v, want pair 0,0", k)
	}
	if k, _ := DistributedLockKey("0000000000000001", false); !k.Equal(Int64Key(1)) { // TestInt64Construction
		t.Errorf("16 hex digits = %v, want int 1", k)
	}
	if k, _ := DistributedLockKey("00000003,ffffffff", false); !k.Equal(PairKey(3, -1)) { // TestInt32PairConstruction
		t.Errorf("8,8 hex digits = %v, want pair 3,-1", k)
	}
	for _, bad := range []string{"漢字", strings.Repeat("A", 10)} { // TestArgumentValidation
		if _, err := DistributedLockKey(bad, false); !errors.Is(err, ErrInvalidKey) {
			t.Errorf("DistributedLockKey(%q, false) = %v, want ErrInvalidKey", bad, err)
		}
	}
	e, _ := DistributedLockKey("", false)
	n, _ := DistributedLockKey("\x00", false)
	if e.Equal(n) {
		t.Error(`"" and "\0" gave the same key`)
	}
	// TestAscii: every repeated ASCII character at every length is a distinct pair key; printable ones decode back.
	seen := map[Key]string{}
	for c := 1; c < 128; c++ {
		for n := 1; n <= 9; n++ {
			name := strings.Repeat(string(rune(c)), n)
			k, err := DistributedLockKey(name, false)
			if err != nil {
				t.Fatal(err)
			}
			if _, _, ok := k.Pair(); !ok {
				t.Fatalf("%q is not a pair key", name)
			}
			plain := plainPair(k)
			if other, dup := seen[plain]; dup {
				t.Fatalf("%q and %q share a key", name, other)
			}
			seen[plain] = name
			if got, ok := decodeDotnetASCII(plain); c >= 0x20 && c != 0x7f && (!ok || got != name) {
				t.Fatalf("decode(%q) = %q, %v", name, got, ok)
			}
		}
	}
	k, err = ParseKey("dotnet:billing")
	if known, ok := KnownKey(plainPair(k), "x"); err != nil || k.String() != "dotnet:billing" || !ok || known.String() != "dotnet:billing" {
		t.Errorf("ParseKey(dotnet:billing) = %s, %v; KnownKey says %s, %v", k, err, known, ok)
	}
}

func TestKnownKey(t *testing.T) {
	m, _ := GolangMigrateKey("app", "public", "schema_migrations").Int64()
	r, _ := RailsMigrationKey("app").Int64()
	for k, want := range map[Key]string{Int64Key(m): "migrate:app/public/schema_migrations", Int64Key(r): "rails:app", Int64Key(42): "", PairKey(1, 2): ""} {
		got, ok := KnownKey(k, "app")
		if ok != (want != "") || ok && (got.String() != want || !got.Equal(k)) {
			t.Errorf("KnownKey(%s) = %s, %v, want %q", k, got, ok, want)
		}
	}
	// A name key whose name starts with a scheme reads back as that name.
	for _, name := range []string{"migrate:x", "rails:y", "dotnet:z", "hashtext:w"} {
		k, err := ParseKey(NameKey(name).String())
		if err != nil || !k.Equal(NameKey(name)) {
			t.Errorf("NameKey(%q) wrote %q, read back %v, %v", name, NameKey(name).String(), k, err)
		}
	}
}

// hashtext is the server's: a lock taken in SQL with pg_advisory_lock(hashtext(name)) is the key HashTextKey
// computes, and a TryLock of it finds it held; likewise hashtextextended.
func TestHashTextKeys(t *testing.T) {
	b := setup(t)
	ctx := ctxT(t, 20*time.Second)
	name := "billing-" + time.Now().Format("150405.000000")
	if _, err := b.obs.Exec(ctx, `SELECT pg_advisory_lock(hashtext($1)), pg_advisory_lock(hashtextextended($1, 7))`, name); err != nil {
		t.Fatal(err)
	}
	defer b.obs.Exec(ctx, `SELECT pg_advisory_unlock_all()`)
	k1, err := ResolveKey(ctx, b.pool, "hashtext:"+name)
	if err != nil {
		t.Fatal(err)
	}
	k2, err := ResolveKey(ctx, b.pool, "hashtextextended:7:"+name)
	if err != nil {
		t.Fatal(err)
	}
	if k1.String() != "hashtext:"+name || k2.String() != "hashtextextended:7:"+name {
		t.Errorf("String: %q, %q", k1, k2)
	}
	for _, k := range []Key{k1, k2} {
		if _, err := b.l.TryLock(ctx, k); !errors.Is(err, ErrNotAcquired) {
			t.Errorf("TryLock(%s) of the key SQL holds: %v", k, err)
		}
		if pids := b.holders(t, k); len(pids) != 1 {
			t.Errorf("pg_locks holders of %s: %v", k, pids)
		}
	}
	if _, err := ParseKey("hashtext:" + name); !errors.Is(err, ErrInvalidKey) {
		t.Errorf("ParseKey(hashtext:) = %v, want an error pointing to ResolveKey", err)
	}
	if _, err := ResolveKey(ctx, b.pool, "hashtextextended:x:y"); !errors.Is(err, ErrInvalidKey) {
		t.Errorf("bad seed: %v", err)
	}
}

func plainPair(k Key) Key {
	a, b, _ := k.Pair()
	return PairKey(a, b)
}
