package advlock

import (
	"context"
	"errors"
	"fmt"

	"github.com/advlock/advlock/internal/session"
	"github.com/jackc/pgx/v5"
)

// XactLock takes key exclusively for the rest of tx, waiting in PostgreSQL until it is granted or ctx ends.
// COMMIT or ROLLBACK releases it: there is no unlock that can fail, and it is the only advisory lock that works
// through PgBouncer in transaction pooling mode. A lock taken after a SAVEPOINT is released by ROLLBACK TO that
// savepoint.
//
// The wait follows the transaction's own statement_timeout and lock_timeout (advlock does not change settings
// inside a caller's transaction). When the wait fails or ctx ends, the transaction is aborted and must be rolled
// back; that also drops the lock if the server granted it at the last moment.
func XactLock(ctx context.Context, tx pgx.Tx, key Key) error {
	return xactLock(ctx, tx, key, false, true)
}

// TryXactLock is XactLock without waiting: ErrNotAcquired when the key is held elsewhere (the transaction stays
// usable).
func TryXactLock(ctx context.Context, tx pgx.Tx, key Key) error {
	return xactLock(ctx, tx, key, false, false)
}

// XactRLock is XactLock in shared mode.
func XactRLock(ctx context.Context, tx pgx.Tx, key Key) error {
	return xactLock(ctx, tx, key, true, true)
}

// TryXactRLock is TryXactLock in shared mode.
func TryXactRLock(ctx context.Context, tx pgx.Tx, key Key) error {
	return xactLock(ctx, tx, key, true, false)
}

func xactLock(ctx context.Context, tx pgx.Tx, key Key, shared, wait bool) error {
	op := xactOp(shared, wait)
	if tx == nil {
		return &keyError{op: op, key: key, err: errors.New("nil transaction")}
	}
	if err := key.valid(); err != nil {
		return &keyError{op: op, key: key, err: err}
	}
	tag, err := tx.Exec(ctx, session.XactSQL(session.Target{ID: key.id, Shared: shared}, wait))
	if err != nil {
		return &keyError{op: op, key: key, err: session.WithContext(ctx, session.TranslateErr(err))}
	}
	if err := session.XactRows(tag.RowsAffected()); err != nil {
		return &keyError{op: op, key: key, err: err}
	}
	return nil
}

func xactOp(shared, wait bool) string {
	switch {
	case shared && wait:
		return "xact rlock"
	case shared:
		return "try xact rlock"
	case wait:
		return "xact lock"
	}
	return "try xact lock"
}

// DoTx begins a transaction on the Locker's pool, takes key exclusively for it (waiting like XactLock), runs fn,
// and commits. It rolls back when fn returns an error or panics (and re-panics). The lock ends with the
// transaction, so nothing can leak. DoTx needs a Locker made by New or Open (over pgxpool).
func (l *Locker) DoTx(ctx context.Context, key Key, fn func(ctx context.Context, tx pgx.Tx) error) (err error) {
	if l == nil || l.pgxPool == nil {
		return &keyError{op: "do tx", key: key, err: fmt.Errorf("%w: DoTx needs a Locker over pgxpool (New or Open)", ErrNoPool)}
	}
	ctx, done, err := l.begin(ctx, true)
	if err != nil {
		return &keyError{op: "do tx", key: key, err: err}
	}
	defer done()
	conn, err := l.pgxPool.Acquire(ctx)
	if err != nil {
		return &keyError{op: "do tx", key: key, err: session.WithContext(ctx, err)}
	}
	l.countConn(1) // one of the Locker's connections (Stats.Conns) until it is released
	defer l.countConn(-1)
	defer func() {
		// A connection pgx gave up (a statement that outlived its ctx, a network gone) is closed by pgx in the
		// background, after a cancel request and a drain of up to 15 s, all that time holding the transaction and
		// its lock on the server. Destroy means now: close the socket, so the server ends the transaction as soon
		// as the network lets it know.
		if conn.Conn().IsClosed() {
			_ = conn.Conn().PgConn().Conn().Close()
		}
		conn.Release()
	}()
	tx, err := conn.Begin(ctx)
	if err != nil {
		return &keyError{op: "do tx", key: key, err: session.WithContext(ctx, err)}
	}
	committed := false
	defer func() { // also when fn panics; the panic goes on
		if !committed {
			rctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), l.opts.ReleaseTimeout)
			defer cancel()
			if tx.Rollback(rctx) != nil {
				_ = conn.Conn().PgConn().Conn().Close() // the transaction's state is unknown: end the session now
			}
		}
	}()
	if err := XactLock(ctx, tx, key); err != nil {
		return err
	}
	if err := fn(ctx, tx); err != nil {
		return preparedHint(err)
	}
	if err := tx.Commit(ctx); err != nil {
		return &keyError{op: "do tx", key: key, err: fmt.Errorf("commit: %w", session.WithContext(ctx, preparedHint(err)))}
	}
	committed = true
	return nil
}

// preparedHint adds to an error that a pooler in transaction mode causes with pgx's named prepared statements
// (SQLSTATE 42P05, a statement that exists already, or 26000, one that does not: the pooler handed another
// client's server session) what to set; any other error is returned as it is.
func preparedHint(err error) error {
	switch session.SQLState(err) {
	case "42P05", "26000":
		return fmt.Errorf("%w (a pooler in transaction mode mixes up named prepared statements: set "+
			"default_query_exec_mode=cache_describe, or exec, in the pool's DSN, as Open's pool does unless told)", err)
	}
	return err
}
