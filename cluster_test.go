package advlock

import (
	"context"
	"errors"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/advlock/advlock/internal/session"
	"github.com/advlock/advlock/internal/testkit/pgtest"
)

// Faults that need a server of their own: restarts, a standby, a full lock table, server-side timeouts.
func TestPrivateCluster(t *testing.T) {
	if testing.Short() {
		t.Skip("starts private PostgreSQL clusters")
	}
	c := pgtest.StartCluster(t, "max_locks_per_transaction = 10")
	obs := pgtest.Conn(t, c.URL)
	b := &bundle{url: c.URL, obs: obs}

	t.Run("standby refuses", func(t *testing.T) {
		s := pgtest.Standby(t, c)
		l := New(pgtest.Pool(t, s.URL, nil))
		defer l.Close()
		ctx := ctxT(t, 10*time.Second)
		k := key(t)
		for name, lock := range map[string]func(context.Context, Key) (*Lock, error){
			"TryLock":  func(ctx context.Context, k Key) (*Lock, error) { return l.TryLock(ctx, k) },
			"TryRLock": func(ctx context.Context, k Key) (*Lock, error) { return l.TryRLock(ctx, k) },
			"Lock":     func(ctx context.Context, k Key) (*Lock, error) { return l.Lock(ctx, k) },
			"RLock":    func(ctx context.Context, k Key) (*Lock, error) { return l.RLock(ctx, k) },
		} {
			if _, err := lock(ctx, k); !errors.Is(err, ErrStandby) {
				t.Errorf("%s on a standby: %v, want ErrStandby", name, err)
			}
		}
		// Lead on a standby is not ended: a standby may be promoted (a failover); it campaigns again and again.
		lctx, cancel := context.WithTimeout(ctx, 1500*time.Millisecond)
		err := l.Lead(lctx, k, func(context.Context) error { t.Error("led on a standby"); return nil })
		cancel()
		if !errors.Is(err, context.DeadlineExceeded) || l.Stats().CampaignRetries < 2 {
			t.Errorf("Lead on a standby for 1.5 s: %v after %d campaigns tried again, want its ctx's error after several", err, l.Stats().CampaignRetries)
		}
		rows, err := pgtest.Locks(ctx, pgtest.Conn(t, s.URL))
		if err != nil {
			t.Fatal(err)
		}
		if len(rows) != 0 {
			t.Errorf("standby holds advisory locks after refusing: %v", rows)
		}
		// A standby of a database that has never seen advlock has neither the fencing sequence nor the lease tables,
		// and cannot create them: that is said as ErrStandby too, not as the CREATE's error.
		for name, opt := range map[string]Option{"WithFencing": WithFencing(), "WithLeases": WithLeases()} {
			l := New(pgtest.Pool(t, s.URL, nil), opt)
			if _, err := l.TryLock(ctx, k); !errors.Is(err, ErrStandby) {
				t.Errorf("TryLock %s on a standby of a database without advlock's objects: %v, want ErrStandby", name, err)
			}
			l.Close()
		}
	})

	t.Run("role default timeouts do not cut a wait", func(t *testing.T) {
		ctx := ctxT(t, 20*time.Second)
		if _, err := obs.Exec(ctx, "ALTER ROLE postgres SET statement_timeout = '100ms'"); err != nil {
			t.Fatal(err)
		}
		if _, err := obs.Exec(ctx, "ALTER ROLE postgres SET lock_timeout = '100ms'"); err != nil {
			t.Fatal(err)
		}
		defer obs.Exec(context.Background(), "ALTER ROLE postgres RESET ALL")
		pool := pgtest.Pool(t, c.URL, nil)
		l := New(pool)
		defer l.Close()
		k := key(t)
		holder := New(pgtest.Pool(t, c.URL, nil))
		defer holder.Close()
		h, err := holder.TryLock(ctx, k)
		if err != nil {
			t.Fatal(err)
		}
		time.AfterFunc(600*time.Millisecond, func() { _ = h.Unlock(context.Background()) })
		lk, err := l.Lock(ctx, k)
		if err != nil {
			t.Fatalf("Lock waiting 600ms under a 100ms role statement_timeout: %v", err)
		}
		var st string
		if err := pool.QueryRow(ctx, "SHOW statement_timeout").Scan(&st); err != nil {
			t.Fatal(err)
		}
		if err := lk.Unlock(ctx); err != nil {
			t.Fatal(err)
		}
		// The pooled sessions keep the application's own setting.
		if err := pool.QueryRow(ctx, "SHOW statement_timeout").Scan(&st); err != nil || st != "100ms" {
			t.Errorf("pooled session statement_timeout = %q, %v; want the role's 100ms back", st, err)
		}
		pgtest.NoIdleLocks(t, pool, obs)
	})

	t.Run("lock table full", func(t *testing.T) {
		ctx := ctxT(t, 30*time.Second)
		pool := pgtest.Pool(t, c.URL, nil)
		l := New(pool)
		defer l.Close()
		// Warm the pool: while the table is full, new connections fail too.
		warm, err := l.TryLock(ctx, key(t))
		if err != nil {
			t.Fatal(err)
		}
		if err := warm.Unlock(ctx); err != nil {
			t.Fatal(err)
		}
		filler := pgtest.Conn(t, c.URL)
		_, err = filler.Exec(ctx, "SELECT pg_advisory_lock(g) FROM generate_series(1, 1000000) g")
		if errCode(err) != "53200" {
			t.Fatalf("filling the lock table: %v, want SQLSTATE 53200", err)
		}
		_, err = l.TryLock(ctx, key(t))
		if !errors.Is(err, ErrLockTableFull) || errCode(err) != "53200" || !strings.Contains(err.Error(), "max_locks_per_transaction") {
			t.Errorf("TryLock with the lock table full: %v, want ErrLockTableFull naming max_locks_per_transaction", err)
		}
		filler.Close(ctx)
		deadline := time.Now().Add(10 * time.Second)
		for {
			lk, err := l.TryLock(ctx, key(t))
			if err == nil {
				if err := lk.Unlock(ctx); err != nil {
					t.Fatal(err)
				}
				break
			}
			if time.Now().After(deadline) {
				t.Fatalf("lock table still full after the filler left: %v", err)
			}
			time.Sleep(20 * time.Millisecond)
		}
	})

	// Shared sessions filled by the Locker itself: batches of tries from many goroutines run into a full table;
	// only the try that found no space fails (ErrLockTableFull), every lock already held stays held, the rows after
	// it go out again, and everything unlocks cleanly afterwards. A refused try keeps nothing: with fencing too (the
	// token's transaction id needs lock-table space after the lock, which is then undone), its key is not held, and
	// another Locker takes it once there is space again.
	for _, fenced := range []bool{false, true} {
		name := "lock table full, shared sessions"
		opts := []Option{WithSharedSessions(2)}
		if fenced {
			name += ", fenced"
			opts = append(opts, WithFencing())
		}
		t.Run(name, func(t *testing.T) {
			ctx := ctxT(t, 60*time.Second)
			l := New(pgtest.Pool(t, c.URL, nil), opts...)
			defer l.Close()
			other := New(pgtest.Pool(t, c.URL, nil), opts...)
			defer other.Close()
			warm, err := other.TryLock(ctx, key(t)) // its shared session opens while there is space
			if err != nil {
				t.Fatal(err)
			}
			if err := warm.Unlock(ctx); err != nil {
				t.Fatal(err)
			}
			var mu sync.Mutex
			var held []*Lock
			var refused []Key
			var wg sync.WaitGroup
			for g := range 16 {
				wg.Add(1)
				go func() {
					defer wg.Done()
					for {
						k := key(t)
						try := l.TryLock
						if g%2 == 1 {
							try = l.TryRLock // shared mode too
						}
						lk, err := try(ctx, k)
						mu.Lock()
						if err == nil {
							held = append(held, lk)
							mu.Unlock()
							continue
						}
						mu.Unlock()
						if !errors.Is(err, ErrLockTableFull) {
							t.Errorf("TryLock filling the table: %v, want ErrLockTableFull", err)
						}
						mu.Lock()
						refused = append(refused, k)
						mu.Unlock()
						return
					}
				}()
			}
			wg.Wait()
			t.Logf("%d locks held when the table filled; %d calls refused", len(held), len(refused))
			if len(held) < 100 {
				t.Fatalf("only %d locks before the table filled", len(held))
			}
			for _, lk := range held[:20] { // reading pg_locks needs lock-table space too
				if err := lk.Unlock(ctx); err != nil {
					t.Fatal(err)
				}
			}
			held = held[20:]
			// A try refused after its key was granted (its test of the key's intent, or its line's flag, found no
			// space) is undone first in its shared session's next round trip, and its caller told once the undo is
			// answered: pg_locks, read once now, shows no refused key.
			rows, err := pgtest.Locks(ctx, obs)
			if err != nil {
				t.Fatal(err)
			}
			granted := 0
			for _, r := range rows {
				if r.Granted {
					granted++
				}
				for _, k := range refused {
					if v, _ := k.Int64(); r.Int64Key(v) {
						t.Errorf("pg_locks shows %s, whose TryLock failed with ErrLockTableFull: %v", k, r)
					}
				}
			}
			if granted != len(held) {
				t.Errorf("pg_locks shows %d granted advisory locks, the Locker holds %d", granted, len(held))
			}
			for _, lk := range held {
				if lk.Err() != nil {
					t.Fatalf("a held lock ended when the table filled: %v", lk.Err())
				}
			}
			for _, k := range refused { // another Locker (another process) takes a refused key
				lk, err := other.TryLock(ctx, k)
				if err != nil {
					t.Errorf("TryLock by another Locker of %s, refused earlier for lack of space: %v", k, err)
					continue
				}
				if err := lk.Unlock(ctx); err != nil {
					t.Fatal(err)
				}
			}
			for _, lk := range held {
				if err := lk.Unlock(ctx); err != nil {
					t.Fatal(err)
				}
			}
			lk, err := l.TryLock(ctx, key(t))
			if err != nil {
				t.Fatalf("TryLock after the table emptied: %v", err)
			}
			if err := lk.Unlock(ctx); err != nil {
				t.Fatal(err)
			}
		})
	}

	t.Run("idle_session_timeout", func(t *testing.T) {
		ctx := ctxT(t, 30*time.Second)
		if _, err := obs.Exec(ctx, "ALTER DATABASE postgres SET idle_session_timeout = '300ms'"); err != nil {
			t.Fatal(err)
		}
		defer obs.Exec(context.Background(), "ALTER DATABASE postgres RESET idle_session_timeout")
		// A session of its own from a plain pool keeps the application's settings: the server ends the idle holder;
		// its FATAL is seen at once.
		plain := New(pgtest.Pool(t, c.URL, nil), WithKeepalive(time.Minute), WithSharedSessions(0))
		defer plain.Close()
		lk, err := plain.TryLock(ctx, key(t))
		if err != nil {
			t.Fatal(err)
		}
		waitDone(t, lk, 10*time.Second)
		if !errors.Is(lk.Err(), ErrLockLost) || errCode(lk.Err()) != "57P05" {
			t.Errorf("Err = %v, want ErrLockLost wrapping SQLSTATE 57P05", lk.Err())
		}
		// A shared session is advlock's: it carries its own idle_session_timeout (3 keepalive intervals), so the
		// database's 300ms does not end it.
		sh := New(pgtest.Pool(t, c.URL, nil), WithKeepalive(time.Second))
		defer sh.Close()
		slk, err := sh.TryLock(ctx, key(t))
		if err != nil {
			t.Fatal(err)
		}
		select {
		case <-slk.Done():
			t.Fatalf("lock on a shared session lost: %v", slk.Err())
		case <-time.After(1500 * time.Millisecond):
		}
		if err := slk.Unlock(ctx); err != nil {
			t.Fatal(err)
		}
		// Open's sessions set it from the keepalive too: the lock survives well past the database's timeout.
		ol, err := Open(ctx, c.URL)
		if err != nil {
			t.Fatal(err)
		}
		defer ol.Close()
		lk, err = ol.TryLock(ctx, key(t))
		if err != nil {
			t.Fatal(err)
		}
		select {
		case <-lk.Done():
			t.Fatalf("lock taken through Open lost: %v", lk.Err())
		case <-time.After(1500 * time.Millisecond):
		}
		b.pidOf(t, lk)
		var app string
		if err := obs.QueryRow(ctx, "SELECT application_name FROM pg_stat_activity WHERE pid = $1", int32(b.pidOf(t, lk))).Scan(&app); err != nil || app != "advlock" {
			t.Errorf("application_name of an Open session = %q, %v; want advlock", app, err)
		}
		if err := lk.Unlock(ctx); err != nil {
			t.Fatal(err)
		}
	})

	t.Run("server restart", func(t *testing.T) {
		for _, mode := range []string{"fast", "immediate"} {
			ctx := ctxT(t, 60*time.Second)
			l, err := Open(ctx, c.URL, WithKeepalive(time.Minute))
			if err != nil {
				t.Fatal(err)
			}
			k := key(t)
			lk, err := l.TryLock(ctx, k)
			if err != nil {
				t.Fatal(err)
			}
			var wg sync.WaitGroup
			wg.Add(1)
			go func() {
				defer wg.Done()
				if err := c.Stop(mode); err != nil {
					t.Error(err)
				}
			}()
			waitDone(t, lk, 30*time.Second)
			if !errors.Is(lk.Err(), ErrLockLost) {
				t.Errorf("%s shutdown: Err = %v, want ErrLockLost", mode, lk.Err())
			}
			if mode == "fast" && errCode(lk.Err()) != "57P01" {
				t.Errorf("fast shutdown: Err = %v, want the server's FATAL 57P01", lk.Err())
			}
			wg.Wait()
			if err := c.Start(); err != nil {
				t.Fatal(err)
			}
			again, err := l.Lock(ctx, k)
			if err != nil {
				t.Fatalf("re-acquire after %s restart: %v", mode, err)
			}
			if err := again.Unlock(ctx); err != nil {
				t.Fatal(err)
			}
			l.Close()
		}
	})
}

// The server's deadlock error (only possible with transaction-scoped locks, several on one session) is
// translated to ErrDeadlock at the adapter boundary.
func TestDeadlockTranslated(t *testing.T) {
	url := pgtest.URL(t)
	ctx := ctxT(t, 20*time.Second)
	a, c := pgtest.Conn(t, url), pgtest.Conn(t, url)
	k1, k2 := key(t), key(t)
	v1, _ := k1.Int64()
	v2, _ := k2.Int64()
	ta, err := a.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	tc, err := c.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := ta.Exec(ctx, "SELECT pg_advisory_xact_lock($1)", v1); err != nil {
		t.Fatal(err)
	}
	if _, err := tc.Exec(ctx, "SELECT pg_advisory_xact_lock($1)", v2); err != nil {
		t.Fatal(err)
	}
	errs := make(chan error, 2)
	// Each side rolls back after its statement, so the survivor is granted once the victim's transaction ends.
	go func() {
		_, err := ta.Exec(ctx, "SELECT pg_advisory_xact_lock($1)", v2)
		_ = ta.Rollback(ctx)
		errs <- err
	}()
	go func() {
		_, err := tc.Exec(ctx, "SELECT pg_advisory_xact_lock($1)", v1)
		_ = tc.Rollback(ctx)
		errs <- err
	}()
	e1, e2 := <-errs, <-errs
	if errCode(e2) == "40P01" {
		e1, e2 = e2, e1
	}
	if errCode(e1) != "40P01" || e2 != nil {
		t.Fatalf("want one server deadlock and one success, got %v and %v", e1, e2)
	}
	if terr := session.TranslateErr(e1); !errors.Is(terr, ErrDeadlock) || errCode(terr) != "40P01" {
		t.Errorf("TranslateErr(%v) = %v, want ErrDeadlock keeping the PgError", e1, terr)
	}
}

// Fencing on a private cluster: the sequence is created on first use by a role that may; a role that may neither
// create nor use it gets ErrFencing saying what to run (and with leases ErrLeaseTable, until LeaseTableSQL ran);
// tokens go on growing across a clean restart and a crash.
func TestFencingCluster(t *testing.T) {
	if testing.Short() {
		t.Skip("starts a private PostgreSQL cluster")
	}
	c := pgtest.StartCluster(t) // of its own: it is restarted
	obs := pgtest.Conn(t, c.URL)
	{
		ctx := ctxT(t, 60*time.Second)
		if _, err := obs.Exec(ctx, "CREATE ROLE fenceweak LOGIN"); err != nil {
			t.Fatal(err)
		}
		weakURL := strings.Replace(c.URL, "postgres@", "fenceweak@", 1)
		weak := New(pgtest.Pool(t, weakURL, nil), WithFencing())
		defer weak.Close()
		_, err := weak.TryLock(ctx, key(t))
		if !errors.Is(err, ErrFencing) || !strings.Contains(err.Error(), "CREATE SEQUENCE public.advlock_fence") {
			t.Fatalf("fencing for a role that may not create the sequence: %v, want ErrFencing saying what to run", err)
		}
		admin := New(pgtest.Pool(t, c.URL, nil), WithFencing())
		defer admin.Close()
		lk, err := admin.TryLock(ctx, key(t))
		if err != nil {
			t.Fatalf("fencing for a role that may create the sequence: %v", err)
		}
		last := lk.Token()
		_ = lk.Unlock(ctx)
		_, err = weak.TryLock(ctx, key(t))
		if !errors.Is(err, ErrFencing) || !strings.Contains(err.Error(), "GRANT USAGE") {
			t.Fatalf("fencing for a role that may not use the sequence: %v, want ErrFencing naming GRANT USAGE", err)
		}
		if err := weak.Lead(ctx, key(t), func(context.Context) error { return nil }); !errors.Is(err, ErrFencing) {
			t.Fatalf("Lead for a role that may not use the sequence: %v, want it to end with ErrFencing", err)
		}
		if _, err := obs.Exec(ctx, "GRANT USAGE ON SEQUENCE public.advlock_fence TO fenceweak"); err != nil {
			t.Fatal(err)
		}
		// Leases: the role may not create the lease tables (ErrLeaseTable says what to run); once an admin ran
		// LeaseTableSQL and granted what it says, its leases work.
		leaser := New(pgtest.Pool(t, weakURL, nil), WithLeases())
		defer leaser.Close()
		if _, err := leaser.TryLock(ctx, key(t)); !errors.Is(err, ErrLeaseTable) || !strings.Contains(err.Error(), "LeaseTableSQL") {
			t.Fatalf("leases for a role that may not create their tables: %v, want ErrLeaseTable saying what to run", err)
		}
		if _, err := obs.Exec(ctx, LeaseTableSQL+"; GRANT SELECT, INSERT, UPDATE, DELETE ON public.advlock_lease, "+
			"public.advlock_lease_timeline, public.advlock_lease_wait TO fenceweak"); err != nil {
			t.Fatal(err)
		}
		// Each privilege leases need beyond those, asked for at the first call with what to run: UPDATE on the
		// sequence (the first grant after a crash moves it), then the table of restarts (every grant reads it).
		if _, err := leaser.TryLock(ctx, key(t)); !errors.Is(err, ErrFencing) || !strings.Contains(err.Error(), "GRANT USAGE, UPDATE ON SEQUENCE") {
			t.Fatalf("leases for a role with USAGE alone on the sequence: %v, want ErrFencing naming the GRANT", err)
		}
		if _, err := obs.Exec(ctx, "GRANT UPDATE ON SEQUENCE public.advlock_fence TO fenceweak"); err != nil {
			t.Fatal(err)
		}
		if _, err := leaser.TryLock(ctx, key(t)); !errors.Is(err, ErrLeaseTable) || !strings.Contains(err.Error(), "advlock_lease_restart") {
			t.Fatalf("leases for a role that may not use the table of restarts: %v, want ErrLeaseTable naming it", err)
		}
		if _, err := obs.Exec(ctx, "GRANT SELECT, INSERT, UPDATE, DELETE ON public.advlock_lease_restart TO fenceweak"); err != nil {
			t.Fatal(err)
		}
		if lk, err := leaser.TryLock(ctx, key(t)); err != nil {
			t.Fatalf("leases once LeaseTableSQL ran and the role was granted: %v", err)
		} else {
			_ = lk.Unlock(ctx)
		}
		// A schema hardened against PUBLIC: the role may not even look at public. That too is for an operator.
		if _, err := obs.Exec(ctx, "REVOKE ALL ON SCHEMA public FROM PUBLIC"); err != nil {
			t.Fatal(err)
		}
		hardened := New(pgtest.Pool(t, weakURL, nil), WithFencing())
		if _, err := hardened.TryLock(ctx, key(t)); !errors.Is(err, ErrFencing) || !strings.Contains(err.Error(), "GRANT USAGE ON SCHEMA public") {
			t.Errorf("fencing for a role that may not use schema public: %v, want ErrFencing naming GRANT USAGE ON SCHEMA", err)
		}
		hardened.Close()
		// Inspect by that role, inside its transaction, with the lease tables there but out of its reach: the
		// session locks are listed, no lease, and the transaction goes on.
		wc := pgtest.Conn(t, weakURL)
		tx, err := wc.Begin(ctx)
		if err != nil {
			t.Fatal(err)
		}
		if _, err := Inspect(ctx, tx); err != nil {
			t.Errorf("Inspect by a role that may not use schema public: %v", err)
		}
		if _, err := tx.Exec(ctx, "SELECT 1"); err != nil {
			t.Errorf("the transaction Inspect read in: %v", err)
		}
		_ = tx.Rollback(ctx)
		if _, err := obs.Exec(ctx, "GRANT USAGE ON SCHEMA public TO PUBLIC"); err != nil {
			t.Fatal(err)
		}
		// A server that revoked pg_logical_emit_message, which a grant needs to flush the WAL covering its token
		// when the server has WAL not yet flushed: an operator's fix too, said at the first fenced lock.
		const emit = "FUNCTION pg_catalog.pg_logical_emit_message(boolean, text, text)"
		if _, err := obs.Exec(ctx, "REVOKE EXECUTE ON "+emit+" FROM PUBLIC"); err != nil {
			t.Fatal(err)
		}
		noEmit := New(pgtest.Pool(t, weakURL, nil), WithFencing())
		if _, err := noEmit.TryLock(ctx, key(t)); !errors.Is(err, ErrFencing) || !strings.Contains(err.Error(), "GRANT EXECUTE ON "+emit) {
			t.Errorf("fencing for a role that may not execute pg_logical_emit_message: %v, want ErrFencing naming the GRANT", err)
		}
		noEmit.Close()
		if _, err := obs.Exec(ctx, "GRANT EXECUTE ON "+emit+" TO PUBLIC"); err != nil {
			t.Fatal(err)
		}
		for _, step := range []string{"granted", "fast", "immediate"} {
			if step != "granted" {
				if err := c.Restart(step); err != nil {
					t.Fatal(err)
				}
			}
			for _, l := range []*Locker{weak, admin} {
				var lk *Lock
				var err error
				for deadline := time.Now().Add(10 * time.Second); ; time.Sleep(50 * time.Millisecond) {
					if lk, err = l.TryLock(ctx, key(t)); err == nil || time.Now().After(deadline) {
						break // (right after a restart the pools' old connections fail once)
					}
				}
				if err != nil {
					t.Fatalf("%s: %v", step, err)
				}
				if lk.Token() <= last {
					t.Fatalf("after %s: token %d, want more than %d", step, lk.Token(), last)
				}
				last = lk.Token()
				_ = lk.Unlock(ctx)
			}
		}
	}

	// A synchronous standby that is down (synchronous_standby_names names one that is not connected) makes every
	// commit that wrote WAL with synchronous_commit = on wait for it. A fenced grant commits (its token must survive
	// a crash; nextval writes WAL once every 32 values) but only locally: it does not wait, the grant goes through, and the locks already held on a shared session are
	// not lost to a round trip stalled past its bound.
	t.Run("synchronous standby down", func(t *testing.T) {
		ctx := ctxT(t, 60*time.Second)
		obs := pgtest.Conn(t, c.URL) // the server restarted since the other one connected
		for _, shared := range []int{4, 0} {
			l := New(pgtest.Pool(t, c.URL, nil), WithFencing(), WithKeepalive(500*time.Millisecond), WithSharedSessions(shared))
			defer l.Close()
			held, err := l.TryLock(ctx, key(t))
			if err != nil {
				t.Fatal(err)
			}
			if _, err := obs.Exec(ctx, "ALTER SYSTEM SET synchronous_standby_names = 'nobody'"); err != nil {
				t.Fatal(err)
			}
			if _, err := obs.Exec(ctx, "SELECT pg_reload_conf()"); err != nil {
				t.Fatal(err)
			}
			time.Sleep(200 * time.Millisecond) // the backends read the new configuration
			for i := range 40 {                // nextval writes WAL (and so waits for a commit) once every 32 values
				lk, err := l.TryLock(ctx, key(t))
				if err != nil {
					t.Fatalf("shared sessions %d: fenced TryLock %d with the synchronous standby down: %v", shared, i, err)
				}
				if lk.Token() <= held.Token() {
					t.Errorf("token %d after %d", lk.Token(), held.Token())
				}
				if err := lk.Unlock(ctx); err != nil {
					t.Fatal(err)
				}
			}
			if held.Err() != nil {
				t.Errorf("shared sessions %d: a lock held before lost: %v", shared, held.Err())
			}
			if _, err := obs.Exec(ctx, "ALTER SYSTEM RESET synchronous_standby_names"); err != nil {
				t.Fatal(err)
			}
			if _, err := obs.Exec(ctx, "SELECT pg_reload_conf()"); err != nil {
				t.Fatal(err)
			}
			if err := held.Unlock(ctx); err != nil {
				t.Fatal(err)
			}
			l.Close()
		}
	})

	// A fenced grant takes a transaction id only when its nextval logs the sequence (once in 32 values): the others
	// commit nothing that needs one. Every grant took one before (txid_current in the grant's statement): a fleet at
	// 1,000 fenced grants a second consumed 86 million transaction ids a day, all to be frozen by VACUUM. Counted on
	// this cluster of its own, where nothing else consumes them.
	t.Run("transaction ids", func(t *testing.T) {
		ctx := ctxT(t, 60*time.Second)
		obs := pgtest.Conn(t, c.URL)
		for _, shared := range []int{4, 0} {
			l := New(pgtest.Pool(t, c.URL, nil), WithFencing(), WithSharedSessions(shared))
			defer l.Close()
			var before, after int64
			if err := obs.QueryRow(ctx, "SELECT txid_current()").Scan(&before); err != nil {
				t.Fatal(err)
			}
			const grants = 640
			for range grants {
				lk, err := l.TryLock(ctx, key(t))
				if err != nil {
					t.Fatal(err)
				}
				if err := lk.Unlock(ctx); err != nil {
					t.Fatal(err)
				}
			}
			if err := obs.QueryRow(ctx, "SELECT txid_current()").Scan(&after); err != nil {
				t.Fatal(err)
			}
			used := after - before - 1
			t.Logf("shared sessions %d: %d transaction ids for %d fenced grants", shared, used, grants)
			if used > grants/32+4 { // one per logged nextval, and a few for the fence check of a new Locker
				t.Errorf("shared sessions %d: %d transaction ids for %d fenced grants, want about %d", shared, used, grants, grants/32)
			}
			// From 16 goroutines at once, a grant often finds WAL not yet flushed (another's logging nextval not
			// committed yet) and flushes it, taking a transaction id: more, but still fewer than one per grant.
			if err := obs.QueryRow(ctx, "SELECT txid_current()").Scan(&before); err != nil {
				t.Fatal(err)
			}
			var wg sync.WaitGroup
			for range 16 {
				wg.Add(1)
				go func() {
					defer wg.Done()
					for range grants / 16 * 5 {
						lk, err := l.TryLock(ctx, key(t))
						if err != nil {
							t.Error(err)
							return
						}
						_ = lk.Unlock(ctx)
					}
				}()
			}
			wg.Wait()
			if err := obs.QueryRow(ctx, "SELECT txid_current()").Scan(&after); err != nil {
				t.Fatal(err)
			}
			used = after - before - 1
			t.Logf("shared sessions %d: %d transaction ids for %d fenced grants from 16 goroutines", shared, used, grants*5)
			if used >= grants*5 {
				t.Errorf("shared sessions %d: %d transaction ids for %d concurrent fenced grants: one per grant", shared, used, grants*5)
			}
			l.Close()
		}
	})
}
