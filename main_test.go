package advlock

import (
	"context"
	"crypto/rand"
	"encoding/binary"
	"os"
	"testing"
	"time"

	"github.com/advlock/advlock/internal/testkit/pgtest"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
)

func TestMain(m *testing.M) {
	if spec := os.Getenv(sweepHolderEnv); spec != "" {
		sweepHolder(spec) // never returns
	}
	os.Exit(pgtest.Main(m))
}

// bundle is what most tests need: a pool, a Locker over it, and a separate connection to observe pg_locks.
type bundle struct {
	url  string
	pool *pgxpool.Pool
	l    *Locker
	obs  *pgx.Conn
}

func setup(t *testing.T, opts ...Option) *bundle {
	t.Helper()
	url := pgtest.URL(t)
	pool := pgtest.Pool(t, url, nil)
	l := New(pool, opts...)
	t.Cleanup(l.Close) // runs before the pool closes
	return &bundle{url: url, pool: pool, l: l, obs: pgtest.Conn(t, url)}
}

// key returns an Int64Key no other test uses.
func key(t *testing.T) Key {
	var b [8]byte
	if _, err := rand.Read(b[:]); err != nil {
		t.Fatal(err)
	}
	return Int64Key(int64(binary.LittleEndian.Uint64(b[:])))
}

func ctxT(t *testing.T, d time.Duration) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), d)
	t.Cleanup(cancel)
	return ctx
}

// holders returns the pids the server says hold k (an int8 key).
func (b *bundle) holders(t *testing.T, k Key) []uint32 {
	t.Helper()
	v, _ := k.Int64()
	pids, err := pgtest.Holders(context.Background(), b.obs, v)
	if err != nil {
		t.Fatal(err)
	}
	return pids
}

func (b *bundle) waitFree(t *testing.T, k Key) {
	t.Helper()
	v, _ := k.Int64()
	pgtest.WaitFree(t, b.obs, v, 10*time.Second)
}

// pidOf returns the server pid of the session holding lk, as the server sees it (exactly one).
func (b *bundle) pidOf(t *testing.T, lk *Lock) uint32 {
	t.Helper()
	pids := b.holders(t, lk.Key())
	if len(pids) != 1 {
		t.Fatalf("want exactly one holder of %s, pg_locks shows %v", lk.Key(), pids)
	}
	return pids[0]
}

func waitDone(t *testing.T, lk *Lock, within time.Duration) time.Duration {
	t.Helper()
	return pgtest.WaitClosed(t, lk.Done(), within, "lock "+lk.Key().String()+" reported lost")
}
