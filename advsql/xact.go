package advsql

import (
	"context"
	"database/sql"
	"fmt"

	"github.com/advlock/advlock"
	"github.com/advlock/advlock/internal/session"
)

// XactLock takes key exclusively for the rest of tx, waiting in PostgreSQL until granted or ctx ends; COMMIT or
// ROLLBACK releases it. See advlock.XactLock.
func XactLock(ctx context.Context, tx *sql.Tx, key advlock.Key) error {
	return xact(ctx, tx, key, false, true)
}

// TryXactLock is XactLock without waiting: advlock.ErrNotAcquired when the key is held elsewhere.
func TryXactLock(ctx context.Context, tx *sql.Tx, key advlock.Key) error {
	return xact(ctx, tx, key, false, false)
}

// XactRLock is XactLock in shared mode.
func XactRLock(ctx context.Context, tx *sql.Tx, key advlock.Key) error {
	return xact(ctx, tx, key, true, true)
}

// TryXactRLock is TryXactLock in shared mode.
func TryXactRLock(ctx context.Context, tx *sql.Tx, key advlock.Key) error {
	return xact(ctx, tx, key, true, false)
}

func xact(ctx context.Context, tx *sql.Tx, key advlock.Key, shared, wait bool) error {
	if tx == nil {
		return fmt.Errorf("advlock: xact lock %s: %w", key, errNilTx)
	}
	id, err := sessionID(key)
	if err != nil {
		return err
	}
	res, err := tx.ExecContext(ctx, session.XactSQL(session.Target{ID: id, Shared: shared}, wait))
	var n int64
	if err == nil {
		n, err = res.RowsAffected()
	}
	if err != nil {
		return fmt.Errorf("advlock: xact lock %s: %w", key, session.WithContext(ctx, session.TranslateErr(err)))
	}
	if err := session.XactRows(n); err != nil {
		return fmt.Errorf("advlock: xact lock %s: %w", key, err)
	}
	return nil
}

func sessionID(k advlock.Key) (session.ID, error) {
	if v, ok := k.Int64(); ok {
		return session.ID{V: v}, nil
	}
	if a, b, ok := k.Pair(); ok {
		return session.ID{Pair: true, V: int64(a)<<32 | int64(uint32(b))}, nil
	}
	return session.ID{}, fmt.Errorf("%w: the zero Key; use Int64Key, PairKey or NameKey", advlock.ErrInvalidKey)
}

// DoTx begins a transaction on db, takes key exclusively for it, runs fn, and commits; it rolls back when fn
// returns an error or panics (and re-panics). The lock ends with the transaction.
func DoTx(ctx context.Context, db *sql.DB, key advlock.Key, fn func(ctx context.Context, tx *sql.Tx) error) error {
	if db == nil {
		return fmt.Errorf("advlock: do tx %s: %w", key, advlock.ErrNoPool)
	}
	tx, err := db.BeginTx(ctx, nil)
	if err != nil {
		return fmt.Errorf("advlock: do tx %s: %w", key, session.WithContext(ctx, err))
	}
	committed := false
	defer func() { // also when fn panics; the panic goes on
		if !committed {
			_ = tx.Rollback()
		}
	}()
	if err := XactLock(ctx, tx, key); err != nil {
		return err
	}
	if err := fn(ctx, tx); err != nil {
		return err
	}
	if err := tx.Commit(); err != nil {
		return fmt.Errorf("advlock: do tx %s: commit: %w", key, err)
	}
	committed = true
	return nil
}
