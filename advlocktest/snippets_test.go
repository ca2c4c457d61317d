package advlocktest_test

// Code that docs/testing-your-code.md shows, compiled (TestReportBusy also runs).

import (
	"context"
	"net/http"
	"net/http/httptest"
	"testing"
	"time"

	"github.com/advlock/advlock"
)

import "github.com/advlock/advlock/advlocktest"

var _ = []any{snippetDSN, snippetHold, snippetLose, snippetLink, snippetServer, snippetGoroutines}

func snippetDSN(t *testing.T, ctx context.Context) (*advlock.Locker, error) {
	dsn := advlocktest.DSN(t)
	l, err := advlock.Open(ctx, dsn)
	return l, err
}

func snippetHold(t *testing.T, dsn string) {
	other := advlocktest.Hold(t, dsn, advlock.NameKey("report")) // a server session of its own holds the key
	// TryLock: ErrNotAcquired; Lock: waits
	other.Release() // returns once the server has let the key go
}

func snippetLose(t *testing.T, dsn string, lk *advlock.Lock) {
	advlocktest.Lose(t, lk)                                   // lk's server session ends: pg_terminate_backend
	advlocktest.LoseKey(t, dsn, advlock.NameKey("scheduler")) // whatever holds the key, as advlock break does
}

func snippetLink(t *testing.T, ctx context.Context, dsn string) (*advlock.Locker, error) {
	link := advlocktest.NewLink(t, dsn)
	l, err := advlock.Open(ctx, link.DSN(), advlock.WithKeepalive(time.Second))
	link.Cut()       // every connection reset: the server ends the sessions, the Locker is told at once
	link.Blackhole() // a partition: nothing passes, sockets left open; what was sent is delivered at Restore
	link.Drop()      // bytes thrown away, sockets left open; Restore resets the connections
	link.Latency(100 * time.Millisecond)
	link.Restore() // no partition, no drop, no latency
	return l, err
}

func snippetServer(t *testing.T) string {
	srv := advlocktest.StartServer(t, nil) // a PostgreSQL of the test's own; extra postgresql.conf lines may be given
	dsn := srv.DSN(t)
	srv.Restart(t) // a fast shutdown and start: every session ends, every lock is lost and told
	srv.Crash(t)   // an immediate shutdown and start: crash recovery
	srv.Stop(t)
	srv.Start(t)
	return dsn
}

func snippetGoroutines(t *testing.T) {
	advlocktest.VerifyNoGoroutines(t) // first in the test
}

func TestReportBusy(t *testing.T) {
	dsn := advlocktest.DSN(t)
	l, err := advlock.Open(t.Context(), dsn)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(l.Close)
	srv := httptest.NewServer(reportHandler(l))
	t.Cleanup(srv.Close)

	advlocktest.Hold(t, dsn, advlock.NameKey("report"))
	resp, err := http.Get(srv.URL)
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode != http.StatusConflict {
		t.Fatalf("status %d while another pod runs the report, want 409", resp.StatusCode)
	}
}
