package advlock

import (
	"context"
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/advlock/advlock/internal/testkit/pgtest"
	"github.com/jackc/pgx/v5"
)

// How a pool that is the Locker's own is shared out, by size: with DefaultOpenConns, 1 shared session, 1
// connection kept for the Locker's reads and 3 sessions of their own.
func TestShare(t *testing.T) {
	for _, tc := range []struct {
		conns, configured       int // configured: WithSharedSessions, or -1 for Open's default
		shared, spare, own, max int
	}{
		{conns: DefaultOpenConns, configured: -1, shared: 1, spare: 1, own: 3},
		{conns: 1, configured: -1, shared: 0, spare: 0, own: 1},
		{conns: 2, configured: -1, shared: 1, spare: 0, own: 1},
		{conns: 3, configured: -1, shared: 1, spare: 1, own: 1},
		{conns: 8, configured: -1, shared: 2, spare: 1, own: 5},
		{conns: 24, configured: -1, shared: 4, spare: 1, own: 19},
		{conns: 100, configured: -1, shared: 4, spare: 1, own: 95},
		{conns: 5, configured: 4, shared: 2, spare: 1, own: 2}, // never more than half
		{conns: 5, configured: 0, shared: 0, spare: 1, own: 4},
	} {
		n := tc.configured
		if n < 0 {
			n = ownPoolShared(tc.conns)
		}
		shared, spare, own := share(tc.conns, n)
		if shared != tc.shared || spare != tc.spare || own != tc.own {
			t.Errorf("%d connections, shared sessions %d: %d shared, %d kept, %d of their own; want %d, %d, %d",
				tc.conns, tc.configured, shared, spare, own, tc.shared, tc.spare, tc.own)
		}
	}
}

// WithMaxConns sizes the pool a Locker owns, and the share-out follows it; the DSN's pool_max_conns wins.
func TestWithMaxConns(t *testing.T) {
	url := pgtest.URL(t)
	ctx := ctxT(t, 10*time.Second)
	for _, tc := range []struct {
		dsn      string
		opts     []Option
		max, own int
	}{
		{url, nil, DefaultOpenConns, 3},
		{url, []Option{WithMaxConns(24)}, 24, 19},
		{url, []Option{WithMaxConns(24), WithSharedSessions(0)}, 24, 23},
		{url + sep(url) + "pool_max_conns=8", []Option{WithMaxConns(24)}, 8, 5},
	} {
		l, err := Open(ctx, tc.dsn, tc.opts...)
		if err != nil {
			t.Fatal(err)
		}
		st := l.Stats()
		l.Close()
		if st.Pool.Max != tc.max || st.MaxOwnSessions != tc.own {
			t.Errorf("Open(%q, %d options): pool %d, %d sessions of their own; want %d and %d", tc.dsn, len(tc.opts), st.Pool.Max, st.MaxOwnSessions, tc.max, tc.own)
		}
	}
}

func sep(url string) string {
	if strings.Contains(url, "?") {
		return "&"
	}
	if strings.Contains(url, "://") {
		return "?"
	}
	return " "
}

// DoTx's transaction is one of the Locker's connections in Stats (it takes it from the same pool), counted while
// the transaction runs and given back after, also when fn fails.
func TestDoTxCounted(t *testing.T) {
	url := pgtest.URL(t)
	app := appName(t, "dotx-count")
	l := openApp(t, url, app, "")
	obs := pgtest.Conn(t, url)
	ctx := ctxT(t, 30*time.Second)
	for _, fail := range []bool{false, true} {
		before := l.Stats().Conns
		errFn := errors.New("fn failed")
		err := l.DoTx(ctx, key(t), func(ctx context.Context, tx pgx.Tx) error {
			if got := l.Stats().Conns; got != before+1 {
				t.Errorf("inside DoTx Stats().Conns is %d, want %d", got, before+1)
			}
			if n := count(t, obs, app); n < 1 {
				t.Errorf("inside DoTx the server shows %d sessions of the Locker", n)
			}
			if fail {
				return errFn
			}
			return nil
		})
		if fail != errors.Is(err, errFn) || !fail && err != nil {
			t.Fatalf("DoTx (fn fails: %v): %v", fail, err)
		}
		if got := l.Stats().Conns; got != before {
			t.Errorf("after DoTx Stats().Conns is %d, want %d", got, before)
		}
	}
}
