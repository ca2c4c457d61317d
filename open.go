package advlock

import (
	"context"
	"fmt"
	"net"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
)

// Open connects a pool made for locking (it makes one round trip to check the server answers) and returns a Locker that owns it; [Locker.Close] closes the pool.
//
// dsn is a pgx connection string (URL or key=value; PG* environment variables fill the gaps). On each of its
// sessions Open sets, unless dsn says otherwise for application_name:
//
//   - application_name=advlock, so that pg_stat_activity and advlock ls show who holds what;
//   - statement_timeout=0, lock_timeout=0, idle_session_timeout=0 and idle_in_transaction_session_timeout=0, so
//     that no server or role default cuts a wait or silently ends an idle holder (startup parameters take
//     precedence over ALTER ROLE/DATABASE defaults);
//   - tcp_keepalives_idle=10, tcp_keepalives_interval=5, tcp_keepalives_count=3 and
//     client_connection_check_interval=5s, so that the server drops the locks of a client that vanished without
//     closing its socket in about 25 s instead of the kernel's default of two hours;
//   - TCP keepalives on the client side with the same timing.
//
// Needs PostgreSQL 14 or later (client_connection_check_interval). Use Open when locks should not compete with the
// application's own queries for connections; use [New] to lock through a pool the application already has.
func Open(ctx context.Context, dsn string, opts ...Option) (*Locker, error) {
	cfg, err := pgxpool.ParseConfig(dsn)
	if err != nil {
		return nil, fmt.Errorf("advlock: parse dsn: %w", err)
	}
	rp := cfg.ConnConfig.RuntimeParams
	if rp["application_name"] == "" {
		rp["application_name"] = "advlock"
	}
	for k, v := range map[string]string{
		"statement_timeout":                   "0",
		"lock_timeout":                        "0",
		"idle_session_timeout":                "0",
		"idle_in_transaction_session_timeout": "0",
		"tcp_keepalives_idle":                 "10",
		"tcp_keepalives_interval":             "5",
		"tcp_keepalives_count":                "3",
		"client_connection_check_interval":    "5s",
	} {
		rp[k] = v
	}
	dialer := &net.Dialer{
		Timeout:         30 * time.Second,
		KeepAliveConfig: net.KeepAliveConfig{Enable: true, Idle: 10 * time.Second, Interval: 5 * time.Second, Count: 3},
	}
	cfg.ConnConfig.DialFunc = dialer.DialContext
	o := defaultOptions()
	for _, opt := range opts {
		opt(&o)
	}
	if o.poolConfig != nil {
		o.poolConfig(cfg)
	}
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		return nil, fmt.Errorf("advlock: open pool: %w", err)
	}
	if err := pool.Ping(ctx); err != nil {
		pool.Close()
		return nil, fmt.Errorf("advlock: connect: %w", err)
	}
	l := newLocker(pgxPool{pool}, pool, o)
	l.ownsPool = pool
	return l, nil
}
