package advlock

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	neturl "net/url"
	"sync"
	"testing"
	"time"

	"github.com/advlock/advlock/internal/testkit/pgtest"
	"github.com/jackc/pgx/v5"
)

// openApp opens a Locker on url whose sessions carry application_name app (so that pg_stat_activity tells its
// connections apart), with extra (such as "pool_max_conns=3") added to the DSN.
func openApp(t *testing.T, url, app, extra string, opts ...Option) *Locker {
	t.Helper()
	u, err := neturl.Parse(url)
	if err != nil {
		t.Fatal(err)
	}
	q := u.Query()
	q.Set("application_name", app)
	if extra != "" {
		x, err := neturl.ParseQuery(extra)
		if err != nil {
			t.Fatal(err)
		}
		for k, v := range x {
			q[k] = v
		}
	}
	u.RawQuery = q.Encode()
	l, err := Open(context.Background(), u.String(), opts...)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(l.Close)
	return l
}

func appName(t *testing.T, what string) string {
	var b [4]byte
	if _, err := rand.Read(b[:]); err != nil {
		t.Fatal(err)
	}
	return what + "-" + hex.EncodeToString(b[:])
}

// sessionsOf counts the server sessions whose application_name is app.
func sessionsOf(ctx context.Context, c *pgx.Conn, app string) (int, error) {
	var n int
	err := c.QueryRow(ctx, "SELECT count(*) FROM pg_stat_activity WHERE application_name = $1", app).Scan(&n)
	return n, err
}

// sampler counts, every few milliseconds until stopped, the server sessions of each of apps, and keeps the most.
type sampler struct {
	stop chan struct{}
	done chan struct{}
	mu   sync.Mutex
	peak map[string]int
	n    int
	err  error
}

func sample(t *testing.T, url string, apps ...string) *sampler {
	c := pgtest.Conn(t, url)
	s := &sampler{stop: make(chan struct{}), done: make(chan struct{}), peak: map[string]int{}}
	go func() {
		defer close(s.done)
		for {
			select {
			case <-s.stop:
				return
			default:
			}
			for _, a := range apps {
				n, err := sessionsOf(context.Background(), c, a)
				s.mu.Lock()
				if err != nil && s.err == nil {
					s.err = err
				}
				s.peak[a] = max(s.peak[a], n)
				s.mu.Unlock()
			}
			s.mu.Lock()
			s.n++
			s.mu.Unlock()
			time.Sleep(2 * time.Millisecond)
		}
	}()
	return s
}

func (s *sampler) end(t *testing.T) map[string]int {
	t.Helper()
	close(s.stop)
	<-s.done
	if s.err != nil {
		t.Fatal(s.err)
	}
	t.Logf("%d samples of pg_stat_activity", s.n)
	return s.peak
}

// waitStats waits until l's Stats satisfy ok, and fails the test after 10 s.
func waitStats(t *testing.T, l *Locker, what string, ok func(Stats) bool) {
	t.Helper()
	for deadline := time.Now().Add(10 * time.Second); !ok(l.Stats()); time.Sleep(time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatalf("%s: not within 10 s: %+v", what, l.Stats())
		}
	}
}
