package advlock

import (
	"context"
	"errors"
	"fmt"
	"net"
	"strconv"
	"sync/atomic"
	"time"

	"github.com/advlock/advlock/internal/session"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
)

// pgxPool adapts a *pgxpool.Pool to the session lifecycle.
type pgxPool struct{ p *pgxpool.Pool }

func (a pgxPool) Acquire(ctx context.Context) (session.Conn, error) {
	c, err := a.p.Acquire(ctx)
	if err != nil {
		return nil, err
	}
	return &pgxConn{c: c, pc: c.Conn().PgConn()}, nil
}

type pgxConn struct {
	c           *pgxpool.Conn
	pc          *pgconn.PgConn // kept: c forgets it once released or hijacked
	interrupted atomic.Bool
}

func translate(err error) error {
	if err == nil {
		return nil
	}
	var pgErr *pgconn.PgError
	if errors.As(err, &pgErr) {
		return session.Translate(err, pgErr.Code)
	}
	return err
}

func (a *pgxConn) QueryInt(ctx context.Context, sql string, args ...any) (int64, error) {
	var v int64
	if len(args) > 0 {
		err := a.c.QueryRow(ctx, sql, args...).Scan(&v)
		return v, translate(err)
	}
	results, err := a.pc.Exec(ctx, sql).ReadAll()
	if err != nil {
		return 0, translate(err)
	}
	if len(results) == 0 || len(results[len(results)-1].Rows) == 0 || len(results[len(results)-1].Rows[0]) == 0 {
		return 0, errors.New("advlock: lock statement returned no row")
	}
	v, err = strconv.ParseInt(string(results[len(results)-1].Rows[0][0]), 10, 64)
	return v, err
}

// Wait blocks in pgconn's reader on the idle connection. No context is handed to pgconn (whose context handler may
// be configured to send a cancel request, which could hit a later statement); a read deadline bounds the read
// instead, which pgconn treats as a harmless timeout.
func (a *pgxConn) Wait(deadline time.Time) error {
	pc := a.pc
	_ = pc.Conn().SetReadDeadline(deadline)
	if a.interrupted.Load() {
		// Interrupt's deadline may have been overwritten just now.
		return session.ErrWaitTimeout
	}
	err := pc.WaitForNotification(context.Background())
	if err == nil {
		return nil
	}
	var netErr net.Error
	if errors.As(err, &netErr) && netErr.Timeout() && !pc.IsClosed() {
		return session.ErrWaitTimeout
	}
	return fmt.Errorf("session ended: %w", translate(err))
}

func (a *pgxConn) Interrupt() {
	a.interrupted.Store(true)
	_ = a.pc.Conn().SetReadDeadline(time.Unix(1, 0))
}

func (a *pgxConn) ClearDeadline() {
	a.interrupted.Store(false)
	_ = a.pc.Conn().SetReadDeadline(time.Time{})
}

func (a *pgxConn) Ping(ctx context.Context) error { return a.c.Ping(ctx) }

func (a *pgxConn) Release() { a.c.Release() }

// Destroy closes the socket first, so that the server ends the backend now even if a polite close would wait on
// a bad network, then takes the connection out of the pool.
func (a *pgxConn) Destroy() {
	conn := a.c.Hijack()
	_ = conn.PgConn().Conn().Close()
	ctx, cancel := context.WithTimeout(context.Background(), time.Second)
	defer cancel()
	_ = conn.Close(ctx)
}
