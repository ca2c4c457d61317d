package advlocktest_test

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"net/http/httptest"
	"sync/atomic"
	"time"

	"github.com/advlock/advlock"
	"github.com/advlock/advlock/advlocktest"
)

// exampleT stands in for the *testing.T that a test function gets, so that the examples run under go test.
type exampleT struct{ recorder }

func (t *exampleT) Errorf(format string, args ...any) { fmt.Printf("error: "+format+"\n", args...) }
func (t *exampleT) Fatalf(format string, args ...any) {
	fmt.Printf("fatal: "+format+"\n", args...)
	panic("fatal")
}
func (t *exampleT) finish() { t.end() }

// The code under test: a handler that runs a report at most once at a time across every pod, and answers 409
// Conflict while another pod runs it.
func reportHandler(l *advlock.Locker) http.HandlerFunc {
	return func(w http.ResponseWriter, r *http.Request) {
		err := l.TryDo(r.Context(), advlock.NameKey("report"), func(ctx context.Context) error {
			fmt.Fprintln(w, "report done")
			return nil
		})
		switch {
		case errors.Is(err, advlock.ErrNotAcquired):
			http.Error(w, "a report is running", http.StatusConflict)
		case err != nil:
			http.Error(w, err.Error(), http.StatusInternalServerError)
		}
	}
}

// serveReport serves reportHandler(l) and returns what a GET of it answers, and how to stop it.
func serveReport(t *exampleT, l *advlock.Locker) (status func() int, stop func()) {
	srv := httptest.NewServer(reportHandler(l))
	return func() int {
		resp, err := http.Get(srv.URL)
		if err != nil {
			t.Fatalf("%v", err)
		}
		resp.Body.Close()
		return resp.StatusCode
	}, srv.Close
}

// Testing a handler against a key held elsewhere: Hold takes the key on a server session of its own, as another
// pod would, until Release.
func Example_handler() {
	t := &exampleT{} // in a test: the test's t
	defer t.finish()

	dsn := advlocktest.DSN(t)
	l, err := advlock.Open(context.Background(), dsn)
	if err != nil {
		t.Fatalf("%v", err)
	}
	defer l.Close()
	status, stop := serveReport(t, l)
	defer stop()

	other := advlocktest.Hold(t, dsn, advlock.NameKey("report"))
	fmt.Println("held by another pod:", status())
	other.Release()
	fmt.Println("free:", status())
	// Output:
	// held by another pod: 409
	// free: 200
}

// The same handler on a Locker of leases, as a service behind a pooler in transaction mode runs it: Hold holds the
// key's lease too, so one test serves either kind of lock, and a lease left held would fail the test as a session
// lock would.
func Example_handlerLeases() {
	t := &exampleT{} // in a test: the test's t
	defer t.finish()

	dsn := advlocktest.DSN(t)
	l, err := advlock.Open(context.Background(), dsn, advlock.WithLeases())
	if err != nil {
		t.Fatalf("%v", err)
	}
	defer l.Close()
	status, stop := serveReport(t, l)
	defer stop()

	other := advlocktest.Hold(t, dsn, advlock.NameKey("report"))
	fmt.Println("held by another pod:", status())
	other.Release()
	fmt.Println("free:", status())
	// Output:
	// held by another pod: 409
	// free: 200
}

// The code under test: a job that writes while it holds its lock, and stops at once when the lock is lost.
func runJob(ctx context.Context, l *advlock.Locker, writes *atomic.Int64) error {
	return l.Do(ctx, advlock.NameKey("nightly-sync"), func(ctx context.Context) error {
		for {
			select {
			case <-ctx.Done():
				return context.Cause(ctx) // ErrLockLost when the lock is lost
			case <-time.After(time.Millisecond):
				writes.Add(1)
			}
		}
	})
}

// Testing that a job stops writing once its lock is lost: LoseKey ends the server session that holds the job's key,
// as a failover, a restart or an operator's pg_terminate_backend does.
func Example_job() {
	t := &exampleT{}
	defer t.finish()

	dsn := advlocktest.DSN(t)
	l, err := advlock.Open(context.Background(), dsn)
	if err != nil {
		t.Fatalf("%v", err)
	}
	defer l.Close()
	var writes atomic.Int64
	done := make(chan error, 1)
	go func() { done <- runJob(context.Background(), l, &writes) }()
	for writes.Load() == 0 {
		time.Sleep(time.Millisecond)
	}

	advlocktest.LoseKey(t, dsn, advlock.NameKey("nightly-sync"))
	err = <-done
	after := writes.Load()
	time.Sleep(50 * time.Millisecond)
	fmt.Println("job ended with the loss:", errors.Is(err, advlock.ErrLockLost))
	fmt.Println("writes after it ended:", writes.Load()-after)
	// Output:
	// job ended with the loss: true
	// writes after it ended: 0
}

// Testing that a leader steps down when its lock is lost, and that leadership returns: Lead campaigns again.
func Example_leader() {
	t := &exampleT{}
	defer t.finish()

	dsn := advlocktest.DSN(t)
	l, err := advlock.Open(context.Background(), dsn)
	if err != nil {
		t.Fatalf("%v", err)
	}
	defer l.Close()
	key := advlock.NameKey("scheduler")
	terms := make(chan context.Context, 2)
	ctx, stop := context.WithCancel(context.Background())
	led := make(chan error, 1)
	go func() {
		led <- l.Lead(ctx, key, func(ctx context.Context) error {
			terms <- ctx // the leader's work runs until ctx ends
			<-ctx.Done()
			return nil
		})
	}()

	term := <-terms
	advlocktest.LoseKey(t, dsn, key)
	<-term.Done()
	fmt.Println("stepped down:", errors.Is(context.Cause(term), advlock.ErrLockLost))
	<-terms
	fmt.Println("leads again")
	stop()
	<-led
	// Output:
	// stepped down: true
	// leads again
}
