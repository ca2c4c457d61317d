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

// NoCancelsReached fails the test, as it ends, when b, a PgBouncer that cancel requests can crash (see DropCancels),
// forwarded one to the server, according to its log: the check that what the test opened through it went through
// DropCancels (or sends none, as lib/pq with NoCancel). A cancel request PgBouncer could not match to a client (one
// sent as its client's connection closed, after it) or found for an idle client is not forwarded, cannot crash it,
// and is only counted in the test's log: a CI run met one, from a client it does not name. Call it right after
// StartBouncer.
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
		var n, other int
		var first string
		for _, l := range strings.Split(string(log), "\n") {
			switch {
			case forwardedCancel(l):
				if n == 0 {
					first = l
				}
				n++
			case strings.Contains(l, "cancel req"): // "cancel request", "cancel req"
				other++
			}
		}
		if n > 0 {
			tb.Errorf("pgtest: %d lines of the log of a PgBouncer that cancel requests can crash tell of one it forwarded, the first: %s", n, first)
		}
		if other > 0 {
			tb.Logf("pgtest: %d lines of PgBouncer's log tell of cancel requests it did not forward", other)
		}
	})
}

// forwardedCancel reports whether l, a line of PgBouncer's log, tells of a cancel request it forwarded, or tried to
// forward, to the server ("started sending cancel request", "successfully sent cancel request", "failed to send
// cancel req"; not "not sending cancel request for client that is now idle", nor "failed cancel request", a key
// that matched no client).
func forwardedCancel(l string) bool {
	return strings.Contains(l, "started sending cancel request") || strings.Contains(l, "sent cancel request") ||
		strings.Contains(l, "send cancel req")
}
