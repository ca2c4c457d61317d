package session

import (
	"context"
	"fmt"
	"testing"
)

// A call that left its connection being set up says so through every wrapping Acquire gives its error (a try's
// noConnWithin, which hides its cause from errors.Is, included): what waited for the set-up's end (a session
// slot's give-back) runs once, after it; once the set-up has ended, nothing is registered and the caller runs it.
func TestAfterSetUpThroughWrappers(t *testing.T) {
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	for name, wrap := range map[string]func(error) error{
		"bare":         func(err error) error { return err },
		"WithContext":  func(err error) error { return WithContext(ctx, fmt.Errorf("check session: %w", err)) },
		"noConnWithin": func(err error) error { return &noConnWithin{cause: err} },
	} {
		e := &apartErr{err: context.Canceled}
		runs := 0
		if !AfterSetUp(wrap(e), func() { runs++ }) {
			t.Errorf("%s: AfterSetUp found no set-up going on", name)
		}
		if runs != 0 {
			t.Errorf("%s: ran before the set-up ended", name)
		}
		e.end()
		if runs != 1 {
			t.Errorf("%s: ran %d times once the set-up ended, want 1", name, runs)
		}
		if AfterSetUp(wrap(e), func() { runs++ }) || runs != 1 {
			t.Errorf("%s: AfterSetUp after the set-up ended registered (or ran) its func", name)
		}
	}
	if AfterSetUp(&noConnWithin{cause: context.DeadlineExceeded}, func() {}) {
		t.Error("AfterSetUp found a set-up in an error without one")
	}
}
