// Package advlock takes PostgreSQL advisory locks that cannot leak through a connection pool.
//
// Each lock lives on its own session pinned from a pool until it is released. Release is exact: only when
// pg_advisory_unlock confirms the release does the session go back to the pool; on false, an error, a timeout or
// a cancelled context the connection is closed instead, so that the server drops the lock and no pooled session
// ever carries one to an unrelated caller (who would otherwise "acquire" it again through PostgreSQL's
// per-session re-entrancy).
//
// # Use
//
//	l, err := advlock.Open(ctx, "postgres://app@db/app")   // or advlock.New(existingPool)
//	if err != nil { ... }
//	defer l.Close()
//
//	err = l.Do(ctx, advlock.NameKey("billing-sync"), func(ctx context.Context) error {
//		return runBillingSync(ctx) // ctx is cancelled if the lock is lost
//	})
//
// Or by hand, when the critical section does not fit in one function:
//
//	lk, err := l.TryLock(ctx, advlock.Int64Key(42))
//	if errors.Is(err, advlock.ErrNotAcquired) { return } // someone else is on it
//	defer lk.Unlock(ctx)
//	select {
//	case <-lk.Done(): // lost: lk.Err() says why
//	case <-work:
//	}
//
// # Guarantees
//
//   - Exclusion: one exclusive holder per key across every process, judged by the server; within one [Locker] a
//     second caller for a held key waits in-process (or gets ErrNotAcquired from a Try call) and never shares a
//     session.
//   - No false success: when a lock call returns a *Lock, the server granted the key to that session.
//   - No leak on failure: when a lock call returns an error, including a cancelled wait that the server granted
//     at the last moment, the key is not held by this Locker: the session is closed unless it is known clean.
//   - Loss is signalled: [Lock.Done] closes when the session dies. A terminated backend, an idle-session timeout
//     or a server shutdown is seen as soon as the server says so (the watcher starts reading within 2 ms of the
//     grant); a network that silently drops is noticed within about twice the keepalive interval
//     ([WithKeepalive], default 5 s).
//   - Refusal on standbys: on a server in recovery every lock call fails with ErrStandby.
//
// # Not guaranteed
//
//   - Fencing. A holder paused (GC, SIGSTOP, a slow disk) past loss detection may still act after another
//     holder started; protect the resource itself if that matters.
//   - PgBouncer in transaction pooling mode: session locks do not work through it at all.
//   - Capacity: every held lock takes a server lock-table slot and a connection. When the table is full, lock
//     calls fail with ErrLockTableFull and the whole server refuses new connections.
//   - Replicas: a lock taken on the primary is not visible on standbys; after a failover no lock survives, and
//     holders see ErrLockLost when their session ends.
//
// # Keys
//
// [Int64Key] and [PairKey] name the server's two key spaces; [NameKey] hashes a string into the int8 space with a
// documented, stable hash so that SQL and other programs can compute the same key. [ParseKey] reads the text form
// that [Key.String] writes, and [KeyFromPgLocks] decodes pg_locks rows.
package advlock
