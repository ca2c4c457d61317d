package cli

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"os"
	"os/signal"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/advlock/advlock"
	"github.com/advlock/advlock/internal/session"
)

const runSynopsis = "[--wait DURATION | --no-wait] [--shared | --leases] [--fence] [--hold-at-least DURATION] [--tick PERIOD] [--quiet] [--grace DURATION] [--keepalive DURATION] [--dsn DSN] KEY [--] COMMAND [ARGS...]"

const runExits = `
Holds KEY while COMMAND runs and releases it when COMMAND exits. COMMAND finds KEY in $ADVLOCK_KEY (as advlock
writes keys) and, with --fence, the grant's fencing token in $ADVLOCK_TOKEN: a resource that keeps the largest
token it saw (UPDATE ... SET fence = $ADVLOCK_TOKEN WHERE ... AND fence < $ADVLOCK_TOKEN) refuses a holder whose
lock was lost once a later holder has written. Flags may come before or after KEY; COMMAND
starts after "--" (or at the first argument after KEY that is not a flag). A "--" may also come before KEY
(advlock run -- -7 COMMAND, for a KEY that starts with "-"); COMMAND then follows KEY, after another "--" or not.

COMMAND runs in a process group of its own, which gets the terminal when advlock has it (so COMMAND can read it
and Ctrl-C, Ctrl-Z and Ctrl-\ reach COMMAND, as with flock). SIGINT, SIGTERM, SIGHUP and SIGTSTP sent to advlock
are forwarded to that group. If advlock dies (even by SIGKILL), the whole group is killed: nothing runs without
the lock.

A DURATION is seconds (5, 0.5, as with flock -w) or a Go duration (1m30s, 500ms). The wait for KEY (--wait)
does not include connecting; connecting is bounded by the DSN's connect_timeout (default 10s). --wait 0 is
--no-wait. If advlock itself freezes (SIGSTOP, a debugger, a stuck VM), the server ends its session after 3
--keepalive intervals of silence and a waiter gets KEY; when advlock resumes it finds the lock lost and ends
COMMAND (exit 70). COMMAND runs on while advlock is frozen: protect what it writes with a fencing check if that
matters.

With --leases (or ADVLOCK_LEASES=1 in the environment, for a crontab), KEY is held as a lease: a row of the table
public.advlock_lease, taken, renewed and released by single statements, so that it works behind a pooler in
transaction mode (PgBouncer pool_mode=transaction, Supabase's and Neon's pooled ports). A lease excludes only
other leases of KEY, not session locks of it: every run of a job must use --leases or none. Its fencing token is
always in $ADVLOCK_TOKEN. A lease lasts 15s, renewed every 5s; if advlock freezes or dies, a waiter gets KEY once
the lease expires (--keepalive does not apply), and when advlock resumes it finds the lease lost and ends COMMAND
(exit 70). advlock break KEY deletes a lease; its holder learns at its next renewal (within 5s) and ends COMMAND.
--leases takes no --shared lock and detects no deadlock: a nested run's wait for a lease needs --wait.

A scheduled job on several hosts (the same crontab everywhere, a Kubernetes CronJob in several clusters) runs
once per tick with --hold-at-least: KEY stays held until DURATION after it was acquired, even when COMMAND ends
sooner, so that a host whose clock or start is later by less than DURATION finds KEY held and skips the run (with
--no-wait: exit 75; --quiet prints nothing then, for cron, which mails every line it sees). advlock exits with
COMMAND's status once the hold has passed; SIGINT, SIGTERM or SIGHUP during the hold end it at once (COMMAND's
status still), and a lock lost during the hold is reported on stderr (another host may then run the tick again).
DURATION must end before the next tick's first host starts: for a job every minute and clocks within a few
seconds, --hold-at-least 30s. Or name the run's tick in the key with --tick PERIOD (the schedule's period): KEY
becomes the name KEY@TICK, TICK being this host's clock rounded to the nearest multiple of PERIOD (UTC, as in
minutely-sync@2026-12-03T12:00:00Z); ticks never share a key, so DURATION need only exceed how far the hosts'
clocks and starts differ, which must stay under half of PERIOD.

An advlock run inside COMMAND knows what this one holds ($ADVLOCK_HOLDING): if its wait closes a cycle of waits
(two nested runs taking two keys in opposite orders), one of the waits gives up (exit 71) instead of both waiting
for ever; its parent run then exits 71 too (COMMAND's status), releasing its key, and the other proceeds.

Exit status: COMMAND's (128+N if it died of signal N); 75 KEY not acquired (--no-wait, --wait 0, or --wait
elapsed); 71 deadlock: the wait for KEY closed a cycle of waits; 69 database unreachable or refused; 70 lock
lost while COMMAND ran (COMMAND's group got SIGTERM, then SIGKILL after --grace); 126 COMMAND could not be run;
127 COMMAND not found; 2 usage error; 128+N if advlock got signal N before COMMAND started.
`

// runArgs splits run's arguments into flags (parsed into fs), KEY and COMMAND. Flags may come before or after
// KEY; COMMAND is everything after the first "--", or, without one, everything from the first argument after KEY
// that is not a flag. A "--" before KEY ends the flags: KEY is the argument after it (even one that looks like a
// flag, such as -7), then COMMAND, after a second "--" if there is one.
func runArgs(fs *flag.FlagSet, args []string) (key string, command []string, err error) {
	before, after, dashes := args, []string(nil), false
	if i := slices.Index(args, "--"); i >= 0 {
		before, after, dashes = args[:i], args[i+1:], true
	}
	var pos []string
	for {
		if err := fs.Parse(before); err != nil {
			return "", nil, err
		}
		rest := fs.Args()
		if len(rest) == 0 {
			break
		}
		pos = append(pos, rest[0])
		before = rest[1:]
		if !dashes && len(pos) == 2 { // KEY, then the first word of COMMAND: the rest is COMMAND's
			return pos[0], append(pos[1:], before...), nil
		}
	}
	switch {
	case len(pos) == 0 && len(after) > 0: // run [FLAGS] -- KEY [--] COMMAND
		command = after[1:]
		if len(command) > 0 && command[0] == "--" {
			command = command[1:]
		}
		return after[0], command, nil
	case len(pos) == 0:
		return "", nil, argError("missing KEY")
	case len(pos) > 1:
		return "", nil, argError(fmt.Sprintf("unexpected %q between KEY and --", pos[1]))
	}
	return pos[0], after, nil
}

// argError is a mistake in run's arguments other than in a flag.
type argError string

func (e argError) Error() string { return string(e) }

func runCmd(ctx context.Context, args []string, std Stdio) int {
	fs := newFlags("run", runSynopsis, runExits)
	wait := durationFlag(fs, "wait", 0, "give up (exit 75) if KEY is not acquired within `DURATION` (0: do not wait); default: wait as long as it takes")
	noWait := fs.Bool("no-wait", false, "exit 75 at once if KEY is held elsewhere")
	shared := fs.Bool("shared", false, "take KEY in shared mode (any number of shared holders, no exclusive one)")
	fence := fs.Bool("fence", false, "pass a fencing token to COMMAND in $ADVLOCK_TOKEN (greater than every token before it;\n"+
		"needs the sequence public.advlock_fence, created if missing)")
	grace := durationFlag(fs, "grace", 10*time.Second, "after the lock is lost, COMMAND has `DURATION` between SIGTERM and SIGKILL")
	keepalive := durationFlag(fs, "keepalive", 5*time.Second, "ping the lock's session after `DURATION` of silence; the server ends it after 3 of them,\n"+
		"so if advlock freezes (SIGSTOP, a stuck VM) a waiter gets KEY within about 3x this")
	leases := fs.Bool("leases", envBool("ADVLOCK_LEASES"), "hold KEY as a lease, a row of a table, instead of a session lock: works through any pooler\n"+
		"(default $ADVLOCK_LEASES)")
	holdAtLeast := durationFlag(fs, "hold-at-least", 0, "keep KEY held until `DURATION` after it was acquired, even when COMMAND ends sooner;\n"+
		"exit with COMMAND's status once it has passed (a scheduled job on several hosts)")
	tick := durationFlag(fs, "tick", 0, "name the run's tick in the key: KEY@TICK, this host's clock rounded to the nearest multiple of\n"+
		"`PERIOD` (a scheduled job on several hosts, with --hold-at-least)")
	quiet := fs.Bool("quiet", false, "print nothing when KEY is held elsewhere (exit 75): for cron, which mails every line")
	flagDSN := fs.String("dsn", "", "connection string (default $DATABASE_URL, then the PG* variables)")
	keyArg, command, err := runArgs(fs, args)
	if ae := argError(""); errors.As(err, &ae) {
		return usageError(std, "run: %s\nUsage: advlock run %s", ae, runSynopsis)
	}
	if code, done := parsed(fs, std, err); done {
		return code
	}
	key, err := parseKeyArg(keyArg)
	if err != nil {
		return usageError(std, "run: %s", describe(err))
	}
	if len(command) == 0 {
		return usageError(std, "run: missing COMMAND after KEY %s\nUsage: advlock run %s", keyArg, runSynopsis)
	}
	waitSet := false
	fs.Visit(func(f *flag.Flag) { waitSet = waitSet || f.Name == "wait" })
	if *noWait && waitSet {
		return usageError(std, "run: --wait and --no-wait exclude each other")
	}
	if v := os.Getenv("ADVLOCK_LEASES"); v != "" {
		if _, err := strconv.ParseBool(v); err != nil {
			return usageError(std, "run: ADVLOCK_LEASES=%q: want 1, t or true (in any case) for leases, 0, f or false for none", v)
		}
	}
	if *leases && *shared {
		return usageError(std, "run: --shared and --leases exclude each other (a lease is exclusive)")
	}
	switch {
	case *wait < 0:
		return badValue(fs, std, "wait", "must not be negative")
	case *grace < 0:
		return badValue(fs, std, "grace", "must not be negative")
	case *keepalive <= 0:
		return badValue(fs, std, "keepalive", "must be positive")
	case *holdAtLeast < 0:
		return badValue(fs, std, "hold-at-least", "must not be negative")
	case *tick < 0:
		return badValue(fs, std, "tick", "must not be negative")
	}
	if *tick > 0 {
		name, ok := key.Name()
		if !ok {
			return usageError(std, "run: --tick needs KEY to be a name (the key becomes the name KEY@TICK), not %s", keyArg)
		}
		key = advlock.TickKey(name, time.Now(), *tick)
	}
	if waitSet && *wait == 0 {
		*noWait = true // as flock -w 0: do not wait
	}
	conn, code, bad := connString(std, "run", *flagDSN)
	if bad {
		return code
	}

	// Signals: until COMMAND starts they abort (SIGTSTP stops advlock); once it runs they are forwarded to its group.
	sigs := make(chan os.Signal, 8)
	signal.Notify(sigs, syscall.SIGINT, syscall.SIGTERM, syscall.SIGHUP, syscall.SIGTSTP)
	defer signal.Stop(sigs)
	sctx, cancel := context.WithCancelCause(ctx)
	defer cancel(nil)
	stopSigWatch := make(chan struct{})
	var gotSig os.Signal
	sigWatchDone := make(chan struct{})
	go func() {
		defer close(sigWatchDone)
		for {
			select {
			case s := <-sigs:
				if s == syscall.SIGTSTP { // Ctrl-Z while waiting: stop, as any foreground job does
					_ = syscall.Kill(os.Getpid(), syscall.SIGSTOP)
					continue
				}
				gotSig = s
				cancel(errSignal)
				return
			case <-stopSigWatch:
				return
			}
		}
	}()

	if advlock.NeedsServer(keyArg) { // hashtext: the server computes the key
		if key, err = resolveKey(sctx, conn, keyArg); err != nil {
			close(stopSigWatch)
			<-sigWatchDone
			if gotSig != nil {
				return 128 + int(gotSig.(syscall.Signal))
			}
			fmt.Fprintf(std.Err, "advlock: run: %s\n", describe(err))
			return exitUnavailable
		}
	}
	opts := []advlock.Option{advlock.WithKeepalive(*keepalive)}
	if *fence {
		opts = append(opts, advlock.WithFencing())
	}
	if *leases {
		opts = append(opts, advlock.WithLeases(), advlock.WithLeaseHolder("advlock run "+keyArg))
	}
	lk, l, code := acquire(sctx, std, conn, key, *shared, *noWait, *quiet, *wait, opts, advlock.HoldAtLeast(*holdAtLeast))
	close(stopSigWatch)
	<-sigWatchDone
	if l != nil {
		defer l.Close()
	}
	if gotSig != nil { // during the wait, or between the grant and now: COMMAND never starts
		if lk != nil {
			_ = lk.Unlock(ctx)
		}
		fmt.Fprintf(std.Err, "advlock: run: %v before %s was acquired and COMMAND started\n", gotSig, key)
		return 128 + int(gotSig.(syscall.Signal))
	}
	if lk == nil {
		return code
	}
	return supervise(ctx, std, lk, key, command, sigs, *grace, *holdAtLeast > 0)
}

// acquire connects and takes key. Connecting has its own budget (the DSN's connect_timeout, default 10s); the
// lock is tried first, and only then waited for, within wait if it is not zero. It returns the lock, or the exit
// status when there is none.
func acquire(ctx context.Context, std Stdio, conn string, key advlock.Key, shared, noWait, quiet bool, wait time.Duration, opts []advlock.Option, hold advlock.CallOption) (*advlock.Lock, *advlock.Locker, int) {
	l, err := open(ctx, conn, "advlock run "+key.String(), opts...)
	if err != nil {
		if ctx.Err() == nil {
			fmt.Fprintf(std.Err, "advlock: run: %s\n", describe(err))
		}
		return nil, nil, exitUnavailable
	}
	try, lock := l.TryLock, l.Lock
	if shared {
		try, lock = l.TryRLock, l.RLock
	}
	lk, err := try(ctx, key, hold)
	if errors.Is(err, advlock.ErrNotAcquired) && !noWait {
		// An advlock run that runs this one holds its key on this one's behalf (ADVLOCK_HOLDING): a wait that
		// closes a cycle through it ends with ErrDeadlock.
		wctx, cancel := session.WithHeld(ctx, holdingEnv()...), context.CancelFunc(func() {})
		if wait > 0 {
			wctx, cancel = context.WithTimeout(wctx, wait)
		}
		lk, err = lock(wctx, key, hold)
		cancel()
		if errors.Is(err, advlock.ErrDeadlock) && ctx.Err() == nil {
			fmt.Fprintf(std.Err, "advlock: run: %v\n", err)
			return nil, l, exitDeadlock
		}
		if err != nil && ctx.Err() == nil && errors.Is(err, context.DeadlineExceeded) {
			if !quiet {
				fmt.Fprintf(std.Err, "advlock: %s not acquired within %v\n", key, wait)
			}
			return nil, l, exitNotAcquired
		}
	}
	switch {
	case err == nil:
		return lk, l, 0
	case ctx.Err() != nil: // a signal; reported by the caller
		return nil, l, 0
	case errors.Is(err, advlock.ErrNotAcquired):
		if !quiet {
			fmt.Fprintf(std.Err, "advlock: %s is held by another holder\n", key)
		}
		return nil, l, exitNotAcquired
	}
	fmt.Fprintf(std.Err, "advlock: run: %s\n", describe(err))
	return nil, l, exitUnavailable
}

// supervise runs command under lk until it exits, forwarding signals, and ends its group if the lock is lost.
func supervise(ctx context.Context, std Stdio, lk *advlock.Lock, key advlock.Key, command []string, sigs <-chan os.Signal, grace time.Duration, hold bool) int {
	env := []string{"ADVLOCK_KEY=" + key.String(), "ADVLOCK_HOLDING=" + holding(lk)}
	if lk.Token() != 0 {
		env = append(env, "ADVLOCK_TOKEN="+strconv.FormatInt(lk.Token(), 10))
	}
	j, err := startJob(command, env, std)
	if err != nil {
		_ = lk.Unlock(ctx)
		fmt.Fprintf(std.Err, "advlock: run: %v\n", err)
		return exitCannotExec
	}
	lost := false
	lostC := lk.Done()
	ready := j.ready()
	var kill <-chan time.Time
	var ws syscall.WaitStatus
loop:
	for {
		select {
		case s := <-sigs:
			j.signal(s.(syscall.Signal))
		case <-ready:
			ready = nil
			j.flush()
		case <-lostC:
			lostC = nil // once: a closed channel would fire forever
			lost = true
			fmt.Fprintf(std.Err, "advlock: lock %s lost while the command ran: %s; sending SIGTERM\n", key, describe(lk.Err()))
			j.lost()
			kill = time.After(grace)
		case <-kill:
			kill = nil
			fmt.Fprintf(std.Err, "advlock: command's process group still running %v after SIGTERM; sending SIGKILL\n", grace)
			j.signal(syscall.SIGKILL)
		case ev := <-j.events:
			if ev.stopped {
				j.suspend()
				close(ev.resume)
				continue
			}
			if ev.err != nil {
				fmt.Fprintf(std.Err, "advlock: run: wait: %v\n", ev.err)
			}
			ws = ev.ws
			break loop
		}
	}
	j.finish()
	uctx, ucancel := context.WithTimeout(context.WithoutCancel(ctx), 10*time.Second)
	defer ucancel()
	// With --hold-at-least an Unlock before the hold has passed leaves the key held until it has (marked held past
	// its work, as advlock ls shows), once the server said the lock is still held.
	err = lk.Unlock(uctx)
	if err != nil && !lost {
		if errors.Is(err, advlock.ErrLockLost) {
			fmt.Fprintf(std.Err, "advlock: lock %s was lost before the command's end was recorded: %s\n", key, describe(err))
			return exitLost
		}
		fmt.Fprintf(std.Err, "advlock: warning: %s\n", describe(err))
	}
	if hold && !lost { // also when the question got no answer: the key stays held until the hold has passed
		holdOn(std, lk, key, sigs)
	}
	switch {
	case lost:
		return exitLost
	case ws.Signaled():
		return 128 + int(ws.Signal())
	case ws.Exited():
		return ws.ExitStatus() // the guard exits with COMMAND's status, 128+N for a signal, 126/127 if not run
	}
	return exitCannotExec
}

// holdOn waits, after COMMAND has ended, for the end of lk, which its early Unlock left held until its
// --hold-at-least has passed: its release, or a signal (the caller's Close then releases it at once), or its loss,
// which it reports (another host may run the tick again; the status stays COMMAND's).
func holdOn(std Stdio, lk *advlock.Lock, key advlock.Key, sigs <-chan os.Signal) {
	for {
		select {
		case s := <-sigs:
			if s == syscall.SIGTSTP {
				continue
			}
			return
		case <-lk.Done():
			if errors.Is(lk.Err(), advlock.ErrLockLost) {
				fmt.Fprintf(std.Err, "advlock: lock %s lost during --hold-at-least (another host may run the job again): %s\n",
					key, describe(lk.Err()))
			}
			return
		}
	}
}

var errSignal = errors.New("signal received")

// envBool is the boolean the environment variable name holds (false when unset or not a boolean: runCmd refuses
// that).
func envBool(name string) bool {
	v, _ := strconv.ParseBool(os.Getenv(name))
	return v
}

// holdingEnv reads ADVLOCK_HOLDING, which an advlock run that runs this process sets to what it holds (and what
// those that run it hold): "pid.objsubid.classid.objid.mode" for each lock, comma-separated.
func holdingEnv() []session.Ref {
	var refs []session.Ref
	for f := range strings.SplitSeq(os.Getenv("ADVLOCK_HOLDING"), ",") {
		if r, ok := session.ParseRef(f); ok {
			refs = append(refs, r)
		}
	}
	return refs
}

// holding is ADVLOCK_HOLDING for COMMAND: lk, then what this process's own ADVLOCK_HOLDING says.
func holding(lk *advlock.Lock) string {
	var id session.ID
	if v, ok := lk.Key().Int64(); ok {
		id = session.ID{V: v}
	} else if a, b, ok := lk.Key().Pair(); ok {
		id = session.ID{Pair: true, V: int64(a)<<32 | int64(uint32(b))}
	}
	refs := []string{session.Ref{PID: lk.PID(), ID: id, Shared: lk.Shared()}.String()}
	for _, r := range holdingEnv() {
		refs = append(refs, r.String())
	}
	return strings.Join(refs, ",")
}
