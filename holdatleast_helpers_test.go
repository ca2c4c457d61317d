package advlock

import (
	"context"
	"errors"
	"runtime"
	"strings"
	"sync"
	"testing"
	"time"
)

// haEnds records every LockEnd, per key.
type haEnds struct {
	mu   sync.Mutex
	ends map[string][]LockEnd
}

func newHaEnds() *haEnds { return &haEnds{ends: map[string][]LockEnd{}} }

func (r *haEnds) observer() Observer {
	return endObserver(func(e LockEnd) {
		r.mu.Lock()
		defer r.mu.Unlock()
		r.ends[e.Key.String()] = append(r.ends[e.Key.String()], e)
	})
}

func (r *haEnds) of(k Key) []LockEnd {
	r.mu.Lock()
	defer r.mu.Unlock()
	return append([]LockEnd(nil), r.ends[k.String()]...)
}

// once checks that k's lock was told ended exactly once, with cause.
func (r *haEnds) once(t *testing.T, k Key, cause string) {
	t.Helper()
	ends := r.of(k)
	if len(ends) != 1 {
		t.Errorf("LockEnd told %d times for %s, want once: %+v", len(ends), k, ends)
		return
	}
	if ends[0].Cause != cause {
		t.Errorf("LockEnd cause %q (err %v), want %q", ends[0].Cause, ends[0].Err, cause)
	}
}

// haGoroutineIn waits until some goroutine's stack shows fn (such as "(*Locker).forget"), or within passes.
func haGoroutineIn(fn string, within time.Duration) bool {
	deadline := time.Now().Add(within)
	buf := make([]byte, 1<<20)
	for {
		n := runtime.Stack(buf, true)
		if n == len(buf) {
			buf = make([]byte, 2*len(buf))
			continue
		}
		if strings.Contains(string(buf[:n]), fn) {
			return true
		}
		if time.Now().After(deadline) {
			return false
		}
		time.Sleep(time.Millisecond)
	}
}

// haClose closes l, failing the test if Close has not returned within 30 s (a hang, not a slow machine: every hold
// in these tests is an hour). rescue then undoes what keeps Close waiting, so that the test ends.
func haClose(t *testing.T, l *Locker, rescue func()) {
	t.Helper()
	done := make(chan struct{})
	go func() { l.Close(); close(done) }()
	select {
	case <-done:
		return
	case <-time.After(30 * time.Second):
		t.Errorf("Close has not returned 30 s later (the holds are an hour long)")
	}
	if rescue != nil {
		rescue()
	}
	<-done
}

// haRescue stops lk's hold timer as Close should have, so that a Close stuck on it returns.
func haRescue(l *Locker, lk *Lock) func() {
	return func() {
		l.mu.Lock()
		defer l.mu.Unlock()
		if lk.stopLinger() {
			l.inflight.Done()
		}
	}
}

// errClass names an outcome for the logs of the free-running races (without the key).
func errClass(err error) string {
	switch {
	case err == nil:
		return "nil"
	case errors.Is(err, ErrClosed):
		return "closed"
	case errors.Is(err, context.Canceled) && strings.Contains(err.Error(), "after the context ended"):
		return "canceled after the grant"
	case errors.Is(err, context.Canceled):
		return "canceled"
	}
	return err.Error()
}

func haModes() []struct {
	name string
	opts []Option
} {
	return []struct {
		name string
		opts []Option
	}{{"dedicated", []Option{WithSharedSessions(0)}}, {"shared", nil}}
}
