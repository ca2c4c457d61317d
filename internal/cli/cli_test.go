package cli

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"net"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/advlock/advlock"
	"github.com/advlock/advlock/internal/testkit/pgtest"
	"github.com/jackc/pgx/v5"
)

var update = flag.Bool("update", false, "rewrite golden files")

// bin is the advlock binary built for the end-to-end tests.
var bin string

func TestMain(m *testing.M) {
	flag.Parse()
	dir, err := os.MkdirTemp("", "advlock-bin-")
	if err != nil {
		panic(err)
	}
	bin = filepath.Join(dir, "advlock")
	out, err := exec.Command("go", "build", "-o", bin, "github.com/advlock/advlock/cmd/advlock").CombinedOutput()
	if err != nil {
		fmt.Fprintf(os.Stderr, "build advlock: %v\n%s", err, out)
		os.Exit(1)
	}
	code := pgtest.Main(m)
	os.RemoveAll(dir)
	os.Exit(code)
}

// run runs the built advlock binary with args and stdin, and returns its exit status, stdout and stderr.
func run(t *testing.T, stdin string, args ...string) (int, string, string) {
	t.Helper()
	var out, errb bytes.Buffer
	cmd := exec.Command(bin, args...)
	cmd.Stdin, cmd.Stdout, cmd.Stderr = strings.NewReader(stdin), &out, &errb
	err := cmd.Run()
	var ee *exec.ExitError
	if err != nil && !errors.As(err, &ee) {
		t.Fatalf("advlock %v: %v", args, err)
	}
	return cmd.ProcessState.ExitCode(), out.String(), errb.String()
}

func golden(t *testing.T, name, got string) {
	t.Helper()
	path := filepath.Join("testdata", name)
	if *update {
		if err := os.WriteFile(path, []byte(got), 0o644); err != nil {
			t.Fatal(err)
		}
		return
	}
	want, err := os.ReadFile(path)
	if err != nil {
		t.Fatalf("%v (run go test ./internal/cli -update)", err)
	}
	if got != string(want) {
		t.Errorf("%s differs from the golden file:\n--- got\n%s\n--- want\n%s", name, got, want)
	}
}

func TestHelp(t *testing.T) {
	for name, args := range map[string][]string{
		"help.golden":       {"help"},
		"run-help.golden":   {"run", "-h"},
		"ls-help.golden":    {"ls", "-h"},
		"break-help.golden": {"break", "-h"},
		"demo-help.golden":  {"demo", "-h"},
	} {
		code, out, errOut := run(t, "", args...)
		if code != 0 || errOut != "" {
			t.Errorf("%v: exit %d, stderr %q", args, code, errOut)
		}
		golden(t, name, out)
	}
	if code, out, _ := run(t, "", "--version"); code != 0 || !strings.HasPrefix(out, "advlock ") {
		t.Errorf("--version: %d %q", code, out)
	}
}

func TestTable(t *testing.T) {
	now := time.Date(2026, 11, 30, 12, 0, 0, 0, time.Local)
	wait := now.Add(-1500 * time.Millisecond)
	rows := []advlock.LockInfo{
		{Key: advlock.NameKey("billing-sync"), Granted: true, PID: 4242, ApplicationName: "advlock run billing-sync",
			ClientAddr: "10.1.2.3", BackendStart: now.Add(-time.Hour), State: "idle"},
		{Key: advlock.NameKey("billing-sync"), WaitStart: &wait, BlockedBy: []int32{4242}, PID: 4343,
			ApplicationName: "cron", ClientAddr: "local", BackendStart: now.Add(-time.Minute), State: "active"},
		{Key: advlock.PairKey(1, -2), Shared: true, Granted: true, PID: 77, ClientAddr: "::1", State: "idle"},
		{Key: advlock.Int64Key(9), Granted: true, PID: 88, ApplicationName: "svc", ClientAddr: "10.1.2.4", State: "idle"},
		{Key: advlock.Int64Key(10), Granted: true, PID: 88, ApplicationName: "svc", ClientAddr: "10.1.2.4", State: "idle",
			Lingering: true},
		{Key: advlock.Int64Key(11), WaitStart: &wait, BlockedBy: []int32{4343}, PID: 89, ApplicationName: "svc",
			ClientAddr: "10.1.2.4", State: "active"},
	}
	var b bytes.Buffer
	printTable(&b, rows, now)
	printClients(&b, rows)
	printTable(&b, nil, now)
	printClients(&b, nil)
	printLockTable(&b, advlock.LockTableUse{Advisory: 5000, Used: 5012, Capacity: 7040})
	golden(t, "ls-table.golden", b.String())
}

func TestUsageErrors(t *testing.T) {
	for _, tc := range []struct {
		args []string
		want string
	}{
		{[]string{"run", "pair:1", "--", "true"}, "separated by a comma"},
		{[]string{"run", "int:x", "--", "true"}, `"x" after int:`},
		{[]string{"run", "k"}, "missing COMMAND"},
		{[]string{"run"}, "missing KEY"},
		{[]string{"run", "--no-wait", "--wait", "1s", "k", "--", "true"}, "exclude each other"},
		{[]string{"run", "--bogus", "k", "--", "true"}, "unknown flag --bogus"},
		{[]string{"ls", "a", "b"}, "at most one KEY"},
		{[]string{"break"}, "exactly one KEY"},
		{[]string{"frobnicate"}, "unknown command"},
		{[]string{"--bogus"}, "unknown command"},
		{nil, "Usage:"},
	} {
		code, _, errOut := run(t, "", tc.args...)
		if code != exitUsage || !strings.Contains(errOut, tc.want) {
			t.Errorf("%v: exit %d, stderr %q; want exit 2 naming %q", tc.args, code, errOut, tc.want)
		}
		// One line says what was wrong (two with the synopsis), not the whole help; only no arguments at all
		// prints the usage.
		if lines := strings.Count(strings.TrimSpace(errOut), "\n") + 1; tc.args != nil && lines > 2 {
			t.Errorf("%v: %d lines on stderr, want at most 2:\n%s", tc.args, lines, errOut)
		}
		if tc.args != nil && !strings.HasPrefix(errOut, "advlock: ") {
			t.Errorf("%v: stderr %q does not start with \"advlock: \"", tc.args, errOut)
		}
	}
}

// syncBuffer is a bytes.Buffer that a process writes while a test reads it.
type syncBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (s *syncBuffer) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.Write(p)
}
func (s *syncBuffer) String() string { s.mu.Lock(); defer s.mu.Unlock(); return s.b.String() }
func (s *syncBuffer) Len() int       { s.mu.Lock(); defer s.mu.Unlock(); return s.b.Len() }

// proc runs the built binary.
type proc struct {
	cmd      *exec.Cmd
	out, err syncBuffer
	done     chan struct{}
	code     int
	took     time.Duration
}

func start(t *testing.T, env []string, args ...string) *proc {
	t.Helper()
	p := &proc{cmd: exec.Command(bin, args...), done: make(chan struct{})}
	p.cmd.Env = append(os.Environ(), env...)
	p.cmd.Stdout, p.cmd.Stderr = &p.out, &p.err
	begin := time.Now()
	if err := p.cmd.Start(); err != nil {
		t.Fatal(err)
	}
	go func() {
		_ = p.cmd.Wait()
		p.took = time.Since(begin)
		p.code = p.cmd.ProcessState.ExitCode()
		close(p.done)
	}()
	t.Cleanup(func() {
		_ = p.cmd.Process.Kill()
		<-p.done
	})
	return p
}

func (p *proc) wait(t *testing.T, within time.Duration) int {
	t.Helper()
	select {
	case <-p.done:
		return p.code
	case <-time.After(within):
		t.Fatalf("%v still running after %v; stdout %q stderr %q", p.cmd.Args, within, p.out.String(), p.err.String())
		return -1
	}
}

func keyName(t *testing.T) string {
	return "cli-" + strings.ReplaceAll(t.Name(), "/", "-") + "-" + fmt.Sprint(time.Now().UnixNano())
}

func dbEnv(t *testing.T) []string { return []string{"DATABASE_URL=" + pgtest.URL(t)} }

// holderOf waits until the server shows a holder of key and returns it.
func holderOf(t *testing.T, key advlock.Key) advlock.LockInfo {
	t.Helper()
	conn := pgtest.Conn(t, pgtest.URL(t))
	deadline := time.Now().Add(10 * time.Second)
	for {
		if r, ok := heldRow(t, conn, key); ok {
			return r
		}
		if time.Now().After(deadline) {
			t.Fatalf("nobody holds %s", key)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// heldRow is Inspect's row of key's holder, read once, if one holds it.
func heldRow(t *testing.T, conn *pgx.Conn, key advlock.Key) (advlock.LockInfo, bool) {
	t.Helper()
	rows, err := advlock.Inspect(context.Background(), conn)
	if err != nil {
		t.Fatal(err)
	}
	for _, r := range rows {
		if r.Granted && r.Key.Equal(key) {
			return r, true
		}
	}
	return advlock.LockInfo{}, false
}

func TestRunExclusion(t *testing.T) {
	k := keyName(t)
	var ps []*proc
	for range 2 {
		ps = append(ps, start(t, dbEnv(t), "run", "--no-wait", k, "--", "sleep", "1"))
	}
	codes := map[int]int{}
	for _, p := range ps {
		codes[p.wait(t, 20*time.Second)]++
	}
	if codes[0] != 1 || codes[exitNotAcquired] != 1 {
		t.Errorf("two concurrent run --no-wait: exit codes %v, want one 0 and one 75", codes)
	}
}

func TestRunPassesStatusAndOutput(t *testing.T) {
	p := start(t, dbEnv(t), "run", "--no-wait", keyName(t), "--", "sh", "-c", "echo hello; exit 3")
	if code := p.wait(t, 20*time.Second); code != 3 || p.out.String() != "hello\n" {
		t.Errorf("exit %d stdout %q, want 3 and hello", code, p.out.String())
	}
	p = start(t, dbEnv(t), "run", keyName(t), "--", "/nonexistent/cmd")
	if code := p.wait(t, 20*time.Second); code != exitNotFound {
		t.Errorf("missing command: exit %d, want 127", code)
	}
}

func TestRunWaitsBehindHolder(t *testing.T) {
	k := keyName(t)
	key, _ := advlock.ParseKey(k)
	l := advlock.New(pgtest.Pool(t, pgtest.URL(t), nil))
	defer l.Close()
	lk, err := l.TryLock(context.Background(), key)
	if err != nil {
		t.Fatal(err)
	}
	p := start(t, dbEnv(t), "run", "--wait", "10s", k, "--", "echo", "ran")
	time.Sleep(300 * time.Millisecond)
	select {
	case <-p.done:
		t.Fatalf("run did not wait behind the holder: exit %d", p.code)
	default:
	}
	if err := lk.Unlock(context.Background()); err != nil {
		t.Fatal(err)
	}
	if code := p.wait(t, 10*time.Second); code != 0 || p.out.String() != "ran\n" {
		t.Errorf("exit %d stdout %q stderr %q", code, p.out.String(), p.err.String())
	}

	// --wait elapses: 75.
	lk, err = l.TryLock(context.Background(), key)
	if err != nil {
		t.Fatal(err)
	}
	defer lk.Unlock(context.Background())
	p = start(t, dbEnv(t), "run", "--wait", "300ms", k, "--", "echo", "ran")
	if code := p.wait(t, 10*time.Second); code != exitNotAcquired || p.out.Len() != 0 {
		t.Errorf("--wait elapsed: exit %d stdout %q, want 75 and no output", code, p.out.String())
	}
}

// While run holds the key, ls --json shows it with run's application_name; when the holder's backend is
// terminated, the command gets SIGTERM and run exits 70.
func TestRunLost(t *testing.T) {
	k := keyName(t)
	key, _ := advlock.ParseKey(k)
	script := `trap 'echo got-term; exit 0' TERM; echo started; while :; do sleep 0.05; done`
	p := start(t, dbEnv(t), "run", "--grace", "5s", k, "--", "sh", "-c", script)
	h := holderOf(t, key)

	code, out, errOut := run(t, "", "ls", "--json", "--dsn", pgtest.URL(t), k)
	if code != 0 {
		t.Fatalf("ls --json: %d %s", code, errOut)
	}
	var rows []map[string]any
	if err := json.Unmarshal([]byte(out), &rows); err != nil {
		t.Fatalf("ls --json output %q: %v", out, err)
	}
	if len(rows) != 1 || rows[0]["application_name"] != "advlock run "+k || rows[0]["key"] != k ||
		rows[0]["granted"] != true || rows[0]["mode"] != "exclusive" {
		t.Errorf("ls --json = %s", out)
	}

	// Without KEY, ls shows the key by the name advlock run's session is named after, not as int:N.
	code, out, errOut = run(t, "", "ls", "--json", "--dsn", pgtest.URL(t))
	if code != 0 || !strings.Contains(out, `"key": "`+k+`"`) {
		t.Errorf("ls --json without KEY (exit %d, %s) does not name %s: %s", code, errOut, k, out)
	}
	conn := pgtest.Conn(t, pgtest.URL(t))
	time.Sleep(50 * time.Millisecond)
	pgtest.Terminate(t, conn, uint32(h.PID))
	if code := p.wait(t, 10*time.Second); code != exitLost {
		t.Errorf("run after its lock was lost: exit %d, want 70; stderr %q", code, p.err.String())
	}
	if !strings.Contains(p.out.String(), "got-term") {
		t.Errorf("command did not get SIGTERM: stdout %q", p.out.String())
	}
	if !strings.Contains(p.err.String(), "lost") {
		t.Errorf("stderr does not say the lock was lost: %q", p.err.String())
	}
}

func TestRunDatabaseDown(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	port := ln.Addr().(*net.TCPAddr).Port
	ln.Close()
	down := fmt.Sprintf("postgres://postgres:secret-pw@127.0.0.1:%d/test", port)
	p := start(t, nil, "run", "--dsn", down, "--wait", "2s", "k", "--", "echo", "ran")
	if code := p.wait(t, 10*time.Second); code != exitUnavailable || p.took > 5*time.Second {
		t.Errorf("database down: exit %d after %v, want 69 at once", code, p.took)
	}
	if strings.Contains(p.err.String(), "secret-pw") {
		t.Errorf("password printed: %q", p.err.String())
	}
	blackhole, err := net.Listen("tcp", "127.0.0.1:0") // accepts, never answers
	if err != nil {
		t.Fatal(err)
	}
	defer blackhole.Close()
	var wg sync.WaitGroup
	wg.Add(1)
	go func() {
		defer wg.Done()
		for {
			c, err := blackhole.Accept()
			if err != nil {
				return
			}
			defer c.Close()
		}
	}()
	// An address that swallows packets: connecting is bounded by the DSN's connect_timeout (not by --wait).
	p = start(t, nil, "run", "--dsn", "postgres://postgres@"+blackhole.Addr().String()+"/test?connect_timeout=1", "k", "--", "echo", "ran")
	if code := p.wait(t, 10*time.Second); code != exitUnavailable || p.took > 5*time.Second {
		t.Errorf("unanswering database: exit %d after %v, want 69 within the 1s connect_timeout", code, p.took)
	}
	blackhole.Close()
	wg.Wait()
}

func TestBreak(t *testing.T) {
	k := keyName(t)
	key, _ := advlock.ParseKey(k)
	url := pgtest.URL(t)
	l := advlock.New(pgtest.Pool(t, url, nil))
	defer l.Close()
	lk, err := l.TryLock(context.Background(), key)
	if err != nil {
		t.Fatal(err)
	}
	code, out, _ := run(t, "n\n", "break", "--dsn", url, k)
	if code != exitFailure || !strings.Contains(out, "not confirmed") {
		t.Errorf("break answered n: exit %d, out %q", code, out)
	}
	select {
	case <-lk.Done():
		t.Fatal("holder terminated without confirmation")
	default:
	}
	code, out, errOut := run(t, "", "break", "--yes", "--dsn", url, k)
	if code != 0 || !strings.Contains(out, "terminated pid") {
		t.Fatalf("break --yes: exit %d out %q err %q", code, out, errOut)
	}
	select {
	case <-lk.Done():
	case <-time.After(5 * time.Second):
		t.Fatal("holder not told after break")
	}
	if code, out, _ := run(t, "", "break", "--yes", "--dsn", url, k); code != 0 || !strings.Contains(out, "no session or lease holds") {
		t.Errorf("break of a free key: %d %q", code, out)
	}
}

// break without the privilege to terminate the holder: exit 77 with the reason.
func TestBreakNoPrivilege(t *testing.T) {
	if testing.Short() {
		t.Skip("starts a private cluster")
	}
	c := pgtest.StartCluster(t)
	admin := pgtest.Conn(t, c.URL)
	if _, err := admin.Exec(context.Background(), "CREATE ROLE weak LOGIN"); err != nil {
		t.Fatal(err)
	}
	k := keyName(t)
	key, _ := advlock.ParseKey(k)
	l := advlock.New(pgtest.Pool(t, c.URL, nil))
	defer l.Close()
	if _, err := l.TryLock(context.Background(), key); err != nil {
		t.Fatal(err)
	}
	weak := strings.Replace(c.URL, "postgres@", "weak@", 1)
	code, _, errOut := run(t, "", "break", "--yes", "--dsn", weak, k)
	if code != exitNoPerm || !strings.Contains(errOut, "pg_signal_backend") {
		t.Errorf("break without privilege: exit %d stderr %q, want 77 explaining the privilege", code, errOut)
	}
}

func TestDemo(t *testing.T) {
	if testing.Short() {
		t.Skip("runs the whole demo")
	}
	p := start(t, dbEnv(t), "demo")
	if code := p.wait(t, 60*time.Second); code != 0 {
		t.Fatalf("demo: exit %d\n%s\n%s", code, p.out.String(), p.err.String())
	}
	for _, want := range []string{"TWO HOLDERS AT ONCE", "not acquired", "at most 1 holder of any job", "advlock demo worker",
		"holder told after", "waiter granted"} {
		if !strings.Contains(p.out.String(), want) {
			t.Errorf("demo output lacks %q:\n%s", want, p.out.String())
		}
	}
}

// Keys other tools lock: while SQL holds golang-migrate's migration lock for the test database (as its postgres
// driver takes it) and a lock on hashtext(name), run with those KEYs is not acquired (75), ls names them, and once
// released run gets them.
func TestRunOtherToolsKeys(t *testing.T) {
	conn := pgtest.Conn(t, pgtest.URL(t))
	ctx := context.Background()
	var db string
	if err := conn.QueryRow(ctx, "SELECT current_database()").Scan(&db); err != nil {
		t.Fatal(err)
	}
	name := keyName(t)
	mig, _ := advlock.GolangMigrateKey(db, "public", "schema_migrations").Int64()
	if _, err := conn.Exec(ctx, `SELECT pg_advisory_lock($1::bigint), pg_advisory_lock(hashtext($2))`, mig, name); err != nil {
		t.Fatal(err)
	}
	for _, k := range []string{"migrate:" + db, "hashtext:" + name} {
		p := start(t, dbEnv(t), "run", "--no-wait", k, "--", "echo", "ran")
		if code := p.wait(t, 20*time.Second); code != exitNotAcquired {
			t.Errorf("run %s while SQL holds it: exit %d (stderr %q), want 75", k, code, p.err.String())
		}
	}
	code, out, errOut := run(t, "", "ls", "--dsn", pgtest.URL(t))
	if code != 0 || !strings.Contains(out, "migrate:"+db+"/public/schema_migrations") {
		t.Errorf("ls (exit %d, %s) does not name golang-migrate's lock:\n%s", code, errOut, out)
	}
	code, out, _ = run(t, "", "ls", "--json", "--dsn", pgtest.URL(t), "hashtext:"+name)
	if code != 0 || !strings.Contains(out, `"key": "hashtext:`+name+`"`) {
		t.Errorf("ls hashtext:%s (exit %d):\n%s", name, code, out)
	}
	if _, err := conn.Exec(ctx, `SELECT pg_advisory_unlock_all()`); err != nil {
		t.Fatal(err)
	}
	for _, k := range []string{"migrate:" + db, "hashtext:" + name} {
		p := start(t, dbEnv(t), "run", "--no-wait", k, "--", "echo", "ran")
		if code := p.wait(t, 20*time.Second); code != 0 || p.out.String() != "ran\n" {
			t.Errorf("run %s once free: exit %d stdout %q stderr %q", k, code, p.out.String(), p.err.String())
		}
	}
	if code, _, errOut := run(t, "", "run", "--no-wait", "migrate:a/b/c/d", "--", "true"); code != exitUsage || !strings.Contains(errOut, "migrate:") {
		t.Errorf("bad migrate: key: exit %d, %q", code, errOut)
	}
}

// ls --tree: each key, its holders (one held past its work), then its waiters longest first, with wait times and
// whom they queue behind.
func TestLsTreeGolden(t *testing.T) {
	now := time.Date(2026, 11, 30, 12, 0, 10, 0, time.UTC)
	at := func(s int) *time.Time { x := now.Add(-time.Duration(s) * time.Second); return &x }
	rows := []advlock.LockInfo{
		{Key: advlock.NameKey("nightly-report"), Granted: true, PID: 101, ApplicationName: "advlock run nightly-report", ClientAddr: "10.0.0.5"},
		{Key: advlock.NameKey("nightly-report"), WaitStart: at(2), BlockedBy: []int32{101}, PID: 202, ApplicationName: "worker"},
		{Key: advlock.NameKey("nightly-report"), WaitStart: at(7), BlockedBy: []int32{101}, PID: 203, ApplicationName: "worker"},
		{Key: advlock.NameKey("nightly-report"), Shared: true, WaitStart: at(1), BlockedBy: []int32{101, 202}, PID: 204},
		{Key: advlock.PairKey(3, 17), Shared: true, Granted: true, PID: 301, ApplicationName: "api"},
		{Key: advlock.PairKey(3, 17), Shared: true, Granted: true, PID: 302, ApplicationName: "api"},
		{Key: advlock.Int64Key(42), WaitStart: at(60), BlockedBy: []int32{999}, PID: 401},
		{Key: advlock.NameKey("reports@2026-11-30T12:00:00Z"), Granted: true, PID: 501, ApplicationName: "advlock run reports", ClientAddr: "10.0.0.7", Lingering: true},
	}
	var b strings.Builder
	printTree(&b, rows, now)
	golden(t, "tree.golden", b.String())
}

// ls --watch on a pipe prints one snapshot after another, with no escape codes, and ends cleanly when its context
// does (here once it has printed 3, however long a loaded machine takes over them); --dsn also works before the
// command.
func TestLsWatchSnapshots(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	var errb bytes.Buffer
	out := &framesOut{frame: "advlock ls, every 100ms", want: 3, full: cancel}
	code := Main(ctx, []string{"--dsn", pgtest.URL(t), "ls", "--watch", "--interval", "100ms"}, Stdio{In: strings.NewReader(""), Out: out, Err: &errb})
	if code != 0 {
		t.Fatalf("exit %d: %s", code, errb.String())
	}
	if n := out.frames(); n < 3 || strings.Contains(out.String(), "\x1b") {
		t.Errorf("%d frames in 30 s (want 3), escape codes: %v\n%s", n, strings.Contains(out.String(), "\x1b"), out.String())
	}
	if code, _, errOut := run(t, "", "--dsn"); code != exitUsage || !strings.Contains(errOut, "--dsn") {
		t.Errorf("--dsn without a value: exit %d %q", code, errOut)
	}
	if code, _, _ := run(t, "", "--dsn="+pgtest.URL(t), "ls", "--json"); code != 0 {
		t.Errorf("--dsn=URL ls: exit %d", code)
	}
	if code, _, errOut := run(t, "", "ls", "--json", "--tree"); code != exitUsage {
		t.Errorf("--json --tree: exit %d %q", code, errOut)
	}
}

// A server that answers with an error is the user's problem to see: demo says what it answered and exits 69,
// without starting a throwaway server; only when nothing answers does it start one.
func TestDemoServerRefuses(t *testing.T) {
	u, err := url.Parse(pgtest.URL(t))
	if err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct{ name, user, db, want string }{
		{"missing database", "postgres", "no_such_db_advlock", "3D000"},
		{"missing role", "no_such_role_advlock", "postgres", "28000"},
	} {
		v := *u
		v.User = url.User(tc.user)
		v.Path = "/" + tc.db
		p := start(t, []string{"DATABASE_URL=" + v.String()}, "demo")
		code := p.wait(t, 30*time.Second)
		if code != exitUnavailable || !strings.Contains(p.err.String(), tc.want) || strings.Contains(p.out.String(), "throwaway") {
			t.Errorf("%s: exit %d, stderr %q, stdout %q; want 69 naming %s and no throwaway server", tc.name, code,
				p.err.String(), p.out.String(), tc.want)
		}
	}
}

// framesOut is a command's output that calls full once it holds want frames (each starting with frame).
type framesOut struct {
	mu    sync.Mutex
	b     bytes.Buffer
	frame string
	want  int
	full  func()
}

func (o *framesOut) Write(p []byte) (int, error) {
	o.mu.Lock()
	defer o.mu.Unlock()
	n, err := o.b.Write(p)
	if strings.Count(o.b.String(), o.frame) >= o.want {
		o.full()
	}
	return n, err
}

func (o *framesOut) frames() int {
	o.mu.Lock()
	defer o.mu.Unlock()
	return strings.Count(o.b.String(), o.frame)
}

func (o *framesOut) String() string {
	o.mu.Lock()
	defer o.mu.Unlock()
	return o.b.String()
}
