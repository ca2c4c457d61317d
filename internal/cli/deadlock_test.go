package cli

import (
	"context"
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/advlock/advlock"
	"github.com/advlock/advlock/internal/testkit/pgtest"
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
