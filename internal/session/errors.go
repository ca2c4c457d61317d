package session

import (
	"database/sql/driver"
	"errors"
	"fmt"
	"io"
	"net"
	"strings"
	"syscall"

	"github.com/jackc/pgx/v5/pgconn"
)

// The sentinels of package advlock live here so that the state machine and every backend adapter can return them;
// the root package re-exports them.
var (
	ErrNotAcquired   = errors.New("advlock: not acquired: the key is held by another session")
	ErrNotHeld       = errors.New("advlock: lock not held")
	ErrLockLost      = errors.New("advlock: lock lost")
	ErrClosed        = errors.New("advlock: locker closed")
	ErrNoPool        = errors.New("advlock: locker has no pool")
	ErrStandby       = errors.New("advlock: server is a standby in recovery; its advisory locks exclude nobody on the primary")
	ErrLockTableFull = errors.New("advlock: server lock table full (SQLSTATE 53200); raise max_locks_per_transaction or hold fewer locks")
	ErrDeadlock      = errors.New("advlock: deadlock (SQLSTATE 40P01 or a cycle advlock found)")
	ErrUnlockFailed  = errors.New("advlock: unlock not confirmed; the session was closed so the server releases the lock")
	ErrInvalidKey    = errors.New("advlock: invalid key")
	ErrFencing       = errors.New("advlock: fencing tokens unavailable")
	ErrPoolExhausted = errors.New("advlock: no free connection in the pool (held locks, waits and the application " +
		"have taken them all); a try does not wait for one")
	ErrTxPooling = errors.New("advlock: the connection goes through a pooler in transaction mode (another client " +
		"got the same server session): a session-level lock would stay on a server session that other clients use; " +
		"use pool_mode=session for session locks, or transaction-scoped locks, which work there: DoTx (a Locker from " +
		"Open works with the DSN as written; over a pgx pool of your own, set default_query_exec_mode=cache_describe " +
		"on a pooler that keeps no prepared statements) or XactLock in your own transaction; or leases, locks as rows " +
		"of a table that work through any pooler and exclude only other leases of their key (WithLeases; advlock " +
		"run --leases)")
	ErrUnverified = errors.New("advlock: could not prove that the connection is a server session of its own: the " +
		"pid the driver reports is not the session's (a pooler answers in its place) or it reports none, and no second connection " +
		"was free within 2s to rule out a pooler in transaction mode; refusing a session-level lock that could leak " +
		"(the next lock call tries again)")
)

// ErrReadOnly marks a statement that must write refused by a primary that is read-only for this session
// (default_transaction_read_only, set for the server, the database or the role; SQLSTATE 25006 where the server
// is not in recovery): leases and fencing tokens write, and a standby is another thing (ErrStandby). It is not
// re-exported: errors.As finds the server's error, and its SQLSTATE says 25006.
var ErrReadOnly = errors.New("advlock: the server refuses writes in this session (default_transaction_read_only, or a " +
	"read-only setting of the database or the role; it is not a standby): advlock needs to write here")

// ReadOnly wraps err, a refusal to write (25006) from a server that is not in recovery, with ErrReadOnly.
func ReadOnly(err error) error { return &codedError{sentinel: ErrReadOnly, err: err} }

// SQLState returns the SQLSTATE of the server error in err (any driver whose errors have a SQLState method:
// pgconn.PgError, lib/pq's Error), or "".
func SQLState(err error) string {
	if err == nil {
		return ""
	}
	var s interface{ SQLState() string }
	if errors.As(err, &s) {
		return s.SQLState()
	}
	return ""
}

// TranslateErr is Translate with the SQLSTATE read from err.
func TranslateErr(err error) error {
	if err == nil {
		return nil
	}
	return Translate(err, SQLState(err))
}

// Translate maps a server error, identified by its SQLSTATE, to the sentinel it stands for, keeping the original
// error reachable with errors.As. Adapters call it at their boundary so that nobody matches error strings.
func Translate(err error, sqlstate string) error {
	if err == nil {
		return nil
	}
	switch sqlstate {
	case "53200":
		return &codedError{sentinel: ErrLockTableFull, err: err}
	case "40P01":
		return &codedError{sentinel: ErrDeadlock, err: err}
	}
	return err
}

type codedError struct {
	sentinel error
	err      error
}

func (e *codedError) Error() string {
	if e.sentinel == errSessionEnded {
		return e.err.Error()
	}
	return e.sentinel.Error() + ": " + e.err.Error()
}
func (e *codedError) Unwrap() []error { return []error{e.sentinel, e.err} }

// errSessionEnded marks an error that an adapter knows came from a connection its driver has closed.
var errSessionEnded = errors.New("connection closed")

// SessionEnded marks err, from a statement on a connection that the driver reports closed, so that [Ended]
// recognises it whatever the driver's own error says.
func SessionEnded(err error) error {
	if err == nil || Ended(err) {
		return err
	}
	return &codedError{sentinel: errSessionEnded, err: err}
}

// Ended reports whether err says that the session itself is gone (not merely that a statement failed): the
// server ended it (SQLSTATE class 57P: terminated, shut down, crashed, database dropped, idle timeout; 25P03 idle
// in transaction timeout; class 08 connection failures, which PgBouncer uses when its server connection died; any
// FATAL as lib/pq reports it), or the connection broke (EOF, reset, broken pipe, a driver's bad connection).
func Ended(err error) bool {
	if err == nil {
		return false
	}
	if errors.Is(err, errSessionEnded) {
		return true
	}
	if code := SQLState(err); code != "" {
		if strings.HasPrefix(code, "57P") || strings.HasPrefix(code, "08") || code == "25P03" {
			return true
		}
		var f interface{ Fatal() bool }
		return errors.As(err, &f) && f.Fatal()
	}
	return errors.Is(err, io.EOF) || errors.Is(err, io.ErrUnexpectedEOF) || errors.Is(err, syscall.ECONNRESET) ||
		errors.Is(err, syscall.EPIPE) || errors.Is(err, syscall.ECONNABORTED) || errors.Is(err, net.ErrClosed) ||
		errors.Is(err, driver.ErrBadConn)
}

// noConnWithin is a try's failure to get a connection within VerifyBound. It is no context error (the caller set no
// deadline, and a dial cut by the bound matches context.DeadlineExceeded), so it does not wrap its cause; errors.As
// finds the cause's *pgconn.ConnectError, when it has one, as it does in every other failure to connect, and
// AfterSetUp the connection still being made apart (see Waits.setUp).
type noConnWithin struct{ cause error }

func (e *noConnWithin) Error() string {
	return fmt.Sprintf("acquire connection: none within %v (%v)", VerifyBound, e.cause)
}

func (e *noConnWithin) As(target any) bool {
	if _, ok := target.(**apartErr); ok {
		return errors.As(e.cause, target)
	}
	t, ok := target.(**pgconn.ConnectError)
	if !ok {
		return false
	}
	var ce *pgconn.ConnectError
	if !errors.As(e.cause, &ce) {
		return false
	}
	*t = ce
	return true
}
