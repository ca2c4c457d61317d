//lint:file-ignore SA4006 the docs show one call a line, assigned to the same variables, not a program

package advlock_test

import (
	"context"
	"errors"
	"time"

	"github.com/advlock/advlock"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
)

// Code that README.md and docs/*.md show. These functions are compiled with the package's tests and never run;
// TestDocsGoBlocks (docs_test.go) fails when a ```go block of the docs is not an excerpt of a Go file that builds,
// such as this one.
var _ = []any{apiOnOneScreen, leaderElection, semaphoreSlots, transactionScope, holdingLocks, openOptions, leases,
	scheduledJob}

// The README's "API in one screen".
func apiOnOneScreen(ctx context.Context, pool *pgxpool.Pool, dsn string, opts []advlock.Option, key advlock.Key,
	fn, job func(ctx context.Context) error, txfn func(ctx context.Context, tx pgx.Tx) error, tx pgx.Tx) {
	l := advlock.New(pool)                                            // over a *pgxpool.Pool you own
	l, err := advlock.Open(ctx, dsn, opts...)                         // or a pool of its own, tuned for locking
	lk, err := l.TryLock(ctx, advlock.NameKey("billing-sync"))        // ErrNotAcquired when held elsewhere
	lk, err = l.Lock(ctx, advlock.Int64Key(42))                       // waits in PostgreSQL until granted or ctx ends
	lk, err = l.Lock(ctx, key, advlock.Wait(2*time.Second))           // ErrNotAcquired after 2 s; ctx still governs
	lk, err = l.RLock(ctx, key)                                       // shared mode; also TryRLock
	<-lk.Done()                                                       // closed once released or lost; lk.Err() says which
	err = lk.Unlock(ctx)                                              // nil, ErrNotHeld, ErrLockLost, ErrUnlockFailed or ErrClosed
	err = l.Do(ctx, key, fn)                                          // Lock, run fn (its ctx ends on loss), Unlock
	err = l.TryDo(ctx, key, fn)                                       // Do without waiting: ErrNotAcquired when busy
	err = l.TryDo(ctx, key, job, advlock.HoldAtLeast(30*time.Second)) // a scheduled job: held 30 s even if job is quick
	key = advlock.TickKey("reports", time.Now(), time.Minute)         // ... keyed by its tick: once per tick, not per replica
	err = l.Lead(ctx, key, fn)                                        // leader election: fn runs while this process leads
	lk, err = l.Semaphore("partner-api", 3).Acquire(ctx)              // at most 3 holders at once, across processes
	err = l.DoTx(ctx, key, txfn)                                      // a transaction that holds key: COMMIT or ROLLBACK ends it
	err = advlock.XactLock(ctx, tx, key)                              // the same inside your own pgx.Tx
	l, err = advlock.Open(ctx, dsn, advlock.WithFencing())            // lk.Token(), advlock.FenceToken(ctx) inside Do
	l, err = advlock.Open(ctx, dsn, advlock.WithLeases())             // locks as rows of a table: through any pooler, any driver
	err = l.Ping(ctx)                                                 // one round trip: Open does not connect; fail fast at start
	st := l.Stats()                                                   // held, waiting, sessions, the pool's figures
	rows, err := l.Inspect(ctx)                                       // every advisory lock, through the Locker's own pool
	use, err := l.LockTable(ctx)                                      // the server's lock-table use against its size
	who, ok, err := l.Leader(ctx, key)                                // who leads key, from any process
	l.Close()                                                         // releases everything (held past Unlock too), waits
	_, _, _, _, _, _ = st, rows, use, who, ok, err
}

func leaderElection(ctx context.Context, l *advlock.Locker, pool *pgxpool.Pool) {
	err := l.Lead(ctx, advlock.NameKey("scheduler"), func(ctx context.Context) error {
		return runScheduler(ctx) // ctx ends when leadership is lost or ctx ends; FenceToken(ctx) with WithFencing
	})
	who, ok, err := advlock.Leader(ctx, pool, advlock.NameKey("scheduler")) // from any process: pid, app, address
	who, ok, err = l.Leader(ctx, advlock.NameKey("scheduler"))              // the same, through the Locker's pool
	_, _, _ = who, ok, err
}

func runScheduler(ctx context.Context) error {
	<-ctx.Done()
	return ctx.Err()
}

func semaphoreSlots(ctx context.Context, l *advlock.Locker) error {
	sem := l.Semaphore("partner-api", 3) // at most 3 holders at once, across every process
	lk, err := sem.Acquire(ctx)          // waits for a slot and for a connection, until ctx ends, or Acquire(ctx, Wait(d))
	if err != nil {                      // (TryAcquire: ErrNotAcquired when all 3 are taken, ErrPoolExhausted without a connection)
		return err
	}
	callPartner(ctx)
	return lk.Unlock(ctx) // a Lock like any other: Done, Err, Token; ErrLockLost here means the slot was lost meanwhile
}

func callPartner(context.Context) {}

func transactionScope(ctx context.Context, l *advlock.Locker) error {
	err := l.DoTx(ctx, advlock.NameKey("invoice-42"), func(ctx context.Context, tx pgx.Tx) error {
		_, err := tx.Exec(ctx, "UPDATE invoices SET state = 'sent' WHERE id = 42")
		return err // nil commits, an error (or a panic) rolls back; either way the lock ends
	})
	// or by hand inside your own transaction: advlock.XactLock(ctx, tx, key)
	return err
}

func holdingLocks(ctx context.Context, locks *advlock.Locker, keyA, keyB advlock.Key) error {
	a, err := locks.Lock(ctx, keyA)
	if err != nil {
		return err
	}
	b, err := locks.Lock(advlock.Holding(ctx, a), keyB) // this caller holds a while it waits for keyB
	if err != nil {
		// ErrDeadlock: a caller that holds keyB waits for keyA; let a go and try again later
		return errors.Join(err, a.Unlock(ctx))
	}
	transfer(ctx)
	return errors.Join(b.Unlock(ctx), a.Unlock(ctx))
}

func transfer(context.Context) {}

func openOptions(ctx context.Context, dsn string) (*advlock.Locker, error) {
	return advlock.Open(ctx, dsn,
		advlock.WithSharedSessions(0),        // a session per lock (default: shared sessions, 1 with Open's pool of 5)
		advlock.WithKeepalive(2*time.Second), // ping an idle held session after 2 s of silence (default 5 s)
		advlock.WithReleaseTimeout(time.Second),
		advlock.WithMaxConns(50), // the budget of a pool the Locker owns (default 5)
		advlock.WithFencing(),
		advlock.WithLogger(nil), // a *slog.Logger; nil logs nothing
	)
}

// docs/leases.md.
func leases(ctx context.Context, dsn string, run func(context.Context) error) {
	l, err := advlock.Open(ctx, dsn, advlock.WithLeases()) // also advlock.New(pool, advlock.WithLeases()), advsql
	err = l.Do(ctx, advlock.NameKey("billing-sync"), func(ctx context.Context) error {
		return run(ctx) // ctx ends if the lease is lost; advlock.FenceToken(ctx) is the lease's term
	})
	_ = err
}

// docs/locks.md, "Scheduled jobs".
func scheduledJob(ctx context.Context, locks *advlock.Locker, runReports func(context.Context) error) error {
	key := advlock.TickKey("reports", time.Now(), time.Minute) // this run's tick, on this replica's clock
	err := locks.TryDo(ctx, key, runReports, advlock.HoldAtLeast(30*time.Second))
	return err
}
