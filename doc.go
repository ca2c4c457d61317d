// Package advlock takes PostgreSQL advisory locks that cannot leak through a connection pool: "only one pod may
// run this", across every process that uses the same database.
//
// Locking through a pool is subtly wrong: pg_advisory_lock on a pooled connection leaves the lock on that
// connection when it goes back to the pool, and the next caller that gets it "acquires" the key again, since the
// server's locks are re-entrant per session. A [Locker] never lets a pooled connection hold a lock. Its locks live
// on sessions it pins: a few shared sessions that each hold many locks ([WithSharedSessions]: 1 with [Open]'s
// default budget of 5 connections, 4 with [New]), and a session of its own for a lock that had to wait in the
// server. A session goes back to its pool only once the
// server confirms it holds nothing, is closed on any doubt (so that the server drops what it held), and is read
// continuously, so that a lost lock is reported at once: [Lock.Done] closes and [Lock.Err] says why. Within one
// Locker a key has at most one exclusive holder, so the server's re-entrancy never grants it twice.
//
// # Use
//
// [Open] makes a Locker with a pool of its own, tuned for locking (it does not connect; [Locker.Ping] fails fast
// when the database is down); [New] locks through a *pgxpool.Pool the application already has. [Locker.Do] takes
// a key, runs a function with a context that is cancelled if the lock is lost, and releases the key:
//
//	l, err := advlock.Open(ctx, os.Getenv("DATABASE_URL"))
//	if err != nil {
//		log.Fatal(err) // a malformed DSN
//	}
//	defer l.Close()
//
//	err = l.Do(ctx, advlock.NameKey("billing-sync"), func(ctx context.Context) error {
//		return runBillingSync(ctx) // ctx is cancelled if the lock is lost
//	})
//	if errors.Is(err, advlock.ErrLockLost) {
//		log.Print("lost the lock mid-run; the job may have overlapped: ", err)
//	}
//
// [Locker.Do] waits in the server for a key held elsewhere, until granted or ctx ends; [Wait] bounds that wait
// apart from ctx, and [Locker.TryDo] does not wait at all ([ErrNotAcquired] when the key is held). When the critical
// section does not fit in one function, [Locker.Lock] and [Locker.TryLock] return the held [Lock]:
//
//	lk, err := l.TryLock(ctx, advlock.Int64Key(42))
//	if errors.Is(err, advlock.ErrNotAcquired) {
//		return nil // someone else is on it
//	}
//	if err != nil {
//		return err
//	}
//	select {
//	case <-lk.Done(): // lost: lk.Err() says why
//	case <-work:
//	}
//	return lk.Unlock(ctx) // nil, or why the unlock was not clean (ErrLockLost: the work may have overlapped)
//
// Beyond one key: [Locker.Lead] elects a leader (fn runs while this process leads); [Locker.Semaphore] admits at
// most n holders at once; [XactLock] and [Locker.DoTx] lock for the rest of a transaction, with nothing to unlock
// (the only advisory locks that work through PgBouncer in transaction pooling); [WithFencing] gives every grant a
// fencing token ([Lock.Token], [FenceToken]) that a resource can check to refuse a holder that acts after its lock
// was lost; [Holding] lets a wait for a second key end with [ErrDeadlock] instead of waiting for ever when it
// closes a cycle of waits; [Inspect] and [Leader] say who holds and waits for what, from any process; [WithLogger]
// and [WithObserver] report what a Locker does, and [Locker.Stats] what it holds now. Package
// github.com/advlock/advlock/advsql gives the same Locker over database/sql (pgx's driver or lib/pq), and the
// advlock command (cmd/advlock) runs shell commands under these locks, like flock(1) across machines.
//
// # Guarantees
//
// Each is a test against a real PostgreSQL that checks the server's own view (pg_locks), run against every
// backend and through PgBouncer in session pooling mode:
//
//   - Exclusion: one exclusive holder per key across every process, judged by the server; within one Locker a
//     second caller for a held key waits in-process (or gets ErrNotAcquired from a Try call) and never shares the
//     first one's hold. A wait whose caller holds locks ([Holding], Do's fn) waits in the server instead, on a
//     session of its own, so that deadlock detection sees it; the server keeps it apart from the holder's session.
//   - Deadlocks the server cannot see: a cycle of watched waits (see [Holding]) across processes or within one
//     ends one wait of the cycle (the same one whichever process looks) with [ErrDeadlock], within about 2.5 s of
//     its forming (later while readings of the lock graph take more than 0.5 s); a wait that closes no cycle never
//     gets it.
//   - No false success: when a lock call returns a *Lock, the server granted the key.
//   - No leak on failure: when a lock call returns an error, including a cancelled wait that the server granted at
//     the last moment, the key is not held by this Locker: the session is closed unless it is known clean.
//   - Loss is signalled: [Lock.Done] closes when the session holding the lock ends. A terminated backend, an idle
//     session timeout or a server shutdown is seen as soon as the server says so; a network that silently drops is
//     noticed within about twice the keepalive interval ([WithKeepalive], default 5 s).
//   - Nothing hangs: a try never waits for a connection ([ErrPoolExhausted]) and is bounded even under a context
//     without a deadline; [Locker.Close] releases everything and ends every call in flight, within the release
//     timeout and about a second also during a network partition.
//   - Refusal where a lock would protect nothing: on a server in recovery every lock call fails with
//     [ErrStandby]; behind a pooler in transaction mode every session lock fails with [ErrTxPooling] (or
//     [ErrUnverified] while no second connection is free to tell), nothing locked.
//
// # Not guaranteed
//
//   - A paused holder acting late: a holder paused (GC, SIGSTOP, a VM migration) past the loss of its lock may act
//     after another holder started. Only a resource that checks fencing tokens ([WithFencing]) refuses it.
//   - Capacity: every held lock takes an entry of the server's shared lock table. When the table is full, lock
//     calls fail with [ErrLockTableFull] and the whole server refuses new connections.
//   - Replicas: a lock taken on the primary is not visible on standbys; after a failover no lock survives, and
//     holders see [ErrLockLost] when their session ends.
//   - Deadlocks through waits whose context does not say what its caller holds (see [Holding]).
//
// # Keys
//
// [Int64Key] and [PairKey] name the server's two key spaces; [NameKey] hashes a string into the int8 space with a
// documented, stable hash so that SQL and other programs can compute the same key. [ParseKey] reads the text form
// that [Key.String] writes, in which an integer is an int8 key as in SQL ("42" is pg_advisory_lock(42); a name
// that is a number is "name:42"), and [KeyFromPgLocks] decodes pg_locks rows. [GolangMigrateKey],
// [RailsMigrationKey] and [DistributedLockKey] are the keys other tools lock.
//
// # More
//
// The repository's docs/ directory goes into depth: docs/guarantees.md (every guarantee with its test, and what is
// not guaranteed), docs/errors.md, docs/locks.md (scopes, waits, Lead, Semaphore, database/sql, deadlocks),
// docs/poolers.md (shared sessions, New or Open, PgBouncer), docs/fencing.md, docs/keys.md, docs/command.md,
// docs/observability.md, docs/high-availability.md, docs/performance.md, docs/chaos.md, docs/testing.md and
// docs/architecture.md.
package advlock
