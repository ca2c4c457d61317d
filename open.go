package advlock

import (
	"context"
	"fmt"
	"net"
	"strings"
	"time"

	"github.com/advlock/advlock/internal/config"
	"github.com/advlock/advlock/internal/session"
	"github.com/jackc/pgx/v5/pgxpool"
)

// Open connects a pool made for locking (it makes one round trip to check the server answers) and returns a
// Locker that owns it; [Locker.Close] closes the pool.
//
// dsn is a pgx connection string (URL or key=value; PG* environment variables fill the gaps). Its sessions carry
// application_name=advlock (unless dsn names one), so that pg_stat_activity and advlock ls show who holds what;
// connect_timeout defaults to [DefaultConnectTimeout].
// Once per physical connection, before its first session lock and only after proving that the connection is a
// server session of its own (direct, or pinned by a pooler in session mode), Open's Locker sets on it:
//
//   - statement_timeout=0, lock_timeout=0 and idle_in_transaction_session_timeout=0, so that no server or role
//     default cuts a wait;
//   - idle_session_timeout of 3 keepalive intervals ([WithKeepalive]; 15s by default): a live holder's session
//     is never silent that long (it is pinged after one interval of silence), so the server ends only the sessions
//     of a holder that froze (SIGSTOP, a debugger, a stuck VM), and a waiter takes its locks; when the holder
//     resumes it is told its locks were lost (SQLSTATE 57P05). Idle pooled connections end the same way, and the
//     pool replaces them;
//   - tcp_keepalives_idle=10, tcp_keepalives_interval=5, tcp_keepalives_count=3 and
//     client_connection_check_interval=5s, so that the server drops the locks of a client that vanished without
//     closing its socket in about 25 s instead of the kernel's default of two hours (on a direct connection;
//     behind a pooler these settings watch the pooler's connection, and the pooler's own client keepalives
//     decide).
//
// They are SET after connecting rather than sent as startup parameters, which PgBouncer refuses unless they are
// listed in its ignore_startup_parameters (and then drops): Open works through a stock PgBouncer. Behind a
// transaction-mode pooler nothing is set, since a setting would stay on a server session that other clients use
// (session locks are refused there with ErrTxPooling; transaction locks work). The client side uses TCP
// keepalives with the same timing.
//
// Needs PostgreSQL 14 or later (client_connection_check_interval, idle_session_timeout). Use Open when locks
// should not compete with the application's own queries for connections; use [New] to lock through a pool the
// application already has.
func Open(ctx context.Context, dsn string, opts ...Option) (*Locker, error) {
	cfg, err := pgxpool.ParseConfig(dsn)
	if err != nil {
		return nil, fmt.Errorf("advlock: parse dsn: %w", err)
	}
	if !strings.Contains(dsn, "pool_max_conns") {
		cfg.MaxConns = DefaultOpenConns
	}
	if cfg.ConnConfig.ConnectTimeout == 0 { // no connect_timeout in dsn
		cfg.ConnConfig.ConnectTimeout = DefaultConnectTimeout
	}
	if rp := cfg.ConnConfig.RuntimeParams; rp["application_name"] == "" {
		rp["application_name"] = "advlock"
	}
	dialer := &net.Dialer{
		Timeout:         30 * time.Second,
		KeepAliveConfig: net.KeepAliveConfig{Enable: true, Idle: 10 * time.Second, Interval: 5 * time.Second, Count: 3},
	}
	cfg.ConnConfig.DialFunc = dialer.DialContext
	o := config.Defaults()
	for _, opt := range opts {
		opt(&o)
	}
	o.Settings = session.OpenSettings(o.Keepalive)
	if o.PoolConfig != nil {
		o.PoolConfig(cfg)
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

// DefaultOpenConns is the size of Open's pool unless the DSN's pool_max_conns or WithPoolConfig sets another: the
// shared sessions (4 by default), and 20 more for Lock calls waiting in the server at once, each of which keeps
// its session while the lock it got is held (with WithSharedSessions(0), every held lock takes one).
const DefaultOpenConns = 24

// DefaultConnectTimeout bounds each connection attempt of Open's pool (dialing and the server's answer) when dsn
// has no connect_timeout: a connection made into a network that silently drops packets fails instead of hanging,
// with it the call that needed the connection, even a TryLock under a context without a deadline.
const DefaultConnectTimeout = 10 * time.Second
