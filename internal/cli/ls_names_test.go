package cli

import (
	"context"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/advlock/advlock"
	lsession "github.com/advlock/advlock/internal/session"
	"github.com/advlock/advlock/internal/testkit/pgtest"
	"github.com/jackc/pgx/v5/pgxpool"
)

// ls names the keys Lead campaigns for, as it names a key given on its command line: a leader of a session lock
// and one of a lease, in the tree, the table and JSON; a plain lock of a NameKey, whose name no process wrote,
// stays a number.
func TestLsNamesLeaders(t *testing.T) {
	url := pgtest.URL(t)
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	stamp := time.Now().UnixNano()
	session, leased, plain := fmt.Sprintf("scheduler-%d", stamp), fmt.Sprintf("mailer ✓ %d", stamp), fmt.Sprintf("plain-%d", stamp)
	leading := make(chan struct{}, 2)
	lctx, stop := context.WithCancel(ctx)
	done := make(chan struct{}, 2)
	for _, c := range []struct {
		name string
		opts []advlock.Option
	}{{session, nil}, {leased, []advlock.Option{advlock.WithLeases()}}} {
		l := advlock.New(pgtest.Pool(t, url, func(c *pgxpool.Config) { c.MaxConns = 4 }), c.opts...)
		t.Cleanup(l.Close)
		go func() {
			defer func() { done <- struct{}{} }()
			_ = l.Lead(lctx, advlock.NameKey(c.name), func(ctx context.Context) error {
				leading <- struct{}{}
				<-ctx.Done()
				return nil
			})
		}()
	}
	defer func() { stop(); <-done; <-done }()
	pl := advlock.New(pgtest.Pool(t, url, nil))
	t.Cleanup(pl.Close)
	lk, err := pl.Lock(ctx, advlock.NameKey(plain))
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = lk.Unlock(ctx) }()
	<-leading
	<-leading
	// A name with an escape sequence, written to the table by hand and its key locked from psql: shown as a number.
	evil := fmt.Sprintf("evil\x1b[2J\n%d", stamp)
	ev, _ := advlock.NameKey(evil).Int64()
	conn := pgtest.Conn(t, url)
	// The leaders write their names as this runs, and on a database that never had one they create the table too:
	// a create at the same moment as theirs fails with a duplicate key on pg_type (23505), 42P07 or 42710.
	for attempt := 0; ; attempt++ {
		_, err := conn.Exec(ctx, lsession.NamesSQL)
		if err == nil {
			break
		}
		if c := lsession.SQLState(err); attempt < 3 && (c == "23505" || c == "42P07" || c == "42710") {
			continue
		}
		t.Fatal(err)
	}
	if _, err := conn.Exec(ctx, "INSERT INTO "+lsession.NamesTable+" (key, name) VALUES ($1, $2)", ev, evil); err != nil {
		t.Fatal(err)
	}
	if _, err := conn.Exec(ctx, "SELECT pg_advisory_lock($1)", ev); err != nil {
		t.Fatal(err)
	}
	v, _ := advlock.NameKey(plain).Int64()
	number := advlock.Int64Key(v).String()
	for _, args := range [][]string{{"ls", "--tree"}, {"ls"}, {"ls", "--json"}} {
		var out string
		// A term writes its name apart from its work: at most one round trip after it began.
		for deadline := time.Now().Add(10 * time.Second); ; {
			var code int
			var errOut string
			code, out, errOut = run(t, "", append([]string{"--dsn", url}, args...)...)
			if code != 0 {
				t.Fatalf("advlock %v: exit %d: %s", args, code, errOut)
			}
			if strings.Contains(out, session) && strings.Contains(out, leased) || time.Now().After(deadline) {
				break
			}
			time.Sleep(50 * time.Millisecond)
		}
		if !strings.Contains(out, session) || !strings.Contains(out, leased) {
			t.Errorf("advlock %v does not name the leaders %q and %q:\n%s", args, session, leased, out)
		}
		if !strings.Contains(out, number) || strings.Contains(out, plain) {
			t.Errorf("advlock %v: the plain lock of %q should show as %s:\n%s", args, plain, number, out)
		}
		if !strings.Contains(out, advlock.Int64Key(ev).String()) || strings.Contains(out, "\x1b") {
			t.Errorf("advlock %v: a name with an escape sequence should show as its number:\n%q", args, out)
		}
	}
}
