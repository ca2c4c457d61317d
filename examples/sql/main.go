// Command sql is the database/sql example of docs/locks.md: the same locks over *sql.DB, with lib/pq or pgx's driver,
// and a transaction-scoped lock.
package main

import (
	"context"
	"database/sql"
	"fmt"
	"log"
	"os"

	"github.com/advlock/advlock"
	"github.com/advlock/advlock/advsql"
	_ "github.com/lib/pq" // or _ "github.com/jackc/pgx/v5/stdlib" and sql.Open("pgx", ...)
)

func main() {
	ctx := context.Background()
	db, err := sql.Open("postgres", os.Getenv("DATABASE_URL")) // e.g. postgres://postgres@127.0.0.1/test?sslmode=disable
	if err != nil {
		log.Fatal(err)
	}
	defer db.Close()

	l := advsql.New(db) // session locks, many on one shared *sql.Conn
	defer l.Close()
	err = l.Do(ctx, advlock.NameKey("nightly-report"), func(ctx context.Context) error {
		fmt.Println("session lock held: running the nightly report")
		return nil
	})
	if err != nil {
		log.Fatal(err)
	}

	// Transaction scope: COMMIT or ROLLBACK releases the lock; nothing to unlock, safe through PgBouncer.
	err = advsql.DoTx(ctx, db, advlock.NameKey("invoice-42"), func(ctx context.Context, tx *sql.Tx) error {
		_, err := tx.ExecContext(ctx, "SELECT 1") // the work, in the same transaction
		fmt.Println("transaction lock held: invoice 42 updated")
		return err
	})
	if err != nil {
		log.Fatal(err)
	}
}
