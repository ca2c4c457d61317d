// Package pgxwait holds what every pgx-based backend adapter does on a pinned connection: run a multi-statement
// query for one integer, and block reading the idle connection with a read deadline that another goroutine can
// pull in.
package pgxwait

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
)

// Reader watches one pgconn connection.
type Reader struct {
	PC          *pgconn.PgConn
	interrupted atomic.Bool
}

// ExecInt runs sql (several statements allowed) over the simple protocol and returns the integer in the first
// column of the last statement's first row.
func (r *Reader) ExecInt(ctx context.Context, sql string) (int64, error) {
	s, err := r.ExecText(ctx, sql)
	if err != nil {
		return 0, err
	}
	return strconv.ParseInt(s, 10, 64)
}

// ExecText runs sql (several statements allowed) over the simple protocol and returns the text in the first column
// of the last statement's first row. It reads the answer as it comes, keeping only that text.
func (r *Reader) ExecText(ctx context.Context, sql string) (string, error) {
	mrr := r.PC.Exec(ctx, sql)
	var v string
	row := false // the statement read last had a row
	for mrr.NextResult() {
		rr := mrr.ResultReader()
		row = rr.NextRow()
		if row && len(rr.Values()) > 0 {
			v = string(rr.Values()[0])
		} else {
			row = false
		}
		if _, err := rr.Close(); err != nil {
			_ = mrr.Close()
			return "", r.Translate(err)
		}
	}
	if err := mrr.Close(); err != nil {
		return "", r.Translate(err)
	}
	if !row {
		return "", errors.New("advlock: statement returned no row")
	}
	return v, nil
}

// ExecTextUntil is ExecText bounded by a deadline on the connection's socket instead of a context (see
// session.UntilQuerier): nothing to allocate, and nothing for pgx's context handler to do, which may be configured
// to send a cancel request that could hit a later statement. Past the deadline it fails with a timeout, and the
// connection is to be destroyed; the error then matches context.DeadlineExceeded, as a context's deadline would
// (whatever pgconn made of the socket's timeout). The deadline is cleared before it returns, whatever happened, on a
// connection still open: one whose statement the server refused goes back to its pool, where a deadline left on it
// would cut another's statement (a closed one is pgconn's to drain and close, under a deadline of its own).
func (r *Reader) ExecTextUntil(deadline time.Time, sql string) (v string, err error) {
	nc := r.PC.Conn()
	_ = nc.SetDeadline(deadline)
	defer func() {
		if !r.PC.IsClosed() {
			_ = nc.SetDeadline(time.Time{})
		}
	}()
	v, err = r.ExecText(context.Background(), sql)
	var ne net.Error
	if err != nil && errors.As(err, &ne) && ne.Timeout() && !time.Now().Before(deadline) {
		err = fmt.Errorf("%w: %w", context.DeadlineExceeded, ne)
	}
	return v, err
}

// Translate maps an error from a statement on the connection: server errors to the sentinels they stand for, and
// any error after which pgconn reports the connection closed to a session that ended.
func (r *Reader) Translate(err error) error {
	if err == nil {
		return nil
	}
	err = session.TranslateErr(err)
	if r.PC.IsClosed() {
		return session.SessionEnded(err)
	}
	return err
}

// Wait blocks in pgconn's reader on the idle connection (see session.Conn.Wait). No context is handed to pgconn,
// whose context handler may be configured to send a cancel request that could hit a later statement; a read
// deadline bounds the read instead, which pgconn treats as a harmless timeout.
func (r *Reader) Wait(deadline time.Time) error {
	_ = r.PC.Conn().SetReadDeadline(deadline)
	if r.interrupted.Load() {
		return session.ErrWaitTimeout // Interrupt's deadline may have just been overwritten
	}
	err := r.PC.WaitForNotification(context.Background())
	if err == nil {
		return nil
	}
	var netErr net.Error
	if errors.As(err, &netErr) && netErr.Timeout() && !r.PC.IsClosed() {
		return session.ErrWaitTimeout
	}
	return fmt.Errorf("session ended: %w", session.TranslateErr(err))
}

// Interrupt makes a current or next Wait return at once.
func (r *Reader) Interrupt() {
	r.interrupted.Store(true)
	_ = r.PC.Conn().SetReadDeadline(time.Unix(1, 0))
}

// ClearDeadline readies the connection for statements again.
func (r *Reader) ClearDeadline() {
	r.interrupted.Store(false)
	_ = r.PC.Conn().SetReadDeadline(time.Time{})
}

const (
	verifiedKey = "advlock.verified"
	pidKey      = "advlock.pid"
)

// Verified reports whether the connection was marked with MarkVerified, and as a direct one.
func (r *Reader) Verified() (ok, direct bool) {
	v, ok := r.PC.CustomData()[verifiedKey].(bool)
	return ok, v
}

// MarkVerified marks the physical connection as a proven server session of its own; direct says no pooler sits
// between, and pid is the server session's pid (pg_backend_pid).
func (r *Reader) MarkVerified(direct bool, pid uint32) {
	r.PC.CustomData()[verifiedKey] = direct
	r.PC.CustomData()[pidKey] = pid
}

const preparedKey = "advlock.prepared"

// Prepared reports whether MarkPrepared recorded name as prepared on the physical connection.
func (r *Reader) Prepared(name string) bool {
	m, _ := r.PC.CustomData()[preparedKey].(map[string]bool)
	return m[name]
}

// MarkPrepared records whether the physical connection's session has prepared name.
func (r *Reader) MarkPrepared(name string, ok bool) {
	m, _ := r.PC.CustomData()[preparedKey].(map[string]bool)
	if m == nil {
		if !ok {
			return
		}
		m = map[string]bool{}
		r.PC.CustomData()[preparedKey] = m
	}
	if ok {
		m[name] = true
	} else {
		delete(m, name)
	}
}

// ServerPID is the pid MarkVerified recorded (0 before).
func (r *Reader) ServerPID() uint32 {
	pid, _ := r.PC.CustomData()[pidKey].(uint32)
	return pid
}

// Cancel sends a cancel request for the connection's backend when it is a direct connection (see
// session.Conn.Cancel).
func (r *Reader) Cancel(ctx context.Context) {
	if _, direct := r.Verified(); direct {
		_ = r.PC.CancelRequest(ctx)
	}
}

// ClientPID is the pid from the startup BackendKeyData.
func (r *Reader) ClientPID() uint32 { return r.PC.PID() }

// CloseSocket closes the network connection at once, so the server ends the backend now.
func (r *Reader) CloseSocket() { _ = r.PC.Conn().Close() }
