package pgtest

import (
	"context"
	"errors"
	"net/url"
	"os"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
)

func TestMain(m *testing.M) { os.Exit(Main(m)) }

// A statement cut short by its ctx: pgconn closes the connection and sends a cancel request, which ends the
// server's statement at once; DropCancels, for an address that takes none, keeps it from being sent, and the
// server's statement runs on (the server does not notice a closed client while it sleeps).
func TestDropCancels(t *testing.T) {
	srv := URL(t)
	u, err := url.Parse(srv)
	if err != nil {
		t.Fatal(err)
	}
	obs := Conn(t, srv)
	for _, drop := range []bool{false, true} {
		t.Run(map[bool]string{false: "kept", true: "dropped"}[drop], func(t *testing.T) {
			if drop {
				noCancelAddrs.Store(u.Host, true)
				defer noCancelAddrs.Delete(u.Host)
			}
			cfg, err := pgx.ParseConfig(srv)
			if err != nil {
				t.Fatal(err)
			}
			DropCancels(&cfg.Config)
			c, err := pgx.ConnectConfig(context.Background(), cfg)
			if err != nil {
				t.Fatal(err)
			}
			pid := c.PgConn().PID()
			before := droppedCancels.Load()
			defer obs.Exec(context.Background(), "SELECT pg_terminate_backend($1::int4)", int64(pid))
			ctx, cancel := context.WithTimeout(context.Background(), 300*time.Millisecond)
			defer cancel()
			if _, err := c.Exec(ctx, "SELECT pg_sleep(60)"); !errors.Is(err, context.DeadlineExceeded) && !c.IsClosed() {
				t.Fatalf("pg_sleep(60) with a 300 ms ctx: %v", err)
			}
			sleeping := func() bool {
				var n int
				if err := obs.QueryRow(context.Background(), "SELECT count(*) FROM pg_stat_activity WHERE pid = $1::int4 AND state = 'active' AND query LIKE 'SELECT pg_sleep%'", int64(pid)).Scan(&n); err != nil {
					t.Fatal(err)
				}
				return n == 1
			}
			if drop {
				// Once dropped, a cancel request sent instead would have been answered, its signal given a moment.
				for droppedCancels.Load() == before {
					select {
					case <-c.PgConn().CleanupDone():
						t.Fatal("pgconn closed the connection without a cancel request to drop")
					case <-time.After(10 * time.Millisecond):
					}
				}
				time.Sleep(300 * time.Millisecond)
				if !sleeping() {
					t.Error("a cancel request reached the server through DropCancels: the statement ended")
				}
				// pgconn's close reads until the server answers its Terminate, after the statement: end it.
				if _, err := obs.Exec(context.Background(), "SELECT pg_terminate_backend($1::int4)", int64(pid)); err != nil {
					t.Fatal(err)
				}
				WaitClosed(t, c.PgConn().CleanupDone(), 20*time.Second, "pgconn's close")
				return
			}
			WaitClosed(t, c.PgConn().CleanupDone(), 20*time.Second, "pgconn's close (after its cancel request)")
			if droppedCancels.Load() != before {
				t.Error("a cancel request was dropped for an address that takes them")
			}
			for deadline := time.Now().Add(10 * time.Second); sleeping(); time.Sleep(20 * time.Millisecond) {
				if time.Now().After(deadline) {
					t.Fatal("the server's statement ran on 10 s after pgconn's close: no cancel request arrived")
				}
			}
		})
	}
}
