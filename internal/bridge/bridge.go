// Package bridge lets backend adapters in other packages of this module (advsql) build a *advlock.Locker over
// their own session.Pool without making that constructor part of the public API. Package advlock sets the
// functions in its init.
package bridge

import "github.com/advlock/advlock/internal/session"

var (
	// NewLocker returns a *advlock.Locker (as any) over pool; opts is a []advlock.Option.
	NewLocker func(pool session.Pool, opts any) any
	// WithWrap returns an advlock.Option (as any) that wraps every connection (fault injection in tests).
	WithWrap func(func(session.Conn) session.Conn) any
)
