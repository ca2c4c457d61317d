package session

import (
	"context"
	"fmt"
	"strconv"
	"testing"
	"time"

	"github.com/advlock/advlock/internal/testkit/pgtest"
	"github.com/jackc/pgx/v5"
)

// lineConns gives a test connections of its own to the server and a reader of a statement's last answer (the
// simple protocol: LineSQL's texts hold several statements).
func lineConns(t *testing.T, ctx context.Context) (conn func() *pgx.Conn, q func(*pgx.Conn, string) (int64, error)) {
	return lineConnsTo(t, ctx, pgtest.URL(t))
}

// lineConnsTo is lineConns to the database at url.
func lineConnsTo(t *testing.T, ctx context.Context, url string) (conn func() *pgx.Conn, q func(*pgx.Conn, string) (int64, error)) {
	conn = func() *pgx.Conn {
		c, err := pgx.Connect(ctx, url)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { c.Close(context.Background()) })
		return c
	}
	q = func(c *pgx.Conn, sql string) (int64, error) {
		res, err := c.PgConn().Exec(ctx, sql).ReadAll()
		if err != nil {
			return 0, err
		}
		last := res[len(res)-1]
		if len(last.Rows) != 1 {
			return 0, fmt.Errorf("%d rows", len(last.Rows))
		}
		return strconv.ParseInt(string(last.Rows[0][0]), 10, 64)
	}
	return conn, q
}

// mustQ is q failing the test on an error.
func mustQ(t *testing.T, q func(*pgx.Conn, string) (int64, error)) func(*pgx.Conn, string) int64 {
	return func(c *pgx.Conn, sql string) int64 {
		t.Helper()
		v, err := q(c, sql)
		if err != nil {
			t.Fatal(err)
		}
		return v
	}
}

// advisoryHeld lists the advisory locks x's session holds or waits for, as "mode number", read through obs.
func advisoryHeld(t *testing.T, ctx context.Context, obs, x *pgx.Conn) []string {
	t.Helper()
	rows, err := obs.Query(ctx, "SELECT mode || ' ' || ((classid::int8 << 32) | objid::int8) FROM pg_locks WHERE locktype = 'advisory' AND pid = $1 ORDER BY 1",
		x.PgConn().PID())
	if err != nil {
		t.Fatal(err)
	}
	s, err := pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil {
		t.Fatal(err)
	}
	return s
}

// holdsOnly fails the test unless x's session holds k in mode (ExclusiveLock, ShareLock) and no other advisory
// lock, as read through obs.
func holdsOnly(t *testing.T, ctx context.Context, obs, x *pgx.Conn, mode string, k ID) {
	t.Helper()
	if got, want := advisoryHeld(t, ctx, obs, x), mode+" "+strconv.FormatInt(k.V, 10); len(got) != 1 || got[0] != want {
		t.Fatalf("pid %d holds %q, want only [%s]", x.PgConn().PID(), got, want)
	}
}

// grantedAlone fails the test unless the statement of x that answers on got was granted, and x's session then
// holds k alone in mode, with its idle_session_timeout restored.
func grantedAlone(t *testing.T, ctx context.Context, obs, x *pgx.Conn, got <-chan int64, mode string, k ID) {
	t.Helper()
	if v := <-got; v != resultAcquired {
		t.Fatalf("pid %d's wait: %d, want a grant", x.PgConn().PID(), v)
	}
	holdsOnly(t, ctx, obs, x, mode, k)
	idleRestored(t, ctx, x)
}

// passes has from let go of every advisory lock it holds (k among them) once to waits for k, and fails the test
// unless to's statement, which answers on got, is then granted, to holding k alone in mode.
func passes(t *testing.T, ctx context.Context, obs *pgx.Conn, must func(*pgx.Conn, string) int64, from, to *pgx.Conn, got <-chan int64, mode string, k ID) {
	t.Helper()
	awaitKeyWait(t, ctx, obs, to, k)
	must(from, "SELECT length(pg_advisory_unlock_all()::text) + 1")
	grantedAlone(t, ctx, obs, to, got, mode, k)
}

// idleRestored fails the test unless x's session has an idle_session_timeout of 0, as before its wait.
func idleRestored(t *testing.T, ctx context.Context, x *pgx.Conn) {
	t.Helper()
	var setting string
	if err := x.QueryRow(ctx, "SHOW idle_session_timeout").Scan(&setting); err != nil || setting != "0" {
		t.Fatalf("idle_session_timeout: %q %v, want 0 (restored)", setting, err)
	}
}

// awaitDoor waits until n sessions hold (granted) or wait for the door of k's line (pg_locks), and fails the test
// after 5 s.
func awaitDoor(t *testing.T, ctx context.Context, obs *pgx.Conn, k ID, granted bool, n int) {
	t.Helper()
	d := k.lineBase()
	sub, c, o := 1, uint64(d.V)>>32, uint64(uint32(d.V))
	if k.Pair {
		sub = 2
	}
	for deadline := time.Now().Add(5 * time.Second); ; time.Sleep(10 * time.Millisecond) {
		var got int
		if err := obs.QueryRow(ctx, "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND granted = $4 AND objsubid = $1 AND classid = $2::int8::oid AND objid = $3::int8::oid",
			sub, int64(c), int64(o), granted).Scan(&got); err != nil {
			t.Fatal(err)
		}
		if got == n {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("%d sessions hold (%v) the door of the line, want %d", got, granted, n)
		}
	}
}

// awaitKeyWait waits until x's session waits for k itself (pg_locks, through obs), and fails the test after 5 s.
func awaitKeyWait(t *testing.T, ctx context.Context, obs, x *pgx.Conn, k ID) {
	t.Helper()
	for deadline := time.Now().Add(5 * time.Second); ; time.Sleep(5 * time.Millisecond) {
		var n int
		if err := obs.QueryRow(ctx, "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND NOT granted AND pid = $1 AND objsubid = $3 AND ((classid::int8 << 32) | objid::int8) = $2",
			x.PgConn().PID(), k.V, map[bool]int{false: 1, true: 2}[k.Pair]).Scan(&n); err != nil {
			t.Fatal(err)
		}
		if n == 1 {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("pid %d does not wait for the key", x.PgConn().PID())
		}
	}
}
