package conformance

import (
	"context"
	"errors"
	mrand "math/rand/v2"
	"sync"
	"testing"
	"time"

	"github.com/advlock/advlock"
	"github.com/advlock/advlock/internal/config"
	"github.com/advlock/advlock/internal/testkit/pgtest"
	"github.com/jackc/pgx/v5"
)

// leaseLength is the length of the suite's leases: renewed every 500 ms, trusted for 1.4 s after each send.
const leaseLength = 1500 * time.Millisecond

// Leases runs the cases of the suite that apply to leases (WithLeases) against be, each judged by the lease
// table as the server holds it: exclusion, waits and their bounds, the calls leases refuse, a wait cancelled as
// the key is granted, a lease broken or cut off told to its holder before anyone else is granted the key, Close
// during a wait. A lease needs no session, so be may be a pooler in transaction mode.
func Leases(t *testing.T, be Backend) {
	s := &leaseSuite{be: be}
	for _, tc := range []struct {
		name string
		fn   func(*testing.T)
	}{
		{"Exclusion", s.exclusion},
		{"WaitsAndRefusals", s.waitsAndRefusals},
		{"CancelRace", s.cancelRace},
		{"BrokenTold", s.brokenTold},
		{"CutOffToldFirst", s.cutOffToldFirst},
		{"CloseDuringWait", s.closeDuringWait},
	} {
		t.Run(tc.name, tc.fn)
	}
}

type leaseSuite struct{ be Backend }

func (s *leaseSuite) open(t *testing.T, url string) *advlock.Locker {
	h := s.be.Open(t, url, advlock.WithLeases(), advlock.WithLeaseLength(leaseLength),
		option(func(o *config.Options) { o.LeasePoll = 10 * time.Millisecond }))
	t.Cleanup(h.L.Close)
	return h.L
}

// leaseTerm reads k's live lease from the table: its term, and whether there is one.
func leaseTerm(t *testing.T, obs *pgx.Conn, k advlock.Key) (int64, bool) {
	t.Helper()
	v, _ := k.Int64()
	var term int64
	err := obs.QueryRow(context.Background(), "SELECT term FROM public.advlock_lease"+
		" WHERE space = 1 AND key = $1 AND expires > clock_timestamp()", v).Scan(&term)
	if errors.Is(err, pgx.ErrNoRows) {
		return 0, false
	}
	if err != nil {
		t.Fatal(err)
	}
	return term, true
}

// exclusion: four Lockers run Do on one key, ten times each; no two fns overlap, each fn's token is the term the
// table holds while it runs, each term is greater than the one before, and no row outlives the last Do.
func (s *leaseSuite) exclusion(t *testing.T) {
	obs := pgtest.Conn(t, s.be.ObsURL)
	ctx := ctxT(t, 60*time.Second)
	k := Key(t)
	var mu sync.Mutex
	inside, last := 0, int64(0)
	var wg sync.WaitGroup
	for range 4 {
		l := s.open(t, s.be.URL)
		wg.Add(1)
		go func() {
			defer wg.Done()
			for range 10 {
				err := l.Do(ctx, k, func(ctx context.Context) error {
					tok := advlock.FenceToken(ctx)
					mu.Lock()
					inside++
					if inside > 1 {
						t.Errorf("two holders of %s at once", k)
					}
					if tok <= last {
						t.Errorf("token %d after %d", tok, last)
					}
					last = tok
					mu.Unlock()
					if term, ok := leaseTerm(t, obs, k); !ok || term != tok {
						t.Errorf("fn runs with token %d; the table holds %d (%v)", tok, term, ok)
					}
					mu.Lock()
					inside--
					mu.Unlock()
					return nil
				})
				if err != nil {
					t.Error(err)
					return
				}
			}
		}()
	}
	wg.Wait()
	if term, ok := leaseTerm(t, obs, k); ok {
		t.Errorf("a lease of term %d outlived every Do", term)
	}
}

// waitsAndRefusals: a second Locker's TryLock is refused, its Lock(Wait) is bounded, its Lock is granted once the
// holder lets go (a greater term); shared locks and an unbounded wait inside Do are refused with
// errors.ErrUnsupported, a bounded one is not.
func (s *leaseSuite) waitsAndRefusals(t *testing.T) {
	obs := pgtest.Conn(t, s.be.ObsURL)
	ctx := ctxT(t, 30*time.Second)
	a, b := s.open(t, s.be.URL), s.open(t, s.be.URL)
	k := Key(t)
	first, err := a.TryLock(ctx, k)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := b.TryLock(ctx, k); !errors.Is(err, advlock.ErrNotAcquired) {
		t.Fatalf("TryLock of a held lease: %v", err)
	}
	began := time.Now()
	if _, err := b.Lock(ctx, k, advlock.Wait(200*time.Millisecond)); !errors.Is(err, advlock.ErrNotAcquired) {
		t.Fatalf("Lock(Wait(200ms)) of a held lease: %v", err)
	} else if d := time.Since(began); d > 2*time.Second {
		t.Errorf("Lock(Wait(200ms)) returned after %v", d)
	}
	got := make(chan *advlock.Lock, 1)
	go func() {
		lk, err := b.Lock(ctx, k)
		if err != nil {
			t.Error(err)
		}
		got <- lk
	}()
	time.Sleep(50 * time.Millisecond)
	if err := first.Unlock(ctx); err != nil {
		t.Fatal(err)
	}
	second := <-got
	if second == nil {
		t.FailNow()
	}
	if term, ok := leaseTerm(t, obs, k); !ok || term != second.Token() || second.Token() <= first.Token() {
		t.Errorf("the waiter's token %d (first %d); the table holds %d (%v)", second.Token(), first.Token(), term, ok)
	}
	if err := second.Unlock(ctx); err != nil {
		t.Fatal(err)
	}
	if _, err := a.RLock(ctx, k); !errors.Is(err, errors.ErrUnsupported) {
		t.Errorf("RLock over leases: %v, want errors.ErrUnsupported", err)
	}
	if _, err := a.TryRLock(ctx, k); !errors.Is(err, errors.ErrUnsupported) {
		t.Errorf("TryRLock over leases: %v, want errors.ErrUnsupported", err)
	}
	// Do's ctx has no deadline here (ctx's would bound the wait); the inner key is free, so a wait that is not
	// refused is granted at once.
	err = a.Do(context.WithoutCancel(ctx), k, func(ctx context.Context) error {
		if lk, err := a.Lock(ctx, Key(t)); !errors.Is(err, errors.ErrUnsupported) {
			t.Errorf("an unbounded wait inside Do: %v, want errors.ErrUnsupported", err)
			if err == nil {
				_ = lk.Unlock(ctx)
			}
		}
		lk, err := a.Lock(ctx, Key(t), advlock.Wait(time.Second))
		if err != nil {
			return err
		}
		return lk.Unlock(ctx)
	})
	if err != nil {
		t.Errorf("a bounded wait inside Do: %v", err)
	}
}

// cancelRace: a waiter's ctx is cancelled at a random moment near the holder's release, again and again. When
// Lock returns an error the waiter holds nothing (no row of the key remains: a grant the cancel raced is deleted
// before Lock returns); when it returns a lock, the table holds that lock's term.
func (s *leaseSuite) cancelRace(t *testing.T) {
	obs := pgtest.Conn(t, s.be.ObsURL)
	ctx := ctxT(t, 60*time.Second)
	a, b := s.open(t, s.be.URL), s.open(t, s.be.URL)
	granted, cancelled := 0, 0
	for i := range 60 {
		k := Key(t)
		held, err := a.TryLock(ctx, k)
		if err != nil {
			t.Fatal(err)
		}
		wctx, cancel := context.WithCancel(ctx)
		res := make(chan error, 1)
		var lk *advlock.Lock
		go func() {
			var err error
			lk, err = b.Lock(wctx, k)
			res <- err
		}()
		time.Sleep(time.Duration(mrand.IntN(15)) * time.Millisecond)
		go func() { _ = held.Unlock(ctx) }()
		time.Sleep(time.Duration(mrand.IntN(20)) * time.Millisecond)
		cancel()
		err = <-res
		term, ok := leaseTerm(t, obs, k)
		switch {
		case err == nil:
			granted++
			if !ok || term != lk.Token() {
				t.Errorf("iteration %d: a granted waiter's token %d; the table holds %d (%v)", i, lk.Token(), term, ok)
			}
			_ = lk.Unlock(ctx)
		case ok && term != held.Token():
			t.Errorf("iteration %d: Lock returned %v, yet the table holds its grant of term %d", i, err, term)
		default:
			cancelled++
		}
	}
	t.Logf("%d waits granted, %d cancelled", granted, cancelled)
}

// brokenTold: a lease whose row is deleted (advlock break) is told lost at its holder's next renewal: Done
// closes, Err and Unlock match ErrLockLost.
func (s *leaseSuite) brokenTold(t *testing.T) {
	obs := pgtest.Conn(t, s.be.ObsURL)
	ctx := ctxT(t, 30*time.Second)
	l := s.open(t, s.be.URL)
	k := Key(t)
	lk, err := l.TryLock(ctx, k)
	if err != nil {
		t.Fatal(err)
	}
	if ok, err := advlock.BreakLease(ctx, obs, k, lk.Token()); err != nil || !ok {
		t.Fatalf("BreakLease: %v %v", ok, err)
	}
	waitDone(t, lk, leaseLength)
	if !errors.Is(lk.Err(), advlock.ErrLockLost) || !errors.Is(lk.Unlock(ctx), advlock.ErrLockLost) {
		t.Errorf("a broken lease: Err %v, want ErrLockLost", lk.Err())
	}
}

// cutOffToldFirst: a holder whose network goes silent (a blackhole between it and be.URL) is told of its loss
// before a waiter on another connection is granted the key, and that waiter's term is greater.
func (s *leaseSuite) cutOffToldFirst(t *testing.T) {
	ctx := ctxT(t, 30*time.Second)
	url, p := (&suite{be: s.be}).proxyURL(t)
	holder, waiter := s.open(t, url), s.open(t, s.be.URL)
	k := Key(t)
	lk, err := holder.TryLock(ctx, k)
	if err != nil {
		t.Fatal(err)
	}
	time.Sleep(time.Duration(mrand.IntN(600)) * time.Millisecond) // somewhere in the renewal cycle
	p.Blackhole(true)
	defer p.Blackhole(false)
	toldAt := make(chan time.Time, 1)
	go func() { <-lk.Done(); toldAt <- time.Now() }()
	got, err := waiter.Lock(ctx, k, advlock.Wait(5*leaseLength))
	if err != nil {
		t.Fatal(err)
	}
	defer got.Unlock(ctx)
	select {
	case <-toldAt:
	default:
		t.Fatal("the waiter was granted while the cut-off holder still trusted its lease")
	}
	if !errors.Is(lk.Err(), advlock.ErrLockLost) || got.Token() <= lk.Token() {
		t.Errorf("the holder's end %v; the waiter's token %d after %d", lk.Err(), got.Token(), lk.Token())
	}
}

// closeDuringWait: Close ends a polling wait with ErrClosed at once and deletes the leases the Locker held.
func (s *leaseSuite) closeDuringWait(t *testing.T) {
	obs := pgtest.Conn(t, s.be.ObsURL)
	ctx := ctxT(t, 30*time.Second)
	a, b := s.open(t, s.be.URL), s.open(t, s.be.URL)
	k, mine := Key(t), Key(t)
	if _, err := a.TryLock(ctx, k); err != nil {
		t.Fatal(err)
	}
	if _, err := b.TryLock(ctx, mine); err != nil {
		t.Fatal(err)
	}
	res := make(chan error, 1)
	go func() { _, err := b.Lock(ctx, k); res <- err }()
	time.Sleep(50 * time.Millisecond)
	began := time.Now()
	b.Close()
	select {
	case err := <-res:
		if !errors.Is(err, advlock.ErrClosed) {
			t.Errorf("a wait ended by Close: %v, want ErrClosed", err)
		}
	case <-time.After(5 * time.Second):
		t.Fatal("Close did not end the wait")
	}
	if d := time.Since(began); d > time.Second {
		t.Errorf("Close took %v", d)
	}
	if term, ok := leaseTerm(t, obs, mine); ok {
		t.Errorf("the closed Locker's lease (term %d) outlived Close", term)
	}
}
