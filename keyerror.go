package advlock

import "fmt"

// keyError names the operation and key in an error while keeping the cause matchable.
type keyError struct {
	op  string
	key Key
	err error
}

func (e *keyError) Error() string {
	return fmt.Sprintf("advlock: %s %s: %s", e.op, e.key, trimPrefix(e.err.Error()))
}

func (e *keyError) Unwrap() error { return e.err }

func trimPrefix(s string) string {
	const p = "advlock: "
	if len(s) >= len(p) && s[:len(p)] == p {
		return s[len(p):]
	}
	return s
}
