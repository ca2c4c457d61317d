//go:build unix

package pgcluster

import (
	"fmt"
	"os/exec"
	"path/filepath"
	"strconv"
	"syscall"
)

// RemoveWhenGone makes a process of its own remove the cluster (an immediate stop, when it runs, then its files)
// once the process pid has exited, however it exits: for a cluster that lives as long as a test binary that has no
// TestMain to remove it, or whose test may be killed by go test's timeout. The remover is in a session of its own,
// with no file of ours open (go test waits for its test binary's output to close), and checks pid once a second.
func (c *Cluster) RemoveWhenGone(pid int) error {
	stop := strconv.Quote(filepath.Join(c.bin, "pg_ctl")) + " -D " + strconv.Quote(c.Dir) + " -m immediate -w stop"
	if c.asPG {
		stop = "runuser -u postgres -- " + stop
	}
	script := fmt.Sprintf("while kill -0 %d 2>/dev/null; do sleep 1; done; "+
		"if [ -f %s ]; then %s >/dev/null 2>&1; fi; rm -rf %s",
		pid, strconv.Quote(filepath.Join(c.Dir, "postmaster.pid")), stop, strconv.Quote(c.tmp))
	cmd := exec.Command("sh", "-c", script)
	cmd.SysProcAttr = &syscall.SysProcAttr{Setsid: true}
	if err := cmd.Start(); err != nil {
		return fmt.Errorf("pgcluster: start the remover: %w", err)
	}
	return cmd.Process.Release()
}
