//go:build !linux

package cli

import (
	"errors"
	"fmt"
	"syscall"
)

// advlock run's supervision of COMMAND (a guard process that kills COMMAND's group when advlock dies, terminal
// hand-over, stop relay) is built on Linux facilities (a child subreaper, Pdeathsig).

const guardCmd = "__guard"

type job struct{ events chan jobEvent }

type jobEvent struct {
	stopped bool
	resume  chan struct{}
	ws      syscall.WaitStatus
	err     error
}

func startJob(_, _ []string, _ Stdio) (*job, error) {
	return nil, errors.New("advlock run supervises COMMAND with Linux facilities; it is not available on this system")
}

func (*job) signal(syscall.Signal)  {}
func (*job) ready() <-chan struct{} { return nil }
func (*job) flush()                 {}
func (*job) lost()                  {}
func (*job) suspend()               {}
func (*job) finish()                {}

func guardMain(_ []string, std Stdio) int {
	fmt.Fprintln(std.Err, "advlock: __guard is internal to advlock run")
	return exitUsage
}
