package advlock

import (
	"context"
	"testing"
	"time"

	"github.com/advlock/advlock/internal/session"
	"github.com/jackc/pgx/v5"
)

// A token drawn inside a transaction (a DoTx holder, which has no token of its own) compares with the tokens of
// session-lock grants: a holder that comes later gets a greater token, either way round, on the same timeline.
func TestFenceTokenInTx(t *testing.T) {
	b := setup(t, WithFencing())
	ctx := ctxT(t, 30*time.Second)
	k := key(t)
	lk, err := b.l.Lock(ctx, k)
	if err != nil {
		t.Fatal(err)
	}
	t1 := lk.Token()
	if err := lk.Unlock(ctx); err != nil {
		t.Fatal(err)
	}
	var t2 int64
	if err := b.l.DoTx(ctx, k, func(ctx context.Context, tx pgx.Tx) error {
		return tx.QueryRow(ctx, "SELECT "+FenceTokenSQL).Scan(&t2)
	}); err != nil {
		t.Fatal(err)
	}
	lk, err = b.l.Lock(ctx, k)
	if err != nil {
		t.Fatal(err)
	}
	t3 := lk.Token()
	if err := lk.Unlock(ctx); err != nil {
		t.Fatal(err)
	}
	tl1, _ := session.TokenParts(t1)
	tl2, _ := session.TokenParts(t2)
	t.Logf("tokens: lock %d, transaction %d, lock %d", t1, t2, t3)
	if !(t1 < t2 && t2 < t3) || tl1 != tl2 {
		t.Errorf("tokens lock %d (timeline %d), then transaction %d (timeline %d), then lock %d: want each greater than the one before, on one timeline", t1, tl1, t2, tl2, t3)
	}
}
