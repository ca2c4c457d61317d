package pgxwait

import (
	"context"
	"errors"
	"net"
	"os"
	"testing"
	"time"

	"github.com/advlock/advlock/internal/session"
	"github.com/advlock/advlock/internal/testkit/pgtest"
)

func TestMain(m *testing.M) { os.Exit(pgtest.Main(m)) }

// ExecTextUntil bounds a statement by the socket's deadline: a statement still running at the deadline fails then,
// not when it ends, with an error that says so as a context's deadline would (not as a session that ended).
func TestExecTextUntilCutsAtTheDeadline(t *testing.T) {
	r := &Reader{PC: pgtest.Conn(t, pgtest.URL(t)).PgConn()}
	start := time.Now()
	_, err := r.ExecTextUntil(start.Add(200*time.Millisecond), "SELECT pg_sleep(3)::text")
	took := time.Since(start)
	var ne net.Error
	if !errors.Is(err, context.DeadlineExceeded) || !errors.As(err, &ne) || !ne.Timeout() {
		t.Fatalf("a statement past its deadline: %v (after %v), want a timeout matching context.DeadlineExceeded", err, took)
	}
	if session.Ended(err) {
		t.Errorf("a statement past its deadline: %v, which reads as a session that ended", err)
	}
	if took > 2500*time.Millisecond {
		t.Errorf("a statement past its deadline returned after %v: when it ended, not at its deadline", took)
	}
}

// A statement the server refuses leaves the connection usable and goes back to its pool: the deadline is cleared
// whatever the answer, so that it cuts no later statement of another user.
func TestExecTextUntilClearsTheDeadline(t *testing.T) {
	c := pgtest.Conn(t, pgtest.URL(t))
	r := &Reader{PC: c.PgConn()}
	if v, err := r.ExecTextUntil(time.Now().Add(300*time.Millisecond), "SELECT 'a'; SELECT 'b'"); err != nil || v != "b" {
		t.Fatalf("answered: %q %v, want the last statement's text", v, err)
	}
	if _, err := r.ExecTextUntil(time.Now().Add(300*time.Millisecond), "SELECT (1/0)::text"); err == nil {
		t.Fatal("a division by zero was answered")
	}
	time.Sleep(500 * time.Millisecond) // past both deadlines
	var v string
	if err := c.QueryRow(context.Background(), "SELECT pg_sleep(0.1)::text").Scan(&v); err != nil {
		t.Fatalf("a statement after the deadlines passed: %v (a deadline was left on the connection)", err)
	}
	if _, err := r.ExecText(context.Background(), "SELECT 1 WHERE false"); err == nil {
		t.Error("a statement that returned no row was answered")
	}
}
