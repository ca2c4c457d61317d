package advsql_test

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/advlock/advlock"
	"github.com/advlock/advlock/advsql"
	"github.com/advlock/advlock/internal/testkit/pgtest"
)

// A cycle on a Locker from Open with 2 connections (a shared session and one session of its own, none kept for
// the readings): one wait waits in the server on the session of its own, the other in the process for one, and the
// readings find no connection of the pool free. They go on a connection opened outside it, with Open's driver and
// dsn, and exactly one wait ends with ErrDeadlock.
func TestDeadlockOpenNoSpare(t *testing.T) {
	url := pgtest.URL(t)
	l, err := advsql.Open(context.Background(), "pgx", url, advlock.WithMaxConns(2), advlock.WithSharedSessions(1))
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 15*time.Second)
	defer cancel()
	a, b := advlock.NameKey(t.Name()+"/a"), advlock.NameKey(t.Name()+"/b")
	la, err := l.Lock(ctx, a)
	if err != nil {
		t.Fatal(err)
	}
	lb, err := l.Lock(ctx, b)
	if err != nil {
		t.Fatal(err)
	}
	take := func(first *advlock.Lock, next advlock.Key) error {
		lk, err := l.Lock(advlock.Holding(ctx, first), next)
		if err == nil {
			err = lk.Unlock(context.Background())
		}
		if uerr := first.Unlock(context.Background()); uerr != nil {
			t.Errorf("unlock %s: %v", first.Key(), uerr)
		}
		return err
	}
	errs := make(chan error, 2)
	go func() { errs <- take(la, b) }()
	for l.Stats().WaitingInServer != 1 {
		time.Sleep(5 * time.Millisecond)
	}
	go func() { errs <- take(lb, a) }()
	got := []error{<-errs, <-errs}
	dead := 0
	for _, err := range got {
		switch {
		case errors.Is(err, advlock.ErrDeadlock):
			dead++
		case err != nil:
			t.Errorf("a wait of the cycle ended with %v", err)
		}
	}
	if dead != 1 {
		t.Errorf("%d waits ended with ErrDeadlock, want exactly one; Stats %+v", dead, l.Stats())
	}
}
