package advlock

import (
	"time"

	"github.com/advlock/advlock/internal/config"
	"github.com/jackc/pgx/v5/pgxpool"
)

// Option configures a Locker made by [New] or [Open] (or advsql.New). Use the With functions of this package.
type Option func(*config.Options)

// WithKeepalive sets how long a held lock's session may stay silent before the Locker makes a keepalive round
// trip, and how long that round trip may take. A network that silently drops the connection is noticed within
// about twice this; a terminated session or a server shutdown is noticed at once whatever its value.
// Default 5s. Values <= 0 keep the default.
func WithKeepalive(d time.Duration) Option {
	return func(o *config.Options) {
		if d > 0 {
			o.Keepalive = d
		}
	}
}

// WithReleaseTimeout bounds each unlock that [Locker.Close] and [Locker.Do] make on their own (after the caller's
// context ended, or at Close). When it expires the session is closed instead, which also releases the lock.
// Default 5s. Values <= 0 keep the default.
func WithReleaseTimeout(d time.Duration) Option {
	return func(o *config.Options) {
		if d > 0 {
			o.ReleaseTimeout = d
		}
	}
}

// WithPoolConfig lets [Open] adjust the pool configuration after advlock applied its defaults, for example to
// set MaxConns (each held lock and each waiting Lock uses one connection). New ignores it.
func WithPoolConfig(f func(*pgxpool.Config)) Option {
	return func(o *config.Options) { o.PoolConfig = f }
}
