package pgtest

import (
	"net/url"
	"os"
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
	if BouncerCrashesOnCancel() {
		u, err := url.Parse(b.URL)
		if err != nil {
			tb.Fatalf("pgtest: %v", err)
		}
		noCancelAddrs.Store(u.Host, true) // see DropCancels
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
