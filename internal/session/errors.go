package session

import "errors"

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
	ErrDeadlock      = errors.New("advlock: deadlock detected by the server (SQLSTATE 40P01)")
	ErrUnlockFailed  = errors.New("advlock: unlock not confirmed; the session was closed so the server releases the lock")
	ErrInvalidKey    = errors.New("advlock: invalid key")
)

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

func (e *codedError) Error() string   { return e.sentinel.Error() + ": " + e.err.Error() }
func (e *codedError) Unwrap() []error { return []error{e.sentinel, e.err} }
