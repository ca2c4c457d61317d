package lease

import (
	"context"
	"os"
	"testing"
	"time"

	"github.com/advlock/advlock/internal/session"
	"github.com/advlock/advlock/internal/testkit/pgtest"
	"github.com/jackc/pgx/v5"
)

func TestMain(m *testing.M) { os.Exit(pgtest.Main(m)) }

func one(t *testing.T, c *pgx.Conn, sql string) int64 {
	t.Helper()
	var r int64
	if err := c.QueryRow(context.Background(), sql).Scan(&r); err != nil {
		t.Fatalf("%v\n%s", err, sql)
	}
	return r
}

// The statements at the moments they race, on a real server: a grant takes a free key and refuses a held one; a
// renewal, a release and a grant's undo are keyed on the owner and the term, so a holder whose lease expired and
// was taken over can neither renew nor release the new holder's (a renewal racing expiry fails even with nobody
// waiting); the takeover's term is greater; an expired lease is taken over, a live one never.
func TestStatements(t *testing.T) {
	url := pgtest.FreshDB(t, pgtest.URL(t))
	c := pgtest.Conn(t, url)
	ctx := context.Background()
	if _, err := c.Exec(ctx, "CREATE SEQUENCE "+session.FenceSeq+"; "+CreateSQL); err != nil {
		t.Fatal(err)
	}
	for _, id := range []session.ID{{V: 42}, {Pair: true, V: 7<<32 | 9}} {
		length := 300 * time.Millisecond
		a := one(t, c, GrantSQL(id, "owner-a", "a", length))
		if a <= 0 {
			t.Fatalf("grant of a free key: %d", a)
		}
		if r := one(t, c, GrantSQL(id, "owner-b", "b", length)); r != resultHeld {
			t.Fatalf("grant of a held key: %d, want %d", r, resultHeld)
		}
		if r := one(t, c, RenewSQL(id, "owner-a", a, length)); r != 1 {
			t.Fatalf("renewal by the holder: %d", r)
		}
		if r := one(t, c, RenewSQL(id, "owner-b", a, length)); r != 0 {
			t.Errorf("renewal by another owner: %d", r)
		}
		if r := one(t, c, RenewSQL(id, "owner-a", a+1, length)); r != 0 {
			t.Errorf("renewal of another term: %d", r)
		}
		time.Sleep(length + 50*time.Millisecond)
		if r := one(t, c, RenewSQL(id, "owner-a", a, length)); r != 0 {
			t.Errorf("renewal of an expired lease (nobody took it over): %d", r)
		}
		b := one(t, c, GrantSQL(id, "owner-b", "b", length))
		if b <= a {
			t.Fatalf("takeover of an expired lease: %d, want a term greater than %d", b, a)
		}
		for what, sql := range map[string]string{
			"renewal": RenewSQL(id, "owner-a", a, length), "release": ReleaseSQL(id, "owner-a", a), "undo": UndoSQL(id, "owner-a"),
		} {
			if r := one(t, c, sql); r != 0 {
				t.Errorf("%s by the holder whose lease was taken over: %d", what, r)
			}
		}
		if r := one(t, c, RenewSQL(id, "owner-b", b, length)); r != 1 {
			t.Errorf("the new holder's renewal after the old holder's tries: %d", r)
		}
		if r := one(t, c, ReleaseSQL(id, "owner-b", b)); r != 1 {
			t.Errorf("release by the holder: %d", r)
		}
		if r := one(t, c, ReleaseSQL(id, "owner-b", b)); r != 0 {
			t.Errorf("second release: %d", r)
		}
	}
	// The two key spaces never overlap: int8 key 7<<32|9 is not the pair (7, 9).
	if r := one(t, c, GrantSQL(session.ID{V: 7<<32 | 9}, "x", "x", time.Second)); r <= 0 {
		t.Errorf("int8 key beside a pair of the same bits: %d", r)
	}
	if r := one(t, c, GrantSQL(session.ID{Pair: true, V: 7<<32 | 9}, "y", "y", time.Second)); r <= 0 {
		t.Errorf("pair beside an int8 key of the same bits: %d", r)
	}
}
