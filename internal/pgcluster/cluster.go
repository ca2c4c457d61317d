// Package pgcluster starts private throwaway PostgreSQL clusters from the installed server binaries (initdb on
// PATH or under /usr/lib/postgresql/*/bin), and PgBouncers in front of a server. Running as root, it runs them as
// the postgres user.
//
// It belongs to the product, not to the test kit under internal/testkit: advlock demo links it into the command
// to start a throwaway server when none answers. So it keeps the product's import rule (layers_test.go): it
// imports neither the test kit nor package testing, and reports failures as errors. The test kit builds on it
// (pgtest.StartCluster, pgtest.Standby, pgtest.Bouncer), and so does the chaos campaign, for anything that
// restarts, promotes or reconfigures a server.
package pgcluster

import (
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"os/exec"
	"os/user"
	"path/filepath"
	"sort"
	"strconv"
	"strings"
	"sync"
	"time"
)

// Cluster is a private throwaway PostgreSQL server.
type Cluster struct {
	Dir  string // data directory
	Port int
	URL  string // database postgres, user postgres, trust auth
	bin  string
	tmp  string
	asPG bool     // run server commands as the postgres user (we are root)
	env  []string // added to the environment of the server's commands (StartFaketime)
}

// Start initialises and starts a private cluster with extra postgresql.conf lines (name = value). Remove stops it
// and deletes its files.
func Start(settings ...string) (*Cluster, error) { return startCluster(settings, 0) }

// StartRemovedWhenGone is Start for a cluster that a process of its own removes once the process pid has exited,
// however it exits (see RemoveWhenGone), from before initdb: a process killed while the cluster starts leaves
// nothing behind either.
func StartRemovedWhenGone(pid int, settings ...string) (*Cluster, error) {
	return startCluster(settings, pid)
}

// StartFaketime is Start for a cluster whose server runs under libfaketime (Debian's package libfaketime), so that
// StepClock can step its wall clock (clock_timestamp(), now()) at run time, as an NTP step or a resumed VM would;
// its monotonic clock is left alone.
func StartFaketime(settings ...string) (*Cluster, error) {
	lib, err := faketimeLib()
	if err != nil {
		return nil, err
	}
	c, err := startCluster(settings, 0)
	if err != nil {
		return nil, err
	}
	clock := filepath.Join(c.tmp, "faketime")
	if err := os.WriteFile(clock, []byte("+0\n"), 0o644); err != nil {
		c.Remove()
		return nil, err
	}
	c.env = []string{"LD_PRELOAD=" + lib, "FAKETIME_TIMESTAMP_FILE=" + clock, "FAKETIME_NO_CACHE=1",
		"FAKETIME_DONT_FAKE_MONOTONIC=1"}
	if err := c.Restart("fast"); err != nil {
		c.Remove()
		return nil, err
	}
	return c, nil
}

var (
	faketimeOnce sync.Once
	faketimePath string
	faketimeErr  error
)

// faketimeLib finds libfaketime, installing Debian's package when it is missing and we are root.
func faketimeLib() (string, error) {
	faketimeOnce.Do(func() {
		find := func() string {
			libs, _ := filepath.Glob("/usr/lib/*/faketime/libfaketime.so.1")
			if len(libs) == 0 {
				return ""
			}
			return libs[0]
		}
		if faketimePath = find(); faketimePath != "" {
			return
		}
		if faketimeErr = aptInstall("libfaketime"); faketimeErr != nil {
			return
		}
		if faketimePath = find(); faketimePath == "" {
			faketimeErr = errors.New("libfaketime installed but not found (/usr/lib/*/faketime/libfaketime.so.1)")
		}
	})
	return faketimePath, faketimeErr
}

// StepClock sets the server's wall clock to offset from the real one, at once (a cluster from StartFaketime):
// from +0 to +20s is a step forward of 20 s, then to -20s one back of 40 s.
func (c *Cluster) StepClock(offset time.Duration) error {
	if c.env == nil {
		return errors.New("pgcluster: StepClock on a cluster not started with StartFaketime")
	}
	return os.WriteFile(filepath.Join(c.tmp, "faketime"), fmt.Appendf(nil, "%+.3f\n", offset.Seconds()), 0o644)
}

// binDir finds initdb: on PATH, else the newest /usr/lib/postgresql/*/bin.
func binDir() (string, error) {
	if p, err := exec.LookPath("initdb"); err == nil {
		if real, err := filepath.EvalSymlinks(p); err == nil {
			p = real // a link on PATH into the server's bin directory, which also has pg_basebackup
		}
		return filepath.Dir(p), nil
	}
	dirs, _ := filepath.Glob("/usr/lib/postgresql/*/bin")
	sort.Slice(dirs, func(i, j int) bool { return version(dirs[i]) > version(dirs[j]) })
	for _, d := range dirs {
		if _, err := os.Stat(filepath.Join(d, "initdb")); err == nil {
			return d, nil
		}
	}
	return "", errors.New("initdb not found on PATH or under /usr/lib/postgresql/*/bin")
}

func version(dir string) int {
	n, _ := strconv.Atoi(filepath.Base(filepath.Dir(dir)))
	return n
}

// FreePort returns a TCP port on 127.0.0.1 that was free a moment ago.
func FreePort() (int, error) {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return 0, err
	}
	defer l.Close()
	return l.Addr().(*net.TCPAddr).Port, nil
}

func startCluster(settings []string, watch int) (*Cluster, error) {
	bin, err := binDir()
	if err != nil {
		return nil, err
	}
	tmp, err := os.MkdirTemp("", "advlock-pg-")
	if err != nil {
		return nil, err
	}
	c := &Cluster{bin: bin, tmp: tmp, Dir: filepath.Join(tmp, "data"), asPG: os.Geteuid() == 0}
	if err := c.chownTmp(); err != nil {
		os.RemoveAll(tmp)
		return nil, err
	}
	if watch != 0 {
		if err := c.RemoveWhenGone(watch); err != nil {
			os.RemoveAll(tmp)
			return nil, err
		}
	}
	if out, err := c.run("initdb", "-D", c.Dir, "-U", "postgres", "--auth=trust", "--no-sync", "-E", "UTF8"); err != nil {
		os.RemoveAll(tmp)
		return nil, fmt.Errorf("initdb: %v: %s", err, out)
	}
	conf := []string{"listen_addresses = '127.0.0.1'", "unix_socket_directories = '" + tmp + "'", "fsync = off",
		"synchronous_commit = off", "full_page_writes = off", "max_connections = 50", "shared_buffers = 16MB"}
	if err := c.appendConf(append(conf, settings...)...); err != nil {
		c.Remove()
		return nil, err
	}
	if err := c.startOnFreePort(); err != nil {
		c.Remove()
		return nil, err
	}
	return c, nil
}

func (c *Cluster) startOnFreePort() error {
	var last error
	for range 5 {
		port, err := FreePort()
		if err != nil {
			return err
		}
		c.Port = port
		c.URL = fmt.Sprintf("postgres://postgres@127.0.0.1:%d/postgres?sslmode=disable", port)
		if last = c.Start(); last == nil {
			return nil
		}
	}
	return last
}

// Start starts the server (again) on its port and waits until it accepts connections.
func (c *Cluster) Start() error {
	out, err := c.run("pg_ctl", "-D", c.Dir, "-l", filepath.Join(c.tmp, "log"), "-w", "-t", "60",
		"-o", fmt.Sprintf("-p %d", c.Port), "start")
	if err != nil {
		log, _ := os.ReadFile(filepath.Join(c.tmp, "log"))
		return fmt.Errorf("pg_ctl start: %v: %s\n%s", err, out, log)
	}
	return nil
}

// LogFile is the server's log (its stderr, through pg_ctl -l), kept until Remove.
func (c *Cluster) LogFile() string { return filepath.Join(c.tmp, "log") }

// Stop stops the server with the given shutdown mode (smart, fast or immediate).
func (c *Cluster) Stop(mode string) error {
	out, err := c.run("pg_ctl", "-D", c.Dir, "-m", mode, "-w", "-t", "60", "stop")
	if err != nil {
		return fmt.Errorf("pg_ctl stop: %v: %s", err, out)
	}
	return nil
}

// Restart stops the server with mode and starts it again on the same port.
func (c *Cluster) Restart(mode string) error {
	if err := c.Stop(mode); err != nil {
		return err
	}
	return c.Start()
}

// Standby makes a hot standby of c with pg_basebackup and starts it. Remove it when done.
func (c *Cluster) Standby() (*Cluster, error) { return c.StandbyVia("127.0.0.1", c.Port) }

// StandbyVia makes a hot standby of c that streams from host:port (a proxy in front of c, so that a test can make it
// lag or cut it off) and starts it on a port of its own. Remove it when done.
func (c *Cluster) StandbyVia(host string, port int) (*Cluster, error) {
	tmp, err := os.MkdirTemp("", "advlock-pg-standby-")
	if err != nil {
		return nil, err
	}
	s := &Cluster{bin: c.bin, tmp: tmp, Dir: filepath.Join(tmp, "data"), asPG: c.asPG}
	if err := s.chownTmp(); err != nil {
		s.Remove()
		return nil, err
	}
	if err := s.backupFrom(c, host, port); err != nil {
		s.Remove()
		return nil, err
	}
	if err := s.startOnFreePort(); err != nil {
		s.Remove()
		return nil, err
	}
	return s, nil
}

// backupFrom fills s.Dir with a base backup of c (taken directly) and makes it a standby streaming from host:port.
func (s *Cluster) backupFrom(c *Cluster, host string, port int) error {
	if out, err := s.run("pg_basebackup", "-h", "127.0.0.1", "-p", strconv.Itoa(c.Port), "-U", "postgres",
		"-D", s.Dir, "-R", "-X", "stream", "--no-sync", "--checkpoint=fast"); err != nil {
		return fmt.Errorf("pg_basebackup: %v: %s", err, out)
	}
	if err := s.appendConf("unix_socket_directories = '"+s.tmp+"'", "hot_standby = on"); err != nil {
		return err
	}
	// pg_basebackup -R wrote primary_conninfo to postgresql.auto.conf, which is read last: the last line wins.
	return s.appendFile("postgresql.auto.conf", fmt.Sprintf(
		"primary_conninfo = 'host=%s port=%d user=postgres application_name=standby'", host, port))
}

// Promote makes a standby the primary (pg_ctl promote) and waits until it accepts writes. A promotion starts a new
// timeline.
func (c *Cluster) Promote() error {
	if out, err := c.run("pg_ctl", "-D", c.Dir, "-w", "-t", "60", "promote"); err != nil {
		return fmt.Errorf("pg_ctl promote: %v: %s", err, out)
	}
	return nil
}

// Aside starts the stopped server c on a port of its own that nobody else knows (its crash recovery, if it was
// stopped at once, replays the whole of its own WAL first), runs f with a URL for it, and stops it again: what a
// primary lost in a failover had committed, read without letting any client that knew it reach it.
func (c *Cluster) Aside(f func(url string) error) error {
	port, err := FreePort()
	if err != nil {
		return err
	}
	if out, err := c.run("pg_ctl", "-D", c.Dir, "-l", filepath.Join(c.tmp, "log"), "-w", "-t", "60",
		"-o", fmt.Sprintf("-p %d -c listen_addresses=127.0.0.1", port), "start"); err != nil {
		return fmt.Errorf("pg_ctl start aside: %v: %s", err, out)
	}
	ferr := f(fmt.Sprintf("postgres://postgres@127.0.0.1:%d/postgres?sslmode=disable", port))
	if err := c.Stop("fast"); err != nil && ferr == nil {
		ferr = err
	}
	return ferr
}

// RebuildAsStandbyOf stops c (at once) if it runs, throws its data away, and makes it a standby of p streaming from
// host:port, started again on its own port: the old primary of a failover, rejoining as the new standby.
func (c *Cluster) RebuildAsStandbyOf(p *Cluster, host string, port int) error {
	_, _ = c.run("pg_ctl", "-D", c.Dir, "-m", "immediate", "-w", "stop")
	if err := os.RemoveAll(c.Dir); err != nil {
		return err
	}
	if err := c.backupFrom(p, host, port); err != nil {
		return err
	}
	return c.Start()
}

func (c *Cluster) chownTmp() error {
	if !c.asPG {
		return nil
	}
	u, err := user.Lookup("postgres")
	if err != nil {
		return fmt.Errorf("running as root needs a postgres user: %w", err)
	}
	uid, _ := strconv.Atoi(u.Uid)
	gid, _ := strconv.Atoi(u.Gid)
	return os.Chown(c.tmp, uid, gid)
}

func (c *Cluster) appendConf(lines ...string) error { return c.appendFile("postgresql.conf", lines...) }

func (c *Cluster) appendFile(name string, lines ...string) error {
	f, err := os.OpenFile(filepath.Join(c.Dir, name), os.O_APPEND|os.O_WRONLY, 0)
	if err != nil {
		return err
	}
	_, err = f.WriteString("\n" + strings.Join(lines, "\n") + "\n")
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	return err
}

func (c *Cluster) run(name string, args ...string) ([]byte, error) {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	path := filepath.Join(c.bin, name)
	var cmd *exec.Cmd
	if c.asPG {
		cmd = exec.CommandContext(ctx, "runuser", append([]string{"-u", "postgres", "--", path}, args...)...)
	} else {
		cmd = exec.CommandContext(ctx, path, args...)
	}
	cmd.Dir = c.tmp
	if c.env != nil {
		cmd.Env = append(os.Environ(), c.env...)
	}
	return cmd.CombinedOutput()
}

// Remove stops the server at once and deletes its files. It is idempotent.
func (c *Cluster) Remove() {
	if c.tmp == "" {
		return
	}
	_, _ = c.run("pg_ctl", "-D", c.Dir, "-m", "immediate", "-w", "stop")
	os.RemoveAll(c.tmp)
	c.tmp = ""
}
