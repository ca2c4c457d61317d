package advlock

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/advlock/advlock/internal/testkit/pgtest"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
)

// A watched wait that waits for a connection of an exhausted pool: the readings go on a connection dialed outside
// the pool, which the server shows while they last and never after, whether detection stops because the wait got
// its key or because Close came during a reading.
func TestDeadlockDialedConnGoes(t *testing.T) {
	for _, closeDuring := range []bool{false, true} {
		t.Run(map[bool]string{false: "wait ends", true: "close during a reading"}[closeDuring], func(t *testing.T) {
			url := pgtest.URL(t)
			app := appName(t, "dial")
			pool := pgtest.Pool(t, url, func(c *pgxpool.Config) {
				c.MaxConns = 2
				c.ConnConfig.RuntimeParams["application_name"] = app
			})
			l := New(pool, WithSharedSessions(0))
			defer l.Close()
			obs := pgtest.Conn(t, url)
			ctx := ctxT(t, 30*time.Second)
			a, bk := key(t), key(t)
			la, err := l.Lock(ctx, a)
			if err != nil {
				t.Fatal(err)
			}
			lb, err := l.Lock(ctx, bk)
			if err != nil {
				t.Fatal(err)
			}
			read := make(chan struct{})
			closed := make(chan struct{})
			first := true
			hook := func(hl *Locker) bool {
				if hl != l || !first {
					return false
				}
				first = false
				close(read)
				if closeDuring {
					go func() { l.Close(); close(closed) }()
					time.Sleep(200 * time.Millisecond) // Close runs while this reading is judged
				}
				return false
			}
			testHookGraphRead.Store(&hook)
			defer testHookGraphRead.Store(nil)
			werr := make(chan error, 1)
			go func() {
				lk, err := l.Lock(Holding(ctx, la), bk) // waits for a connection of the pool
				if err == nil {
					err = lk.Unlock(ctx)
				}
				werr <- err
			}()
			select {
			case <-read:
			case <-time.After(10 * time.Second):
				t.Fatalf("no reading: %+v", l.Stats())
			}
			if n := count(t, obs, app); n != 3 {
				t.Errorf("during the wait the server shows %d sessions of the pool, want 3 (2 and the one dialed)", n)
			}
			if !closeDuring {
				if st := l.Stats(); st.Conns != 3 || st.PeakConns < 3 {
					t.Errorf("during the wait Stats says Conns %d, PeakConns %d; want 3 (the dialed one counts)", st.Conns, st.PeakConns)
				}
			}
			if closeDuring {
				<-closed
				if err := <-werr; !errors.Is(err, ErrClosed) {
					t.Errorf("the wait: %v, want ErrClosed", err)
				}
			} else {
				if err := lb.Unlock(ctx); err != nil {
					t.Fatal(err)
				}
				if err := <-werr; err != nil {
					t.Fatalf("the wait: %v", err)
				}
				if err := la.Unlock(ctx); err != nil {
					t.Fatal(err)
				}
				for deadline := time.Now().Add(5 * time.Second); ; time.Sleep(50 * time.Millisecond) {
					l.mu.Lock()
					detecting := l.detecting
					l.mu.Unlock()
					if !detecting {
						break
					}
					if time.Now().After(deadline) {
						t.Fatal("detection did not stop within 5 s of the last watched wait")
					}
				}
				time.Sleep(100 * time.Millisecond) // the detector's deferred close
				if n, open := count(t, obs, app), pool.Stat().TotalConns(); n != int(open) {
					t.Errorf("detection stopped: the server shows %d sessions of the pool, which has %d", n, open)
				}
				if st := l.Stats(); st.Conns != 0 {
					t.Errorf("nothing held, nothing waits: Stats says Conns %d, want 0", st.Conns)
				}
				l.Close()
			}
			pool.Close()
			for deadline := time.Now().Add(3 * time.Second); count(t, obs, app) != 0; time.Sleep(50 * time.Millisecond) {
				if time.Now().After(deadline) {
					t.Fatalf("after Close and the pool's: the server shows %d sessions", count(t, obs, app))
				}
			}
		})
	}
}

func count(t *testing.T, c *pgx.Conn, app string) int {
	t.Helper()
	n, err := sessionsOf(context.Background(), c, app)
	if err != nil {
		t.Fatal(err)
	}
	return n
}
