package advlock

import (
	"context"
	"errors"

	"github.com/advlock/advlock/internal/lease"
	"github.com/advlock/advlock/internal/session"
)

// Errors returned by this package. Match them with errors.Is; the server's own error (*pgconn.PgError) and the
// context's error stay reachable through errors.As and errors.Is.
var (
	// ErrNotAcquired: a Try call found the key held by another session (or by another holder in this Locker), or a
	// Wait bound elapsed before the grant.
	ErrNotAcquired = session.ErrNotAcquired
	// ErrNotHeld: Unlock of a lock that was already unlocked.
	ErrNotHeld = session.ErrNotHeld
	// ErrLockLost: the session holding the lock ended (terminated, timed out, server restart, network loss) or the
	// server said it no longer held the key. The critical section may have overlapped with another holder.
	ErrLockLost = session.ErrLockLost
	// ErrClosed: the Locker was closed (also what Unlock returns for a lock that Close released).
	ErrClosed = session.ErrClosed
	// ErrNoPool: the Locker has no pool to take sessions from: it was made with New(nil), or its pool was closed
	// under it (close the Locker before its pool); also DoTx on a Locker that is not over pgxpool.
	ErrNoPool = session.ErrNoPool
	// ErrStandby: the server is a hot standby (pg_is_in_recovery()); its locks would exclude nobody on the primary.
	ErrStandby = session.ErrStandby
	// ErrLockTableFull: SQLSTATE 53200, the server's shared lock table is full. Raise max_locks_per_transaction
	// (needs a restart) or hold fewer locks; while it is full, new connections to the server fail too.
	ErrLockTableFull = session.ErrLockTableFull
	// ErrDeadlock: a wait that closed a cycle of waits and gave up, having taken nothing; the caller should release
	// what it holds and try again. Either the server found the cycle (SQLSTATE 40P01: transaction-scoped locks on
	// one transaction), or advlock did (a *DeadlockError): the caller holds locks on other sessions (Do's fn, Lead's
	// fn, Holding) or in this process's gate, which the server cannot see. See "Deadlocks" in docs/locks.md.
	ErrDeadlock = session.ErrDeadlock
	// ErrUnlockFailed: Unlock could not get the server to confirm the release (error, timeout, cancelled ctx), so
	// the session was closed instead of being pooled; the server drops the lock when it sees the socket close. For
	// an Unlock before the lock's HoldAtLeast had passed: no answer came to its question whether the lock was still
	// held, and the lock stays held until the hold has passed.
	ErrUnlockFailed = session.ErrUnlockFailed
	// ErrInvalidKey: the zero Key, or text that ParseKey cannot read.
	ErrInvalidKey = session.ErrInvalidKey
	// ErrFencing: WithFencing is on and the sequence public.advlock_fence can neither be used nor created by this
	// role; the message says what to run. Nothing was locked. It is only ever this, which an operator must fix.
	ErrFencing = session.ErrFencing
	// ErrPoolExhausted: a try (TryLock, TryRLock, TryDo, Wait(0)) found no free connection in the pool when it
	// needed one (a session of its own, or the first shared session) and did not wait. Nothing was locked; the
	// key's state is unknown. Give the Locker a pool of its own ([Open]) or a bigger one.
	ErrPoolExhausted = session.ErrPoolExhausted
	// ErrTxPooling: the connection goes through a pooler in transaction mode (PgBouncer pool_mode=transaction),
	// where a session lock would stay on a server session other clients use. Nothing was locked. Use session
	// pooling, or the transaction-scoped XactLock and DoTx.
	ErrTxPooling = session.ErrTxPooling
	// ErrUnverified: a new connection could not be proved to be a server session of its own: the driver does not
	// report the session's pid (lib/pq), or the pid it reports is not the session's (a pooler), and no second
	// connection of the pool was free within 2s to rule out a pooler in transaction mode. Nothing was locked; it
	// passes once the pool has a connection free (Lead tries again). Give locks a pool of their own ([Open],
	// advsql.Open) or a bigger one.
	ErrUnverified = session.ErrUnverified
	// ErrInvalidDSN: [Open] (or advsql.Open) was given a connection string that does not parse, or that parses
	// other than meant (a host holding an '@', which an unescaped '@' in a password gives). The message never shows
	// the string or any part of it; the parser's own error is reachable with errors.As.
	ErrInvalidDSN = session.ErrInvalidDSN
	// ErrLeaseTable: with [WithLeases], the lease tables do not exist and this role may not create them, or it may
	// not read and write the two that every grant writes (advlock_lease_restart, advlock_lease_timeline); the
	// message says what to run ([LeaseTableSQL], the GRANT). Nothing was locked.
	ErrLeaseTable = lease.ErrLeaseTable
)

// notAcquiredError is ErrNotAcquired with the reason in its text.
type notAcquiredError struct{ why string }

func (e *notAcquiredError) Error() string        { return "advlock: not acquired: " + e.why }
func (e *notAcquiredError) Is(target error) bool { return target == ErrNotAcquired }

// errHeldInProcess: a Try call found the key held by another holder of the same Locker.
var errHeldInProcess error = &notAcquiredError{why: "the key is held by another holder in this process (the same Locker)"}

// lostError is Do's result when the loss of the lock cancelled fn's context: it matches ErrLockLost, and what fn
// returned (through errors.Is and errors.As), except context.Canceled, which there only says that the loss
// cancelled fn's context. It has no Unwrap, since errors.Is would find context.Canceled through it.
type lostError struct {
	fn   error // what fn returned, maybe nil
	loss error // matches ErrLockLost
}

func (e *lostError) Error() string {
	if e.fn == nil {
		return e.loss.Error()
	}
	return e.loss.Error() + "; fn returned: " + e.fn.Error()
}

func (e *lostError) Is(target error) bool {
	if target == context.Canceled {
		return false
	}
	return errors.Is(e.loss, target) || e.fn != nil && errors.Is(e.fn, target)
}

func (e *lostError) As(target any) bool {
	return errors.As(e.loss, target) || e.fn != nil && errors.As(e.fn, target)
}
