// Command slog shows what advlock.WithLogger writes: a TryLock and its Unlock, then a Lock whose backend another
// session terminates (the output in docs/observability.md comes from it).
package main

import (
	"context"
	"log"
	"log/slog"
	"os"
	"time"

	"github.com/advlock/advlock"
	"github.com/jackc/pgx/v5"
)

func main() {
	ctx := context.Background()
	dsn := os.Getenv("DATABASE_URL") // e.g. postgres://postgres@127.0.0.1:5432/test
	logger := slog.New(slog.NewTextHandler(os.Stdout, &slog.HandlerOptions{Level: slog.LevelDebug,
		ReplaceAttr: func(_ []string, a slog.Attr) slog.Attr {
			if a.Key == slog.TimeKey {
				return slog.Attr{} // shorter lines
			}
			return a
		}}))
	l, err := advlock.Open(ctx, dsn, advlock.WithLogger(logger))
	if err != nil {
		log.Fatal(err)
	}
	defer l.Close()
	key := advlock.NameKey("billing-sync")
	lk, err := l.TryLock(ctx, key)
	if err != nil {
		log.Fatal(err)
	}
	time.Sleep(30 * time.Millisecond)
	if err := lk.Unlock(ctx); err != nil {
		log.Fatal(err)
	}
	if lk, err = l.Lock(ctx, key); err != nil {
		log.Fatal(err)
	}
	// Another session ends the holder's backend, as an operator running advlock break would.
	other, err := pgx.Connect(ctx, dsn)
	if err != nil {
		log.Fatal(err)
	}
	defer other.Close(ctx)
	v, _ := key.Int64()
	if _, err := other.Exec(ctx, `SELECT pg_terminate_backend(pid) FROM pg_locks
		WHERE locktype = 'advisory' AND objsubid = 1 AND granted AND (classid::bigint << 32 | objid::bigint) = $1`, v); err != nil {
		log.Fatal(err)
	}
	<-lk.Done()
	time.Sleep(50 * time.Millisecond) // the session's end is logged just after
}
