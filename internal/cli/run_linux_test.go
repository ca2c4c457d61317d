package cli

import (
	"context"
	"fmt"
	"net"
	"net/url"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/advlock/advlock"
	"github.com/advlock/advlock/internal/testkit/faults"
	"github.com/advlock/advlock/internal/testkit/pgtest"
)

// holdKey takes k in this process until the test ends (or the returned function is called).
func holdKey(t *testing.T, k string) func() {
	t.Helper()
	key, err := advlock.ParseKey(k)
	if err != nil {
		t.Fatal(err)
	}
	l := advlock.New(pgtest.Pool(t, pgtest.URL(t), nil))
	t.Cleanup(l.Close)
	lk, err := l.TryLock(context.Background(), key)
	if err != nil {
		t.Fatal(err)
	}
	return func() {
		if err := lk.Unlock(context.Background()); err != nil {
			t.Error(err)
		}
	}
}

// waiters returns the pids waiting for k in pg_locks.
func waiters(t *testing.T, k string) []int32 {
	t.Helper()
	key, _ := advlock.ParseKey(k)
	rows, err := advlock.Inspect(context.Background(), pgtest.Conn(t, pgtest.URL(t)))
	if err != nil {
		t.Fatal(err)
	}
	var pids []int32
	for _, r := range rows {
		if !r.Granted && r.Key.Equal(key) {
			pids = append(pids, r.PID)
		}
	}
	return pids
}

// A command that reads the terminal gets it: it is in the terminal's foreground group, not stopped by SIGTTIN.
func TestRunTerminalRead(t *testing.T) {
	k := keyName(t)
	p, tt := startOnTTY(t, dbEnv(t), "run", k, "--", "sh", "-c", "echo ready; read x; echo got:$x")
	tt.waitFor(t, "ready", 10*time.Second)
	time.Sleep(100 * time.Millisecond) // sh is in read (or stopped, were it in the background)
	tt.typeIn(t, "hello\n")
	if code := p.wait(t, 10*time.Second); code != 0 {
		t.Fatalf("exit %d, want 0; terminal: %q", code, tt.output())
	}
	tt.waitFor(t, "got:hello", 5*time.Second) // what the command read, echoed back
}

// Ctrl-C reaches the command (and only through it advlock): 130, lock released.
func TestRunTerminalCtrlC(t *testing.T) {
	k := keyName(t)
	p, tt := startOnTTY(t, dbEnv(t), "run", k, "--", "sh", "-c", "echo ready; read x")
	tt.waitFor(t, "ready", 10*time.Second)
	tt.typeIn(t, "\x03")
	if code := p.wait(t, 10*time.Second); code != 130 {
		t.Fatalf("Ctrl-C: exit %d, want 130; terminal: %q", code, tt.output())
	}
	key, _ := advlock.ParseKey(k)
	v, _ := key.Int64()
	pgtest.WaitFree(t, pgtest.Conn(t, pgtest.URL(t)), v, 5*time.Second)
}

// Ctrl-Z stops the command and advlock; continuing advlock (as fg does) continues the command with the terminal.
func TestRunTerminalCtrlZ(t *testing.T) {
	k := keyName(t)
	p, tt := startOnTTY(t, dbEnv(t), "run", k, "--", "sh", "-c", "echo pid:$$; read x; echo got:$x")
	pid := tt.number(t, "pid:")
	time.Sleep(100 * time.Millisecond)
	tt.typeIn(t, "\x1a")
	waitState(t, pid, 5*time.Second, "T")
	waitState(t, p.cmd.Process.Pid, 5*time.Second, "T")
	if err := p.cmd.Process.Signal(syscall.SIGCONT); err != nil {
		t.Fatal(err)
	}
	waitState(t, pid, 5*time.Second, "S", "R")
	tt.typeIn(t, "again\n")
	if code := p.wait(t, 10*time.Second); code != 0 {
		t.Fatalf("after Ctrl-Z and SIGCONT: exit %d, terminal %q", code, tt.output())
	}
	tt.waitFor(t, "got:again", 5*time.Second)
}

// SIGKILL of advlock kills the command's whole group, grandchildren too, and the key can be taken at once.
func TestRunDiesWithAdvlock(t *testing.T) {
	k := keyName(t)
	p, tt := startOnTTY(t, dbEnv(t), "run", k, "--", "sh", "-c", "sleep 300 & echo child:$!; echo pid:$$; wait")
	child, pid := tt.number(t, "child:"), tt.number(t, "pid:")
	if err := p.cmd.Process.Kill(); err != nil {
		t.Fatal(err)
	}
	p.wait(t, 5*time.Second)
	for _, q := range []int{pid, child} {
		deadline := time.Now().Add(5 * time.Second)
		for !gone(q) {
			if time.Now().After(deadline) {
				t.Fatalf("process %d of the command still runs (state %s) after advlock was killed", q, procState(q))
			}
			time.Sleep(10 * time.Millisecond)
		}
	}
	q := start(t, dbEnv(t), "run", "--wait", "5s", k, "--", "true")
	if code := q.wait(t, 10*time.Second); code != 0 {
		t.Errorf("second run after advlock was killed: exit %d, stderr %q", code, q.err.String())
	}
}

// After a lost lock, a grandchild that ignores SIGTERM (its parent obeys it) is killed after --grace, before
// advlock exits 70; advlock does not spin while it waits.
func TestRunLostKillsWholeGroup(t *testing.T) {
	k := keyName(t)
	key, _ := advlock.ParseKey(k)
	script := `sh -c 'trap "" TERM; echo gc:$$; while :; do sleep 0.1; done' & trap 'exit 0' TERM; wait`
	p := start(t, dbEnv(t), "run", "--grace", "2s", k, "--", "sh", "-c", script)
	h := holderOf(t, key)
	deadline := time.Now().Add(10 * time.Second)
	for !strings.Contains(p.out.String(), "gc:") && time.Now().Before(deadline) {
		time.Sleep(10 * time.Millisecond)
	}
	var gc int
	if _, err := fmt.Sscanf(p.out.String()[strings.Index(p.out.String(), "gc:"):], "gc:%d", &gc); err != nil {
		t.Fatalf("no grandchild pid in %q", p.out.String())
	}
	t.Cleanup(func() { _ = syscall.Kill(gc, syscall.SIGKILL) }) // if the test fails, before its output is collected
	pgtest.Terminate(t, pgtest.Conn(t, pgtest.URL(t)), uint32(h.PID))
	code := p.wait(t, 15*time.Second)
	if !gone(gc) {
		t.Errorf("advlock exited %d while the grandchild that ignored SIGTERM still ran (state %s)", code, procState(gc))
	}
	if code != exitLost {
		t.Errorf("exit %d, want 70; stderr %q", code, p.err.String())
	}
	if p.took < 2*time.Second {
		t.Errorf("advlock exited after %v, before --grace 2s could have killed the grandchild", p.took)
	}
	if cpu := p.cmd.ProcessState.UserTime() + p.cmd.ProcessState.SystemTime(); cpu > time.Second {
		t.Errorf("advlock used %v of CPU while waiting out a 2s grace period: it spins", cpu)
	}
}

// Flags after KEY are flags, not COMMAND; --wait 0 does not wait; --no-wait with --wait is a usage error.
func TestRunArguments(t *testing.T) {
	k := keyName(t)
	release := holdKey(t, k)
	for _, args := range [][]string{
		{"run", k, "--no-wait", "--", "echo", "ran"},
		{"run", k, "--no-wait", "echo", "ran"},
		{"run", "--wait", "0", k, "--", "echo", "ran"},
		{"run", k, "--wait=0s", "echo", "ran"},
	} {
		p := start(t, dbEnv(t), args...)
		if code := p.wait(t, 10*time.Second); code != exitNotAcquired || p.out.Len() != 0 {
			t.Errorf("%v on a held key: exit %d, stdout %q; want 75 at once and nothing run", args, code, p.out.String())
		}
	}
	for _, args := range [][]string{
		{"run", "--no-wait", "--wait", "0", k, "--", "true"},
		{"run", k, "--wait", "0", "--no-wait", "--", "true"},
		{"run", k, "extra", "--", "true"},
	} {
		code, _, errOut := run(t, "", args...)
		if code != exitUsage {
			t.Errorf("%v: exit %d (%q), want 2", args, code, errOut)
		}
	}
	release()
	p := start(t, dbEnv(t), "run", k, "--shared", "echo", "--no-wait") // after COMMAND starts, flags are COMMAND's
	if code := p.wait(t, 10*time.Second); code != 0 || p.out.String() != "--no-wait\n" {
		t.Errorf("run k --shared echo --no-wait: exit %d stdout %q", code, p.out.String())
	}
}

// --wait bounds the wait for KEY, not connecting: a tiny budget on a free key, or a slow link, still runs.
func TestRunWaitBudget(t *testing.T) {
	k := keyName(t)
	p := start(t, dbEnv(t), "run", "--wait", "1us", k, "--", "echo", "ran")
	if code := p.wait(t, 10*time.Second); code != 0 || p.out.String() != "ran\n" {
		t.Errorf("--wait 1us on a free key: exit %d stdout %q stderr %q, want 0", code, p.out.String(), p.err.String())
	}
	u, err := url.Parse(pgtest.URL(t))
	if err != nil {
		t.Fatal(err)
	}
	px := faults.Start(t, u.Host)
	px.Latency(75 * time.Millisecond) // each way: a 150 ms round trip
	u.Host = px.Addr()
	p = start(t, []string{"DATABASE_URL=" + u.String()}, "run", "--wait", "500ms", k, "--", "echo", "ran")
	if code := p.wait(t, 30*time.Second); code != 0 {
		t.Errorf("--wait 500ms over a 150 ms round trip: exit %d stderr %q, want 0", code, p.err.String())
	}
}

// A connection string that cannot be parsed is a usage error, and no part of it is printed.
func TestRunBadDSN(t *testing.T) {
	for _, dsn := range []string{`host=127.0.0.1 password=my\ secret bogus`, "postgres://u:p@ss-word@127.0.0.1/test"} {
		for _, cmd := range [][]string{{"run", "--dsn", dsn, "k", "--", "true"}, {"ls", "--dsn", dsn}, {"break", "--yes", "--dsn", dsn, "k"}} {
			code, out, errOut := run(t, "", cmd...)
			if code != exitUsage {
				t.Errorf("%s with a malformed DSN: exit %d, want 2", cmd[0], code)
			}
			for _, leak := range []string{"secret", "ss-word", "password="} {
				if strings.Contains(out+errOut, leak) {
					t.Errorf("%s printed part of the DSN (%q): %q", cmd[0], leak, out+errOut)
				}
			}
		}
	}
}

// A wait that times out or is interrupted leaves no waiter in pg_locks: the server is told at once, not at its
// next client_connection_check_interval (5s).
func TestRunNoGhostWaiter(t *testing.T) {
	k := keyName(t)
	holdKey(t, k)
	p := start(t, dbEnv(t), "run", "--wait", "300ms", k, "--", "true")
	if code := p.wait(t, 10*time.Second); code != exitNotAcquired {
		t.Fatalf("exit %d, want 75", code)
	}
	if w := waiters(t, k); len(w) != 0 {
		time.Sleep(time.Second)
		if w := waiters(t, k); len(w) != 0 {
			t.Errorf("1s after run --wait 300ms gave up, pg_locks still shows waiters %v", w)
		}
	}
	p = start(t, dbEnv(t), "run", k, "--", "true")
	for deadline := time.Now().Add(10 * time.Second); len(waiters(t, k)) == 0; time.Sleep(10 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatal("run never waited in the server")
		}
	}
	_ = p.cmd.Process.Signal(syscall.SIGINT)
	if code := p.wait(t, 10*time.Second); code != 130 {
		t.Fatalf("SIGINT while waiting: exit %d, want 130", code)
	}
	if w := waiters(t, k); len(w) != 0 {
		time.Sleep(time.Second)
		if w := waiters(t, k); len(w) != 0 {
			t.Errorf("1s after run was interrupted, pg_locks still shows waiters %v", w)
		}
	}
}

// A signal that reaches advlock while it waits, or as the lock is granted, is never lost: the command either
// does not run, or gets the signal.
func TestRunSignalAtGrant(t *testing.T) {
	k := keyName(t)
	key, _ := advlock.ParseKey(k)
	l := advlock.New(pgtest.Pool(t, pgtest.URL(t), nil))
	defer l.Close()
	script := `trap 'echo got-term; exit 0' TERM; echo started; sleep 0.5; echo finished`
	for i := range 15 {
		lk, err := l.TryLock(context.Background(), key)
		if err != nil {
			t.Fatal(err)
		}
		p := start(t, dbEnv(t), "run", k, "--", "sh", "-c", script)
		for deadline := time.Now().Add(10 * time.Second); len(waiters(t, k)) == 0; time.Sleep(5 * time.Millisecond) {
			if time.Now().After(deadline) {
				t.Fatal("run never waited in the server")
			}
		}
		unlocked := make(chan struct{})
		go func() { _ = lk.Unlock(context.Background()); close(unlocked) }()
		time.Sleep(time.Duration(i*100) * time.Microsecond)
		_ = p.cmd.Process.Signal(syscall.SIGTERM)
		p.wait(t, 10*time.Second)
		<-unlocked
		if strings.Contains(p.out.String(), "finished") {
			t.Fatalf("iteration %d: SIGTERM was lost: the command ran to its end (stdout %q, exit %d)", i, p.out.String(), p.code)
		}
	}
}

// A signal while connecting (to a server that never answers) ends run at once with 128+N; a signal while COMMAND
// runs is forwarded to it, and run exits with COMMAND's status.
func TestRunSignalWhileConnectingAndRunning(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0") // accepts, never answers
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	accepted := make(chan net.Conn, 1)
	go func() {
		if c, err := ln.Accept(); err == nil {
			accepted <- c
		}
	}()
	p := start(t, nil, "run", "--dsn", "postgres://postgres@"+ln.Addr().String()+"/test", "k", "--", "echo", "ran")
	select { // run connects once its signal handling is in place: signal it while it waits for the answer
	case c := <-accepted:
		defer c.Close()
	case <-time.After(30 * time.Second):
		t.Fatal("run never connected")
	}
	_ = p.cmd.Process.Signal(syscall.SIGTERM)
	if code := p.wait(t, 5*time.Second); code != 128+int(syscall.SIGTERM) || p.out.Len() != 0 {
		t.Errorf("SIGTERM while connecting: exit %d stdout %q, want 143 and nothing run", code, p.out.String())
	}

	k := keyName(t)
	p = start(t, dbEnv(t), "run", k, "--", "sh", "-c", `trap 'echo got-term; exit 7' TERM; echo started; while :; do sleep 0.05; done`)
	for deadline := time.Now().Add(10 * time.Second); !strings.Contains(p.out.String(), "started"); time.Sleep(10 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatal("command did not start")
		}
	}
	_ = p.cmd.Process.Signal(syscall.SIGTERM)
	if code := p.wait(t, 10*time.Second); code != 7 || !strings.Contains(p.out.String(), "got-term") {
		t.Errorf("SIGTERM while COMMAND runs: exit %d stdout %q, want COMMAND's 7 after it got SIGTERM", code, p.out.String())
	}
}

// Through a stock PgBouncer: in session mode run holds and releases as directly; in transaction mode it exits 69
// saying why and what to do.
func TestRunThroughPgBouncer(t *testing.T) {
	if testing.Short() {
		t.Skip("starts pgbouncer")
	}
	k := keyName(t)
	key, _ := advlock.ParseKey(k)
	v, _ := key.Int64()
	env := []string{"DATABASE_URL=" + pgtest.Bouncer(t, pgtest.URL(t), "session")}
	p := start(t, env, "run", "--no-wait", k, "--", "sh", "-c", "echo started; sleep 0.5")
	holderOf(t, key)
	if code := p.wait(t, 10*time.Second); code != 0 || !strings.Contains(p.out.String(), "started") {
		t.Errorf("run through PgBouncer in session mode: exit %d stdout %q stderr %q", code, p.out.String(), p.err.String())
	}
	pgtest.WaitFree(t, pgtest.Conn(t, pgtest.URL(t)), v, 5*time.Second)

	env = []string{"DATABASE_URL=" + pgtest.Bouncer(t, pgtest.URL(t), "transaction")}
	p = start(t, env, "run", "--no-wait", k, "--", "echo", "ran")
	if code := p.wait(t, 10*time.Second); code != exitUnavailable || p.out.Len() != 0 ||
		!strings.Contains(p.err.String(), "pool_mode=session") {
		t.Errorf("run through PgBouncer in transaction mode: exit %d stdout %q stderr %q, want 69 saying pool_mode=session", code, p.out.String(), p.err.String())
	}
}

// A frozen holder (advlock stopped with SIGSTOP; its kernel still answers TCP keepalives) loses KEY within about
// 3 --keepalive intervals: a waiter gets it; when the holder is continued it finds the lock lost, ends COMMAND and
// exits 70.
func TestRunFrozenHolder(t *testing.T) {
	k := keyName(t)
	key, _ := advlock.ParseKey(k)
	const keepalive = 300 * time.Millisecond
	p := start(t, dbEnv(t), "run", "--keepalive", keepalive.String(), "--grace", "2s", k, "--", "sh", "-c",
		`trap 'echo got-term; exit 0' TERM; while :; do sleep 0.05; done`)
	holderOf(t, key)
	time.Sleep(2 * keepalive) // a live holder keeps its session past the idle bound
	if err := p.cmd.Process.Signal(syscall.SIGSTOP); err != nil {
		t.Fatal(err)
	}
	stopped := time.Now()
	q := start(t, dbEnv(t), "run", "--wait", "20s", k, "--", "echo", "taken")
	if code := q.wait(t, 25*time.Second); code != 0 || q.out.String() != "taken\n" {
		t.Fatalf("waiter behind a frozen holder: exit %d stdout %q stderr %q", code, q.out.String(), q.err.String())
	}
	took := time.Since(stopped)
	t.Logf("the waiter got the key %v after the holder froze (keepalive %v)", took, keepalive)
	if took > 10*time.Second {
		t.Errorf("the waiter got the key %v after the holder froze, want about 3 keepalives (%v)", took, 3*keepalive)
	}
	if err := p.cmd.Process.Signal(syscall.SIGCONT); err != nil {
		t.Fatal(err)
	}
	if code := p.wait(t, 15*time.Second); code != exitLost || !strings.Contains(p.out.String(), "got-term") {
		t.Errorf("the frozen holder, continued: exit %d stdout %q stderr %q, want 70 after its command got SIGTERM", code, p.out.String(), p.err.String())
	}
}

// COMMAND gets KEY in $ADVLOCK_KEY, and with --fence a token in $ADVLOCK_TOKEN that grows from run to run.
func TestRunPassesKeyAndToken(t *testing.T) {
	k := keyName(t)
	p := start(t, dbEnv(t), "run", k, "--", "sh", "-c", `echo "key=$ADVLOCK_KEY token=${ADVLOCK_TOKEN:-none}"`)
	if code := p.wait(t, 10*time.Second); code != 0 || p.out.String() != "key="+k+" token=none\n" {
		t.Errorf("without --fence: exit %d stdout %q", code, p.out.String())
	}
	var last int64
	for range 3 {
		p := start(t, dbEnv(t), "run", "--fence", k, "--", "sh", "-c", `echo "$ADVLOCK_TOKEN"`)
		if code := p.wait(t, 10*time.Second); code != 0 {
			t.Fatalf("--fence: exit %d stderr %q", code, p.err.String())
		}
		var tok int64
		if _, err := fmt.Sscan(p.out.String(), &tok); err != nil || tok <= last {
			t.Fatalf("--fence: ADVLOCK_TOKEN %q after %d, want a larger number", p.out.String(), last)
		}
		last = tok
	}
}

// A fleet's first deploy: 8 processes run --fence at the same moment on a database that has never seen advlock.
// Every one runs its command with a token of its own (the fencing sequence created once, by whichever came first).
func TestRunFenceFirstUse(t *testing.T) {
	env := []string{"DATABASE_URL=" + pgtest.FreshDB(t, pgtest.URL(t))}
	var ps []*proc
	for i := range 8 {
		ps = append(ps, start(t, env, "run", "--fence", fmt.Sprintf("%s-%d", keyName(t), i), "--", "sh", "-c", `echo "$ADVLOCK_TOKEN"`))
	}
	seen := map[int64]bool{}
	for i, p := range ps {
		if code := p.wait(t, 30*time.Second); code != 0 {
			t.Errorf("process %d: exit %d, stderr %q", i, code, p.err.String())
			continue
		}
		var tok int64
		if _, err := fmt.Sscan(p.out.String(), &tok); err != nil || tok <= 0 || seen[tok] {
			t.Errorf("process %d: ADVLOCK_TOKEN %q (seen %v)", i, p.out.String(), seen)
		}
		seen[tok] = true
	}
}

// advlock run through a multi-host DSN when the primary fails over: the holder's lock goes with the old primary
// (its command gets SIGTERM, exit 70, as for any loss), and once the standby is promoted the next run takes the
// key there with a greater token.
func TestRunFailover(t *testing.T) {
	if testing.Short() {
		t.Skip("starts a private primary and standby")
	}
	primary := pgtest.StartCluster(t)
	standby := pgtest.Standby(t, primary)
	dsn := fmt.Sprintf("host=127.0.0.1,127.0.0.1 port=%d,%d user=postgres dbname=postgres sslmode=disable "+
		"target_session_attrs=read-write connect_timeout=2", primary.Port, standby.Port)
	env := []string{"DATABASE_URL=" + dsn}
	k := keyName(t)
	p := start(t, env, "run", "--fence", "--grace", "2s", k, "--", "sh", "-c",
		`trap 'echo got-term; exit 0' TERM; echo "token=$ADVLOCK_TOKEN"; while :; do sleep 0.05; done`)
	for deadline := time.Now().Add(10 * time.Second); !strings.Contains(p.out.String(), "token="); time.Sleep(20 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatalf("run did not start its command: stderr %q", p.err.String())
		}
	}
	var first int64
	fmt.Sscanf(strings.TrimPrefix(strings.SplitN(p.out.String(), "\n", 2)[0], "token="), "%d", &first)
	time.Sleep(300 * time.Millisecond) // the standby has replayed the grant
	if err := primary.Stop("immediate"); err != nil {
		t.Fatal(err)
	}
	if code := p.wait(t, 15*time.Second); code != exitLost || !strings.Contains(p.out.String(), "got-term") {
		t.Fatalf("the holder when its primary died: exit %d stdout %q stderr %q, want 70 after its command got SIGTERM",
			code, p.out.String(), p.err.String())
	}
	if err := standby.Promote(); err != nil {
		t.Fatal(err)
	}
	q := start(t, env, "run", "--fence", "--wait", "10s", k, "--", "sh", "-c", `echo "$ADVLOCK_TOKEN"`)
	if code := q.wait(t, 20*time.Second); code != 0 {
		t.Fatalf("run after the promotion: exit %d stderr %q", code, q.err.String())
	}
	var next int64
	if _, err := fmt.Sscan(q.out.String(), &next); err != nil || next <= first {
		t.Errorf("run after the promotion: token %q, want one greater than %d", q.out.String(), first)
	}
	t.Logf("token %d on the old primary, %d on the promoted standby", first, next)
}
