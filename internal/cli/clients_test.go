package cli

import (
	"context"
	"encoding/json"
	"fmt"
	"math/rand/v2"
	neturl "net/url"
	"os/exec"
	"regexp"
	"testing"
	"time"

	"github.com/advlock/advlock"
	"github.com/advlock/advlock/internal/testkit/pgtest"
)

// advlock ls, through the binary, counts the sessions of each client: a Locker from Open that holds three keys on
// its shared session and waits in the server for a fourth shows as 2 sessions (1 holding 3 locks, 1 waiting),
// in the table and as client_sessions in --json.
func TestLsCountsClientSessions(t *testing.T) {
	url := pgtest.URL(t)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	app := fmt.Sprintf("cli-clients-%d", rand.Uint32())
	u, err := neturl.Parse(url)
	if err != nil {
		t.Fatal(err)
	}
	q := u.Query()
	q.Set("application_name", app)
	u.RawQuery = q.Encode()
	l, err := advlock.Open(ctx, u.String())
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	for range 3 {
		if _, err := l.TryLock(ctx, advlock.Int64Key(rand.Int64())); err != nil {
			t.Fatal(err)
		}
	}
	other := advlock.Int64Key(rand.Int64())
	v, _ := other.Int64()
	holder := pgtest.Conn(t, url)
	if _, err := holder.Exec(ctx, "SELECT pg_advisory_lock($1::bigint)", v); err != nil {
		t.Fatal(err)
	}
	wctx, stop := context.WithCancel(ctx)
	waited := make(chan struct{})
	go func() {
		defer close(waited)
		_, _ = l.Lock(wctx, other)
	}()
	defer func() { stop(); <-waited }()
	for deadline := time.Now().Add(10 * time.Second); l.Stats().WaitingInServer != 1; time.Sleep(time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatalf("the Lock is not waiting in the server: %+v", l.Stats())
		}
	}
	line := regexp.MustCompile(`(?m)^2\s+1\s+1\s+3\s+\S+\s+` + regexp.QuoteMeta(app) + `$`)
	for deadline := time.Now().Add(10 * time.Second); ; time.Sleep(20 * time.Millisecond) {
		out, err := exec.Command(bin, "ls", "--dsn", url).Output()
		if err != nil {
			t.Fatalf("advlock ls: %v", err)
		}
		if line.Match(out) {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("advlock ls does not count 2 sessions (1 holding 3 locks, 1 waiting) for %s:\n%s", app, out)
		}
	}
	out, err := exec.Command(bin, "ls", "--json", "--dsn", url).Output()
	if err != nil {
		t.Fatalf("advlock ls --json: %v", err)
	}
	var rows []struct {
		ApplicationName string `json:"application_name"`
		ClientSessions  *int   `json:"client_sessions"`
	}
	if err := json.Unmarshal(out, &rows); err != nil {
		t.Fatal(err)
	}
	mine := 0
	for _, r := range rows {
		if r.ClientSessions == nil {
			t.Fatalf("ls --json has no client_sessions: %s", out)
		}
		if r.ApplicationName == app {
			mine++
			if *r.ClientSessions != 2 {
				t.Errorf("client_sessions %d for %s, want 2", *r.ClientSessions, app)
			}
		}
	}
	if mine != 4 {
		t.Errorf("%d rows for %s in ls --json, want 4 (3 held, 1 waiting)", mine, app)
	}
}
