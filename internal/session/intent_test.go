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
			if _, err := writer.Exec(ctx, "SELECT pg_advisory_lock("+k.Intent().literal()+")").ReadAll(); err != nil {
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
			if _, err := writer.Exec(ctx, "SELECT pg_advisory_unlock("+k.Intent().literal()+")").ReadAll(); err != nil {
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

// Intent and Linger are bijections of each key space that move every key: distinct keys of a space get distinct
// derived keys (a sample), a key's derived keys are of its own space (a pair's never meet an int8 key: the two
// spaces are apart in pg_locks), and no key is its own intent or marker.
func TestIntent(t *testing.T) {
	for _, derive := range []func(ID) ID{ID.Intent, ID.Linger} {
		seen := map[ID]ID{}
		for i := int64(-1000); i < 1000; i++ {
			for _, pair := range []bool{false, true} {
				for _, v := range []int64{i, i << 32, i ^ 0x7061697273706163} {
					id := ID{Pair: pair, V: v}
					in := derive(id)
					if in.Pair != pair || in.V == id.V {
						t.Fatalf("%v -> %v", id, in)
					}
					if prev, ok := seen[in]; ok && prev != id {
						t.Fatalf("%v and %v share the derived key %v", prev, id, in)
					}
					seen[in] = id
				}
			}
		}
	}
	// The pair (a, b) once shared its intent with the int8 key (a<<32|b) xor "pairspac".
	p := ID{Pair: true, V: 7<<32 | 9}
	if i, j := p.Intent(), (ID{V: p.V ^ 0x7061697273706163}).Intent(); i == j || !i.Pair || j.Pair {
		t.Fatalf("the pair's intent %v, the int8 key's %v", i, j)
	}
}
