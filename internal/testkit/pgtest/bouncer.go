package pgtest

import (
	"net/url"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/advlock/advlock/internal/pgcluster"
)

// Bouncer starts PgBouncer with pool_mode mode ("session" or "transaction") in front of the server at serverURL
// (see pgcluster.StartBouncer), stops it when the test ends, and returns serverURL rewritten to go through it.
// Set ADVLOCK_KEEP_BOUNCER_LOG to keep its directory and log.
func Bouncer(tb testing.TB, serverURL, mode string) string {
	tb.Helper()
	return StartBouncer(tb, serverURL, mode).URL
}

// StartBouncer is Bouncer that returns the PgBouncer itself (to stall it, say).
func StartBouncer(tb testing.TB, serverURL, mode string) *pgcluster.Bouncer {
	tb.Helper()
	b, err := pgcluster.StartBouncer(serverURL, mode)
	if err != nil {
		tb.Fatalf("pgtest: %v", err)
	}
	crashes, err := BouncerCrashesOnCancel()
	if err != nil {
		b.Stop()
		os.RemoveAll(b.Dir)
		tb.Fatalf("pgtest: %v", err)
	}
	if crashes {
		u, err := url.Parse(b.URL)
		if err != nil {
			tb.Fatalf("pgtest: %v", err)
		}
		noCancelAddrs.Store(u.Host, true) // see DropCancels
		tb.Cleanup(func() { noCancelAddrs.Delete(u.Host) })
	}
	tb.Cleanup(func() {
		if died := b.Died(); died != "" {
			tb.Errorf("pgtest: %s", died) // the tests that failed after it failed for this
		}
		b.Stop()
		if os.Getenv("ADVLOCK_KEEP_BOUNCER_LOG") == "" {
			os.RemoveAll(b.Dir)
		}
	})
	return b
}

// BouncerVersion returns the installed PgBouncer's major and minor version.
func BouncerVersion() ([2]int, error) { return pgcluster.BouncerVersion() }

// NoCancelsReached fails the test, as it ends, when a cancel request reached b, a PgBouncer that one can crash (see
// DropCancels), according to its log: the check that what the test opened through it went through DropCancels (or
// sends none, as lib/pq with NoCancel). Call it right after StartBouncer.
func NoCancelsReached(tb testing.TB, b *pgcluster.Bouncer) {
	tb.Helper()
	crashes, err := BouncerCrashesOnCancel()
	if err != nil {
		tb.Fatalf("pgtest: %v", err)
	}
	if !crashes {
		return
	}
	tb.Cleanup(func() {
		log, err := os.ReadFile(filepath.Join(b.Dir, "log"))
		if err != nil {
			tb.Errorf("pgtest: PgBouncer's log: %v", err)
			return
		}
		var n int
		var first string
		for _, l := range strings.Split(string(log), "\n") {
			if strings.Contains(l, "cancel req") { // "cancel request", "cancel req"
				if n == 0 {
					first = l
				}
				n++
			}
		}
		if n > 0 {
			tb.Errorf("pgtest: %d lines of the log of a PgBouncer that cancel requests can crash tell of one, the first: %s", n, first)
		}
	})
}
