package pgtest

import (
	"context"
	"encoding/binary"
	"io"
	"net"
	"strconv"
	"sync"
	"sync/atomic"
	"testing"

	"github.com/jackc/pgx/v5/pgconn"
)

// PgBouncer 1.18 to 1.20 can exit ("server_proto: server in bad state: 11", pgbouncer issue #822, fixed in 1.21)
// when a client closes its connection while a cancel request for it is being forwarded. pgconn does just that
// whenever a statement is cut short (a ctx that ends, a socket closed under a wait): it closes the connection and
// sends a cancel request on the way. The suites end statements that way by the hundred, and such a PgBouncer fell
// over mid-suite now and then, failing every test behind it. So connections that the helpers here open through one
// (Pool, Conn, DropCancels) send no cancel request: one written is dropped, as by a server that ignored it, and the
// statement ends as it does with lib/pq's NoCancel or advlock's own pooled connections, by its client connection
// closing. Direct connections, and PgBouncers of other versions, keep their cancel requests.

// noCancelAddrs holds the addresses (host:port) that cancel requests must not be sent to: those of the crash-prone
// PgBouncers StartBouncer started, and of proxies in front of them (NoCancelsTo).
var noCancelAddrs sync.Map

// droppedCancels counts the cancel requests dropped.
var droppedCancels atomic.Int64

// BouncerCrashesOnCancel reports whether the installed PgBouncer is one (1.18 to 1.20) that cancel requests can
// crash (see above).
func BouncerCrashesOnCancel() (bool, error) {
	v, err := BouncerVersion()
	if err != nil {
		return false, err
	}
	return v[0] == 1 && v[1] >= 18 && v[1] <= 20, nil
}

// NoCancelsTo makes the connections DropCancels configures for addr (host:port) send no cancel request when the
// one at upstream (host:port) takes none, until the test ends: a proxy at addr in front of a crash-prone PgBouncer
// at upstream.
func NoCancelsTo(tb testing.TB, addr, upstream string) {
	if _, ok := noCancelAddrs.Load(upstream); ok {
		noCancelAddrs.Store(addr, true)
		tb.Cleanup(func() { noCancelAddrs.Delete(addr) })
	}
}

// TakesCancels reports whether cancel requests may be sent to the server or pooler at cfg's address.
func TakesCancels(cfg *pgconn.Config) bool {
	_, no := noCancelAddrs.Load(net.JoinHostPort(cfg.Host, strconv.Itoa(int(cfg.Port))))
	return !no
}

// DropCancels makes the connections cfg opens drop the cancel requests they would send, when its address takes
// none (TakesCancels); otherwise it leaves cfg alone. Only a plain cancel request is seen: one sent over TLS (which
// the PgBouncers the tests start do not offer) goes through.
func DropCancels(cfg *pgconn.Config) {
	if TakesCancels(cfg) {
		return
	}
	dial := cfg.DialFunc
	cfg.DialFunc = func(ctx context.Context, network, addr string) (net.Conn, error) {
		c, err := dial(ctx, network, addr)
		if err != nil {
			return nil, err
		}
		return &noCancelConn{Conn: c}, nil
	}
}

// noCancelConn drops a cancel request written as its first message: it closes the socket and reads end at once,
// as when the server has closed a cancel connection.
type noCancelConn struct {
	net.Conn
	wrote   atomic.Bool
	dropped atomic.Bool
}

// cancelRequestCode is the CancelRequest message's code (the protocol's 1234 5678).
const cancelRequestCode = 80877102

func (c *noCancelConn) Write(p []byte) (int, error) {
	if !c.wrote.Swap(true) && len(p) >= 16 && binary.BigEndian.Uint32(p[0:4]) == uint32(len(p)) &&
		binary.BigEndian.Uint32(p[4:8]) == cancelRequestCode {
		c.dropped.Store(true)
		droppedCancels.Add(1)
		_ = c.Conn.Close()
		return len(p), nil
	}
	return c.Conn.Write(p)
}

func (c *noCancelConn) Read(p []byte) (int, error) {
	if c.dropped.Load() {
		return 0, io.EOF
	}
	return c.Conn.Read(p)
}
