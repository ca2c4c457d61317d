package pgcluster

import (
	"fmt"
	"net"
	"net/url"
	"os"
	"os/exec"
	"os/user"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"
)

var (
	bouncerOnce sync.Once
	bouncerBin  string
	bouncerErr  error
)

// aptInstall installs Debian's package pkg when we are root, refreshing the package lists once if the first try
// fails; it says what to install when we are not.
func aptInstall(pkg string) error {
	if os.Geteuid() != 0 {
		return fmt.Errorf("%s is not installed (apt-get install %s)", pkg, pkg)
	}
	install := func() error {
		out, err := exec.Command("apt-get", "install", "-y", "--no-install-recommends", pkg).CombinedOutput()
		if err != nil {
			return fmt.Errorf("apt-get install %s: %v: %s", pkg, err, out)
		}
		return nil
	}
	if err := install(); err != nil {
		_ = exec.Command("apt-get", "update").Run()
		return install()
	}
	return nil
}

// pgbouncerBin finds pgbouncer, installing Debian's package when it is missing and we are root.
func pgbouncerBin() (string, error) {
	bouncerOnce.Do(func() {
		find := func() string {
			if p, err := exec.LookPath("pgbouncer"); err == nil {
				return p
			}
			if _, err := os.Stat("/usr/sbin/pgbouncer"); err == nil {
				return "/usr/sbin/pgbouncer"
			}
			return ""
		}
		if bouncerBin = find(); bouncerBin != "" {
			return
		}
		if bouncerErr = aptInstall("pgbouncer"); bouncerErr != nil {
			return
		}
		if bouncerBin = find(); bouncerBin == "" {
			bouncerErr = fmt.Errorf("pgbouncer installed but not found")
		}
	})
	return bouncerBin, bouncerErr
}

// Bouncer is a PgBouncer started by StartBouncer.
type Bouncer struct {
	URL    string // the server URL rewritten to go through PgBouncer
	Dir    string // its ini, log and pid files
	cmd    *exec.Cmd
	exited chan struct{}
	state  *os.ProcessState // how it exited; set before exited closes
}

// StartBouncer starts PgBouncer with pool_mode mode ("session" or "transaction") in front of the server at
// serverURL. Trust authentication; otherwise PgBouncer's own defaults (notably ignore_startup_parameters, which
// refuses any startup parameter but extra_float_digits and the ones it tracks), except for the extra ini lines
// in settings (name = value, in the [pgbouncer] section). Stop it when done.
func StartBouncer(serverURL, mode string, settings ...string) (*Bouncer, error) {
	bin, err := pgbouncerBin()
	if err != nil {
		return nil, err
	}
	u, err := url.Parse(serverURL)
	if err != nil {
		return nil, err
	}
	host, port := u.Hostname(), u.Port()
	if port == "" {
		port = "5432"
	}
	usr := u.User.Username()
	dir, err := os.MkdirTemp("", "advlock-pgbouncer-")
	if err != nil {
		return nil, err
	}
	b := &Bouncer{Dir: dir, exited: make(chan struct{})}
	fail := func(err error) (*Bouncer, error) {
		os.RemoveAll(dir)
		return nil, err
	}
	var args []string
	if os.Geteuid() == 0 { // pgbouncer refuses to run as root
		pg, err := user.Lookup("postgres")
		if err != nil {
			return fail(fmt.Errorf("running pgbouncer as root needs a postgres user: %w", err))
		}
		uid, _ := strconv.Atoi(pg.Uid)
		gid, _ := strconv.Atoi(pg.Gid)
		if err := os.Chown(dir, uid, gid); err != nil {
			return fail(err)
		}
		args = append(args, "-u", "postgres")
	}
	listen, err := FreePort()
	if err != nil {
		return fail(err)
	}
	ini := fmt.Sprintf(`[databases]
* = host=%s port=%s
%s
[pgbouncer]
listen_addr = 127.0.0.1
listen_port = %d
unix_socket_dir =
auth_type = trust
auth_file = %s
pool_mode = %s
max_client_conn = 500
default_pool_size = 60
logfile = %s
pidfile = %s
`, host, port, endDatabases, listen, filepath.Join(dir, "users.txt"), mode, filepath.Join(dir, "log"), filepath.Join(dir, "pid"))
	for _, l := range settings {
		ini += l + "\n"
	}
	for name, body := range map[string]string{"pgbouncer.ini": ini, "users.txt": fmt.Sprintf("%q \"\"\n", usr)} {
		if err := os.WriteFile(filepath.Join(dir, name), []byte(body), 0o644); err != nil {
			return fail(err)
		}
	}
	b.cmd = exec.Command(bin, append(args, filepath.Join(dir, "pgbouncer.ini"))...)
	b.cmd.Dir = dir
	stderr, err := os.Create(filepath.Join(dir, "stderr"))
	if err != nil {
		return fail(err)
	}
	defer stderr.Close()
	b.cmd.Stdout, b.cmd.Stderr = stderr, stderr
	if err := b.cmd.Start(); err != nil {
		return fail(fmt.Errorf("start pgbouncer: %w", err))
	}
	go func() {
		_ = b.cmd.Wait()
		b.state = b.cmd.ProcessState
		close(b.exited)
	}()
	addr := net.JoinHostPort("127.0.0.1", strconv.Itoa(listen))
	for deadline := time.Now().Add(15 * time.Second); ; time.Sleep(20 * time.Millisecond) {
		if c, err := net.Dial("tcp", addr); err == nil {
			c.Close()
			break
		}
		select {
		case <-b.exited:
			log, _ := os.ReadFile(filepath.Join(dir, "log"))
			return fail(fmt.Errorf("pgbouncer exited: %s", log))
		default:
		}
		if time.Now().After(deadline) {
			b.Stop()
			return fail(fmt.Errorf("pgbouncer did not listen within 15s"))
		}
	}
	u.Host = addr
	b.URL = u.String()
	return b, nil
}

// endDatabases ends the [databases] section of the ini (see Repoint).
const endDatabases = "; end of databases"

// Repoint sends PgBouncer's new server connections to the server at serverURL (its host and port), as an operator
// does after a failover: the ini's database line rewritten, then a reload (SIGHUP). Server connections to the old
// server close as they are released (those to a server that is gone have failed already).
func (b *Bouncer) Repoint(serverURL string) error {
	u, err := url.Parse(serverURL)
	if err != nil {
		return err
	}
	path := filepath.Join(b.Dir, "pgbouncer.ini")
	ini, err := os.ReadFile(path)
	if err != nil {
		return err
	}
	_, rest, ok := strings.Cut(string(ini), endDatabases)
	if !ok {
		return fmt.Errorf("pgbouncer.ini has no %q", endDatabases)
	}
	port := u.Port()
	if port == "" {
		port = "5432"
	}
	ini = fmt.Appendf(nil, "[databases]\n* = host=%s port=%s\n%s%s", u.Hostname(), port, endDatabases, rest)
	if err := os.WriteFile(path, ini, 0o644); err != nil {
		return err
	}
	return b.cmd.Process.Signal(syscall.SIGHUP)
}

// Stall stops PgBouncer (SIGSTOP) while on, and continues it (SIGCONT) when off: stopped, it keeps what clients
// send in its sockets' buffers and forwards it once continued, also from clients that have closed their sockets
// since.
func (b *Bouncer) Stall(on bool) error {
	if on {
		return b.cmd.Process.Signal(syscall.SIGSTOP)
	}
	return b.cmd.Process.Signal(syscall.SIGCONT)
}

// Died says, when PgBouncer exited before Stop was called, how (its exit status, what it printed, the end of its
// log); "" while it runs.
func (b *Bouncer) Died() string {
	select {
	case <-b.exited:
	default:
		return ""
	}
	out, _ := os.ReadFile(filepath.Join(b.Dir, "stderr"))
	log, _ := os.ReadFile(filepath.Join(b.Dir, "log"))
	lines := strings.Split(strings.TrimRight(string(log), "\n"), "\n")
	lines = lines[max(0, len(lines)-30):]
	return fmt.Sprintf("pgbouncer exited (%v); it printed %q; the last lines of its log:\n%s", b.state, out, strings.Join(lines, "\n"))
}

// Stop stops PgBouncer (SIGINT, then SIGKILL after 10 s). It keeps Dir; remove it when done with the log.
func (b *Bouncer) Stop() {
	_ = b.cmd.Process.Signal(syscall.SIGCONT) // a stalled one would never see the SIGINT
	_ = b.cmd.Process.Signal(syscall.SIGINT)
	select {
	case <-b.exited:
	case <-time.After(10 * time.Second):
		_ = b.cmd.Process.Kill()
		<-b.exited
	}
}

// BouncerVersion returns the installed PgBouncer's major and minor version.
func BouncerVersion() ([2]int, error) { return bouncerVersion() }

// bouncerVersion asks the installed pgbouncer once per process.
var bouncerVersion = sync.OnceValues(func() ([2]int, error) {
	bin, err := pgbouncerBin()
	if err != nil {
		return [2]int{}, err
	}
	out, err := exec.Command(bin, "--version").Output()
	if err != nil {
		return [2]int{}, fmt.Errorf("pgbouncer --version: %w", err)
	}
	var v [2]int
	if _, err := fmt.Sscanf(string(out), "PgBouncer %d.%d", &v[0], &v[1]); err != nil {
		return [2]int{}, fmt.Errorf("pgbouncer --version said %q: %w", out, err)
	}
	return v, nil
})
