package advlock_test

import (
	"context"
	"errors"
	"fmt"
	"log"
	"os"

	"github.com/advlock/advlock"
	"github.com/advlock/advlock/internal/pgtest"
)

// exampleDSN is the server the examples run against (the tests' server).
func exampleDSN() string {
	if u := os.Getenv(pgtest.EnvURL); u != "" {
		return u
	}
	return "postgres://postgres@127.0.0.1:5432/test?sslmode=disable"
}

func ExampleLocker_Do() {
	ctx := context.Background()
	l, err := advlock.Open(ctx, exampleDSN())
	if err != nil {
		log.Fatal(err)
	}
	defer l.Close()

	err = l.Do(ctx, advlock.NameKey("example-billing-sync"), func(ctx context.Context) error {
		fmt.Println("only one process runs this at a time")
		return nil
	})
	fmt.Println("err:", err)
	// Output:
	// only one process runs this at a time
	// err: <nil>
}

func ExampleLocker_TryLock() {
	ctx := context.Background()
	a, err := advlock.Open(ctx, exampleDSN())
	if err != nil {
		log.Fatal(err)
	}
	defer a.Close()
	b, err := advlock.Open(ctx, exampleDSN()) // another process, say
	if err != nil {
		log.Fatal(err)
	}
	defer b.Close()

	key := advlock.PairKey(7, 11)
	lk, err := a.TryLock(ctx, key)
	if err != nil {
		log.Fatal(err)
	}
	_, err = b.TryLock(ctx, key)
	fmt.Println("second holder refused:", errors.Is(err, advlock.ErrNotAcquired))
	fmt.Println("unlock:", lk.Unlock(ctx))
	fmt.Println("unlock again:", errors.Is(lk.Unlock(ctx), advlock.ErrNotHeld))
	// Output:
	// second holder refused: true
	// unlock: <nil>
	// unlock again: true
}

func ExampleNameKey() {
	k := advlock.NameKey("billing-sync")
	n, _ := k.Int64()
	fmt.Println(k, n)
	// Output: billing-sync 6451652757638753977
}
