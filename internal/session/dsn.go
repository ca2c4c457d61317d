package session

import (
	"errors"
	"strings"

	"github.com/jackc/pgx/v5/pgconn"
)

// ErrInvalidDSN is what Open (advlock's and advsql's) returns for a connection string that does not parse, or
// that parses other than its writer meant (a host that holds an '@': a password with an unescaped '@'). The
// message never shows the string or any part of it, since it may hold a password.
var ErrInvalidDSN = errors.New("advlock: invalid connection string (not shown: it may hold a password)")

// dsnError is a connection string refused: its message is fixed (ErrInvalidDSN's and a hint), and the parser's
// own error stays reachable with errors.As (pgconn's best-effort redaction may leave part of a password in it).
type dsnError struct {
	hint  string
	cause error
}

func (e *dsnError) Error() string   { return ErrInvalidDSN.Error() + ": " + e.hint }
func (e *dsnError) Unwrap() []error { return []error{ErrInvalidDSN, e.cause} }

// dsnHint says how to write a connection string pgx reads as meant.
const dsnHint = "write it as a URL, postgres://user:password@host:port/db, with '@', ':', '/', '?' and '#' in the " +
	"password percent-encoded (%40, %3A, %2F, %3F, %23), or as key=value pairs (password='...')"

// InvalidDSN turns an error of pgx's parser into one that shows no part of the string (ErrInvalidDSN).
func InvalidDSN(err error) error {
	if err == nil {
		return nil
	}
	return &dsnError{hint: "it does not parse; " + dsnHint, cause: err}
}

// CheckDSN refuses a connection string that pgx parsed other than its writer meant: a host (or a fallback host)
// that holds an '@', which a password with an unescaped '@' gives (pgx ends the user information at the first
// '@'), and which a connection error would then print, password and all.
func CheckDSN(c *pgconn.Config) error {
	hosts := []string{c.Host}
	for _, f := range c.Fallbacks {
		hosts = append(hosts, f.Host)
	}
	for _, h := range hosts {
		if strings.Contains(h, "@") {
			return &dsnError{hint: "a host holds an '@' (a password with an unescaped '@'?); " + dsnHint,
				cause: errors.New("'@' in a host")}
		}
	}
	return nil
}
