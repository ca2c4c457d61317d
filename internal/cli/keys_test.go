package cli

import (
	"context"
	"encoding/json"
	"math/rand/v2"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/advlock/advlock"
	"github.com/advlock/advlock/internal/testkit/pgtest"
)

// downDSN is a server that is not there: nothing listens on port 1.
const downDSN = "postgres://postgres@127.0.0.1:1/test?connect_timeout=2"

// A bad KEY is a usage error (exit 2) for every command that takes one, found before connecting: with the server
// down, it is still 2, not 69. A good KEY with the server down is 69.
func TestKeyCheckedBeforeConnecting(t *testing.T) {
	for _, tc := range []struct{ key, want string }{
		{"hashtextextended:x", "needs SEED:NAME"},
		{"hashtextextended:seed:x", "needs SEED:NAME"},
		{"Int:42", "did you mean int:42?"},
		{"PAIR:1,2", "did you mean pair:1,2?"},
		{"HashText:x", "did you mean hashtext:x?"},
		{"9223372036854775808", "not within 64 bits"},
		{"pair:1", "separated by a comma"},
		{"migrate:a/b/c/d", "migrate: needs"},
	} {
		for _, args := range [][]string{
			{"run", "--dsn", downDSN, tc.key, "--", "echo", "ran"},
			{"ls", "--dsn", downDSN, tc.key},
			{"break", "--yes", "--dsn", downDSN, tc.key},
		} {
			p := start(t, nil, args...)
			if code := p.wait(t, 10*time.Second); code != exitUsage || !strings.Contains(p.err.String(), tc.want) ||
				p.out.Len() != 0 {
				t.Errorf("%v: exit %d, stdout %q, stderr %q; want exit 2 naming %q", args, code, p.out.String(),
					p.err.String(), tc.want)
			}
		}
	}
	for _, key := range []string{"hashtextextended:7:x", "hashtext:x", "42", "-7", "name:42"} {
		p := start(t, nil, "run", "--dsn", downDSN, "--", key, "echo", "ran")
		if code := p.wait(t, 10*time.Second); code != exitUnavailable {
			t.Errorf("run %s with the server down: exit %d (stderr %q), want 69", key, code, p.err.String())
		}
	}
}

// A bare integer KEY is the key psql's pg_advisory_lock(N) takes: run with it is not acquired while SQL holds it,
// and ls finds the holder by it. A negative one goes after "--".
func TestRunIntegerKey(t *testing.T) {
	ctx := context.Background()
	conn := pgtest.Conn(t, pgtest.URL(t))
	for _, n := range []int64{rand.Int64(), -rand.Int64()} {
		if _, err := conn.Exec(ctx, "SELECT pg_advisory_lock($1::bigint)", n); err != nil {
			t.Fatal(err)
		}
		key := strconv.FormatInt(n, 10)
		p := start(t, dbEnv(t), "run", "--no-wait", "--", key, "echo", "ran")
		if code := p.wait(t, 20*time.Second); code != exitNotAcquired || p.out.Len() != 0 {
			t.Errorf("run %s while SQL holds pg_advisory_lock(%d): exit %d stdout %q stderr %q, want 75", key, n, code,
				p.out.String(), p.err.String())
		}
		code, out, errOut := run(t, "", "ls", "--json", "--dsn", pgtest.URL(t), "--", key)
		if code != 0 || !strings.Contains(out, `"key": "int:`+key+`"`) {
			t.Errorf("ls %s (exit %d, %s) does not show SQL's lock:\n%s", key, code, errOut, out)
		}
		if _, err := conn.Exec(ctx, "SELECT pg_advisory_unlock($1::bigint)", n); err != nil {
			t.Fatal(err)
		}
		p = start(t, dbEnv(t), "run", "--no-wait", "--", key, "--", "echo", "ran")
		if code := p.wait(t, 20*time.Second); code != 0 || p.out.String() != "ran\n" {
			t.Errorf("run %s once free: exit %d stdout %q stderr %q", key, code, p.out.String(), p.err.String())
		}
	}
}

// advlock ls writes every key so that it pastes back as a KEY: each key held by advlock run (an integer, a pair, a
// name that is a number, a name that starts with a scheme in another case, a plain name) and one SQL holds, as ls
// --json and the table print it, is not acquired by run --no-wait while held.
func TestLsKeysPasteBack(t *testing.T) {
	ctx := context.Background()
	r := rand.Int64()
	number := strconv.FormatUint(rand.Uint64(), 10)
	a, b := rand.Int32(), -rand.Int32()
	keys := map[string]string{ // KEY given to run: what ls must print
		strconv.FormatInt(r, 10):                                    "int:" + strconv.FormatInt(r, 10),
		"pair:" + strconv.Itoa(int(a)) + "," + strconv.Itoa(int(b)): "pair:" + strconv.Itoa(int(a)) + "," + strconv.Itoa(int(b)),
		"name:" + number:                                            "name:" + number,
		"name:Int:" + number:                                        "name:Int:" + number,
		"cli-paste-" + number:                                       "cli-paste-" + number,
	}
	for k := range keys {
		start(t, dbEnv(t), "run", k, "--", "sleep", "30")
		key, err := advlock.ParseKey(k)
		if err != nil {
			t.Fatal(err)
		}
		holderOf(t, key)
	}
	sqlKey := rand.Int64()
	conn := pgtest.Conn(t, pgtest.URL(t))
	if _, err := conn.Exec(ctx, "SELECT pg_advisory_lock($1::bigint)", sqlKey); err != nil {
		t.Fatal(err)
	}
	keys["int:"+strconv.FormatInt(sqlKey, 10)] = "int:" + strconv.FormatInt(sqlKey, 10)

	code, out, errOut := run(t, "", "ls", "--json", "--dsn", pgtest.URL(t))
	if code != 0 {
		t.Fatalf("ls --json: exit %d %s", code, errOut)
	}
	var rows []struct{ Key string }
	if err := json.Unmarshal([]byte(out), &rows); err != nil {
		t.Fatal(err)
	}
	var printed []string
	for _, r := range rows {
		printed = append(printed, r.Key)
	}
	_, table, _ := run(t, "", "ls", "--dsn", pgtest.URL(t))
	for given, want := range keys {
		if !slices.Contains(printed, want) {
			t.Errorf("ls --json does not print %s (held as %s) as %q", want, given, want)
			continue
		}
		if !strings.Contains(table, "\n"+want+" ") {
			t.Errorf("the ls table does not print %q:\n%s", want, table)
		}
		p := start(t, dbEnv(t), "run", "--no-wait", "--", want, "echo", "ran")
		if code := p.wait(t, 20*time.Second); code != exitNotAcquired {
			t.Errorf("run %s, pasted from ls, while %s is held: exit %d stderr %q, want 75", want, given, code,
				p.err.String())
		}
	}
}
