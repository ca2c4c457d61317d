package advlock

import (
	"context"
	"errors"
	"fmt"
	"net"
	"strconv"
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
	return &pgxConn{c: c}, nil
}

type pgxConn struct{ c *pgxpool.Conn }

func translate(err error) error {
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
	results, err := a.c.Conn().PgConn().Exec(ctx, sql).ReadAll()
	if err != nil {
		return 0, translate(err)
	}
	if len(results) == 0 || len(results[len(results)-1].Rows) == 0 || len(results[len(results)-1].Rows[0]) == 0 {
		return 0, errors.New("advlock: lock statement returned no row")
	}
	v, err = strconv.ParseInt(string(results[len(results)-1].Rows[0][0]), 10, 64)
	return v, err
}

// Wait blocks in pgconn's reader on the idle connection. The context is not handed to pgconn (whose context
// handler may be configured to send a cancel request, which could hit a later statement); instead a read deadline
// in the past interrupts the read, which pgconn treats as a harmless timeout.
func (a *pgxConn) Wait(ctx context.Context) error {
	pc := a.c.Conn().PgConn()
	nc := pc.Conn()
	fired := make(chan struct{})
	stop := context.AfterFunc(ctx, func() {
		_ = nc.SetReadDeadline(time.Unix(1, 0))
		close(fired)
	})
	err := pc.WaitForNotification(context.Background())
	if !stop() {
		<-fired
		_ = nc.SetReadDeadline(time.Time{})
		var netErr net.Error
		if err != nil && errors.As(err, &netErr) && netErr.Timeout() && !pc.IsClosed() {
			return ctx.Err()
		}
	}
	if err != nil {
		return fmt.Errorf("session ended: %w", translate(err))
	}
	return nil
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
