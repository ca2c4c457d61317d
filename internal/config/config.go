// Package config holds what a Locker is configured with. It is the seam between package advlock and the backends
// and tests in this module: advlock.Option is a func(*Options), so that package advsql can hand the Locker its
// database/sql backend, and tests a connection wrapper, as typed options, while the fields stay out of the public
// API.
package config

import (
	"context"
	"time"

	"github.com/advlock/advlock/internal/session"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
)

// Querier runs a query and returns its rows, as advlock.Querier (which this package cannot import).
type Querier interface {
	Query(ctx context.Context, sql string, args ...any) (pgx.Rows, error)
}

// Options configures a Locker.
type Options struct {
	Keepalive      time.Duration
	ReleaseTimeout time.Duration
	PoolConfig     func(*pgxpool.Config) // Open only
	MaxConns       int                   // the size of a pool the Locker owns (Open, advsql.Open); 0: the default
	// Backend, when set, is the pool the Locker takes sessions from instead of the *pgxpool.Pool given to New
	// (package advsql sets it).
	Backend session.Pool
	// Querier, when set, is what the Locker reads the server's views through (Inspect, Leader, LockTable) instead
	// of the *pgxpool.Pool given to New (package advsql sets it over its *sql.DB).
	Querier Querier
	// Wrap wraps each connection (tests inject faults with it).
	Wrap func(session.Conn) session.Conn
	// UnlockKey changes the key each unlock is sent for (tests only: the server then answers false).
	UnlockKey func(session.ID) session.ID
	// OpenBound bounds the opening of a shared session (tests only; 0: session.VerifyBound).
	OpenBound time.Duration
	// WaitSlice bounds each statement of a wait in the server (tests only; 0: session.DefaultWaitSlice).
	WaitSlice time.Duration
	// Settings are applied once per proved physical connection (Open sets them).
	Settings []session.Setting
	// SharedSessions is how many shared sessions a Locker may open (0: a session per lock); SharedSet says an
	// option set it (else a Locker whose pool is its own chooses from its pool's size).
	SharedSessions int
	SharedSet      bool
	// OwnPool: the pool is the Locker's alone (advlock.Open, advsql.Open), so the Locker shares its connections out
	// between shared sessions, one kept for its reads, and sessions of their own (advlock's budget.go).
	OwnPool bool
	// Fencing: every session-lock grant carries a token from the sequence session.FenceSeq.
	Fencing bool
	// Leases: locks are rows of a table (internal/lease), of LeaseLength (0: the default), waits trying again every
	// LeasePoll (0: the default; tests shorten it).
	Leases      bool
	LeaseLength time.Duration
	LeasePoll   time.Duration
	// LeaseHolder is added to the host and pid a lease names as its holder (WithLeaseHolder).
	LeaseHolder string
	// AppName is the application_name the connection string gave (none: ""), added to a lease's holder before
	// LeaseHolder.
	AppName string
	// OnClose, when set, runs once when the Locker is closed, after everything else (advsql.Open closes its
	// *sql.DB).
	OnClose func()
	// Observers are advlock.Observer values (WithObserver, WithLogger); typed there, since this package cannot
	// import advlock.
	Observers []any
}

// Defaults returns the options before any Option is applied.
func Defaults() Options {
	return Options{Keepalive: session.DefaultKeepalive, ReleaseTimeout: 5 * time.Second, SharedSessions: 4}
}

// NewOption makes an advlock.Option of f, and ApplyOption applies one to o: package advlock sets both (in its init),
// so that the adapters and the test kit can make and read options while advlock.Option shows nothing of this
// package in the public API.
var (
	NewOption   func(f func(*Options)) any
	ApplyOption func(opt any, o *Options)
)
