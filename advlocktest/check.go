package advlocktest

import (
	"bytes"
	"runtime"
	"strings"
	"time"
)

// VerifyNoGoroutines fails the test if, when it ends, goroutines of advlock or of a pgx pool run that did not run
// when VerifyNoGoroutines was called: a Locker not closed (its pool's, its shared sessions' readers, its locks'
// watchers, a lease's renewer, a Lead), a lock held past the test, a pgxpool not closed. Call it first in the test,
// so that its check comes after every cleanup registered later (a Locker closed with t.Cleanup) and every deferred
// Close. It waits up to 5 s for goroutines that are ending. What starts meanwhile counts, whoever starts it: a
// Locker opened before the call that opens a session during the test, and other tests running in parallel; use it
// in tests that do not run in parallel with others that use advlock, with Lockers the test opens.
func VerifyNoGoroutines(t TB) {
	t.Helper()
	before := map[string]bool{}
	for _, g := range advlockGoroutines() {
		before[g.id] = true
	}
	t.Cleanup(func() {
		t.Helper()
		var left []goroutine
		for deadline := time.Now().Add(5 * time.Second); ; {
			left = left[:0]
			for _, g := range advlockGoroutines() {
				if !before[g.id] {
					left = append(left, g)
				}
			}
			if len(left) == 0 || time.Now().After(deadline) {
				break
			}
			time.Sleep(10 * time.Millisecond)
		}
		if len(left) > 0 {
			var b strings.Builder
			for _, g := range left {
				b.WriteString("\n\n")
				b.WriteString(g.stack)
			}
			t.Errorf("advlocktest: %d goroutine(s) of advlock still run as the test ends (a Locker not closed?):%s", len(left), b.String())
		}
	})
}

type goroutine struct {
	id    string // "goroutine 42"
	stack string
}

// The module's import path, and the kit's (whose own goroutines are not advlock's).
const (
	modulePath = "github.com/advlock/advlock"
	kitPath    = modulePath + "/advlocktest"
)

// advlockGoroutines returns the goroutines whose stack runs code of advlock, or that advlock started.
func advlockGoroutines() []goroutine {
	buf := make([]byte, 1<<20)
	for {
		n := runtime.Stack(buf, true)
		if n < len(buf) {
			buf = buf[:n]
			break
		}
		buf = make([]byte, 2*len(buf))
	}
	var out []goroutine
	for _, g := range bytes.Split(buf, []byte("\n\n")) {
		s := string(g)
		header, _, _ := strings.Cut(s, " [")
		if !strings.HasPrefix(header, "goroutine ") || !ours(s) {
			continue
		}
		out = append(out, goroutine{id: header, stack: s})
	}
	return out
}

// Goroutines of these packages count too: the pools a Locker opens (Open), or that a test opens for New.
var poolPaths = []string{"github.com/jackc/pgx/v5/pgxpool.", "github.com/jackc/puddle/"}

// ours reports whether a goroutine's stack has a frame of advlock's packages (the kit and the faults proxy aside)
// or of a pgx pool, or was created by one.
func ours(stack string) bool {
	for _, line := range strings.Split(stack, "\n") {
		line = strings.TrimPrefix(strings.TrimSpace(line), "created by ")
		for _, p := range poolPaths {
			if strings.HasPrefix(line, p) {
				return true
			}
		}
		if !strings.HasPrefix(line, modulePath) || strings.HasPrefix(line, kitPath) ||
			strings.HasPrefix(line, modulePath+"/internal/testkit/") {
			continue
		}
		rest := line[len(modulePath):]
		if rest == "" || rest[0] == '.' || rest[0] == '/' {
			return true
		}
	}
	return false
}
