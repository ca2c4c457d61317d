package cli

import (
	"context"
	"encoding/json"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/advlock/advlock"
	"github.com/advlock/advlock/internal/testkit/pgtest"
)

// advlock run --leases behind PgBouncer in transaction mode, with the DSN as a user writes it: two runs at once,
// one runs COMMAND (with the lease's term in $ADVLOCK_TOKEN, as the lease table holds it) and the other exits 75;
// ADVLOCK_LEASES=1 does what --leases does; ls shows the lease by its KEY with its term; break deletes it and the
// run finds its lease lost at its next renewal, ends COMMAND and exits 70.
func TestRunLeases(t *testing.T) {
	if testing.Short() {
		t.Skip("starts pgbouncer")
	}
	url := pgtest.URL(t)
	bouncer := []string{"DATABASE_URL=" + pgtest.Bouncer(t, url, "transaction")}
	k := keyName(t)
	key, _ := advlock.ParseKey(k)
	v, _ := key.Int64()
	script := `trap 'echo got-term; exit 0' TERM; echo "token $ADVLOCK_TOKEN"; while :; do sleep 0.05; done`
	ps := []*proc{
		start(t, bouncer, "run", "--leases", "--no-wait", "--grace", "5s", k, "--", "sh", "-c", script),
		start(t, append(bouncer, "ADVLOCK_LEASES=1"), "run", "--no-wait", "--grace", "5s", k, "--", "sh", "-c", script),
	}
	obs := pgtest.Conn(t, url)
	var term int64
	deadline := time.Now().Add(10 * time.Second)
	for obs.QueryRow(context.Background(), "SELECT term FROM public.advlock_lease WHERE space = 1 AND key = $1 "+
		"AND expires > clock_timestamp()", v).Scan(&term) != nil {
		if time.Now().After(deadline) {
			t.Fatalf("no lease row for %s; stderr %q %q", k, ps[0].err.String(), ps[1].err.String())
		}
		time.Sleep(20 * time.Millisecond)
	}
	var holder, other *proc
	for holder == nil {
		for i, p := range ps {
			if strings.Contains(p.out.String(), "token") {
				holder, other = p, ps[1-i]
			}
		}
		if time.Now().After(deadline) {
			t.Fatalf("no run started COMMAND: stdout %q %q", ps[0].out.String(), ps[1].out.String())
		}
		time.Sleep(20 * time.Millisecond)
	}
	if code := other.wait(t, 10*time.Second); code != exitNotAcquired {
		t.Errorf("the second run of a leased key: exit %d, want 75; stderr %q", code, other.err.String())
	}
	if got := strings.TrimSpace(holder.out.String()); got != "token "+strconv.FormatInt(term, 10) {
		t.Errorf("COMMAND saw %q, the lease table holds term %d", got, term)
	}

	code, out, errOut := run(t, "", "ls", "--dsn", url)
	if code != 0 || !strings.Contains(out, k) || !strings.Contains(out, "lease") ||
		!strings.Contains(out, "term "+strconv.FormatInt(term, 10)) {
		t.Errorf("ls (exit %d, %s) does not show the lease of %s with its term %d:\n%s", code, errOut, k, term, out)
	}
	if strings.Contains(out, "\n1 leases held") || strings.Contains(out, " 1 waits for leases") || !strings.Contains(out, " held, ") {
		t.Errorf("ls's count of leases (one lease, one wait: singular):\n%s", out)
	}
	code, out, _ = run(t, "", "ls", "--json", "--dsn", url, k)
	var rows []struct {
		Key   string `json:"key"`
		Lease *struct {
			Token  int64 `json:"token"`
			LeftMS int64 `json:"left_ms"`
		} `json:"lease"`
	}
	if err := json.Unmarshal([]byte(out), &rows); code != 0 || err != nil || len(rows) != 1 || rows[0].Lease == nil ||
		rows[0].Lease.Token != term || rows[0].Lease.LeftMS <= 0 || rows[0].Key != k {
		t.Errorf("ls --json %s: exit %d, %v:\n%s", k, code, err, out)
	}

	code, out, errOut = run(t, "", "break", "--yes", "--dsn", url, k)
	if code != 0 || !strings.Contains(out, "deleted the lease of term "+strconv.FormatInt(term, 10)) {
		t.Fatalf("break --yes of a lease: exit %d out %q err %q", code, out, errOut)
	}
	if code := holder.wait(t, 15*time.Second); code != exitLost {
		t.Errorf("run whose lease was broken: exit %d, want 70; stderr %q", code, holder.err.String())
	}
	if !strings.Contains(holder.out.String(), "got-term") || !strings.Contains(holder.err.String(), "lost") {
		t.Errorf("run whose lease was broken: stdout %q stderr %q", holder.out.String(), holder.err.String())
	}

	for _, c := range []struct {
		env  []string
		args []string
		want string
	}{
		{[]string{"ADVLOCK_LEASES=maybe"}, []string{"run", k, "true"}, "ADVLOCK_LEASES"},
		{nil, []string{"run", "--leases", "--shared", k, "true"}, "--shared and --leases"},
	} {
		p := start(t, append(dbEnv(t), c.env...), c.args...)
		if code := p.wait(t, 10*time.Second); code != exitUsage || !strings.Contains(p.err.String(), c.want) {
			t.Errorf("%v %v: exit %d stderr %q, want 2 saying %s", c.env, c.args, code, p.err.String(), c.want)
		}
	}
}

// What ls prints of a lease's holder cannot forge lines: anyone who may write the lease table chooses that text.
func TestLsLeaseHolderText(t *testing.T) {
	if got := orDash("h pid 1\nint:1  lease  held\x1b[2J\xff"); strings.ContainsAny(got, "\n\x1b") || strings.Contains(got, "\xff") {
		t.Errorf("orDash kept control characters: %q", got)
	}
}

// advlock ls and break through PgBouncer in transaction mode, with the DSN of a --leases user: each runs again and
// again (named prepared statements of one connection would meet those of another on the server: 42P05).
func TestLsThroughTransactionPooler(t *testing.T) {
	if testing.Short() {
		t.Skip("starts pgbouncer")
	}
	burl := pgtest.Bouncer(t, pgtest.URL(t), "transaction")
	k := keyName(t)
	for i := range 4 {
		if code, _, errOut := run(t, "", "ls", "--dsn", burl, k); code != 0 {
			t.Fatalf("ls #%d through PgBouncer in transaction mode: exit %d: %s", i, code, errOut)
		}
		if code, _, errOut := run(t, "", "break", "--yes", "--dsn", burl, k); code != 0 {
			t.Fatalf("break #%d through PgBouncer in transaction mode: exit %d: %s", i, code, errOut)
		}
	}
}
