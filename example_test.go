package advlock_test

import (
	"context"
	"errors"
	"fmt"
	"log"
	"os"

	"github.com/advlock/advlock"
	"github.com/advlock/advlock/internal/pgtest"
	"github.com/jackc/pgx/v5"
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

// A resource guarded by fencing tokens keeps the largest token it has seen and refuses writes that bring a smaller
// one: a holder that was paused past the loss of its lock cannot overwrite the work of the holder after it.
func ExampleWithFencing() {
	ctx := context.Background()
	l, err := advlock.Open(ctx, exampleDSN(), advlock.WithFencing())
	if err != nil {
		log.Fatal(err)
	}
	defer l.Close()
	db, err := pgx.Connect(ctx, exampleDSN())
	if err != nil {
		log.Fatal(err)
	}
	defer db.Close(ctx)
	if _, err := db.Exec(ctx, `CREATE TEMP TABLE invoice (id int PRIMARY KEY, fence bigint NOT NULL, state text);
		INSERT INTO invoice VALUES (42, 0, 'new')`); err != nil {
		log.Fatal(err)
	}
	// The resource side: a write carries the writer's token and happens only if no later holder has written.
	write := func(token int64, state string) bool {
		tag, err := db.Exec(ctx, "UPDATE invoice SET fence = $1, state = $2 WHERE id = 42 AND fence < $1", token, state)
		if err != nil {
			log.Fatal(err)
		}
		return tag.RowsAffected() == 1
	}
	key := advlock.PairKey(2, 42)
	first, err := l.TryLock(ctx, key)
	if err != nil {
		log.Fatal(err)
	}
	stale := first.Token()
	_ = first.Unlock(ctx) // as if its holder had been paused (a GC pause, SIGSTOP) until its lock was lost

	second, err := l.TryLock(ctx, key)
	if err != nil {
		log.Fatal(err)
	}
	defer second.Unlock(ctx)
	fmt.Println("the second holder writes:", write(second.Token(), "sent"))
	fmt.Println("the first holder, resumed, writes:", write(stale, "cancelled"))
	// Output:
	// the second holder writes: true
	// the first holder, resumed, writes: false
}
