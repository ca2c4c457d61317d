package main

import (
	"errors"
	"os/exec"
	"syscall"
	"testing"
)

// A worker the stop's SIGTERM ended before it caught the signal is told apart from one that died otherwise: its
// exit says SIGTERM; a SIGKILL, an exit status or no error at all does not.
func TestTerminated(t *testing.T) {
	run := func(sig syscall.Signal, args ...string) error {
		cmd := exec.Command(args[0], args[1:]...)
		if err := cmd.Start(); err != nil {
			t.Fatal(err)
		}
		if sig != 0 {
			_ = cmd.Process.Signal(sig)
		}
		return cmd.Wait()
	}
	if err := run(syscall.SIGTERM, "sleep", "10"); !terminated(err) {
		t.Errorf("sleep ended by SIGTERM: %v, not seen as terminated", err)
	}
	for _, c := range []struct {
		sig  syscall.Signal
		args []string
	}{{syscall.SIGKILL, []string{"sleep", "10"}}, {0, []string{"false"}}, {0, []string{"true"}}} {
		if err := run(c.sig, c.args...); terminated(err) {
			t.Errorf("%v %v: %v seen as terminated", c.sig, c.args, err)
		}
	}
	if terminated(errors.New("signal: terminated")) {
		t.Error("an error that only reads like it seen as terminated")
	}
}
