package advsql

import (
	"context"
	"database/sql"
	"testing"
	"time"

	"github.com/advlock/advlock"
	"github.com/advlock/advlock/internal/config"
	"github.com/advlock/advlock/internal/testkit/pgtest"
)

// The marks of verified driver connections stay bounded by the connections that can be alive: database/sql closes
// old ones without telling (here each lives 1 ms), and 120 locks over lib/pq go through about 120 connections.
// Every one was kept referenced before.
func TestVerifiedBounded(t *testing.T) {
	db, err := sql.Open("postgres", pgtest.URL(t))
	if err != nil {
		t.Fatal(err)
	}
	defer db.Close()
	db.SetMaxOpenConns(2)
	db.SetConnMaxLifetime(time.Millisecond)
	backend := &pool{db: db, verified: map[any]*mark{}}
	l := advlock.New(nil, option(func(o *config.Options) { o.Backend = backend }))
	defer l.Close()
	ctx := context.Background()
	most := 0
	for i := range 120 {
		lk, err := l.TryLock(ctx, advlock.Int64Key(time.Now().UnixNano()+int64(i)))
		if err != nil {
			t.Fatal(err)
		}
		if err := lk.Unlock(ctx); err != nil {
			t.Fatal(err)
		}
		time.Sleep(2 * time.Millisecond)
		backend.mu.Lock()
		most = max(most, len(backend.verified))
		backend.mu.Unlock()
	}
	t.Logf("at most %d marks over 120 locks on short-lived connections", most)
	if most > 16 {
		t.Errorf("%d marks kept for a pool of 2", most)
	}
}
