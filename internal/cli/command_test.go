package cli

import (
	"context"
	"flag"
	"io"
	"os"
	"os/exec"
	"regexp"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/advlock/advlock"
	"github.com/advlock/advlock/internal/testkit/pgtest"
)

// run's arguments: flags before or after KEY, COMMAND after "--" or at the first word after KEY, and a "--" before
// KEY (for a KEY such as -7), with or without a second one before COMMAND.
func TestRunArgs(t *testing.T) {
	for _, tc := range []struct {
		args    []string
		key     string
		command []string
		noWait  bool
		err     string
	}{
		{args: []string{"k", "--", "echo", "hi"}, key: "k", command: []string{"echo", "hi"}},
		{args: []string{"k", "echo", "--no-wait"}, key: "k", command: []string{"echo", "--no-wait"}},
		{args: []string{"k", "--no-wait", "--", "echo"}, key: "k", command: []string{"echo"}, noWait: true},
		{args: []string{"--", "k", "echo", "hi"}, key: "k", command: []string{"echo", "hi"}},
		{args: []string{"--no-wait", "--", "-7", "echo"}, key: "-7", command: []string{"echo"}, noWait: true},
		{args: []string{"--", "-7", "--", "echo", "--"}, key: "-7", command: []string{"echo", "--"}},
		{args: []string{"--", "k"}, key: "k"},
		{args: []string{"--"}, err: "missing KEY"},
		{args: nil, err: "missing KEY"},
		{args: []string{"k", "x", "--", "echo"}, err: `unexpected "x" between KEY and --`},
	} {
		fs := flag.NewFlagSet("run", flag.ContinueOnError)
		fs.SetOutput(io.Discard)
		noWait := fs.Bool("no-wait", false, "")
		key, command, err := runArgs(fs, tc.args)
		if tc.err != "" {
			if err == nil || err.Error() != tc.err {
				t.Errorf("runArgs(%q) = %q, %q, %v; want error %q", tc.args, key, command, err, tc.err)
			}
			continue
		}
		if err != nil || key != tc.key || !slices.Equal(command, tc.command) || *noWait != tc.noWait {
			t.Errorf("runArgs(%q) = %q, %q, %v (no-wait %v); want %q, %q (no-wait %v)", tc.args, key, command, err,
				*noWait, tc.key, tc.command, tc.noWait)
		}
	}
}

// run -- KEY COMMAND runs COMMAND under KEY, through the binary.
func TestRunDashesBeforeKey(t *testing.T) {
	p := start(t, dbEnv(t), "run", "--no-wait", "--", keyName(t), "echo", "ran")
	if code := p.wait(t, 20*time.Second); code != 0 || p.out.String() != "ran\n" {
		t.Errorf("run -- KEY echo ran: exit %d stdout %q stderr %q", code, p.out.String(), p.err.String())
	}
}

// A duration flag takes a plain number as seconds (as flock -w does) besides a Go duration.
func TestParseDuration(t *testing.T) {
	for in, want := range map[string]time.Duration{
		"5": 5 * time.Second, "0.5": 500 * time.Millisecond, ".5": 500 * time.Millisecond, "5.": 5 * time.Second,
		"0": 0, "+2": 2 * time.Second, "-1": -time.Second, "1.25": 1250 * time.Millisecond,
		"1m30s": 90 * time.Second, "500ms": 500 * time.Millisecond, "-1s": -time.Second,
	} {
		if got, err := parseDuration(in); err != nil || got != want {
			t.Errorf("parseDuration(%q) = %v, %v; want %v", in, got, err, want)
		}
	}
	for _, in := range []string{"", "abc", "1x", "1e3", "1.2.3", ".", "+", "--1", "5 s", "inf", "NaN", "0x10", "99999999999"} {
		if got, err := parseDuration(in); err == nil {
			t.Errorf("parseDuration(%q) = %v, want an error", in, got)
		}
	}
}

// --wait in seconds, through the binary: --wait 0.3 gives up after about 300ms behind a holder (75); --wait 5 and
// --grace 1 run COMMAND once the key is free.
func TestRunWaitSeconds(t *testing.T) {
	k := keyName(t)
	ctx := context.Background()
	conn := pgtest.Conn(t, pgtest.URL(t))
	key, _ := advlock.ParseKey(k)
	v, _ := key.Int64()
	if _, err := conn.Exec(ctx, "SELECT pg_advisory_lock($1::bigint)", v); err != nil {
		t.Fatal(err)
	}
	p := start(t, dbEnv(t), "run", "--wait", "0.3", k, "--", "echo", "ran")
	if code := p.wait(t, 10*time.Second); code != exitNotAcquired || p.took < 300*time.Millisecond || p.out.Len() != 0 {
		t.Errorf("--wait 0.3 behind a holder: exit %d after %v, stdout %q, stderr %q; want 75 after 300ms or more",
			code, p.took, p.out.String(), p.err.String())
	}
	if !strings.Contains(p.err.String(), "not acquired within 300ms") {
		t.Errorf("stderr %q does not say 300ms", p.err.String())
	}
	if _, err := conn.Exec(ctx, "SELECT pg_advisory_unlock($1::bigint)", v); err != nil {
		t.Fatal(err)
	}
	p = start(t, dbEnv(t), "run", "--wait", "5", "--grace", "1", "--keepalive", "2.5", k, "--", "echo", "ran")
	if code := p.wait(t, 10*time.Second); code != 0 || p.out.String() != "ran\n" {
		t.Errorf("--wait 5 --grace 1 --keepalive 2.5 on a free key: exit %d stdout %q stderr %q", code,
			p.out.String(), p.err.String())
	}
}

// A bad flag is one line on stderr that names the flag (and, for a duration, the forms it takes) and points to
// the command's help; exit 2, nothing on stdout, no usage. The server is never reached.
func TestBadFlagOneLine(t *testing.T) {
	for _, tc := range []struct {
		args []string
		want string
	}{
		{[]string{"run", "--wait", "abc", "k", "--", "true"},
			`advlock: run: invalid --wait "abc": want seconds (5, 0.5) or a duration (1m30s); see advlock run --help`},
		{[]string{"run", "k", "--grace=1x", "--", "true"},
			`advlock: run: invalid --grace "1x": want seconds (5, 0.5) or a duration (1m30s); see advlock run --help`},
		{[]string{"run", "--keepalive", "abc", "k", "--", "true"}, `invalid --keepalive "abc": want seconds`},
		{[]string{"run", "--wait", "-1", "k", "--", "true"}, "advlock: run: invalid --wait -1s: must not be negative; see advlock run --help"},
		{[]string{"run", "--grace", "-0.5", "k", "--", "true"}, "invalid --grace -500ms: must not be negative"},
		{[]string{"run", "--keepalive", "0", "k", "--", "true"}, "invalid --keepalive 0s: must be positive"},
		{[]string{"run", "--bogus", "k", "--", "true"}, "advlock: run: unknown flag --bogus; see advlock run --help"},
		{[]string{"run", "--wait"}, "advlock: run: flag needs an argument: -wait; see advlock run --help"},
		{[]string{"ls", "--interval", "abc"},
			`advlock: ls: invalid --interval "abc": want seconds (5, 0.5) or a duration (1m30s); see advlock ls --help`},
		{[]string{"ls", "--interval", "0"}, "advlock: ls: invalid --interval 0s: must be positive; see advlock ls --help"},
		{[]string{"break", "--bogus", "k"}, "advlock: break: unknown flag --bogus; see advlock break --help"},
		{[]string{"demo", "--bogus"}, "advlock: demo: unknown flag --bogus; see advlock demo --help"},
		{[]string{"run", "--nowait", "k", "--", "true"}, "advlock: run: unknown flag --nowait; did you mean --no-wait?; see advlock run --help"},
		{[]string{"run", "-7", "true"}, "advlock: run: unknown flag -7: a negative KEY goes after -- (advlock run -- -7 ...) or as int:-7"},
		{[]string{"ls", "-7"}, "advlock: ls: unknown flag -7: a negative KEY goes after -- (advlock ls -- -7 ...) or as int:-7"},
		{[]string{"run", "name:", "--", "true"}, `advlock: run: invalid key "name:": an empty name`},
		{[]string{"run", "", "--", "true"}, "advlock: run: invalid key: empty key"},
		{[]string{"ls", "k", "--tree", "l"}, "advlock: ls: at most one KEY"},
		{[]string{"ls", "k", "--json", "--tree"}, "advlock: ls: --json and --tree exclude each other"},
	} {
		p := start(t, []string{"DATABASE_URL=" + downDSN}, tc.args...)
		code := p.wait(t, 10*time.Second)
		errOut := p.err.String()
		if code != exitUsage || p.out.Len() != 0 || strings.Count(errOut, "\n") != 1 || !strings.Contains(errOut, tc.want) {
			t.Errorf("%v: exit %d, stdout %q, stderr %q; want exit 2 and the one line %q", tc.args, code,
				p.out.String(), errOut, tc.want)
		}
	}
}

// Declining break, through the binary: answering n, or not answering (end of input), terminates nobody, says so
// in one line of its own, and exits 1.
func TestBreakDeclined(t *testing.T) {
	ctx := context.Background()
	k := keyName(t)
	key, _ := advlock.ParseKey(k)
	v, _ := key.Int64()
	conn := pgtest.Conn(t, pgtest.URL(t))
	if _, err := conn.Exec(ctx, "SELECT pg_advisory_lock($1::bigint)", v); err != nil {
		t.Fatal(err)
	}
	for _, answer := range []string{"n\n", "no\n", "", "yes please\n"} {
		cmd := exec.Command(bin, "break", "--dsn", pgtest.URL(t), k)
		cmd.Stdin = strings.NewReader(answer)
		var out, errb strings.Builder
		cmd.Stdout, cmd.Stderr = &out, &errb
		_ = cmd.Run()
		lines := strings.Split(strings.TrimSuffix(out.String(), "\n"), "\n")
		if code := cmd.ProcessState.ExitCode(); code != exitFailure || lines[len(lines)-1] != "not confirmed; nothing terminated" ||
			!strings.HasSuffix(lines[len(lines)-2], "[y/N] ") || errb.Len() != 0 {
			t.Errorf("break answered %q: exit %d, stdout %q, stderr %q; want 1 and the line %q", answer, code, out.String(),
				errb.String(), "not confirmed; nothing terminated")
		}
		if holders, err := pgtest.Holders(ctx, conn, v); err != nil || len(holders) != 1 {
			t.Fatalf("after break answered %q: holders %v, %v; want the one still holding", answer, holders, err)
		}
	}
}

// The exit statuses in advlock help, in each command's -h and in the table of docs/command.md are the same numbers.
func TestExitCodesDocumented(t *testing.T) {
	number := regexp.MustCompile(`\b\d+\b`)
	codes := func(text string) []string {
		set := number.FindAllString(text, -1)
		slices.Sort(set)
		return slices.Compact(set)
	}
	doc, err := os.ReadFile("../../docs/command.md")
	if err != nil {
		t.Fatal(err)
	}
	_, help, _ := run(t, "", "help")
	_, overall, _ := strings.Cut(help, "\nExit status:\n")
	for _, cmd := range []string{"run", "ls", "break", "demo"} {
		rows := regexp.MustCompile("(?m)^\\| `"+cmd+"` \\|(.*)\\|$").FindAllStringSubmatch(string(doc), -1)
		if len(rows) != 1 {
			t.Errorf("docs/command.md has %d exit status rows for %s; want 1", len(rows), cmd)
			continue
		}
		row := rows[0]
		entry := regexp.MustCompile(`(?m)^  ` + cmd + ` +(.*(\n {10}.*)*)`).FindStringSubmatch(overall)
		if entry == nil {
			t.Errorf("advlock help has no exit status for %s", cmd)
			continue
		}
		_, sub, _ := run(t, "", cmd, "-h")
		_, own, ok := strings.Cut(sub, "Exit status:")
		if !ok {
			t.Errorf("advlock %s -h has no exit status", cmd)
			continue
		}
		want := codes(row[1])
		if got := codes(entry[1]); !slices.Equal(got, want) {
			t.Errorf("%s: advlock help names exit statuses %v, docs/command.md %v", cmd, got, want)
		}
		if got := codes(own); !slices.Equal(got, want) {
			t.Errorf("%s: advlock %s -h names exit statuses %v, docs/command.md %v", cmd, cmd, got, want)
		}
	}
}
