package advlock

import (
	"context"
	"fmt"
	"log/slog"
	neturl "net/url"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/advlock/advlock/internal/session"
	"github.com/advlock/advlock/internal/testkit/pgtest"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
)

// Lead writes its NameKey's name to the names table, so that advlock ls can show a leader by its name: on a
// database that has never seen advlock, from many Lockers starting at once (session locks and leases, some
// leading the same name), with text no statement may take as its own (quotes, backslashes, letters beyond
// ASCII). The rows are the server's truth: one per name, its key the name's hash. A plain Lock writes nothing.
func TestLeadPublishesName(t *testing.T) {
	t.Parallel()
	url := pgtest.FreshDB(t, pgtest.URL(t))
	obs := pgtest.Conn(t, url)
	ctx := ctxT(t, time.Minute)
	stamp := time.Now().UnixNano()
	names := []string{
		fmt.Sprintf("billing-sync-%d", stamp),
		fmt.Sprintf(`it's a \'name\' ✓ "%d"`, stamp),
		fmt.Sprintf("42%d", stamp), // a name that reads as a number
		fmt.Sprintf("name:x-%d", stamp),
	}
	var logs syncBuffer
	logger := slog.New(slog.NewTextHandler(&logs, nil))
	lctx, cancel := context.WithCancel(ctx)
	var wg sync.WaitGroup
	leading := make(chan string, 16)
	start := make(chan struct{})
	for i := range 8 {
		name := names[i%len(names)]
		opts := []Option{WithLogger(logger)}
		if i%2 == 1 {
			opts = append(opts, WithLeases())
		}
		l := New(pgtest.Pool(t, url, func(c *pgxpool.Config) { c.MaxConns = 4 }), opts...)
		t.Cleanup(l.Close)
		wg.Add(1)
		go func() {
			defer wg.Done()
			<-start
			_ = l.Lead(lctx, NameKey(name), func(ctx context.Context) error {
				leading <- name
				<-ctx.Done()
				return nil
			})
		}()
	}
	close(start)
	seen := map[string]bool{}
	for len(seen) < len(names) {
		select {
		case n := <-leading:
			seen[n] = true
		case <-ctx.Done():
			t.Fatalf("leaders of %d names of %d", len(seen), len(names))
		}
	}
	plain := New(pgtest.Pool(t, url, nil))
	t.Cleanup(plain.Close)
	other := fmt.Sprintf("plain-lock-%d", stamp)
	lk, err := plain.Lock(ctx, NameKey(other))
	if err != nil {
		t.Fatal(err)
	}
	want := map[int64]string{}
	for _, n := range names {
		v, _ := NameKey(n).Int64()
		want[v] = n
	}
	var got map[int64]string
	deadline := time.Now().Add(10 * time.Second)
	for {
		got = namesRows(t, ctx, obs)
		if len(got) == len(want) || time.Now().After(deadline) {
			break
		}
		time.Sleep(20 * time.Millisecond)
	}
	for v, n := range want {
		if got[v] != n {
			t.Errorf("names table: key %d has %q, want %q", v, got[v], n)
		}
	}
	if len(got) != len(want) {
		t.Errorf("names table: %d rows, want %d (the plain Lock of %q wrote none): %v", len(got), len(want), other, got)
	}
	if err := lk.Unlock(ctx); err != nil {
		t.Fatal(err)
	}
	cancel()
	wg.Wait()
	if strings.Contains(logs.String(), session.NamesTable) {
		t.Errorf("a Lead logged that its name was not written:\n%s", logs.String())
	}
}

// A role that may not create the names table (no CREATE on schema public, PostgreSQL 15's default for a role that
// does not own it) leads all the same: the name is not written, which the log says once for the Locker, not once
// per term; and it is not asked again.
func TestLeadNameWithoutPrivilege(t *testing.T) {
	t.Parallel()
	url := pgtest.FreshDB(t, pgtest.URL(t))
	admin := pgtest.Conn(t, url)
	ctx := ctxT(t, time.Minute)
	role := fmt.Sprintf("advlock_noname_%d", time.Now().UnixNano())
	if _, err := admin.Exec(ctx, "CREATE ROLE "+role+" LOGIN; REVOKE CREATE ON SCHEMA public FROM PUBLIC"); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _, _ = admin.Exec(context.Background(), "DROP ROLE IF EXISTS "+role) })
	u, err := neturl.Parse(url)
	if err != nil {
		t.Fatal(err)
	}
	u.User = neturl.User(role)
	var logs syncBuffer
	l := New(pgtest.Pool(t, u.String(), nil), WithLogger(slog.New(slog.NewTextHandler(&logs, nil))))
	t.Cleanup(l.Close)
	terms := 0
	lctx, cancel := context.WithCancel(ctx)
	defer cancel()
	name := fmt.Sprintf("no-table-%d", time.Now().UnixNano())
	err = l.Lead(lctx, NameKey(name), func(ctx context.Context) error {
		terms++
		if terms == 3 {
			cancel()
		}
		// The name's write has had its answer: the warning, the first term; the others, no write at all.
		for deadline := time.Now().Add(10 * time.Second); !strings.Contains(logs.String(), session.NamesTable) && time.Now().Before(deadline); {
			time.Sleep(10 * time.Millisecond)
		}
		time.Sleep(20 * time.Millisecond)
		return ErrLockLost // campaign again
	})
	if terms != 3 || err != context.Canceled {
		t.Fatalf("Lead: %d terms, %v; want 3 terms, context.Canceled", terms, err)
	}
	var exists bool
	if err := admin.QueryRow(ctx, "SELECT to_regclass('"+session.NamesTable+"') IS NOT NULL").Scan(&exists); err != nil || exists {
		t.Errorf("names table made by a role without CREATE: %v %v", exists, err)
	}
	if n := strings.Count(logs.String(), session.NamesTable); n != 1 {
		t.Errorf("%d warnings that the name was not written, want 1:\n%s", n, logs.String())
	}
}

// namesRows reads the names table: key to name.
func namesRows(t *testing.T, ctx context.Context, c *pgx.Conn) map[int64]string {
	t.Helper()
	out := map[int64]string{}
	var exists bool
	if err := c.QueryRow(ctx, "SELECT to_regclass('"+session.NamesTable+"') IS NOT NULL").Scan(&exists); err != nil {
		t.Fatal(err)
	}
	if !exists {
		return out
	}
	rows, err := c.Query(ctx, "SELECT key, name FROM "+session.NamesTable)
	if err != nil {
		t.Fatal(err)
	}
	defer rows.Close()
	for rows.Next() {
		var v int64
		var n string
		if err := rows.Scan(&v, &n); err != nil {
			t.Fatal(err)
		}
		out[v] = n
	}
	return out
}
