// Command basic is the README's example: run a job only if no other process is running it.
package main

import (
	"context"
	"errors"
	"fmt"
	"log"
	"os"

	"github.com/advlock/advlock"
)

func main() {
	ctx := context.Background()
	dsn := os.Getenv("DATABASE_URL") // e.g. postgres://postgres@127.0.0.1:5432/test
	l, err := advlock.Open(ctx, dsn)
	if err != nil {
		log.Fatal(err)
	}
	defer l.Close()

	err = l.Do(ctx, advlock.NameKey("billing-sync"), func(ctx context.Context) error {
		fmt.Println("running billing-sync; no other process holds it")
		return nil // ctx is cancelled if the lock is lost while we run
	})
	if errors.Is(err, advlock.ErrLockLost) {
		log.Fatal("lost the lock mid-run; the job may have overlapped: ", err)
	}
	if err != nil {
		log.Fatal(err)
	}
}
