package advlock

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/advlock/advlock/internal/pgxwait"
	"github.com/advlock/advlock/internal/session"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/jackc/puddle/v2"
)

// pgxPool adapts a *pgxpool.Pool to the session lifecycle. named: its connections keep a statement cache but do
// not use it by default (Open's pool, in cache_describe mode so that DoTx works through any pooler): the lock
// statements use it on a session proved pinned, where named prepared statements are safe (one round trip, no
// parse).
type pgxPool struct {
	p     *pgxpool.Pool
	named bool
}

func (a pgxPool) Acquire(ctx context.Context) (session.Conn, error) {
	c, err := a.p.Acquire(ctx)
	if errors.Is(err, puddle.ErrClosedPool) {
		return nil, fmt.Errorf("%w: its pool was closed (close the Locker before its pool): %w", ErrNoPool, err)
	}
	if err != nil {
		return nil, err
	}
	return &pgxConn{c: c, Reader: pgxwait.Reader{PC: c.Conn().PgConn()}, named: a.named}, nil
}

func (pgxPool) Wires() bool { return true }

// DialsInCall is false: pgxpool makes a new connection apart from the caller's context, and pools it when the
// caller has gone.
func (pgxPool) DialsInCall() bool { return false }

// Dial opens a connection outside the pool, with the pool's connection configuration.
func (a pgxPool) Dial(ctx context.Context) (session.TextConn, error) {
	c, err := pgx.ConnectConfig(ctx, a.p.Config().ConnConfig)
	if err != nil {
		return nil, err
	}
	return pgxTextConn{c}, nil
}

type pgxTextConn struct{ c *pgx.Conn }

func (t pgxTextConn) QueryText(ctx context.Context, sql string) (string, error) {
	var v string
	err := t.c.QueryRow(ctx, sql).Scan(&v)
	return v, session.TranslateErr(err)
}

func (t pgxTextConn) Close() {
	ctx, cancel := context.WithTimeout(context.Background(), time.Second)
	defer cancel()
	_ = t.c.Close(ctx)
}

func (a pgxPool) Stats() session.PoolStats {
	st := a.p.Stat()
	return session.PoolStats{Max: int(st.MaxConns()), Open: int(st.TotalConns()), InUse: int(st.AcquiredConns()),
		Idle: int(st.IdleConns()), WaitCount: st.EmptyAcquireCount()}
}

// pgxConn is one pinned pgxpool connection. The embedded Reader keeps the PgConn, which c forgets once released.
type pgxConn struct {
	c *pgxpool.Conn
	pgxwait.Reader
	named bool // see pgxPool
}

func (a *pgxConn) QueryInt(ctx context.Context, sql string, args ...any) (int64, error) {
	if len(args) == 0 {
		return a.ExecInt(ctx, sql)
	}
	if ok, _ := a.Verified(); ok && a.named {
		args = append([]any{pgx.QueryExecModeCacheStatement}, args...)
	}
	var v int64
	err := a.c.QueryRow(ctx, sql, args...).Scan(&v)
	return v, a.Translate(err)
}

// QueryText runs sql over the simple protocol and returns the text in the first column of its last statement's
// first row.
func (a *pgxConn) QueryText(ctx context.Context, sql string) (string, error) {
	return a.ExecText(ctx, sql)
}

// QueryTextUntil is QueryText bounded by a deadline on the connection's socket (session.UntilQuerier).
func (a *pgxConn) QueryTextUntil(_ context.Context, deadline time.Time, sql string) (string, error) {
	return a.ExecTextUntil(deadline, sql)
}

func (a *pgxConn) Ping(ctx context.Context) error { return a.Translate(a.c.Ping(ctx)) }

func (a *pgxConn) Release() { a.c.Release() }

func (a *pgxConn) Abort() { a.CloseSocket() }

// Destroy closes the socket first, so that the server ends the backend now even if a polite close would wait on
// a bad network, then takes the connection out of the pool.
func (a *pgxConn) Destroy() {
	conn := a.c.Hijack()
	a.CloseSocket()
	ctx, cancel := context.WithTimeout(context.Background(), time.Second)
	defer cancel()
	_ = conn.Close(ctx)
}

func (a *pgxConn) Wire(f func(pc *pgconn.PgConn) error) error { return f(a.PC) }
