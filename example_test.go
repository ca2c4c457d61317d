package advlock_test

import (
	"context"
	"errors"
	"fmt"
	"log"
	"log/slog"
	"os"
	"time"

	"github.com/advlock/advlock"
	"github.com/advlock/advlock/internal/testkit/pgtest"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
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

// Open does not connect, so that a service whose database is down at start recovers once it is up; Ping fails fast
// instead, for a program that would rather not start.
func ExampleLocker_Ping() {
	ctx := context.Background()
	l, err := advlock.Open(ctx, exampleDSN())
	if err != nil {
		log.Fatal(err) // a malformed DSN: Open makes no round trip
	}
	defer l.Close()
	if err := l.Ping(ctx); err != nil {
		log.Fatal(err) // the database is down, unreachable or refusing
	}
	fmt.Println("the database answers")
	// Output: the database answers
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
	if err := first.Unlock(ctx); err != nil { // as if its holder had been paused (a GC pause, SIGSTOP) until its lock was lost
		log.Fatal(err)
	}

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

// Lock waits in the server until the key is granted or ctx ends; Wait bounds that wait apart from ctx, and a wait
// that runs out is ErrNotAcquired (its session goes back to the pool).
func ExampleLocker_Lock() {
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

	key := advlock.NameKey("example-nightly-report")
	held, err := a.Lock(ctx, key)
	if err != nil {
		log.Fatal(err)
	}
	_, err = b.Lock(ctx, key, advlock.Wait(100*time.Millisecond))
	fmt.Println("not granted within 100ms:", errors.Is(err, advlock.ErrNotAcquired))

	unlocked := make(chan error, 1)
	go func() {
		time.Sleep(50 * time.Millisecond)
		unlocked <- held.Unlock(ctx)
	}()
	lk, err := b.Lock(ctx, key) // granted as soon as a unlocks
	if err != nil {
		log.Fatal(err)
	}
	fmt.Println("the holder's unlock:", <-unlocked)
	fmt.Println("granted:", lk.Key())
	fmt.Println("unlock:", lk.Unlock(ctx))
	// Output:
	// not granted within 100ms: true
	// the holder's unlock: <nil>
	// granted: example-nightly-report
	// unlock: <nil>
}

// TryDo runs fn only if nobody holds the key, from this process or any other: the pattern for a request that
// should not queue behind a running job.
func ExampleLocker_TryDo() {
	ctx := context.Background()
	l, err := advlock.Open(ctx, exampleDSN())
	if err != nil {
		log.Fatal(err)
	}
	defer l.Close()

	key := advlock.PairKey(7, 12) // kind 7, id 12
	err = l.TryDo(ctx, key, func(ctx context.Context) error {
		err := l.TryDo(ctx, key, func(context.Context) error { return nil }) // a second request meanwhile
		fmt.Println("a second TryDo while fn runs:", errors.Is(err, advlock.ErrNotAcquired))
		return nil
	})
	fmt.Println("err:", err)
	// Output:
	// a second TryDo while fn runs: true
	// err: <nil>
}

// Lead runs fn while this process leads. Here fn steps down by returning an error, which Lead returns; a fn that
// returns nil steps down and campaigns again.
func ExampleLocker_Lead() {
	ctx := context.Background()
	l, err := advlock.Open(ctx, exampleDSN())
	if err != nil {
		log.Fatal(err)
	}
	defer l.Close()
	other, err := advlock.Open(ctx, exampleDSN()) // any other process
	if err != nil {
		log.Fatal(err)
	}
	defer other.Close()

	key := advlock.NameKey("example-scheduler")
	errStepDown := errors.New("step down")
	err = l.Lead(ctx, key, func(ctx context.Context) error {
		// ctx ends when leadership is lost; FenceToken(ctx) is the term's token with WithFencing.
		who, ok, err := other.Leader(ctx, key)
		if err != nil {
			return err
		}
		fmt.Println("another process sees a leader of", who.Key, ok)
		return errStepDown
	})
	fmt.Println("Lead returned:", err)
	// Output:
	// another process sees a leader of example-scheduler true
	// Lead returned: step down
}

// A semaphore admits at most n holders at once, across every process that uses the same name and n.
func ExampleLocker_Semaphore() {
	ctx := context.Background()
	l, err := advlock.Open(ctx, exampleDSN())
	if err != nil {
		log.Fatal(err)
	}
	defer l.Close()

	sem := l.Semaphore("example-partner-api", 2)
	first, err := sem.Acquire(ctx)
	if err != nil {
		log.Fatal(err)
	}
	second, err := sem.Acquire(ctx)
	if err != nil {
		log.Fatal(err)
	}
	_, err = sem.TryAcquire(ctx)
	fmt.Println("a third holder at once:", errors.Is(err, advlock.ErrNotAcquired))

	fmt.Println("the first leaves:", first.Unlock(ctx))
	third, err := sem.Acquire(ctx) // a slot is free again
	if err != nil {
		log.Fatal(err)
	}
	fmt.Println("the third holds a slot:", third.Err() == nil)
	fmt.Println("unlock:", second.Unlock(ctx), third.Unlock(ctx))
	// Output:
	// a third holder at once: true
	// the first leaves: <nil>
	// the third holds a slot: true
	// unlock: <nil> <nil>
}

// A transaction-scoped lock is held until the transaction ends: there is nothing to unlock.
func ExampleXactLock() {
	ctx := context.Background()
	pool, err := pgxpool.New(ctx, exampleDSN())
	if err != nil {
		log.Fatal(err)
	}
	defer pool.Close()
	l := advlock.New(pool) // session locks through the same pool
	defer l.Close()

	key := advlock.NameKey("example-invoice-42")
	tx, err := pool.Begin(ctx)
	if err != nil {
		log.Fatal(err)
	}
	if err := advlock.XactLock(ctx, tx, key); err != nil {
		log.Fatal(err)
	}
	_, err = l.TryLock(ctx, key)
	fmt.Println("held by the transaction:", errors.Is(err, advlock.ErrNotAcquired))
	if err := tx.Commit(ctx); err != nil {
		log.Fatal(err)
	}
	lk, err := l.TryLock(ctx, key)
	fmt.Println("free after COMMIT:", err)
	if err == nil {
		if err := lk.Unlock(ctx); err != nil {
			log.Fatal(err)
		}
	}
	// Output:
	// held by the transaction: true
	// free after COMMIT: <nil>
}

// DoTx runs fn in a transaction that holds the key; COMMIT or ROLLBACK ends the lock.
func ExampleLocker_DoTx() {
	ctx := context.Background()
	l, err := advlock.Open(ctx, exampleDSN())
	if err != nil {
		log.Fatal(err)
	}
	defer l.Close()

	err = l.DoTx(ctx, advlock.NameKey("example-invoice-43"), func(ctx context.Context, tx pgx.Tx) error {
		var n int
		err := tx.QueryRow(ctx, `SELECT count(*) FROM pg_locks
			WHERE locktype = 'advisory' AND pid = pg_backend_pid() AND granted`).Scan(&n)
		fmt.Println("advisory locks this transaction's session holds:", n)
		return err // nil commits, an error (or a panic) rolls back; either way the lock ends
	})
	fmt.Println("err:", err)
	// Output:
	// advisory locks this transaction's session holds: 1
	// err: <nil>
}

// WithLogger logs what a Locker does: DEBUG for acquisitions, releases and sessions, WARN for losses and sessions
// closed on doubt. The times and durations are dropped here so that the output does not change from run to run.
func ExampleWithLogger() {
	ctx := context.Background()
	logger := slog.New(slog.NewTextHandler(os.Stdout, &slog.HandlerOptions{Level: slog.LevelDebug,
		ReplaceAttr: func(_ []string, a slog.Attr) slog.Attr {
			switch a.Key {
			case slog.TimeKey, "took", "held":
				return slog.Attr{}
			}
			return a
		}}))
	l, err := advlock.Open(ctx, exampleDSN(), advlock.WithLogger(logger))
	if err != nil {
		log.Fatal(err)
	}
	lk, err := l.TryLock(ctx, advlock.NameKey("example-logger"))
	if err != nil {
		log.Fatal(err)
	}
	if err := lk.Unlock(ctx); err != nil {
		log.Fatal(err)
	}
	l.Close()
	// Output:
	// level=DEBUG msg="advlock: session open" mode=shared
	// level=DEBUG msg="advlock: acquired" key=example-logger mode=exclusive wait=false token=0
	// level=DEBUG msg="advlock: released" key=example-logger mode=exclusive by=released
	// level=DEBUG msg="advlock: session close" mode=shared
}
