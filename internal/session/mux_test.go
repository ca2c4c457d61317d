package session

import (
	"context"
	"errors"
	"os"
	"strconv"
	"sync"
	"testing"
	"time"

	"github.com/advlock/advlock/internal/pgtest"
	"github.com/jackc/pgx/v5/pgconn"
)

func TestMain(m *testing.M) { os.Exit(pgtest.Main(m)) }

// wireConn is the least a Mux needs of a connection: a plain pgconn connection.
type wireConn struct {
	Conn // the rest is never called on a Mux's connection
	pc   *pgconn.PgConn
	once sync.Once
}

func (c *wireConn) QueryInt(ctx context.Context, sql string, _ ...any) (int64, error) {
	res, err := c.pc.Exec(ctx, sql).ReadAll()
	if err != nil {
		return 0, err
	}
	return strconv.ParseInt(string(res[len(res)-1].Rows[0][0]), 10, 64)
}
func (c *wireConn) Wire(f func(pc *pgconn.PgConn) error) error { return f(c.pc) }
func (c *wireConn) Destroy()                                   { c.once.Do(func() { _ = c.pc.Close(context.Background()) }) }
func (c *wireConn) Release()                                   { c.Destroy() }

// openTestMux opens a Mux on a connection of its own.
func openTestMux(t *testing.T) (*Mux, chan struct{}) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	pc, err := pgconn.Connect(ctx, pgtest.URL(t))
	if err != nil {
		t.Fatal(err)
	}
	gone := make(chan struct{})
	m, err := OpenMux(ctx, &wireConn{pc: pc}, 5*time.Second, func(*Mux) { close(gone) }, nil, false)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(m.Close)
	return m, gone
}

func setHookSettle(t *testing.T, f func(m *Mux, at string)) {
	testHookSettle.Store(&f)
	t.Cleanup(func() { testHookSettle.Store(nil) })
}

var errKilled = errors.New("killed by the test")

// A kill from another goroutine (an unlock answered false, a failed write) closes the socket and counts on whoever
// reads it to settle the Mux. When the kill lands just as the background reader hands the socket to a caller, or
// just as a caller finishes reading its own answer, the locks on the Mux must still be reported lost and the Mux
// must end: the server dropped them with the session.
func TestMuxKillAtHandOff(t *testing.T) {
	for _, at := range []string{"timeout", "complete"} {
		t.Run(at, func(t *testing.T) {
			for i := range 20 {
				m, gone := openTestMux(t)
				ctx := context.Background()
				held, err := m.Try(ctx, Target{ID: ID{V: time.Now().UnixNano()}}, nil)
				if err != nil {
					t.Fatal(err)
				}
				if at == "timeout" {
					time.Sleep(10 * WatchDelay) // the background reader reads the quiet socket
				}
				var once sync.Once
				setHookSettle(t, func(hm *Mux, where string) {
					if hm != m || where != at {
						return
					}
					if at == "timeout" { // only the hand-off to a caller, not a keepalive
						hm.mu.Lock()
						asked := hm.wantToken != nil
						hm.mu.Unlock()
						if !asked {
							return
						}
					}
					once.Do(func() { m.kill(errKilled) })
				})
				// A caller: it asks the background reader for the socket (timeout), or reads its own answer (complete).
				if h, err := m.Try(ctx, Target{ID: ID{V: time.Now().UnixNano() + 1}}, nil); err == nil {
					_ = h.Release(ctx, ErrNotHeld)
				}
				testHookSettle.Store(nil)
				select {
				case <-held.Done():
					if !errors.Is(held.Err(), ErrLockLost) {
						t.Fatalf("iteration %d: Err = %v, want ErrLockLost", i, held.Err())
					}
				case <-time.After(5 * time.Second):
					t.Fatalf("iteration %d: the Mux was killed at %s, but its lock is still reported held", i, at)
				}
				select {
				case <-gone:
				case <-time.After(5 * time.Second):
					t.Fatalf("iteration %d: the killed Mux was never settled", i)
				}
			}
		})
	}
}

// A backend whose Wire gives no connection (database/sql's Raw on a closed *sql.Conn) fails OpenMux instead of
// leaving it waiting for ever.
func TestOpenMuxNoWire(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	pc, err := pgconn.Connect(ctx, pgtest.URL(t))
	if err != nil {
		t.Fatal(err)
	}
	done := make(chan error, 1)
	go func() {
		_, err := OpenMux(ctx, noWire{&wireConn{pc: pc}}, time.Second, nil, nil, false)
		done <- err
	}()
	select {
	case err := <-done:
		if err == nil {
			t.Fatal("OpenMux without a connection succeeded")
		}
		t.Logf("OpenMux: %v", err)
	case <-time.After(5 * time.Second):
		t.Fatal("OpenMux hung when Wire gave no connection")
	}
}

type noWire struct{ *wireConn }

func (noWire) Wire(func(pc *pgconn.PgConn) error) error {
	return errors.New("sql: connection is already closed")
}
