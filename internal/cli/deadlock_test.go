package cli

import (
	"context"
	"fmt"
	neturl "net/url"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/advlock/advlock"
	"github.com/advlock/advlock/internal/testkit/pgtest"
	"github.com/jackc/pgx/v5"
)

// Two nested runs that take two keys in opposite orders: one inner run gives up with exit 71 (its parent then
// exits 71 too, releasing its key), the other completes; nothing is left held or queued.
func TestRunDeadlock(t *testing.T) {
	k1, k2 := keyName(t)+"-1", keyName(t)+"-2"
	nested := func(outer, inner string) *proc {
		return start(t, dbEnv(t), "run", outer, "--", "sh", "-c", `sleep 1; exec "$0" run "$1" -- sleep 0.2`, bin, inner)
	}
	a, b := nested(k1, k2), nested(k2, k1)
	codes := map[int]int{a.wait(t, 30*time.Second): 1}
	codes[b.wait(t, 30*time.Second)]++
	if codes[0] != 1 || codes[exitDeadlock] != 1 {
		t.Fatalf("exit codes %v, want one 0 and one %d; stderr %q, %q", codes, exitDeadlock, a.err.String(), b.err.String())
	}
	if !strings.Contains(a.err.String()+b.err.String(), "deadlock") {
		t.Errorf("no run said deadlock: %q, %q", a.err.String(), b.err.String())
	}
	obs := pgtest.Conn(t, pgtest.URL(t))
	for _, k := range []string{k1, k2} {
		key, err := advlock.ParseKey(k)
		if err != nil {
			t.Fatal(err)
		}
		v, _ := key.Int64()
		pgtest.WaitFree(t, obs, v, 10*time.Second)
	}
}

// A cycle of published waits that nobody ends (raw sessions that publish as advlock does but run no detection):
// ls --tree marks each of its waits, and names what each waiting caller holds.
func TestLsTreeMarksCycle(t *testing.T) {
	url := pgtest.URL(t)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	keys := []int64{time.Now().UnixNano(), time.Now().UnixNano() + 1}
	var holders []uint32
	for _, k := range keys {
		c := pgtest.Conn(t, url)
		var pid uint32
		if err := c.QueryRow(ctx, "SELECT pg_backend_pid(), pg_advisory_lock($1)::text", k).Scan(&pid, new(string)); err != nil {
			t.Fatal(err)
		}
		holders = append(holders, pid)
	}
	var wg sync.WaitGroup
	defer wg.Wait() // before the connections close
	defer cancel()  // the waits end with their connections
	ref := func(k int64) string { return fmt.Sprintf("1.%d.%d.X", uint32(uint64(k)>>32), uint32(k)) }
	for i, k := range keys {
		other := keys[1-i]
		c := pgtest.Conn(t, url)
		// waits for the other key while its caller holds this one (on holders[i]'s session)
		sql := fmt.Sprintf("/*advlock w=%s h=%d.%s*/ SELECT pg_advisory_lock(%d)", ref(other), holders[i], ref(k), other)
		wg.Add(1)
		go func() {
			defer wg.Done()
			_, _ = c.Exec(ctx, sql)
		}()
	}
	deadline := time.Now().Add(10 * time.Second)
	for {
		code, out, errs := run(t, "", "ls", "--tree", "--dsn", url)
		if code != 0 {
			t.Fatalf("ls --tree: exit %d: %s", code, errs)
		}
		if strings.Count(out, "DEADLOCK") >= 2 {
			for _, k := range keys {
				if !strings.Contains(out, fmt.Sprintf("its caller holds int:%d", k)) {
					t.Errorf("ls --tree does not name what the caller holding int:%d holds:\n%s", k, out)
				}
			}
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("ls --tree never marked the cycle:\n%s", out)
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// A published wait whose chain ends at a holder that waits for nothing is not a cycle: ls --tree names what its
// caller holds and marks nothing.
func TestLsTreeChainUnmarked(t *testing.T) {
	url := pgtest.URL(t)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	k1, k2 := time.Now().UnixNano(), time.Now().UnixNano()+1
	ref := func(k int64) string { return fmt.Sprintf("1.%d.%d.X", uint32(uint64(k)>>32), uint32(k)) }
	var pids []uint32
	for _, k := range []int64{k1, k2} { // the caller's k1; another's k2, held by a session that waits for nothing
		c := pgtest.Conn(t, url)
		var pid uint32
		if err := c.QueryRow(ctx, "SELECT pg_backend_pid(), pg_advisory_lock($1)::text", k).Scan(&pid, new(string)); err != nil {
			t.Fatal(err)
		}
		pids = append(pids, pid)
	}
	var wg sync.WaitGroup
	defer wg.Wait()
	defer cancel()
	c := pgtest.Conn(t, url)
	wg.Add(1)
	go func() {
		defer wg.Done()
		_, _ = c.Exec(ctx, fmt.Sprintf("/*advlock w=%s h=%d.%s*/ SELECT pg_advisory_lock(%d)", ref(k2), pids[0], ref(k1), k2))
	}()
	deadline := time.Now().Add(10 * time.Second)
	for {
		code, out, errs := run(t, "", "ls", "--tree", "--dsn", url)
		if code != 0 {
			t.Fatalf("ls --tree: exit %d: %s", code, errs)
		}
		if strings.Contains(out, fmt.Sprintf("its caller holds int:%d", k1)) {
			if strings.Contains(out, "DEADLOCK") {
				t.Errorf("ls --tree marked a chain that is no cycle:\n%s", out)
			}
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("ls --tree never showed the published wait:\n%s", out)
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// The cycle advlock cannot attribute: the holder of a key runs its own transaction on another connection, which
// waits for a row that the waiter's transaction has locked (the waiter's process took the row, then waits for the
// key). ls --tree shows what can be seen: the row wait, who blocks it, and that each end's client also holds or
// waits for the key; it marks no DEADLOCK, since nothing ties those sessions to the advisory ones.
func TestLsTreeShowsOtherWaits(t *testing.T) {
	url := pgtest.FreshDB(t, pgtest.URL(t))
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	tag := fmt.Sprint(time.Now().UnixNano())
	podA, podB := "pod-a-"+tag, "pod-b-"+tag
	as := func(app string) *pgx.Conn {
		u, err := neturl.Parse(url)
		if err != nil {
			t.Fatal(err)
		}
		q := u.Query()
		q.Set("application_name", app)
		u.RawQuery = q.Encode()
		return pgtest.Conn(t, u.String())
	}
	setup := pgtest.Conn(t, url)
	if _, err := setup.Exec(ctx, "CREATE TABLE jobs (id int PRIMARY KEY, v int); INSERT INTO jobs VALUES (1, 0)"); err != nil {
		t.Fatal(err)
	}
	k := time.Now().UnixNano()
	holder, holderTx := as(podA), as(podA) // pod A: holds the key; its migration's transaction on another connection
	waiter, waiterTx := as(podB), as(podB) // pod B: its transaction locked the row; then it waits for the key
	var holderPID, rowPID, waitPID int32
	if err := holder.QueryRow(ctx, "SELECT pg_backend_pid(), pg_advisory_lock($1)::text", k).Scan(&holderPID, new(string)); err != nil {
		t.Fatal(err)
	}
	if err := waiterTx.QueryRow(ctx, "SELECT pg_backend_pid()").Scan(&rowPID); err != nil {
		t.Fatal(err)
	}
	if _, err := waiterTx.Exec(ctx, "BEGIN; UPDATE jobs SET v = 1 WHERE id = 1"); err != nil {
		t.Fatal(err)
	}
	if err := waiter.QueryRow(ctx, "SELECT pg_backend_pid()").Scan(&waitPID); err != nil {
		t.Fatal(err)
	}
	var wg sync.WaitGroup
	defer wg.Wait()
	defer cancel()
	wg.Add(2)
	go func() { defer wg.Done(); _, _ = waiter.Exec(ctx, "SELECT pg_advisory_lock($1)", k) }()
	go func() { defer wg.Done(); _, _ = holderTx.Exec(ctx, "BEGIN; UPDATE jobs SET v = 2 WHERE id = 1") }()
	deadline := time.Now().Add(10 * time.Second)
	for {
		code, out, errs := run(t, "", "ls", "--tree", "--dsn", url)
		if code != 0 {
			t.Fatalf("ls --tree: exit %d: %s", code, errs)
		}
		keyText := fmt.Sprintf("int:%d", k)
		if strings.Contains(out, "waits for other locks") && strings.Contains(out, "blocked by") &&
			strings.Contains(out, fmt.Sprintf("pid %d exclusive %q", waitPID, podB)) {
			for _, want := range []string{
				fmt.Sprintf("held by pid %d exclusive %q", holderPID, podA),
				"ShareLock on transactionid",
				fmt.Sprintf("[its client also holds %s]", keyText),
				fmt.Sprintf("blocked by pid %d %q from ", rowPID, podB),
				fmt.Sprintf("[its client also waits for %s]", keyText),
			} {
				if !strings.Contains(out, want) {
					t.Errorf("ls --tree does not show %q:\n%s", want, out)
				}
			}
			if strings.Contains(out, "DEADLOCK") {
				t.Errorf("ls --tree marked a cycle it cannot attribute:\n%s", out)
			}
			t.Logf("ls --tree:\n%s", out)
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("ls --tree never showed the row wait:\n%s", out)
		}
		time.Sleep(50 * time.Millisecond)
	}
}
