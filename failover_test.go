package advlock

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/advlock/advlock/internal/pgcluster"
	"github.com/advlock/advlock/internal/session"
	"github.com/advlock/advlock/internal/testkit/faults"
	"github.com/advlock/advlock/internal/testkit/pgtest"
	"github.com/jackc/pgx/v5"
)

// pair is a private primary and a hot standby streaming from it through a fault proxy (repl), so that a test can
// make the standby lag or cut it off, then promote it.
type pair struct {
	primary, standby *pgcluster.Cluster
	repl             *faults.Proxy
}

func startPair(t *testing.T) *pair {
	t.Helper()
	p := pgtest.StartCluster(t, "wal_keep_size = '256MB'")
	repl := faults.Start(t, fmt.Sprintf("127.0.0.1:%d", p.Port))
	s, err := p.StandbyVia("127.0.0.1", repl.Port())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(s.Remove)
	fp := &pair{primary: p, standby: s, repl: repl}
	fp.caughtUp(t)
	return fp
}

// caughtUp waits until the standby has replayed everything the primary wrote so far.
func (fp *pair) caughtUp(t *testing.T) {
	t.Helper()
	ctx := ctxT(t, 30*time.Second)
	pc, sc := pgtest.Conn(t, fp.primary.URL), pgtest.Conn(t, fp.standby.URL)
	defer pc.Close(context.Background())
	defer sc.Close(context.Background())
	var lsn string
	if err := pc.QueryRow(ctx, "SELECT pg_current_wal_lsn()::text").Scan(&lsn); err != nil {
		t.Fatal(err)
	}
	for {
		var ok bool
		if err := sc.QueryRow(ctx, "SELECT coalesce(pg_last_wal_replay_lsn() >= $1::pg_lsn, false)", lsn).Scan(&ok); err != nil {
			t.Fatal(err)
		}
		if ok {
			return
		}
		if ctx.Err() != nil {
			t.Fatal("the standby did not catch up")
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// dsn reaches whichever of the two accepts writes: a multi-host connection string, as Patroni or RDS users write.
func (fp *pair) dsn() string {
	return fmt.Sprintf("host=127.0.0.1,127.0.0.1 port=%d,%d user=postgres dbname=postgres sslmode=disable "+
		"target_session_attrs=read-write connect_timeout=2", fp.primary.Port, fp.standby.Port)
}

func tokens(t *testing.T, ctx context.Context, l *Locker, n int) (first, last int64) {
	t.Helper()
	for i := range n {
		lk, err := l.TryLock(ctx, key(t))
		if err != nil {
			t.Fatal(err)
		}
		if i == 0 {
			first = lk.Token()
		}
		last = lk.Token()
		if err := lk.Unlock(ctx); err != nil {
			t.Fatal(err)
		}
	}
	return first, last
}

// Fencing tokens across promotions: the primary hands out tokens while its asynchronous standby is cut off (the
// standby's copy of the sequence lags, as after lost commits), the primary dies, the standby is promoted: its
// tokens are greater than every token of the old primary, although its sequence went back. Then a split brain: the
// old primary rebuilt as the standby of the new one and promoted while the new one keeps running: the one left
// behind hands out only tokens lower than the newest primary's, so a resource that checks them refuses its writes.
func TestFailoverTokens(t *testing.T) {
	if testing.Short() {
		t.Skip("starts a private primary and standby")
	}
	fp := startPair(t)
	ctx := ctxT(t, 2*time.Minute)
	onPrimary := New(pgtest.Pool(t, fp.primary.URL, nil), WithFencing())
	defer onPrimary.Close()
	tokens(t, ctx, onPrimary, 5) // the sequence exists, and the standby has it
	fp.caughtUp(t)

	fp.repl.Refuse(true) // the standby loses its primary: it lags from now on
	fp.repl.Cut()
	_, maxP := tokens(t, ctx, onPrimary, 120)
	onPrimary.Close()
	if err := fp.primary.Stop("immediate"); err != nil {
		t.Fatal(err)
	}
	if err := fp.standby.Promote(); err != nil {
		t.Fatal(err)
	}
	onNew := New(pgtest.Pool(t, fp.standby.URL, nil), WithFencing())
	defer onNew.Close()
	firstN, lastN := tokens(t, ctx, onNew, 5)
	tlP, seqP := session.TokenParts(maxP)
	tlN, seqN := session.TokenParts(firstN)
	t.Logf("old primary's last token %d (timeline %d, sequence %d); promoted standby's first %d (timeline %d, sequence %d)",
		maxP, tlP, seqP, firstN, tlN, seqN)
	if seqN > seqP {
		t.Fatalf("the promoted standby's sequence did not lag (%d after %d): the test did not lose the old primary's last values", seqN, seqP)
	}
	if firstN <= maxP {
		t.Errorf("the promoted standby's first token %d is not greater than the old primary's last %d", firstN, maxP)
	}
	if tlN != tlP+1 {
		t.Errorf("timeline %d after one promotion from %d", tlN, tlP)
	}

	// Split brain: the old primary comes back as the new one's standby, is promoted while the new one still runs.
	repl2 := faults.Start(t, fmt.Sprintf("127.0.0.1:%d", fp.standby.Port))
	if err := fp.primary.RebuildAsStandbyOf(fp.standby, "127.0.0.1", repl2.Port()); err != nil {
		t.Fatal(err)
	}
	onNew.Close()
	again := &pair{primary: fp.standby, standby: fp.primary, repl: repl2}
	again.caughtUp(t)
	if err := fp.primary.Promote(); err != nil {
		t.Fatal(err)
	}
	newest := New(pgtest.Pool(t, fp.primary.URL, nil), WithFencing())
	defer newest.Close()
	deposed := New(pgtest.Pool(t, fp.standby.URL, nil), WithFencing()) // still running, still a primary
	defer deposed.Close()
	firstNewest, _ := tokens(t, ctx, newest, 3)
	_, lastDeposed := tokens(t, ctx, deposed, 50)
	t.Logf("newest primary's first token %d (timeline %d); the deposed one's last %d (timeline %d)", firstNewest,
		firstNewest>>session.TokenSeqBits, lastDeposed, lastDeposed>>session.TokenSeqBits)
	if lastDeposed >= firstNewest || lastN >= firstNewest {
		t.Errorf("the deposed primary handed out %d, not lower than the newest primary's %d", lastDeposed, firstNewest)
	}

	// A resource that checks tokens (FenceSQL's advlock_fence, on a server of its own): the newest primary's holder
	// writes, then the deposed one's is refused.
	res := pgtest.Conn(t, pgtest.FreshDB(t, pgtest.URL(t)))
	defer res.Close(context.Background())
	if _, err := res.Exec(ctx, FenceSQL); err != nil {
		t.Fatal(err)
	}
	write := func(l *Locker) bool {
		lk, err := l.TryLock(ctx, key(t))
		if err != nil {
			t.Fatal(err)
		}
		defer lk.Unlock(ctx)
		var ok bool
		if err := res.QueryRow(ctx, "SELECT advlock_fence('the resource', $1)", lk.Token()).Scan(&ok); err != nil {
			t.Fatal(err)
		}
		return ok
	}
	if !write(newest) {
		t.Fatal("the newest primary's holder was refused")
	}
	if write(deposed) {
		t.Error("the deposed primary's holder was accepted after the newest one: its token was not lower")
	}
}

// Locks and leaders when the primary fails over, through a multi-host DSN (target_session_attrs=read-write):
// every holder on the old primary is told ErrLockLost; Lead campaigns go on (a campaign that meets the standby in
// recovery, or no primary at all, retries) and one leads again soon after the promotion, with a greater token; new
// calls reach the new primary; a Locker that reaches only the standby never gets a lock from it.
func TestFailoverLocksAndLeaders(t *testing.T) {
	if testing.Short() {
		t.Skip("starts a private primary and standby")
	}
	fp := startPair(t)
	ctx := ctxT(t, 2*time.Minute)
	var ls []*Locker
	for _, opts := range [][]Option{{WithFencing(), WithKeepalive(500 * time.Millisecond)},
		{WithFencing(), WithKeepalive(500 * time.Millisecond), WithSharedSessions(0)}} {
		l, err := Open(ctx, fp.dsn(), opts...)
		if err != nil {
			t.Fatal(err)
		}
		defer l.Close()
		ls = append(ls, l)
	}
	onStandby, err := Open(ctx, fp.standby.URL) // any session, as a DSN without target_session_attrs reaches it
	if err != nil {
		t.Fatal(err)
	}
	defer onStandby.Close()
	// Open never hands out a lock from a standby: a try on a shared session, a wait on a session of its own, a
	// Locker without shared sessions, and a transaction lock.
	ownOnStandby, err := Open(ctx, fp.standby.URL, WithSharedSessions(0))
	if err != nil {
		t.Fatal(err)
	}
	defer ownOnStandby.Close()
	for name, call := range map[string]func() error{
		"TryLock":                   func() error { _, err := onStandby.TryLock(ctx, key(t)); return err },
		"Lock":                      func() error { _, err := onStandby.Lock(ctx, key(t)); return err },
		"RLock":                     func() error { _, err := onStandby.RLock(ctx, key(t)); return err },
		"Lock, no shared sessions":  func() error { _, err := ownOnStandby.Lock(ctx, key(t)); return err },
		"TryLock, no shared":        func() error { _, err := ownOnStandby.TryLock(ctx, key(t)); return err },
		"Semaphore.Acquire":         func() error { _, err := onStandby.Semaphore("standby", 2).Acquire(ctx); return err },
		"DoTx (a transaction lock)": func() error { return onStandby.DoTx(ctx, key(t), func(context.Context, pgx.Tx) error { return nil }) },
	} {
		if err := call(); !errors.Is(err, ErrStandby) {
			t.Errorf("%s on the standby: %v, want ErrStandby", name, err)
		}
	}

	// Holders on the old primary: a shared session's lock, a session of its own, and a lock that waited.
	var held []*Lock
	for _, l := range ls {
		lk, err := l.TryLock(ctx, key(t))
		if err != nil {
			t.Fatal(err)
		}
		held = append(held, lk)
	}
	blocker, waited := key(t), (*Lock)(nil)
	bl, err := ls[0].TryLock(ctx, blocker)
	if err != nil {
		t.Fatal(err)
	}
	go func() { time.Sleep(300 * time.Millisecond); _ = bl.Unlock(ctx) }()
	if waited, err = ls[1].Lock(ctx, blocker); err != nil {
		t.Fatal(err)
	}
	held = append(held, waited)

	// Leaders: both Lockers campaign; a term records its start and token, and lasts until it is lost.
	type term struct {
		at    time.Time
		token int64
		l     int
	}
	terms := make(chan term, 16)
	lctx, stopLeading := context.WithCancel(ctx)
	var wg sync.WaitGroup
	for i, l := range ls {
		wg.Add(1)
		go func() {
			defer wg.Done()
			err := l.Lead(lctx, NameKey("failover-leader-"+t.Name()), func(ctx context.Context) error {
				terms <- term{time.Now(), FenceToken(ctx), i}
				<-ctx.Done()
				return nil
			})
			if !errors.Is(err, context.Canceled) {
				t.Errorf("Lead on Locker %d ended with %v", i, err)
			}
		}()
	}
	// A campaign that can only reach the standby: it retries while it is in recovery, and leads once promoted.
	wg.Add(1)
	standbyLed := make(chan time.Time, 1)
	go func() {
		defer wg.Done()
		err := onStandby.Lead(lctx, NameKey("failover-standby-"+t.Name()), func(ctx context.Context) error {
			standbyLed <- time.Now()
			<-ctx.Done()
			return nil
		})
		if !errors.Is(err, context.Canceled) {
			t.Errorf("Lead on the standby ended with %v", err)
		}
	}()
	var first term
	select {
	case first = <-terms:
	case <-time.After(30 * time.Second):
		t.Fatal("no leader within 30 s on a healthy primary")
	}

	time.Sleep(500 * time.Millisecond)
	if err := fp.primary.Stop("immediate"); err != nil {
		t.Fatal(err)
	}
	stopped := time.Now()
	for i, lk := range held {
		select {
		case <-lk.Done():
			if !errors.Is(lk.Err(), ErrLockLost) {
				t.Errorf("holder %d on the old primary: %v, want ErrLockLost", i, lk.Err())
			}
		case <-time.After(10 * time.Second):
			t.Fatalf("holder %d on the old primary was not told within 10 s", i)
		}
	}
	t.Logf("every holder on the old primary told %v after it stopped", time.Since(stopped).Round(time.Millisecond))
	time.Sleep(time.Second) // no primary at all for a while: campaigns keep trying
	select {
	case <-standbyLed:
		t.Fatal("a campaign led on a standby in recovery")
	default:
	}
	if st := onStandby.Stats(); st.CampaignRetries == 0 {
		t.Errorf("the standby's campaign did not retry: %+v", st)
	}
	promoting := time.Now()
	if err := fp.standby.Promote(); err != nil {
		t.Fatal(err)
	}
	promoted := time.Now()
	// The first term after the stop is the new primary's (with no primary, and a standby in recovery, nobody can
	// lead). It may start before pg_ctl promote returns: the server accepts writes a moment before.
	var next term
	for wait := time.After(30 * time.Second); !next.at.After(stopped); {
		select {
		case next = <-terms:
		case <-wait:
			t.Fatal("no leader within 30 s of the promotion")
		}
	}
	var standbyAt time.Time
	select {
	case standbyAt = <-standbyLed:
	case <-time.After(30 * time.Second):
		t.Fatal("the campaign that could only reach the standby did not lead within 30 s of its promotion")
	}
	if next.at.Before(promoting) {
		t.Errorf("a leader at %v, before the promotion began at %v, with no primary", next.at, promoting)
	}
	t.Logf("leader again %v after pg_ctl promote returned (it took %v; Locker %d, token %d after %d); the standby's campaign led %v after",
		next.at.Sub(promoted).Round(time.Millisecond), promoted.Sub(promoting).Round(time.Millisecond), next.l, next.token,
		first.token, standbyAt.Sub(promoted).Round(time.Millisecond))
	if next.token <= first.token {
		t.Errorf("the new leader's token %d is not greater than the old one's %d", next.token, first.token)
	}
	if d := next.at.Sub(promoted); d > 10*time.Second {
		t.Errorf("no leader until %v after the promotion", d)
	}
	// New calls reach the new primary.
	for i, l := range ls {
		lk, err := l.Lock(ctx, key(t))
		if err != nil {
			t.Fatalf("Locker %d after the failover: %v", i, err)
		}
		if lk.PID() == 0 {
			t.Errorf("Locker %d: a lock with no server pid", i)
		}
		_ = lk.Unlock(ctx)
	}
	stopLeading()
	wg.Wait()
}
