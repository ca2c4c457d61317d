package cli

import (
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"os/signal"
	"syscall"
	"time"

	"github.com/advlock/advlock"
)

const runSynopsis = "[--wait DURATION | --no-wait] [--shared] [--grace DURATION] [--dsn DSN] KEY -- COMMAND [ARGS...]"

const runExits = `
Holds KEY while COMMAND runs (in its own process group; SIGINT, SIGTERM and SIGHUP are forwarded to it) and
releases it when COMMAND exits.

Exit status: COMMAND's (128+N if it died of signal N); 75 KEY not acquired (--no-wait, or --wait elapsed);
69 database unreachable or refused; 70 lock lost while COMMAND ran (COMMAND got SIGTERM, then SIGKILL after
--grace); 126 COMMAND could not be run; 127 COMMAND not found; 2 usage error; 128+N if advlock got signal N
while waiting for KEY.
`

func runCmd(ctx context.Context, args []string, std Stdio) int {
	fs := newFlags("run", runSynopsis, std, runExits)
	wait := fs.Duration("wait", 0, "give up (exit 75) if KEY is not acquired within `DURATION`; default: wait as long as it takes")
	noWait := fs.Bool("no-wait", false, "exit 75 at once if KEY is held elsewhere")
	shared := fs.Bool("shared", false, "take KEY in shared mode (any number of shared holders, no exclusive one)")
	grace := fs.Duration("grace", 10*time.Second, "after the lock is lost, how long COMMAND has between SIGTERM and SIGKILL")
	flagDSN := fs.String("dsn", "", "connection string (default $DATABASE_URL, then the PG* variables)")
	if code, done := parse(fs, args, std); done {
		return code
	}
	rest := fs.Args()
	if len(rest) == 0 {
		return usageError(std, "run: missing KEY\nUsage: advlock run %s", runSynopsis)
	}
	key, err := advlock.ParseKey(rest[0])
	if err != nil {
		return usageError(std, "run: %s", describe(err))
	}
	command := rest[1:]
	if len(command) > 0 && command[0] == "--" {
		command = command[1:]
	}
	if len(command) == 0 {
		return usageError(std, "run: missing COMMAND after KEY --")
	}
	if *noWait && *wait != 0 {
		return usageError(std, "run: --wait and --no-wait exclude each other")
	}
	if *wait < 0 || *grace < 0 {
		return usageError(std, "run: durations must not be negative")
	}

	// Signals: while waiting they abort the wait; once COMMAND runs they are forwarded to it.
	sigs := make(chan os.Signal, 4)
	signal.Notify(sigs, syscall.SIGINT, syscall.SIGTERM, syscall.SIGHUP)
	defer signal.Stop(sigs)
	wctx, cancel := context.WithCancelCause(ctx)
	defer cancel(nil)
	if *wait > 0 {
		var c context.CancelFunc
		wctx, c = context.WithTimeout(wctx, *wait)
		defer c()
	}
	stopSigWatch := make(chan struct{})
	var gotSig os.Signal
	sigWatchDone := make(chan struct{})
	go func() {
		defer close(sigWatchDone)
		select {
		case s := <-sigs:
			gotSig = s
			cancel(errSignal)
		case <-stopSigWatch:
		}
	}()

	l, err := open(wctx, dsn(*flagDSN), "advlock run "+key.String())
	var lk *advlock.Lock
	if err == nil {
		defer l.Close()
		switch {
		case *noWait && *shared:
			lk, err = l.TryRLock(wctx, key)
		case *noWait:
			lk, err = l.TryLock(wctx, key)
		case *shared:
			lk, err = l.RLock(wctx, key)
		default:
			lk, err = l.Lock(wctx, key)
		}
	}
	close(stopSigWatch)
	<-sigWatchDone
	if err != nil {
		switch {
		case gotSig != nil:
			fmt.Fprintf(std.Err, "advlock: run: %v while waiting for %s\n", gotSig, key)
			return 128 + int(gotSig.(syscall.Signal))
		case errors.Is(err, advlock.ErrNotAcquired):
			fmt.Fprintf(std.Err, "advlock: %s is held by another session\n", key)
			return exitNotAcquired
		case l != nil && errors.Is(err, context.DeadlineExceeded):
			fmt.Fprintf(std.Err, "advlock: %s not acquired within %v\n", key, *wait)
			return exitNotAcquired
		}
		fmt.Fprintf(std.Err, "advlock: run: %s\n", describe(err))
		return exitUnavailable
	}

	cmd := exec.Command(command[0], command[1:]...)
	cmd.Stdin, cmd.Stdout, cmd.Stderr = std.In, std.Out, std.Err
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true} // signals go to COMMAND's whole process group
	if err := cmd.Start(); err != nil {
		_ = lk.Unlock(ctx)
		fmt.Fprintf(std.Err, "advlock: run: %v\n", err)
		if errors.Is(err, exec.ErrNotFound) || errors.Is(err, os.ErrNotExist) {
			return exitNotFound
		}
		return exitCannotExec
	}
	exited := make(chan struct{})
	var waitErr error
	go func() {
		waitErr = cmd.Wait()
		close(exited)
	}()
	pgid := cmd.Process.Pid
	signalGroup := func(s syscall.Signal) { _ = syscall.Kill(-pgid, s) }

	lost := false
	var kill <-chan time.Time
	for done := false; !done; {
		select {
		case s := <-sigs:
			signalGroup(s.(syscall.Signal))
		case <-lk.Done():
			if !lost {
				lost = true
				fmt.Fprintf(std.Err, "advlock: lock %s lost while the command ran: %s; sending SIGTERM\n", key, describe(lk.Err()))
				signalGroup(syscall.SIGTERM)
				kill = time.After(*grace)
			}
		case <-kill:
			fmt.Fprintf(std.Err, "advlock: command still running %v after SIGTERM; sending SIGKILL\n", *grace)
			signalGroup(syscall.SIGKILL)
			kill = nil
		case <-exited:
			done = true
		}
	}
	uctx, ucancel := context.WithTimeout(context.WithoutCancel(ctx), 10*time.Second)
	defer ucancel()
	if err := lk.Unlock(uctx); err != nil && !lost {
		if errors.Is(err, advlock.ErrLockLost) {
			fmt.Fprintf(std.Err, "advlock: lock %s was lost before the command's end was recorded: %s\n", key, describe(err))
			return exitLost
		}
		fmt.Fprintf(std.Err, "advlock: warning: %s\n", describe(err))
	}
	if lost {
		return exitLost
	}
	return exitStatus(waitErr, cmd)
}

var errSignal = errors.New("signal received")

func exitStatus(err error, cmd *exec.Cmd) int {
	if cmd.ProcessState == nil {
		return exitCannotExec
	}
	if ws, ok := cmd.ProcessState.Sys().(syscall.WaitStatus); ok && ws.Signaled() {
		return 128 + int(ws.Signal())
	}
	return cmd.ProcessState.ExitCode()
}
