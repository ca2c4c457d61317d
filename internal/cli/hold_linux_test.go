package cli

import (
	"context"
	"fmt"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/advlock/advlock"
	"github.com/advlock/advlock/internal/testkit/pgtest"
	"github.com/jackc/pgx/v5"
)

// run --hold-at-least: a quick COMMAND's KEY stays held until the hold has passed (advlock ls shows it held past
// its work), and run then exits with COMMAND's status; a second host's run --no-wait --quiet meanwhile exits 75
// printing nothing; a signal during the hold ends it at once; a loss during the hold is reported, COMMAND's status
// kept.
func TestRunHoldAtLeast(t *testing.T) {
	ctx := context.Background()
	obs := pgtest.Conn(t, pgtest.URL(t))
	k := strconv.FormatInt(time.Now().UnixNano(), 10) // an int8 KEY: Inspect shows it as it is
	key, _ := advlock.ParseKey(k)
	held := func() bool { _, ok := heldRow(t, obs, key); return ok }

	// A short hold that ends by itself: run exits with COMMAND's status, not before the hold, and lets go. (Only the
	// end is timed here; what is seen during a hold is checked below, in holds of an hour that only a signal or a
	// loss ends, so that a slow machine cannot make the hold pass before the check.)
	const hold = 2 * time.Second
	started := time.Now()
	p := start(t, dbEnv(t), "run", "--no-wait", "--hold-at-least", "2s", k, "--", "sh", "-c", "echo job; exit 3")
	for deadline := time.Now().Add(10 * time.Second); !strings.Contains(p.out.String(), "job"); time.Sleep(10 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatalf("COMMAND did not run: stderr %q", p.err.String())
		}
	}
	time.Sleep(200 * time.Millisecond) // COMMAND has ended; run holds on
	// The grant came after started, so a read that returned before started+hold saw the hold's time.
	if h := held(); !h && time.Since(started) < hold {
		t.Fatalf("KEY not held after COMMAND ended, during the hold")
	}
	if code := p.wait(t, 20*time.Second); code != 3 {
		t.Errorf("run --hold-at-least: exit %d, want COMMAND's 3 (stderr %q)", code, p.err.String())
	}
	if d := time.Since(started); d < hold {
		t.Errorf("run exited %v after it started, before its hold of %v", d, hold)
	}
	if held() {
		t.Errorf("KEY still held after run exited")
	}

	// During a hold: advlock ls shows the key held past its work, in each of its forms; a second host's run
	// --no-wait --quiet exits 75 printing nothing, and without --quiet says why.
	q := start(t, dbEnv(t), "run", "--no-wait", "--hold-at-least", "1h", k, "--", "sh", "-c", commandThenGone)
	inHold(t, obs, key, q)
	if !held() {
		t.Fatalf("KEY not held after COMMAND ended, during the hold")
	}
	url := pgtest.URL(t)
	for _, form := range []struct{ flags, want string }{{"", "lingering"}, {"--tree", "held past its work"}, {"--json", `"lingering": true`}} {
		args := append(strings.Fields(form.flags), "--dsn", url, k)
		if code, out, errOut := run(t, "", append([]string{"ls"}, args...)...); code != 0 || !strings.Contains(out, form.want) {
			t.Errorf("ls %s during the hold: exit %d stderr %q, want %q in:\n%s", form.flags, code, errOut, form.want, out)
		}
	}
	r := start(t, dbEnv(t), "run", "--no-wait", "--quiet", k, "--", "echo", "twice")
	if code := r.wait(t, 20*time.Second); code != exitNotAcquired || r.out.Len() != 0 || r.err.Len() != 0 {
		t.Errorf("a second run --no-wait --quiet during the hold: exit %d stdout %q stderr %q, want 75 and nothing printed",
			code, r.out.String(), r.err.String())
	}
	r = start(t, dbEnv(t), "run", "--no-wait", k, "--", "true")
	if code := r.wait(t, 20*time.Second); code != exitNotAcquired || !strings.Contains(r.err.String(), "held by another holder") {
		t.Errorf("run --no-wait during a hold: exit %d stderr %q", code, r.err.String())
	}
	// A signal during the hold ends it at once, with COMMAND's status.
	if code := endHold(t, obs, key, q); code != 0 {
		t.Errorf("SIGTERM during the hold: exit %d, want COMMAND's 0 (stderr %q)", code, q.err.String())
	}
	if held() {
		t.Errorf("KEY still held after a SIGTERM ended the hold")
	}

	// A loss during the hold: reported, COMMAND's status kept.
	q = start(t, dbEnv(t), "run", "--no-wait", "--hold-at-least", "1h", k, "--", "sh", "-c", commandThenGone)
	inHold(t, obs, key, q)
	if _, err := obs.Exec(ctx, "SELECT pg_terminate_backend($1::int4)", int64(holderOf(t, key).PID)); err != nil {
		t.Fatal(err)
	}
	if code := q.wait(t, 20*time.Second); code != 0 || !strings.Contains(q.err.String(), "lost during --hold-at-least") {
		t.Errorf("a loss during the hold: exit %d stderr %q, want COMMAND's 0 and the loss reported", code, q.err.String())
	}

	if code, _, errOut := run(t, "", "run", "--hold-at-least", "-1s", k, "--", "true"); code != exitUsage || !strings.Contains(errOut, "hold-at-least") {
		t.Errorf("a negative --hold-at-least: exit %d stderr %q, want 2", code, errOut)
	}
}

// commandThenGone is a COMMAND that ignores the signals run forwards, and exits 0.
const commandThenGone = `trap "" TERM INT HUP`

// endHold ends p's hold (inHold first) with one SIGTERM, and returns run's exit status. Once the key is marked held
// past its work, COMMAND has ended and run has unlocked: a signal then is run's, read by its hold (sent while COMMAND
// ran it would be COMMAND's; sent again after the hold ended it could find run's handlers gone).
func endHold(t *testing.T, obs *pgx.Conn, k advlock.Key, p *proc) int {
	t.Helper()
	inHold(t, obs, k, p)
	if err := p.cmd.Process.Signal(syscall.SIGTERM); err != nil {
		t.Fatal(err)
	}
	return p.wait(t, 20*time.Second)
}

// inHold waits until Inspect lists k as held past its work (lingering): p's COMMAND has ended and run, having
// unlocked before its --hold-at-least passed, holds on.
func inHold(t *testing.T, obs *pgx.Conn, k advlock.Key, p *proc) {
	t.Helper()
	for deadline := time.Now().Add(20 * time.Second); ; time.Sleep(20 * time.Millisecond) {
		if r, ok := heldRow(t, obs, k); ok && r.Lingering {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("%s not listed as held past its work 20 s on; stdout %q stderr %q", k, p.out.String(), p.err.String())
		}
	}
}

// run --tick PERIOD: KEY becomes the name KEY@TICK for this host's clock rounded to PERIOD (COMMAND sees it in
// $ADVLOCK_KEY, and the server holds that key while COMMAND runs); a second run of the same tick during the first's
// hold is refused, and a run of a key that is no name is a usage error, as is a negative PERIOD.
func TestRunTick(t *testing.T) {
	name := fmt.Sprintf("tick-test-%d", time.Now().UnixNano())
	const period = time.Hour
	// Clear of a tick's edge (half a period away), so that both runs name the same tick.
	if d := time.Until(time.Now().Round(period).Add(period / 2)); d < 30*time.Second {
		time.Sleep(d + time.Second)
	}
	want := advlock.TickKey(name, time.Now(), period)
	p := start(t, dbEnv(t), "run", "--no-wait", "--tick", "1h", "--hold-at-least", "1h", name, "--", "sh", "-c", `trap "" TERM INT HUP; echo $ADVLOCK_KEY`)
	for deadline := time.Now().Add(10 * time.Second); !strings.Contains(p.out.String(), "@"); time.Sleep(10 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatalf("COMMAND did not run: stderr %q", p.err.String())
		}
	}
	got, err := advlock.ParseKey(strings.TrimSpace(p.out.String()))
	if err != nil || !got.Equal(want) {
		t.Fatalf("$ADVLOCK_KEY %q (%v): want the tick's key %v", p.out.String(), err, want)
	}
	q := start(t, dbEnv(t), "run", "--no-wait", "--quiet", "--tick", "1h", name, "--", "echo", "twice")
	if code := q.wait(t, 20*time.Second); code != exitNotAcquired || q.out.Len() != 0 {
		t.Errorf("a second run of the tick during the hold: exit %d stdout %q, want 75", code, q.out.String())
	}
	if code := endHold(t, pgtest.Conn(t, pgtest.URL(t)), want, p); code != 0 {
		t.Errorf("run --tick: exit %d (stderr %q)", code, p.err.String())
	}
	if code, _, errOut := run(t, "", "run", "--tick", "1m", "42", "--", "true"); code != exitUsage || !strings.Contains(errOut, "--tick needs KEY to be a name") {
		t.Errorf("--tick with an integer KEY: exit %d stderr %q, want 2", code, errOut)
	}
	if code, _, errOut := run(t, "", "run", "--tick", "-1m", name, "--", "true"); code != exitUsage || !strings.Contains(errOut, "tick") {
		t.Errorf("a negative --tick: exit %d stderr %q, want 2", code, errOut)
	}
}
