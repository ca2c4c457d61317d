// Command http is the request-scoped pattern: an HTTP service whose POST /sync/{id} runs a sync of one
// integration at a time, across every process running it, with a lock per integration.
//
//	go run ./examples/http              # then: curl -X POST localhost:8080/sync/7 (twice at once: one gets 409)
//	                                    # or:   curl -X POST 'localhost:8080/sync/7?wait' (waits up to 2 s)
//
// DATABASE_URL or the libpq PG* variables choose the server.
package main

import (
	"context"
	"errors"
	"fmt"
	"log"
	"net/http"
	"os"
	"os/signal"
	"strconv"
	"time"

	"github.com/advlock/advlock"
)

var locks *advlock.Locker // one per process

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt)
	defer stop()
	var err error
	locks, err = advlock.Open(ctx, os.Getenv("DATABASE_URL")) // once, at start; it does not connect, so a database down now is no error
	if err != nil {
		log.Fatal(err) // a malformed DSN
	}
	defer locks.Close()
	if err := locks.Ping(ctx); err != nil { // optional: fail fast if the database is down at start
		log.Fatal(err)
	}
	// ... serve; a Locker opened while the database was down works once it is up

	mux := http.NewServeMux()
	mux.HandleFunc("POST /sync/{id}", syncHandler)
	mux.HandleFunc("GET /stats", func(w http.ResponseWriter, r *http.Request) {
		fmt.Fprintf(w, "%+v\n", locks.Stats())
	})
	srv := &http.Server{Addr: "127.0.0.1:8080", Handler: mux}
	go func() {
		<-ctx.Done()
		if err := srv.Shutdown(context.Background()); err != nil {
			log.Print(err)
		}
	}()
	log.Printf("listening on http://%s (POST /sync/{id}, POST /sync/{id}?wait, GET /stats)", srv.Addr)
	if err := srv.ListenAndServe(); !errors.Is(err, http.ErrServerClosed) {
		log.Fatal(err)
	}
}

const integrationClass = 1 // a number per kind of entity: PairKey(class, id)

// POST /sync/{id}: run the sync unless another pod or request is running it for this integration.
func syncHandler(w http.ResponseWriter, r *http.Request) {
	id, err := strconv.ParseInt(r.PathValue("id"), 10, 32)
	if err != nil {
		http.Error(w, "bad integration id", http.StatusBadRequest)
		return
	}
	key := advlock.PairKey(integrationClass, int32(id))
	sync := func(ctx context.Context) error {
		return runSync(ctx, id) // ctx ends if the client goes away or the lock is lost
	}
	if r.URL.Query().Has("wait") {
		err = locks.Do(r.Context(), key, sync, advlock.Wait(2*time.Second)) // waits up to 2 s; the sync itself is not cut short
	} else {
		err = locks.TryDo(r.Context(), key, sync) // ErrNotAcquired at once if a sync of this integration runs
	}
	switch {
	case err == nil:
		fmt.Fprintf(w, "synced integration %d\n", id)
	case errors.Is(err, advlock.ErrNotAcquired):
		http.Error(w, "a sync of this integration is already running", http.StatusConflict)
	case errors.Is(err, advlock.ErrLockLost):
		http.Error(w, "lost the lock mid-sync; it may have overlapped", http.StatusInternalServerError)
	default:
		http.Error(w, err.Error(), http.StatusServiceUnavailable) // ErrPoolExhausted, database down, client gone, ...
	}
}

// runSync stands for the work: it takes a second, and stops when ctx ends.
func runSync(ctx context.Context, id int64) error {
	select {
	case <-time.After(time.Second):
		return nil
	case <-ctx.Done():
		return context.Cause(ctx)
	}
}
