// Command http is the request-scoped pattern: an HTTP service whose POST /sync/{id} runs a sync of one
// integration at a time, across every process running it, with a lock per integration.
//
//	go run ./examples/http              # then: curl -X POST localhost:8080/sync/7 (twice at once: one gets 409)
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

const integrationClass = 1 // a number per kind of entity: PairKey(class, id)

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt)
	defer stop()
	locks, err := advlock.Open(ctx, os.Getenv("DATABASE_URL"))
	if err != nil {
		log.Fatal(err)
	}
	defer locks.Close()

	mux := http.NewServeMux()
	// POST /sync/{id}: run the sync unless one of this integration is already running somewhere.
	mux.HandleFunc("POST /sync/{id}", func(w http.ResponseWriter, r *http.Request) {
		id, err := strconv.ParseInt(r.PathValue("id"), 10, 32)
		if err != nil {
			http.Error(w, "bad integration id", http.StatusBadRequest)
			return
		}
		key := advlock.PairKey(integrationClass, int32(id))
		err = locks.TryDo(r.Context(), key, func(ctx context.Context) error {
			return runSync(ctx, id) // ctx ends if the client goes away or the lock is lost
		})
		respond(w, id, err)
	})
	// POST /sync/{id}/wait: the same, waiting up to 2 s for a running sync to finish first.
	mux.HandleFunc("POST /sync/{id}/wait", func(w http.ResponseWriter, r *http.Request) {
		id, err := strconv.ParseInt(r.PathValue("id"), 10, 32)
		if err != nil {
			http.Error(w, "bad integration id", http.StatusBadRequest)
			return
		}
		key := advlock.PairKey(integrationClass, int32(id))
		err = locks.Do(r.Context(), key, func(ctx context.Context) error { return runSync(ctx, id) },
			advlock.Wait(2*time.Second)) // bounds the wait only: the sync itself is not cut short
		respond(w, id, err)
	})
	mux.HandleFunc("GET /stats", func(w http.ResponseWriter, r *http.Request) {
		fmt.Fprintf(w, "%+v\n", locks.Stats())
	})

	srv := &http.Server{Addr: "127.0.0.1:8080", Handler: mux}
	go func() {
		<-ctx.Done()
		_ = srv.Shutdown(context.Background())
	}()
	log.Printf("listening on http://%s (POST /sync/{id}, POST /sync/{id}/wait, GET /stats)", srv.Addr)
	if err := srv.ListenAndServe(); !errors.Is(err, http.ErrServerClosed) {
		log.Fatal(err)
	}
}

func respond(w http.ResponseWriter, id int64, err error) {
	switch {
	case err == nil:
		fmt.Fprintf(w, "synced integration %d\n", id)
	case errors.Is(err, advlock.ErrNotAcquired):
		http.Error(w, "a sync of this integration is already running", http.StatusConflict)
	case errors.Is(err, advlock.ErrLockLost):
		http.Error(w, "lost the lock mid-sync; it may have overlapped another", http.StatusInternalServerError)
	default: // ErrPoolExhausted, the database down, the client gone
		http.Error(w, err.Error(), http.StatusServiceUnavailable)
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
