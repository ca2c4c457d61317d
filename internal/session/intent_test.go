package session

import (
	"context"
	"strconv"
	"testing"
	"time"

	"github.com/advlock/advlock/internal/testkit/pgtest"
	"github.com/jackc/pgx/v5/pgconn"
)

// A shared session's shared try passes only while no writer holds the key's intent, alone in its round trip and
// among others in one (the array statement), also on a session that holds the key shared already (PostgreSQL's
// re-entrancy would grant it past any waiter); exclusive tries and other keys are not affected, and the test of
// the intent leaves nothing held. Both key spaces.
func TestMuxSharedTryRespectsIntent(t *testing.T) {
	url := pgtest.URL(t)
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	writer, err := pgconn.Connect(ctx, url)
	if err != nil {
		t.Fatal(err)
	}
	defer writer.Close(context.Background())
	for _, pair := range []bool{false, true} {
		t.Run("pair="+strconv.FormatBool(pair), func(t *testing.T) {
			m, _ := openMuxAt(t, url, false)
			base := time.Now().UnixNano() &^ 0xff
			k, other, excl := ID{Pair: pair, V: base + 1}, ID{Pair: pair, V: base + 2}, ID{Pair: pair, V: base + 3}
			held, err := m.Try(ctx, Target{ID: k, Shared: true}, nil) // the session holds k shared
			if err != nil {
				t.Fatal(err)
			}
			if _, err := writer.Exec(ctx, "SELECT pg_advisory_lock("+strconv.FormatInt(k.Intent().V, 10)+")").ReadAll(); err != nil {
				t.Fatal(err)
			}
			// Alone in a round trip: refused, on the session that holds it shared and for a key it does not hold.
			if _, err := m.Try(ctx, Target{ID: k, Shared: true}, nil); err != ErrNotAcquired {
				t.Fatalf("a shared try again of a key whose intent a writer holds: %v, want ErrNotAcquired", err)
			}
			// In one round trip with others: k refused, the other key shared and an exclusive one granted.
			op := func(shared bool, id ID) int16 {
				o := int16(opTry)
				if shared {
					o = opTryShared
				}
				if id.Pair {
					o += opPair
				}
				return o
			}
			rs := []*req{{op: op(true, k), key: k.V}, {op: op(true, other), key: other.V}, {op: op(false, excl), key: excl.V}}
			for _, r := range rs {
				r.sig = make(chan struct{}, 1)
			}
			m.mu.Lock()
			m.queue = append(m.queue, rs[:2]...)
			m.mu.Unlock()
			m.do(rs[2]) // returns once its own request is answered; the three went out together
			for _, r := range rs[:2] {
				m.wait(r)
			}
			if rs[0].err != nil || rs[0].res != 0 || rs[1].err != nil || rs[1].res != 1 || rs[2].err != nil || rs[2].res != 1 {
				t.Fatalf("a round trip of [shared k (intent held), shared other, exclusive]: %d %v, %d %v, %d %v",
					rs[0].res, rs[0].err, rs[1].res, rs[1].err, rs[2].res, rs[2].err)
			}
			unlock := []*req{{op: op(true, other) + 2, key: other.V}, {op: op(false, excl) + 2, key: excl.V}}
			for _, r := range unlock {
				m.do(r)
				if r.err != nil || r.res != 1 {
					t.Fatalf("unlock: %d %v", r.res, r.err)
				}
			}
			// Once the intent is given back, readers pass again.
			if _, err := writer.Exec(ctx, "SELECT pg_advisory_unlock("+strconv.FormatInt(k.Intent().V, 10)+")").ReadAll(); err != nil {
				t.Fatal(err)
			}
			again, err := m.Try(ctx, Target{ID: k, Shared: true}, nil)
			if err != nil {
				t.Fatal(err)
			}
			_ = again.Release(ctx, ErrNotHeld)
			_ = held.Release(ctx, ErrNotHeld)
			// Nothing is left on the Mux's session: its intent tests took nothing.
			res, err := writer.Exec(ctx, "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND pid = "+
				strconv.FormatUint(uint64(m.pid), 10)).ReadAll()
			if err != nil {
				t.Fatal(err)
			}
			if n := string(res[0].Rows[0][0]); n != "0" {
				t.Fatalf("the shared session still holds %s advisory locks", n)
			}
		})
	}
}

// Intent is a bijection of each key space that moves every key: distinct keys of a space get distinct intents (a
// sample), and no key is its own intent.
func TestIntent(t *testing.T) {
	seen := map[int64]ID{}
	for i := int64(-1000); i < 1000; i++ {
		for _, pair := range []bool{false, true} {
			id := ID{Pair: pair, V: i}
			in := id.Intent()
			if in.Pair || (!pair && in.V == id.V) {
				t.Fatalf("%v -> %v", id, in)
			}
			if prev, ok := seen[in.V]; ok {
				t.Fatalf("%v and %v share the intent %d", prev, id, in.V)
			}
			seen[in.V] = id
		}
	}
}
