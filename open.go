package advlock

import (
	"context"
	"errors"
	"fmt"
	"math"
	"net"
	"strings"
	"time"

	"github.com/advlock/advlock/internal/config"
	"github.com/advlock/advlock/internal/session"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
)

// Open makes a pool for locking and returns a Locker that owns it; [Locker.Close] closes the pool. It does not
// connect: it fails only for a dsn it cannot parse (ErrInvalidDSN, also for a dsn that parses other than meant: a
// host holding an '@', from a password with an unescaped '@'; the error never shows the dsn) or an option that
// leaves the pool's configuration invalid,
// never because the server is down, unreachable or refusing. The first call that needs the server reports that
// (as an error of that call), and the Locker works as soon as the server answers, so that a service that opened
// its Locker while the database was down recovers by itself. Call [Locker.Ping] to fail fast at start. ctx is
// used only by the pool's background work (none with the default configuration).
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
// Its connections use pgx's cache_describe query mode unless dsn names a default_query_exec_mode: no named prepared
// statements, so that [Locker.DoTx] works through a pooler in transaction mode with dsn as written.
//
// The pool has [DefaultOpenConns] connections unless [WithMaxConns], dsn's pool_max_conns or [WithPoolConfig] sets another size,
// and the Locker takes no more ([Stats] Conns, PeakConns), but for one that deadlock detection dials when none of
// the pool's is free, kept while watched waits wait (see Stats.Conns). It shares them out when it is made: shared sessions
// (a quarter of the pool, at least 1 and at most 4, unless [WithSharedSessions] says; never more than half), one
// connection kept for what it reads for itself (with a pool of 3 or more), and the rest for sessions of their own
// (Stats().MaxOwnSessions): Lock calls waiting in the server, each of which keeps its session while the lock it got
// is held (with WithSharedSessions(0), every held lock). A Lock, RLock, Do or Lead that needs a session of its own
// while all are in use waits in this process, in the order it came, until one is given back or ctx ends (a
// [Wait] bound ends it with ErrNotAcquired); meanwhile it tries its key on a shared session every 20 ms (less
// often when many wait), and takes it there once it is free. It never fails for want of a connection. A try
// (TryLock, TryRLock, TryDo, Wait(0)) does not wait for one: it fails with ErrPoolExhausted when it needs a session
// of its own and none is free. Deadlock detection counts a wait for a session of its own as a wait for the key's
// holders, and reads the server on the connection kept for it, so a cycle of waits that holds every other
// connection is still found. A cycle with such waits in two or more processes is seen by none of them (each of
// those waits is seen by its own Locker only) until they get their sessions: bound such waits (Wait, ctx), or
// take keys in one order. Ping, Inspect, Leader and LockTable take a connection of the pool for
// each statement, the kept one when the others are busy; when none is free (another of these calls has the kept
// one) they wait for one, as long as ctx allows.
//
// Needs PostgreSQL 14 or later (client_connection_check_interval, idle_session_timeout). Use Open when locks
// should not compete with the application's own queries for connections; use [New] to lock through a pool the
// application already has.
func Open(ctx context.Context, dsn string, opts ...Option) (*Locker, error) {
	cfg, err := pgxpool.ParseConfig(dsn)
	if err != nil {
		return nil, session.InvalidDSN(err)
	}
	if err := session.CheckDSN(&cfg.ConnConfig.Config); err != nil {
		return nil, err
	}
	o := config.Defaults()
	for _, opt := range opts {
		opt.apply(&o)
	}
	if !strings.Contains(dsn, "pool_max_conns") {
		cfg.MaxConns = DefaultOpenConns
		if o.MaxConns > 0 {
			cfg.MaxConns = int32(min(o.MaxConns, math.MaxInt32))
		}
	}
	if !strings.Contains(dsn, "default_query_exec_mode") {
		// No named prepared statements: a pooler in transaction mode (PgBouncer before 1.21, Supabase's and Neon's
		// pooled ports) would hand one client's statements to another's server session, and DoTx fails there with
		// 42P05 or 26000. A description cache keeps statements at one round trip.
		cfg.ConnConfig.DefaultQueryExecMode = pgx.QueryExecModeCacheDescribe
	}
	if cfg.ConnConfig.ConnectTimeout == 0 { // no connect_timeout in dsn
		cfg.ConnConfig.ConnectTimeout = DefaultConnectTimeout
	}
	if rp := cfg.ConnConfig.RuntimeParams; rp["application_name"] == "" {
		rp["application_name"] = "advlock"
	} else {
		o.AppName = rp["application_name"]
	}
	dialer := &net.Dialer{
		Timeout:         30 * time.Second,
		KeepAliveConfig: net.KeepAliveConfig{Enable: true, Idle: 10 * time.Second, Interval: 5 * time.Second, Count: 3},
	}
	cfg.ConnConfig.DialFunc = dialer.DialContext
	o.Settings = session.OpenSettings(o.Keepalive)
	o.OwnPool = true
	if o.PoolConfig != nil {
		o.PoolConfig(cfg)
	}
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		return nil, fmt.Errorf("advlock: open pool: %w", err) // a configuration pgxpool refuses: it does not connect
	}
	named := cfg.ConnConfig.DefaultQueryExecMode == pgx.QueryExecModeCacheDescribe && cfg.ConnConfig.StatementCacheCapacity > 0
	l := newLocker(pgxPool{p: pool, named: named}, pool, o)
	l.ownsPool = pool
	return l, nil
}

// Ping makes one round trip to the server on a connection of the Locker's pool (connecting one if none is idle,
// within the dsn's connect_timeout for Open's pool) and returns it to the pool. Call it at start to fail fast when
// the database is down: [Open] and advsql.Open do not connect. The error says why the server did not answer (and
// wraps ctx's error when ctx ended); ErrNoPool for a Locker without a pool (New(nil), a nil Locker, or a pool
// closed under it), ErrClosed after [Locker.Close] (also when Close is called during Ping).
func (l *Locker) Ping(ctx context.Context) error {
	if l == nil || l.pool == nil {
		return ErrNoPool
	}
	cctx, done, err := l.begin(ctx, true)
	if err != nil {
		return err
	}
	defer done()
	err = ping(cctx, l.pool)
	switch {
	case err == nil:
		return nil
	case ctx.Err() == nil && errors.Is(context.Cause(cctx), ErrClosed):
		return ErrClosed
	case errors.Is(err, ErrNoPool):
		return err
	}
	return fmt.Errorf("advlock: ping: %w", session.WithContext(ctx, err))
}

// ping takes a connection from pool, makes one round trip on it, and hands it back (or discards it if the round
// trip failed).
func ping(ctx context.Context, pool session.Pool) error {
	c, err := pool.Acquire(ctx)
	if err != nil {
		return err
	}
	if err := c.Ping(ctx); err != nil {
		c.Destroy()
		return err
	}
	c.Release()
	return nil
}

// DefaultOpenConns is the size of Open's pool (and advsql.Open's) unless the DSN's pool_max_conns or
// WithPoolConfig sets another: the most connections a Locker from Open takes from the server, shared sessions
// included, so that ten replicas of a service, each with an application pool of its own (pgxpool's default is 4 on
// a small machine), fit a server's default max_connections of 100. The Locker shares them out (see [Open]):
//
//   - 1 shared session: every lock that is free when asked for is taken on it, the requests of all goroutines
//     batched into its round trips (256 goroutines taking distinct keys: as fast with 1 as with 2 or 4 on a
//     2-core server, about 6x raw pgx on 8 connections), so the connections go where each caller needs one of its
//     own;
//   - 1 kept for what the Locker reads for itself: deadlock detection, Ping, Inspect, Leader, LockTable, the
//     checks of a new connection; so that detection still reads the server when every other connection is busy,
//     with a cycle of waits among them;
//   - 3 sessions of their own, for Lock calls that wait in the server, each of which keeps its session while the
//     lock it got is held.
//
// A Lock that needs a session of its own while all 3 are in use waits in this process and never fails for want of
// a connection; TryLock and TryDo never wait for one (ErrPoolExhausted). A Lead campaign that waits, and a
// Semaphore.Acquire, keep one of the 3 for as long as they wait: a process that campaigns for several keys at once,
// or whose callers hold many locks they waited for, needs a bigger pool (pool_max_conns). Two processes of a service running 100
// clients that sync 60 ids (80% TryDo, 20% Do with Wait(2s)) used 8 connections in all (4 each at most) for about
// 500 syncs/s of a 600/s ceiling; with the 24 connections that were this default before, 46 for about 510/s.
const DefaultOpenConns = 5

// DefaultConnectTimeout bounds each connection attempt of Open's pool (dialing and the server's answer) when dsn
// has no connect_timeout: a connection made into a network that silently drops packets fails instead of hanging,
// with it the call that needed the connection, even a TryLock under a context without a deadline.
const DefaultConnectTimeout = 10 * time.Second
