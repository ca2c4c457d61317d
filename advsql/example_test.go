package advsql_test

import (
	"context"
	"database/sql"
	"fmt"
	"log"
	"os"

	"github.com/advlock/advlock"
	"github.com/advlock/advlock/advsql"
	"github.com/advlock/advlock/internal/testkit/pgtest"
	_ "github.com/lib/pq" // the "postgres" driver; advsql registers pgx's as "pgx"
)

// exampleDSN is the server the examples run against (the tests' server).
func exampleDSN() string {
	if u := os.Getenv(pgtest.EnvURL); u != "" {
		return u
	}
	return "postgres://postgres@127.0.0.1:5432/test?sslmode=disable"
}

// Session locks over a *sql.DB the application already has, and a transaction-scoped lock over a *sql.Tx.
func ExampleNew() {
	ctx := context.Background()
	db, err := sql.Open("pgx", exampleDSN()) // pgx's driver; or sql.Open("postgres", ...) with lib/pq
	if err != nil {
		log.Fatal(err)
	}
	defer db.Close()
	l := advsql.New(db) // locks through db; close l before db
	defer l.Close()

	err = l.Do(ctx, advlock.NameKey("example-sql-report"), func(ctx context.Context) error {
		fmt.Println("session lock held")
		return nil
	})
	fmt.Println("Do:", err)

	err = advsql.DoTx(ctx, db, advlock.NameKey("example-sql-invoice"), func(ctx context.Context, tx *sql.Tx) error {
		fmt.Println("transaction lock held")
		_, err := tx.ExecContext(ctx, "SELECT 1") // the work, in the same transaction
		return err
	})
	fmt.Println("DoTx:", err)
	// Output:
	// session lock held
	// Do: <nil>
	// transaction lock held
	// DoTx: <nil>
}

// Open gives locks a *sql.DB of their own, the counterpart of advlock.Open: the application keeps its own pool.
func ExampleOpen() {
	ctx := context.Background()
	l, err := advsql.Open(ctx, "postgres", exampleDSN()) // lib/pq; "pgx" for pgx's driver
	if err != nil {
		log.Fatal(err) // driver not registered, or a DSN it cannot read: advsql.Open does not connect either
	}
	defer l.Close()

	lk, err := l.TryLock(ctx, advlock.NameKey("example-sql-open"))
	if err != nil {
		log.Fatal(err)
	}
	fmt.Println("held:", lk.Key())
	fmt.Println("unlock:", lk.Unlock(ctx))
	// Output:
	// held: example-sql-open
	// unlock: <nil>
}
