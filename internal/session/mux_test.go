package session

import (
	"context"
	"errors"
	"fmt"
	"os"
	"strconv"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/advlock/advlock/internal/testkit/pgtest"
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
func (c *wireConn) ServerPID() uint32                          { return c.pc.PID() }
func (c *wireConn) Destroy()                                   { c.once.Do(func() { _ = c.pc.Close(context.Background()) }) }
func (c *wireConn) Release()                                   { c.Destroy() }

// openTestMux opens a Mux on a connection of its own.
func openTestMux(t *testing.T) (*Mux, chan struct{}) {
	t.Helper()
	return openMuxAt(t, pgtest.URL(t), false)
}

// openMuxAt opens a Mux on a connection of its own to url, fenced or not; gone is closed once its session ends.
func openMuxAt(t *testing.T, url string, fenced bool) (*Mux, chan struct{}) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	pc, err := pgconn.Connect(ctx, url)
	if err != nil {
		t.Fatal(err)
	}
	gone := make(chan struct{})
	m, err := OpenMux(ctx, &wireConn{pc: pc}, 5*time.Second, func(*Mux) { close(gone) }, nil, fenced)
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

// awaitReader waits until m's background reader reads its quiet socket (on a loaded machine, late), then for twice
// WatchDelay more: the next caller's round trip is answered by it.
func awaitReader(t *testing.T, m *Mux) {
	t.Helper()
	for deadline := time.Now().Add(5 * time.Second); ; time.Sleep(WatchDelay) {
		m.mu.Lock()
		bg := m.token == tokenBG
		m.mu.Unlock()
		if bg {
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("the background reader never took the quiet socket")
		}
	}
	time.Sleep(2 * WatchDelay)
}

// A kill from another goroutine (an unlock answered false, a failed write) closes the socket and counts on whoever
// reads it to settle the Mux. When the kill lands just as the background reader hands the socket to a caller, or
// just as a caller finishes reading its own answer, the locks on the Mux must still be reported lost and the Mux
// must end: the server dropped them with the session.
func TestMuxKillAtHandOff(t *testing.T) {
	for _, at := range []string{"hand-back", "complete"} {
		t.Run(at, func(t *testing.T) {
			for i := range 20 {
				m, gone := openTestMux(t)
				ctx := context.Background()
				held, err := m.Try(ctx, Target{ID: ID{V: time.Now().UnixNano()}}, nil)
				if err != nil {
					t.Fatal(err)
				}
				if at == "hand-back" { // the background reader reads the quiet socket (on a loaded machine, late)
					awaitReader(t, m) // quiet for WatchDelay: a caller's answer is read by it, which then hands back
				}
				var once sync.Once
				killed := false
				setHookSettle(t, func(hm *Mux, where string) {
					if hm != m || where != "complete" {
						return
					}
					hm.mu.Lock()
					handBack := hm.handBack && hm.token == tokenBG
					hm.mu.Unlock()
					if handBack != (at == "hand-back") { // the background reader answering a caller, or the caller itself
						return
					}
					once.Do(func() { killed = true; m.kill(errKilled) })
				})
				// A caller: its answer is read by the background reader, which then gives the socket up (hand-back), or
				// by the caller itself (complete).
				if h, err := m.Try(ctx, Target{ID: ID{V: time.Now().UnixNano() + 1}}, nil); err == nil {
					_ = h.Release(ctx, ErrNotHeld)
				}
				testHookSettle.Store(nil)
				if !killed { // the caller's request and the hook ran on this goroutine or before the answer came back
					t.Fatalf("iteration %d: the hand-off at %s never came, nothing was killed", i, at)
				}
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

// A round trip of several requests that fails with an error other than a full lock table puts the session in
// doubt: every caller in it gets an error (none waits for ever), as does every caller queued behind it. die found
// no requests on the wire to settle before, and the callers of that round trip waited for ever.
func TestMuxRoundTripFails(t *testing.T) {
	m, gone := openTestMux(t)
	var once sync.Once
	injected := errors.New("round trip failed (injected)")
	setHookSettle(t, func(hm *Mux, where string) {
		if hm != m || where != "complete" || len(hm.wire) < 2 {
			return
		}
		once.Do(func() { // as the server would answer: an ErrorResponse, no rows
			hm.batchErr = injected
			for i := range hm.results {
				hm.results[i] = -1
			}
		})
	})
	var wg sync.WaitGroup
	errs := make(chan error, 64)
	for g := range 8 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := range 8 {
				h, err := m.Try(context.Background(), Target{ID: ID{V: int64(g*100 + i + 1)}}, nil)
				if err != nil {
					errs <- err
					return
				}
				_ = h.Release(context.Background(), ErrNotHeld)
			}
		}()
	}
	done := make(chan struct{})
	go func() { wg.Wait(); close(done) }()
	select {
	case <-done:
	case <-time.After(10 * time.Second):
		t.Fatal("callers of a round trip that failed still wait")
	}
	close(errs)
	saw := false
	for err := range errs {
		saw = saw || errors.Is(err, injected)
	}
	if !saw {
		t.Error("no caller got the round trip's error")
	}
	select {
	case <-gone:
	case <-time.After(5 * time.Second):
		t.Fatal("the Mux in doubt was not settled")
	}
}

// A fenced try on a lock table with room for its advisory lock alone: the lock is granted, then the token's nextval
// logs the sequence (the first nextval after a checkpoint does) and takes a transaction id, whose lock finds no
// space, and the statement fails with 53200 while the session lock survives. The try fails with ErrLockTableFull and
// keeps nothing: the key is not in pg_locks and another session takes it. (Without the undo the shared session kept
// the key, every time.)
func TestMuxFencedTryUndone(t *testing.T) {
	if testing.Short() {
		t.Skip("starts a private cluster")
	}
	c := pgtest.StartCluster(t, "max_locks_per_transaction = 10")
	ctx, obs := sequenced(t, c.URL)
	m, _ := openMuxAt(t, c.URL, true)
	b := time.Now().UnixNano()
	for round := range 3 {
		key := b + int64(round)
		filler := fillLockTable(t, ctx, c.URL, obs, 1) // room for the advisory lock alone
		if _, err := m.Try(ctx, Target{ID: ID{V: key}}, nil); !errors.Is(err, ErrLockTableFull) {
			t.Fatalf("round %d: fenced try with room for its lock alone: %v, want ErrLockTableFull", round, err)
		}
		if _, err := filler.Exec(ctx, "SELECT pg_advisory_unlock_all()").ReadAll(); err != nil { // space again
			t.Fatal(err)
		}
		_ = filler.Close(ctx)
		if h, err := m.Try(ctx, Target{ID: ID{V: key + 1000}}, nil); err != nil {
			t.Fatalf("round %d: a try after the refused one: %v", round, err) // the undo went out before it
		} else if err := h.Release(ctx, ErrNotHeld); err != nil {
			t.Fatal(err)
		}
		res, err := obs.Exec(ctx, fmt.Sprintf("SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND "+
			"((classid::int8 << 32) | objid::int8) = %d", key)).ReadAll()
		if err != nil {
			t.Fatal(err)
		}
		if n := string(res[0].Rows[0][0]); n != "0" {
			t.Fatalf("round %d: the refused key is in pg_locks (%s rows): the shared session kept it", round, n)
		}
		res, err = obs.Exec(ctx, fmt.Sprintf("SELECT pg_try_advisory_lock(%d), pg_advisory_unlock(%d)", key, key)).ReadAll()
		if err != nil {
			t.Fatal(err)
		}
		if got := string(res[0].Rows[0][0]); got != "t" {
			t.Fatalf("round %d: another session could not take the refused key", round)
		}
	}
}

// A try refused for lack of lock-table space after its key was granted returns only once its undo has landed: the
// moment it returns, pg_locks shows nothing of its key, though the undo's round trip is held up for 300 ms before
// it is written. Three kinds: a shared and an exclusive try of a plain shared session (granted, then their gate,
// the key's intent or its line's flag, found no space) and an exclusive try of a fenced one (granted, then refused
// at its line's flag, in a round trip whose abort undoes it). Before, the caller was told as the undo went out, and
// pg_locks showed its key held for those 300 ms. A try whose caller waits while the background reader reads, and
// whose session is killed while its undo is held up, is answered by the Mux's death (its key ends with the
// session) rather than left waiting for an undo that never comes (it hung without that).
func TestMuxRefusedTryHoldsNothing(t *testing.T) {
	if testing.Short() {
		t.Skip("starts a private cluster")
	}
	c := pgtest.StartCluster(t, "max_locks_per_transaction = 10")
	ctx, obs := sequenced(t, c.URL)
	b := time.Now().UnixNano()
	for i, kind := range []struct {
		name                 string
		fenced, shared, kill bool
	}{{"shared try", false, true, false}, {"exclusive try", false, false, false}, {"fenced try", true, false, false},
		{"exclusive try whose session is killed while its undo is held up", false, false, true}} {
		m, gone := openMuxAt(t, c.URL, kind.fenced)
		key := b + int64(i)
		var refused, held atomic.Bool
		setHookSettle(t, func(hm *Mux, at string) {
			switch {
			case hm != m:
			case at == "complete" && errors.Is(hm.batchErr, ErrLockTableFull):
				refused.Store(true)
			case at == "send" && refused.Load() && !held.Load():
				held.Store(true)
				if kind.kill {
					m.kill(errKilled) // the undo is never written: the key ends with the session
				}
				time.Sleep(300 * time.Millisecond) // the undo's round trip, held up
			}
		})
		filler := fillLockTable(t, ctx, c.URL, obs, 1) // room for the advisory lock alone
		if kind.kill {
			// The background reader reads the quiet socket, so the try's caller waits to be woken (a caller that
			// reads its own answer returns once the Mux has died, answered or not).
			awaitReader(t, m)
		}
		_, err := m.Try(ctx, Target{ID: ID{V: key}, Shared: kind.shared}, nil)
		res, qerr := obs.Exec(ctx, fmt.Sprintf("SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND "+
			"((classid::int8 << 32) | objid::int8) = %d", key)).ReadAll()
		testHookSettle.Store(nil)
		if !errors.Is(err, ErrLockTableFull) {
			t.Fatalf("%s with room for its lock alone: %v, want ErrLockTableFull", kind.name, err)
		}
		if qerr != nil {
			t.Fatal(qerr)
		}
		if !held.Load() {
			t.Fatalf("%s: no round trip went out after the refused one (its undo)", kind.name)
		}
		if kind.kill {
			select { // the try was answered by the Mux's death, which ended its session
			case <-gone:
			case <-time.After(10 * time.Second):
				t.Fatalf("%s: the Mux is not gone", kind.name)
			}
		} else if n := string(res[0].Rows[0][0]); n != "0" {
			t.Errorf("%s: the refused key is in pg_locks (%s rows) as its try returns", kind.name, n)
		}
		if _, err := filler.Exec(ctx, "SELECT pg_advisory_unlock_all()").ReadAll(); err != nil {
			t.Fatal(err)
		}
		_ = filler.Close(ctx)
	}
}

// sequenced connects an observer to the private cluster at url and creates the fencing sequence there; the context
// ends after 60 s, the connection with the test.
func sequenced(t *testing.T, url string) (context.Context, *pgconn.PgConn) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	t.Cleanup(cancel)
	obs, err := pgconn.Connect(ctx, url)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = obs.Close(context.Background()) })
	if _, err := obs.Exec(ctx, "CREATE SEQUENCE "+FenceSeq).ReadAll(); err != nil {
		t.Fatal(err)
	}
	return ctx, obs
}

// fillLockTable fills the server's lock table from a connection of its own, then gives room slots back, and
// checkpoints through obs so that the next nextval of the fencing sequence logs (and takes a transaction id, whose
// lock needs a slot). The filler's locks go with it when the test ends, or with pg_advisory_unlock_all on it.
func fillLockTable(t *testing.T, ctx context.Context, url string, obs *pgconn.PgConn, room int) *pgconn.PgConn {
	t.Helper()
	filler, err := pgconn.Connect(ctx, url)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = filler.Close(context.Background()) })
	if _, err := filler.Exec(ctx, "SELECT pg_advisory_lock(g) FROM generate_series(1, 1000000) g").ReadAll(); SQLState(err) != "53200" {
		t.Fatalf("filling the lock table: %v", err)
	}
	if _, err := filler.Exec(ctx, fmt.Sprintf("SELECT pg_advisory_unlock(g) FROM generate_series(1, %d) g", room)).ReadAll(); err != nil {
		t.Fatal(err)
	}
	if _, err := obs.Exec(ctx, "CHECKPOINT").ReadAll(); err != nil {
		t.Fatal(err)
	}
	return filler
}

// A Held's Done is made on its first call: asked before the end it closes at the end, asked after it is closed
// already, and asked as the lock ends (a loss, from the Mux's own goroutine) it is one or the other, never a channel
// that stays open; Err says the end whenever Done is closed, and AfterEnd runs its f either way.
func TestHeldDoneLate(t *testing.T) {
	m, _ := openTestMux(t)
	ctx := context.Background()
	closedSoon := func(what string, c <-chan struct{}) {
		t.Helper()
		select {
		case <-c:
		case <-time.After(5 * time.Second):
			t.Fatalf("%s: Done still open", what)
		}
	}
	early, err := m.Try(ctx, Target{ID: ID{V: 9101}}, nil)
	if err != nil {
		t.Fatal(err)
	}
	late, err := m.Try(ctx, Target{ID: ID{V: 9102}}, nil)
	if err != nil {
		t.Fatal(err)
	}
	watched := early.Done()
	select {
	case <-watched:
		t.Fatal("Done closed while held")
	default:
	}
	if early.Err() != nil || late.Err() != nil {
		t.Fatal("Err set while held")
	}
	if err := early.Release(ctx, ErrNotHeld); err != nil {
		t.Fatal(err)
	}
	closedSoon("asked before the release", watched)
	if err := late.Release(ctx, ErrNotHeld); err != nil {
		t.Fatal(err)
	}
	closedSoon("asked after the release", late.Done())
	if !errors.Is(early.Err(), ErrNotHeld) || !errors.Is(late.Err(), ErrNotHeld) {
		t.Fatalf("Err after release: %v, %v", early.Err(), late.Err())
	}
	ran := make(chan struct{})
	late.AfterEnd(func() { close(ran) })
	closedSoon("AfterEnd after the end", ran)

	// Locks lost at once, Done asked from other goroutines as the Mux ends them.
	var hs []*Held
	for i := range 50 {
		h, err := m.Try(ctx, Target{ID: ID{V: int64(9200 + i)}}, nil)
		if err != nil {
			t.Fatal(err)
		}
		hs = append(hs, h)
	}
	var wg sync.WaitGroup
	for _, h := range hs {
		wg.Add(1)
		go func() {
			defer wg.Done()
			c := h.Done()
			select {
			case <-c:
			case <-time.After(5 * time.Second):
				t.Error("Done asked as the lock ended stays open")
				return
			}
			if !errors.Is(h.Err(), ErrLockLost) {
				t.Errorf("Err once Done closed: %v", h.Err())
			}
		}()
	}
	m.kill(SessionEnded(errors.New("killed by the test")))
	wg.Wait()
}
