package cli

import (
	"bytes"
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"
	"unsafe"

	"github.com/advlock/advlock/internal/testkit/pgtest"
	"github.com/jackc/pgx/v5"
)

// tty is a pseudo-terminal whose slave side is the controlling terminal of a process started on it, as a login
// shell's would be: the process leads a new session and its group is the terminal's foreground group.
type tty struct {
	master *os.File
	mu     sync.Mutex
	out    bytes.Buffer
	read   chan struct{}
}

func ioctl(fd, req uintptr, arg unsafe.Pointer) error {
	if _, _, e := syscall.Syscall(syscall.SYS_IOCTL, fd, req, uintptr(arg)); e != 0 {
		return e
	}
	return nil
}

// startOnTTY starts the built advlock with args on a new pseudo-terminal.
func startOnTTY(t *testing.T, env []string, args ...string) (*proc, *tty) {
	t.Helper()
	m, err := os.OpenFile("/dev/ptmx", os.O_RDWR|syscall.O_NOCTTY, 0)
	if err != nil {
		t.Fatal(err)
	}
	var unlock int32
	var n uint32
	if err := ioctl(m.Fd(), syscall.TIOCSPTLCK, unsafe.Pointer(&unlock)); err != nil {
		t.Fatal(err)
	}
	if err := ioctl(m.Fd(), syscall.TIOCGPTN, unsafe.Pointer(&n)); err != nil {
		t.Fatal(err)
	}
	s, err := os.OpenFile("/dev/pts/"+strconv.Itoa(int(n)), os.O_RDWR|syscall.O_NOCTTY, 0)
	if err != nil {
		t.Fatal(err)
	}
	tt := &tty{master: m, read: make(chan struct{}, 1)}
	go func() {
		buf := make([]byte, 4096)
		for {
			n, err := m.Read(buf)
			tt.mu.Lock()
			tt.out.Write(buf[:n])
			tt.mu.Unlock()
			select {
			case tt.read <- struct{}{}:
			default:
			}
			if err != nil {
				return
			}
		}
	}()
	p := &proc{cmd: exec.Command(bin, args...), done: make(chan struct{})}
	p.cmd.Env = append(os.Environ(), env...)
	p.cmd.Stdin, p.cmd.Stdout, p.cmd.Stderr = s, s, s
	p.cmd.SysProcAttr = &syscall.SysProcAttr{Setsid: true, Setctty: true, Ctty: 0}
	begin := time.Now()
	if err := p.cmd.Start(); err != nil {
		t.Fatal(err)
	}
	s.Close()
	go func() {
		_ = p.cmd.Wait()
		p.took = time.Since(begin)
		p.code = p.cmd.ProcessState.ExitCode()
		if ws, ok := p.cmd.ProcessState.Sys().(syscall.WaitStatus); ok && ws.Signaled() {
			p.code = 128 + int(ws.Signal())
		}
		close(p.done)
	}()
	t.Cleanup(func() {
		_ = p.cmd.Process.Kill()
		<-p.done
		m.Close()
	})
	return p, tt
}

func (tt *tty) output() string {
	tt.mu.Lock()
	defer tt.mu.Unlock()
	return tt.out.String()
}

// waitFor waits until the terminal has shown s.
func (tt *tty) waitFor(t *testing.T, s string, within time.Duration) {
	t.Helper()
	deadline := time.After(within)
	for !strings.Contains(tt.output(), s) {
		select {
		case <-tt.read:
		case <-deadline:
			t.Fatalf("the terminal did not show %q within %v; it shows %q", s, within, tt.output())
		}
	}
}

// typeIn writes s as typed at the keyboard (\x03 is Ctrl-C, \x1a Ctrl-Z).
func (tt *tty) typeIn(t *testing.T, s string) {
	t.Helper()
	if _, err := tt.master.Write([]byte(s)); err != nil {
		t.Fatal(err)
	}
}

// number returns the integer the terminal showed after prefix (as "pid:1234").
func (tt *tty) number(t *testing.T, prefix string) int {
	t.Helper()
	tt.waitFor(t, prefix, 10*time.Second)
	out := tt.output()
	rest := out[strings.Index(out, prefix)+len(prefix):]
	end := strings.IndexFunc(rest, func(r rune) bool { return r < '0' || r > '9' })
	if end < 0 {
		end = len(rest)
	}
	n, err := strconv.Atoi(rest[:end])
	if err != nil {
		t.Fatalf("no number after %q in %q", prefix, out)
	}
	return n
}

// procState returns the state letter of pid in /proc (R, S, T, Z...), or "" when the process is gone.
func procState(pid int) string {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return ""
	}
	s := string(b)
	i := strings.LastIndexByte(s, ')')
	if i < 0 || i+2 >= len(s) {
		return ""
	}
	return s[i+2 : i+3]
}

// waitState waits until pid's state is one of states ("" means gone).
func waitState(t *testing.T, pid int, within time.Duration, states ...string) {
	t.Helper()
	deadline := time.Now().Add(within)
	for {
		st := procState(pid)
		for _, s := range states {
			if st == s {
				return
			}
		}
		if time.Now().After(deadline) {
			t.Fatalf("process %d is in state %q after %v, want one of %q", pid, st, within, states)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// gone reports whether pid has exited (it may linger as a zombie until something reaps it).
func gone(pid int) bool { st := procState(pid); return st == "" || st == "Z" }

// ls --watch in a real terminal (tmux): the table is redrawn in place (one frame on the screen at a time), a lock
// taken meanwhile appears in it, and Ctrl-C ends it with status 0. ls --tree shows the waiter under the holder.
func TestLsWatchInTmux(t *testing.T) {
	if _, err := exec.LookPath("tmux"); err != nil {
		t.Fatal("tmux is needed for this test (apt-get install tmux; .ci/run installs it)")
	}
	sock := filepath.Join(t.TempDir(), "tmux.sock")
	tmux := func(args ...string) string {
		out, err := exec.Command("tmux", append([]string{"-S", sock}, args...)...).CombinedOutput()
		if err != nil && args[0] != "kill-server" {
			t.Fatalf("tmux %v: %v: %s", args, err, out)
		}
		return string(out)
	}
	url := pgtest.URL(t)
	script := fmt.Sprintf("trap : INT; %s --dsn '%s' ls --watch --interval 200ms; echo exited=$?; sleep 60", bin, url) // the shell outlives Ctrl-C
	tmux("new-session", "-d", "-s", "w", "-x", "200", "-y", "50", "sh", "-c", script)
	defer tmux("kill-server")
	screen := func() string { // "" while the tmux server is still starting
		out, _ := exec.Command("tmux", "-S", sock, "capture-pane", "-p", "-t", "w").Output()
		return string(out)
	}
	waitFor := func(what string, ok func(string) bool) string {
		t.Helper()
		deadline := time.Now().Add(15 * time.Second)
		for {
			s := screen()
			if ok(s) {
				return s
			}
			if time.Now().After(deadline) {
				t.Fatalf("%s; the screen:\n%s", what, s)
			}
			time.Sleep(100 * time.Millisecond)
		}
	}
	waitFor("no frame", func(s string) bool { return strings.Contains(s, "advlock ls, every 200ms") })

	conn := pgtest.Conn(t, url)
	k := time.Now().UnixNano()
	if _, err := conn.Exec(context.Background(), `SELECT pg_advisory_lock($1)`, k); err != nil {
		t.Fatal(err)
	}
	defer conn.Exec(context.Background(), `SELECT pg_advisory_unlock_all()`)
	s := waitFor("the new lock never appeared", func(s string) bool { return strings.Contains(s, fmt.Sprintf("int:%d", k)) })
	if n := strings.Count(s, "advlock ls, every 200ms"); n != 1 {
		t.Errorf("%d frames on the screen, want 1 (redrawn in place):\n%s", n, s)
	}
	tmux("send-keys", "-t", "w", "C-c")
	waitFor("Ctrl-C did not end it with 0", func(s string) bool { return strings.Contains(s, "exited=0") })

	// --tree, in the terminal too: the waiter under the holder.
	wctx, stopWaiter := context.WithCancel(context.Background())
	waiterDone := make(chan struct{})
	go func() { // waits behind conn until the test ends
		defer close(waiterDone)
		if c, err := pgx.Connect(wctx, url); err == nil {
			_, _ = c.Exec(wctx, `SELECT pg_advisory_lock($1)`, k)
			c.Close(context.Background())
		}
	}()
	defer func() { stopWaiter(); <-waiterDone }()
	tmux("new-window", "-t", "w", "sh", "-c", fmt.Sprintf("sleep 0.5; %s --dsn '%s' ls --tree int:%d; sleep 60", bin, url, k))
	s = waitFor("no tree", func(s string) bool { return strings.Contains(s, "waiting") })
	if !strings.Contains(s, fmt.Sprintf("int:%d\n  held by pid", k)) || !strings.Contains(s, "└─ waiting") {
		t.Errorf("tree:\n%s", s)
	}
}
