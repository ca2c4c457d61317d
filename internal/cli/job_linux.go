package cli

import (
	"errors"
	"fmt"
	"os"
	"os/exec"
	"os/signal"
	"runtime"
	"sync/atomic"
	"syscall"
	"unsafe"
)

// How advlock run supervises COMMAND (Linux):
//
//	advlock run ──(pipe)──> guard (advlock __guard, leader of a new process group) ──> COMMAND (same group)
//
// The guard is the same binary. It exists so that nothing of COMMAND outlives advlock's session: when advlock
// dies for any reason, even SIGKILL, the kernel closes the pipe and the guard kills the whole group. The guard is
// a child subreaper, so descendants whose parents exit stay its children; after a lost lock it waits for all of
// them (advlock SIGKILLs the group after --grace), so that a child that ignores SIGTERM cannot run on unlocked.
// When advlock has a controlling terminal and is in its foreground, the group gets the terminal (as a shell gives
// it to a job), so COMMAND can read it and Ctrl-C reaches COMMAND. A stop (Ctrl-Z, SIGTTIN) of COMMAND stops the
// guard and then advlock itself, so the shell sees its job stopped; fg/bg continue all three.

// guardCmd is the hidden subcommand that runs the guard.
const guardCmd = "__guard"

// job is COMMAND under its guard.
type job struct {
	guard  *exec.Cmd
	pgid   int
	tty    *os.File // the controlling terminal, when advlock has one
	ctl    *os.File // write end of the guard's control pipe: 'L' = the lock was lost; EOF = advlock is gone
	events chan jobEvent
	// started is closed once COMMAND exists (the guard closed its end of a pipe, or exited): a signal sent to the
	// group before then would reach only the guard, so signal holds them until then.
	started chan struct{}
	held    []syscall.Signal
}

// jobEvent is what wait4 said about the guard: it stopped (resume is closed when it may be waited for again),
// or it ended.
type jobEvent struct {
	stopped bool
	resume  chan struct{}
	ws      syscall.WaitStatus
	err     error
}

// startJob starts COMMAND under its guard with env added to advlock's environment.
func startJob(command, env []string, std Stdio) (*job, error) {
	exe, err := os.Executable()
	if err != nil {
		return nil, fmt.Errorf("cannot find the advlock executable to guard COMMAND: %w", err)
	}
	r, w, err := os.Pipe()
	if err != nil {
		return nil, err
	}
	defer r.Close()
	sr, sw, err := os.Pipe()
	if err != nil {
		w.Close()
		return nil, err
	}
	defer sw.Close()
	j := &job{ctl: w, events: make(chan jobEvent), started: make(chan struct{})}
	args := []string{guardCmd}
	attr := &syscall.SysProcAttr{Setpgid: true}
	if tty, err := os.OpenFile("/dev/tty", os.O_RDWR, 0); err == nil {
		j.tty = tty
		args = append(args, "--relay-stops")
		if pg, err := tcgetpgrp(tty); err == nil && pg == syscall.Getpgrp() {
			attr.Foreground, attr.Ctty = true, int(tty.Fd()) // set in the child, before exec
		}
	}
	j.guard = exec.Command(exe, append(append(args, "--"), command...)...)
	j.guard.Stdin, j.guard.Stdout, j.guard.Stderr = std.In, std.Out, std.Err
	j.guard.Env = append(os.Environ(), env...) // the guard passes its environment on to COMMAND
	j.guard.ExtraFiles = []*os.File{r, sw}
	j.guard.SysProcAttr = attr
	if err := j.guard.Start(); err != nil {
		w.Close()
		sr.Close()
		if j.tty != nil {
			j.tty.Close()
		}
		return nil, fmt.Errorf("cannot start COMMAND's guard: %w", err)
	}
	j.pgid = j.guard.Process.Pid
	// advlock is now in the background of its terminal: writing to it (with stty tostop) or taking it back must
	// not stop advlock. Set only now, since an ignored signal stays ignored across exec.
	signal.Ignore(syscall.SIGTTOU)
	go j.wait()
	go func() {
		defer sr.Close()
		var b [1]byte
		_, _ = sr.Read(b[:]) // EOF: the guard started COMMAND, or exited
		close(j.started)
	}()
	return j, nil
}

// wait reports the guard's stops and its end on j.events.
func (j *job) wait() {
	for {
		var ws syscall.WaitStatus
		_, err := syscall.Wait4(j.pgid, &ws, syscall.WUNTRACED, nil)
		if errors.Is(err, syscall.EINTR) {
			continue
		}
		if err == nil && ws.Stopped() {
			ev := jobEvent{stopped: true, resume: make(chan struct{})}
			j.events <- ev
			<-ev.resume
			continue
		}
		j.events <- jobEvent{ws: ws, err: err}
		return
	}
}

// signal sends s to COMMAND's whole process group (held until COMMAND exists; see started). A group with no
// process left is not an error.
func (j *job) signal(s syscall.Signal) {
	select {
	case <-j.started:
	default:
		if s != syscall.SIGKILL {
			j.held = append(j.held, s)
			return
		}
	}
	_ = syscall.Kill(-j.pgid, s)
}

// ready is closed once COMMAND exists; then flush sends what signal held.
func (j *job) ready() <-chan struct{} { return j.started }

func (j *job) flush() {
	for _, s := range j.held {
		_ = syscall.Kill(-j.pgid, s)
	}
	j.held = nil
}

// lost tells the guard the lock was lost: it then sends SIGTERM to the group and waits for every descendant.
func (j *job) lost() { _, _ = j.ctl.Write([]byte{'L'}) }

// suspend follows COMMAND's stop: advlock takes its terminal back and stops itself, so that the shell sees the
// job stopped; when continued (fg or bg) it gives the terminal back if it is in the foreground again, and
// continues the group.
func (j *job) suspend() {
	self := syscall.Getpgrp()
	if j.tty != nil {
		if pg, err := tcgetpgrp(j.tty); err == nil && pg == j.pgid {
			_ = tcsetpgrp(j.tty, self)
		}
	}
	// kill(self, SIGSTOP) may return before this thread is stopped (the stop reaches the threads asynchronously):
	// wait for the SIGCONT that ends the stop.
	cont := make(chan os.Signal, 1)
	signal.Notify(cont, syscall.SIGCONT)
	_ = syscall.Kill(os.Getpid(), syscall.SIGSTOP)
	<-cont
	signal.Stop(cont)
	if j.tty != nil {
		if pg, err := tcgetpgrp(j.tty); err == nil && pg == self {
			_ = tcsetpgrp(j.tty, j.pgid)
		}
	}
	_ = syscall.Kill(-j.pgid, syscall.SIGCONT)
}

// finish gives the terminal back to advlock's group and lets exec.Cmd collect its I/O goroutines (the guard is
// already reaped, so its Wait reports ECHILD, which is expected).
func (j *job) finish() {
	if j.tty != nil {
		if pg, err := tcgetpgrp(j.tty); err == nil && pg == j.pgid {
			_ = tcsetpgrp(j.tty, syscall.Getpgrp())
		}
		j.tty.Close()
	}
	_ = j.guard.Wait()
	j.ctl.Close()
}

func tcgetpgrp(f *os.File) (int, error) {
	var pg int32
	if _, _, e := syscall.Syscall(syscall.SYS_IOCTL, f.Fd(), syscall.TIOCGPGRP, uintptr(unsafe.Pointer(&pg))); e != 0 {
		return 0, e
	}
	return int(pg), nil
}

func tcsetpgrp(f *os.File, pg int) error {
	p := int32(pg)
	if _, _, e := syscall.Syscall(syscall.SYS_IOCTL, f.Fd(), syscall.TIOCSPGRP, uintptr(unsafe.Pointer(&p))); e != 0 {
		return e
	}
	return nil
}

// guardMain is the guard process: args are [--relay-stops] -- COMMAND [ARGS...]; fd 3 is the control pipe, fd 4
// is closed once COMMAND has been started (so that advlock forwards no signal to a group without COMMAND). It
// exits with COMMAND's status (128+N if COMMAND died of signal N; 126 or 127 if it could not be run).
func guardMain(args []string, std Stdio) int {
	relay := len(args) > 0 && args[0] == "--relay-stops"
	if relay {
		args = args[1:]
	}
	if len(args) < 2 || args[0] != "--" {
		fmt.Fprintln(std.Err, "advlock: __guard is internal to advlock run")
		return exitUsage
	}
	command := args[1:]
	syscall.CloseOnExec(3) // inherited from advlock without it; COMMAND must not hold either pipe
	syscall.CloseOnExec(4)
	ctl, started := os.NewFile(3, "advlock-control"), os.NewFile(4, "advlock-started")
	// Caught, not ignored, so that COMMAND starts with the default actions: the guard itself must outlive
	// COMMAND whatever the terminal or advlock sends the group.
	sigs := make(chan os.Signal, 16)
	signal.Notify(sigs, syscall.SIGINT, syscall.SIGTERM, syscall.SIGHUP, syscall.SIGQUIT, syscall.SIGTSTP,
		syscall.SIGTTIN, syscall.SIGTTOU, syscall.SIGPIPE)
	go func() {
		for range sigs {
		}
	}()
	if _, _, e := syscall.RawSyscall(syscall.SYS_PRCTL, prSetChildSubreaper, 1, 0); e != 0 {
		fmt.Fprintf(std.Err, "advlock: run: guard: cannot become a subreaper: %v\n", e)
		return exitCannotExec
	}
	path, err := exec.LookPath(command[0])
	if err != nil {
		fmt.Fprintf(std.Err, "advlock: run: %v\n", err)
		if errors.Is(err, exec.ErrNotFound) || errors.Is(err, os.ErrNotExist) {
			return exitNotFound
		}
		return exitCannotExec
	}
	// COMMAND dies with the guard (Pdeathsig is tied to the thread that starts it: keep this one).
	runtime.LockOSThread()
	proc, err := os.StartProcess(path, command, &os.ProcAttr{
		Files: []*os.File{os.Stdin, os.Stdout, os.Stderr},
		Sys:   &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL},
	})
	if err != nil {
		fmt.Fprintf(std.Err, "advlock: run: %v\n", err)
		if errors.Is(err, os.ErrNotExist) {
			return exitNotFound
		}
		return exitCannotExec
	}
	started.Close() // COMMAND is in the group now: advlock may forward signals to it
	var lostMode atomic.Bool
	go func() {
		var b [1]byte
		for {
			if _, err := ctl.Read(b[:]); err != nil { // advlock is gone: nothing may run without its lock
				_ = syscall.Kill(0, syscall.SIGKILL)
				return
			}
			if b[0] == 'L' {
				lostMode.Store(true) // before anyone gets SIGTERM: the guard then waits for every descendant
				_ = syscall.Kill(0, syscall.SIGTERM)
			}
		}
	}()
	status := -1
	for {
		var ws syscall.WaitStatus
		pid, err := syscall.Wait4(-1, &ws, syscall.WUNTRACED, nil)
		switch {
		case errors.Is(err, syscall.EINTR):
			continue
		case err != nil: // ECHILD: no descendant left
			return status
		case ws.Stopped():
			if relay && pid == proc.Pid {
				_ = syscall.Kill(os.Getpid(), syscall.SIGSTOP) // advlock sees it and stops too
			}
			continue
		case pid == proc.Pid:
			status = ws.ExitStatus()
			if ws.Signaled() {
				status = 128 + int(ws.Signal())
			}
			if !lostMode.Load() {
				return status
			}
		}
	}
}

const prSetChildSubreaper = 36 // PR_SET_CHILD_SUBREAPER
