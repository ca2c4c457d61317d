package advlock

import (
	"bufio"
	"context"
	"fmt"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/advlock/advlock/internal/lease"
	"github.com/advlock/advlock/internal/testkit/pgtest"
	"github.com/jackc/pgx/v5"
)

// sweepHolderEnv makes the test binary a process that holds leases and waits for others (sweepHolder), to be
// SIGKILLed by TestLeaseSweep: "URL BASE N WAITBASE M".
const sweepHolderEnv = "ADVLOCK_TEST_SWEEP_HOLDER"

// sweepHolder takes N leases of keys BASE.., waits for M keys WAITBASE.. (held by its parent), says "ready" once
// its waits are queued, and then does nothing until it is killed.
func sweepHolder(spec string) {
	f := strings.Fields(spec)
	base, _ := strconv.ParseInt(f[1], 10, 64)
	n, _ := strconv.Atoi(f[2])
	wbase, _ := strconv.ParseInt(f[3], 10, 64)
	m, _ := strconv.Atoi(f[4])
	ctx := context.Background()
	l, err := Open(ctx, f[0], WithLeases(), WithLeaseLength(1500*time.Millisecond), WithLeaseHolder("sweep-holder"))
	if err != nil {
		fmt.Println("open:", err)
		os.Exit(1)
	}
	for i := range n {
		if _, err := l.TryLock(ctx, Int64Key(base+int64(i))); err != nil {
			fmt.Println("trylock:", err)
			os.Exit(1)
		}
	}
	for i := range m {
		go func() { _, _ = l.Lock(ctx, Int64Key(wbase+int64(i))) }()
	}
	fmt.Println("ready")
	select {}
}

// startSweepHolder starts a sweepHolder process and waits for its "ready"; it is killed when the test ends.
func startSweepHolder(t *testing.T, url string, base int64, n int, wbase int64, m int) *exec.Cmd {
	t.Helper()
	cmd := exec.Command(os.Args[0], "-test.run=^$")
	cmd.Env = append(os.Environ(), fmt.Sprintf("%s=%s %d %d %d %d", sweepHolderEnv, url, base, n, wbase, m))
	out, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = cmd.Process.Kill(); _ = cmd.Wait() })
	if line, err := bufio.NewReader(out).ReadString('\n'); err != nil || line != "ready\n" {
		t.Fatalf("the holder said %q (%v)", line, err)
	}
	return cmd
}

// untilGone polls rows (the dead holder's leases and waits in the tables) until both are 0, and returns how long
// each took; it fails the test after limit.
func untilGone(t *testing.T, rows func() (leases, waits int), limit time.Duration, since string) (leasesGone, waitsGone time.Duration) {
	t.Helper()
	start := time.Now()
	for leasesGone == 0 || waitsGone == 0 {
		a, b := rows()
		if a == 0 && leasesGone == 0 {
			leasesGone = time.Since(start)
		}
		if b == 0 && waitsGone == 0 {
			waitsGone = time.Since(start)
		}
		if time.Since(start) > limit {
			t.Fatalf("%v %s: %d of the dead holder's leases and %d of its waits left", limit, since, a, b)
		}
		time.Sleep(50 * time.Millisecond)
	}
	return leasesGone, waitsGone
}

// The rows dead holders and dead waiters leave are deleted, and nothing else: a process holding 20 leases (of
// 1.5 s) and waiting for 5 keys is SIGKILLed; the sweep of a Locker that holds those 5 keys deletes its 20 leases
// and its 5 waits, while the Locker's own 5 leases stay held, renewed, their rows and terms unchanged. The server
// says so (the tables), not the Lockers.
func TestLeaseSweep(t *testing.T) {
	t.Parallel()
	url := pgtest.FreshDB(t, pgtest.URL(t))
	obs := pgtest.Conn(t, url)
	ctx := ctxT(t, 2*time.Minute)
	const length = 1500 * time.Millisecond
	l := New(pgtest.Pool(t, url, nil), WithLeases(), WithLeaseLength(length))
	defer l.Close()
	base := int64(time.Now().UnixNano() & (1<<40 - 1))
	const n, m = 20, 5
	wbase := base + 1000
	var mine []*Lock
	terms := map[int64]int64{}
	for i := range m {
		lk, err := l.TryLock(ctx, Int64Key(wbase+int64(i)))
		if err != nil {
			t.Fatal(err)
		}
		mine = append(mine, lk)
		terms[wbase+int64(i)] = lk.Token()
	}
	cmd := startSweepHolder(t, url, base, n, wbase, m)
	held := func() (leases, waits int) {
		t.Helper()
		if err := obs.QueryRow(ctx, "SELECT (SELECT count(*) FROM "+lease.Table+" WHERE holder LIKE '%sweep-holder'), "+
			"(SELECT count(*) FROM "+lease.Waits+" WHERE holder LIKE '%sweep-holder')").Scan(&leases, &waits); err != nil {
			t.Fatal(err)
		}
		return leases, waits
	}
	for deadline := time.Now().Add(20 * time.Second); ; time.Sleep(20 * time.Millisecond) {
		if a, b := held(); a == n && b == m {
			break
		} else if time.Now().After(deadline) {
			t.Fatalf("the holder's rows: %d leases, %d waits; want %d and %d", a, b, n, m)
		}
	}
	if err := cmd.Process.Kill(); err != nil {
		t.Fatal(err)
	}
	_ = cmd.Wait()
	leasesGone, waitsGone := untilGone(t, held, 60*time.Second, "after the holder's SIGKILL")
	t.Logf("after the SIGKILL, the dead holder's %d leases were gone in %v, its %d waits in %v (lease length %v)",
		n, leasesGone.Round(10*time.Millisecond), m, waitsGone.Round(10*time.Millisecond), length)
	for _, lk := range mine {
		v, _ := lk.Key().Int64()
		if err := lk.Err(); err != nil {
			t.Errorf("a live lease of %d ended: %v", v, err)
		}
		var term int64
		if err := obs.QueryRow(ctx, "SELECT term FROM "+lease.Table+" WHERE space = 1 AND key = $1", v).Scan(&term); err != nil || term != terms[v] {
			t.Errorf("a live lease's row of %d: term %d (%v), want %d", v, term, err, terms[v])
		}
	}
	for _, lk := range mine {
		if err := lk.Unlock(ctx); err != nil {
			t.Error(err)
		}
	}
	var rows int
	if err := obs.QueryRow(ctx, "SELECT (SELECT count(*) FROM "+lease.Table+") + (SELECT count(*) FROM "+lease.Waits+")").Scan(&rows); err != nil || rows != 0 {
		t.Errorf("rows left in the lease tables: %d (%v)", rows, err)
	}
}

// A dead holder's rows are deleted a lease length after the sweep first read them, whatever the server's clock
// says, and however many rows the tables hold. The tables hold, in key order: 2,100 leases whose owner says 60 s (a
// holder that may still trust them: more than a read covers, 2,000 rows of each table), then 2,496 leases of a dead
// holder whose owner says 1 s, and the live leases of two Lockers of 1.5 s among them; all of them expire an hour away
// on the server's clock (as after the server's clock stepped back an hour); 2,500 waits seen an hour ahead; and a
// rows no Locker made, whose expiries are infinity, -infinity, and years 20000 and 294270 (past what extract's
// microseconds fit in an int8), the last three with an owner that says 500 ms. The sweep deletes every dead lease
// and wait, and nothing else: the 60 s leases stay, and so do the live ones, with their terms, though each Locker
// reads the other's at every sweep, and the four rows at times no Locker writes. The server says so (the tables).
func TestLeaseSweepReadsEveryRow(t *testing.T) {
	t.Parallel()
	url := pgtest.FreshDB(t, pgtest.URL(t))
	obs := pgtest.Conn(t, url)
	ctx := ctxT(t, 2*time.Minute)
	const length = 1500 * time.Millisecond
	l := New(pgtest.Pool(t, url, nil), WithLeases(), WithLeaseLength(length))
	defer l.Close()
	other := New(pgtest.Pool(t, url, nil), WithLeases(), WithLeaseLength(length), WithLeaseHolder("sweep-other"))
	defer other.Close()
	const long, dead = 2100, 2500
	terms := map[int64]int64{}
	var live []*Lock
	for i, lk := range []*Locker{l, other, l, other} {
		k := int64(long + dead/2 + i) // among the dead rows' keys, and so in the pages read
		lock, err := lk.TryLock(ctx, Int64Key(k))
		if err != nil {
			t.Fatal(err)
		}
		live = append(live, lock)
		terms[k] = lock.Token()
	}
	if _, err := obs.Exec(ctx, "INSERT INTO "+lease.Table+" (space, key, owner, term, expires, holder) "+
		"SELECT 1, k, 'a11ea11ea11ea11e' || lpad(to_hex(k), 16, '0') || '/60000', k, clock_timestamp() + interval '1 hour', "+
		"'sweep-long' FROM generate_series(0, $1 - 1) AS k", long); err != nil {
		t.Fatal(err)
	}
	if _, err := obs.Exec(ctx, "INSERT INTO "+lease.Table+" (space, key, owner, term, expires, holder) "+
		"VALUES (1, -1, 'by hand', 1, 'infinity', 'sweep-long'), (1, -2, 'by hand/500', 2, '-infinity', 'sweep-long'), "+
		"(1, -3, 'by hand/500', 3, '20000-01-01 00:00:00+00', 'sweep-long'), (1, -4, 'by hand/500', 4, '294270-01-01 00:00:00+00', 'sweep-long')"); err != nil {
		t.Fatal(err)
	}
	if _, err := obs.Exec(ctx, "INSERT INTO "+lease.Table+" (space, key, owner, term, expires, holder) "+
		"SELECT 1, k, 'dead0000dead0000' || lpad(to_hex(k), 16, '0') || '/1000', k, clock_timestamp() + interval '1 hour', "+
		"'sweep-dead' FROM generate_series($1::int8, $1::int8 + $2::int8 - 1) AS k WHERE k NOT BETWEEN $1::int8 + $2::int8 / 2 AND $1::int8 + $2::int8 / 2 + 3", long, dead); err != nil {
		t.Fatal(err)
	}
	if _, err := obs.Exec(ctx, "INSERT INTO "+lease.Waits+" (space, key, waiter, since, seen, holder) "+
		"SELECT 1, k, 'dead0000dead0000' || lpad(to_hex(k), 16, '0'), clock_timestamp(), clock_timestamp() + interval '1 hour', "+
		"'sweep-dead' FROM generate_series(0, $1 - 1) AS k", dead); err != nil {
		t.Fatal(err)
	}
	left := deadLeft(t, ctx, obs)
	leasesGone, waitsGone := untilGone(t, left, 90*time.Second, "after the rows were written")
	t.Logf("%d dead leases (owner's length 1 s, expiry an hour away) gone in %v, %d dead waits in %v (lease length %v)",
		dead-4, leasesGone.Round(10*time.Millisecond), dead, waitsGone.Round(10*time.Millisecond), length)
	for _, lk := range live {
		v, _ := lk.Key().Int64()
		if err := lk.Err(); err != nil {
			t.Errorf("a live lease of %d ended: %v", v, err)
		}
		var term int64
		if err := obs.QueryRow(ctx, "SELECT term FROM "+lease.Table+" WHERE space = 1 AND key = $1", v).Scan(&term); err != nil || term != terms[v] {
			t.Errorf("a live lease's row of %d: term %d (%v), want %d", v, term, err, terms[v])
		}
		if err := lk.Unlock(ctx); err != nil {
			t.Error(err)
		}
	}
	var kept int
	if err := obs.QueryRow(ctx, "SELECT count(*) FROM "+lease.Table+" WHERE holder = 'sweep-long'").Scan(&kept); err != nil || kept != long+4 {
		t.Errorf("%d of the %d leases whose owner says 60 s and the 4 rows at times no Locker writes are left (%v)", kept, long+4, err)
	}
}

// turnsWindow waits until the Lockers of ls that are alive hold want turns, each turn by one of them, then counts,
// over 8 sweep periods of a lease of length, which of them read rows and how many turns they took; it checks that
// the server's beats of both turns moved meanwhile.
func turnsWindow(t *testing.T, ctx context.Context, obs *pgx.Conn, what string, ls []*Locker, alive map[int]bool, want int,
	length time.Duration) (sweepers, readers []int, taken int64) {
	t.Helper()
	beats := func() string {
		t.Helper()
		var s string
		if err := obs.QueryRow(ctx, "SELECT coalesce(string_agg(timeline || '=' || since, ' ' ORDER BY timeline), '') FROM "+
			lease.Timelines+" WHERE timeline < 0").Scan(&s); err != nil {
			t.Fatal(err)
		}
		return s
	}
	for deadline := time.Now().Add(60 * time.Second); ; time.Sleep(50 * time.Millisecond) {
		held := map[int]int{}
		sweepers = sweepers[:0]
		for i := range alive {
			if turn := ls[i].leases.SweepStats().Turn; turn != 0 {
				held[turn]++
				sweepers = append(sweepers, i)
			}
		}
		if len(held) == want && len(sweepers) == want && strings.Count(beats(), "=") == lease.Turns {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("%s: the turns held by the Lockers alive: %v (Lockers %v), want %d, each by one; the server's beats: %s",
				what, held, sweepers, want, beats())
		}
	}
	before := map[int]lease.SweepStats{}
	for i := range alive {
		before[i] = ls[i].leases.SweepStats()
	}
	was := beats()
	time.Sleep(8 * length / 3)
	for i := range alive {
		after := ls[i].leases.SweepStats()
		if after.Reads > before[i].Reads {
			readers = append(readers, i)
		}
		taken += after.Taken - before[i].Taken
	}
	now := beats()
	t.Logf("%s: Lockers %v hold the turns; over 8 periods, Lockers %v read rows, %d turns were taken; beats %s", what,
		sweepers, readers, taken, now)
	if now == was || strings.Count(now, "=") != lease.Turns {
		t.Fatalf("%s: the server's beats %q, then %q over 8 periods: want both turns' rows, moved on", what, was, now)
	}
	return sweepers, readers, taken
}

// Of the Lockers of leases that share a database, two sweep (read and keep the other Lockers' rows) at a time, not
// every one: five Lockers of 1.5 s leases (a sweep every 0.5 s or less) start at once in a database that has never
// seen a sweep, and over the next 8 periods no more Lockers read rows than the two turns and the turns taken
// meanwhile, and at most 2 turns are taken (a sweeper held up for 2 periods loses its turn: on a loaded machine,
// that may happen); the beats of both turns move on the server. Both sweepers are closed, one after the other (each
// gives its turn back): two of the three others take the turns, and delete the rows of a holder that is gone (50
// leases and 20 waits written by hand, of an owner that says 1 s, expiring an hour away on the server's clock),
// while every live lease keeps its row and its term. The server says so (the tables), and each Locker's count of
// its reads says who swept.
func TestLeaseSweepTurns(t *testing.T) {
	t.Parallel()
	url := pgtest.FreshDB(t, pgtest.URL(t))
	obs := pgtest.Conn(t, url)
	ctx := ctxT(t, 3*time.Minute)
	const length = 1500 * time.Millisecond
	ls := make([]*Locker, 5)
	for i := range ls {
		ls[i] = New(pgtest.Pool(t, url, nil), WithLeases(), WithLeaseLength(length))
		defer ls[i].Close()
	}
	locks, terms := lockEach(t, ctx, ls, 1000)
	alive := map[int]bool{0: true, 1: true, 2: true, 3: true, 4: true}
	sweepers, readers, taken := turnsWindow(t, ctx, obs, "five Lockers started at once", ls, alive, lease.Turns, length)
	if len(readers) == 0 || int64(len(readers)) > lease.Turns+taken || taken > 2 {
		t.Fatalf("%d Lockers read rows over 8 periods, with %d turns taken; want 1 to %d, and at most 2 taken", len(readers), taken, lease.Turns+taken)
	}
	for _, i := range sweepers {
		ls[i].Close()
		delete(alive, i)
		delete(terms, int64(1000+i))
	}
	turnsWindow(t, ctx, obs, "both sweepers closed", ls, alive, lease.Turns, length)
	deadRowsGone(t, ctx, obs, "with both first sweepers closed")
	liveKept(t, ctx, obs, terms, locks, alive)
}

// Two sweepers that die (SIGKILL: they give nothing back) leave their turns to the Lockers alive, which take them
// from the dead (the beats they saw unchanged for two periods) and delete the dead's rows: two processes, each of a
// Locker of 1.5 s leases holding 20, take both turns in a fresh database; three Lockers of this process start
// beside them, and over 8 periods take no turn and read no row (unless a sweeper was held up: at most the turns
// taken); both processes are SIGKILLed; two of the three take the turns, each turn the dead held from a sweeper
// (not a turn given back), and delete the 40 dead leases, while their own leases keep their rows and terms. Before
// the turns are taken, nothing sweeps.
func TestLeaseSweepTurnsOfTheDead(t *testing.T) {
	t.Parallel()
	url := pgtest.FreshDB(t, pgtest.URL(t))
	obs := pgtest.Conn(t, url)
	ctx := ctxT(t, 3*time.Minute)
	const length = 1500 * time.Millisecond
	var holders []*exec.Cmd
	for i := range 2 {
		holders = append(holders, startSweepHolder(t, url, int64(100*i), 20, 0, 0))
	}
	for deadline := time.Now().Add(60 * time.Second); ; time.Sleep(50 * time.Millisecond) {
		var n int
		if err := obs.QueryRow(ctx, "SELECT count(*) FROM "+lease.Timelines+" WHERE timeline < 0").Scan(&n); err != nil {
			t.Fatal(err)
		}
		if n == lease.Turns {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("the two holders' processes hold %d turns after 60 s, want %d", n, lease.Turns)
		}
	}
	ls := make([]*Locker, 3)
	for i := range ls {
		ls[i] = New(pgtest.Pool(t, url, nil), WithLeases(), WithLeaseLength(length))
		defer ls[i].Close()
	}
	locks, terms := lockEach(t, ctx, ls, 1000)
	alive := map[int]bool{0: true, 1: true, 2: true}
	_, readers, taken := turnsWindow(t, ctx, obs, "the turns held by two other processes", ls, alive, 0, length)
	if int64(len(readers)) > taken || taken > 2 {
		t.Fatalf("%d Lockers of this process read rows while two other processes held the turns, with %d turns taken", len(readers), taken)
	}
	before, theirs := int64(0), int64(lease.Turns) // the turns the two processes hold as they are killed
	for i := range ls {
		before += ls[i].leases.SweepStats().Taken
		if ls[i].leases.SweepStats().Turn != 0 {
			theirs-- // taken from one held up in the window above
		}
	}
	for _, cmd := range holders {
		if err := cmd.Process.Kill(); err != nil {
			t.Fatal(err)
		}
		_ = cmd.Wait()
	}
	held := func() (leases, waits int) {
		t.Helper()
		if err := obs.QueryRow(ctx, "SELECT count(*) FROM "+lease.Table+" WHERE holder LIKE '%sweep-holder'").Scan(&leases); err != nil {
			t.Fatal(err)
		}
		return leases, 0
	}
	leasesGone, _ := untilGone(t, held, 60*time.Second, "after both sweepers' SIGKILL")
	t.Logf("the two dead sweepers' 40 leases went %v after their SIGKILL", leasesGone.Round(10*time.Millisecond))
	turnsWindow(t, ctx, obs, "both sweepers SIGKILLed", ls, alive, lease.Turns, length)
	after := int64(0)
	for i := range ls {
		after += ls[i].leases.SweepStats().Taken
	}
	if after-before < theirs {
		t.Fatalf("the turns of the two SIGKILLed sweepers: %d taken from a sweeper, want %d", after-before, theirs)
	}
	liveKept(t, ctx, obs, terms, locks, alive)
}

// lockEach has each Locker of ls take a lease of key base+i, all at once, and returns the locks and their terms.
func lockEach(t *testing.T, ctx context.Context, ls []*Locker, base int64) ([]*Lock, map[int64]int64) {
	t.Helper()
	locks := make([]*Lock, len(ls))
	errs := make(chan error, len(ls))
	for i, l := range ls {
		go func() {
			var err error
			locks[i], err = l.TryLock(ctx, Int64Key(base+int64(i)))
			errs <- err
		}()
	}
	for range ls {
		if err := <-errs; err != nil {
			t.Fatal(err)
		}
	}
	terms := map[int64]int64{}
	for _, lk := range locks {
		v, _ := lk.Key().Int64()
		terms[v] = lk.Token()
	}
	return locks, terms
}

// deadRowsGone writes the rows of a holder that is gone (50 leases and 20 waits of an owner that says 1 s, expiring
// an hour away on the server's clock) and waits until the sweep has deleted them.
func deadRowsGone(t *testing.T, ctx context.Context, obs *pgx.Conn, what string) {
	t.Helper()
	if _, err := obs.Exec(ctx, "INSERT INTO "+lease.Table+" (space, key, owner, term, expires, holder) "+
		"SELECT 1, k, 'dead0000dead0000' || lpad(to_hex(k), 16, '0') || '/1000', k, clock_timestamp() + interval '1 hour', "+
		"'sweep-dead' FROM generate_series(1, 50) AS k"); err != nil {
		t.Fatal(err)
	}
	if _, err := obs.Exec(ctx, "INSERT INTO "+lease.Waits+" (space, key, waiter, since, seen, holder) "+
		"SELECT 1, k, 'dead0000dead0000' || lpad(to_hex(k), 16, '0'), clock_timestamp(), clock_timestamp() + interval '1 hour', "+
		"'sweep-dead' FROM generate_series(1, 20) AS k"); err != nil {
		t.Fatal(err)
	}
	left := deadLeft(t, ctx, obs)
	leasesGone, waitsGone := untilGone(t, left, 60*time.Second, "after the rows were written")
	t.Logf("%s, the gone holder's 50 leases went in %v, its 20 waits in %v", what,
		leasesGone.Round(10*time.Millisecond), waitsGone.Round(10*time.Millisecond))
}

// deadLeft counts the rows written for a holder that is gone ("sweep-dead") still in the tables.
func deadLeft(t *testing.T, ctx context.Context, obs *pgx.Conn) func() (leases, waits int) {
	return func() (leases, waits int) {
		t.Helper()
		if err := obs.QueryRow(ctx, "SELECT (SELECT count(*) FROM "+lease.Table+" WHERE holder = 'sweep-dead'), "+
			"(SELECT count(*) FROM "+lease.Waits+" WHERE holder = 'sweep-dead')").Scan(&leases, &waits); err != nil {
			t.Fatal(err)
		}
		return leases, waits
	}
}

// liveKept checks that the leases of the Lockers alive are held, their rows there with their terms.
func liveKept(t *testing.T, ctx context.Context, obs *pgx.Conn, terms map[int64]int64, locks []*Lock, alive map[int]bool) {
	t.Helper()
	for v, term := range terms {
		var got int64
		if err := obs.QueryRow(ctx, "SELECT term FROM "+lease.Table+" WHERE space = 1 AND key = $1", v).Scan(&got); err != nil || got != term {
			t.Errorf("a live lease's row of %d: term %d (%v), want %d", v, got, err, term)
		}
	}
	for i := range alive {
		if err := locks[i].Err(); err != nil {
			t.Errorf("Locker %d's live lease ended: %v", i, err)
		}
	}
}

// A sweeper that is closed gives its turn back: a Locker alone in a database takes a turn at its first lease call,
// and once Close has returned the server holds no row of that turn (the next Locker takes it at its first read
// rather than after two periods); the other turn, which it never held, has no row either.
func TestLeaseSweepTurnGivenBack(t *testing.T) {
	t.Parallel()
	url := pgtest.FreshDB(t, pgtest.URL(t))
	obs := pgtest.Conn(t, url)
	ctx := ctxT(t, time.Minute)
	l := New(pgtest.Pool(t, url, nil), WithLeases(), WithLeaseLength(1500*time.Millisecond))
	defer l.Close()
	if _, err := l.TryLock(ctx, Int64Key(1)); err != nil {
		t.Fatal(err)
	}
	for deadline := time.Now().Add(30 * time.Second); l.leases.SweepStats().Turn == 0; time.Sleep(20 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatal("a Locker alone took no turn in 30 s")
		}
	}
	var rows int
	if err := obs.QueryRow(ctx, "SELECT count(*) FROM "+lease.Timelines+" WHERE timeline < 0").Scan(&rows); err != nil || rows != 1 {
		t.Fatalf("turns' rows while the Locker sweeps: %d (%v), want 1", rows, err)
	}
	l.Close()
	if err := obs.QueryRow(ctx, "SELECT count(*) FROM "+lease.Timelines+" WHERE timeline < 0").Scan(&rows); err != nil || rows != 0 {
		t.Fatalf("turns' rows once the sweeper is closed: %d (%v), want 0", rows, err)
	}
}

// A sweeper whose answers come late loses its turn and stops sweeping, and nothing live is deleted: Locker A (behind
// a proxy) takes the first turn alone in a fresh database, then B and C start beside it; A's link then answers 3 s
// late (its beats stop moving for more than two periods), so C or B takes its turn; A's late beat, once answered,
// finds the turn another's and A stops sweeping (it holds no turn once the link is fast again). The leases B and C
// hold throughout keep their rows and terms on the server.
func TestLeaseSweepTurnLateBeat(t *testing.T) {
	t.Parallel()
	url := pgtest.FreshDB(t, pgtest.URL(t))
	obs := pgtest.Conn(t, url)
	ctx := ctxT(t, 2*time.Minute)
	const length = 1500 * time.Millisecond
	p, pool := proxiedPool(t, url, 32) // as pgtest.Pool makes them
	slow := New(pool, WithLeases(), WithLeaseLength(length))
	defer slow.Close()
	lk, err := slow.TryLock(ctx, Int64Key(1)) // starts its sweep; it holds nothing after
	if err != nil {
		t.Fatal(err)
	}
	if err := lk.Unlock(ctx); err != nil {
		t.Fatal(err)
	}
	until := func(what string, cond func() bool) {
		t.Helper()
		for deadline := time.Now().Add(30 * time.Second); !cond(); time.Sleep(20 * time.Millisecond) {
			if time.Now().After(deadline) {
				t.Fatalf("30 s on, %s", what)
			}
		}
	}
	until("the Locker alone holds no turn", func() bool { return slow.leases.SweepStats().Turn != 0 })
	ls := []*Locker{slow}
	for range 2 {
		l := New(pgtest.Pool(t, url, nil), WithLeases(), WithLeaseLength(length))
		defer l.Close()
		ls = append(ls, l)
	}
	locks, terms := lockEach(t, ctx, ls[1:], 1000)
	alive := map[int]bool{0: true, 1: true}
	p.AnswerLatency(3 * time.Second)
	until("no Locker took the late sweeper's turn", func() bool {
		return ls[1].leases.SweepStats().Taken+ls[2].leases.SweepStats().Taken > 0
	})
	p.AnswerLatency(0)
	until("the late sweeper still holds its turn", func() bool { return slow.leases.SweepStats().Turn == 0 })
	turnsWindow(t, ctx, obs, "the late sweeper's turn taken", ls[1:], alive, lease.Turns, length)
	if st := slow.leases.SweepStats(); st.Turn != 0 {
		t.Fatalf("the late sweeper took a turn again: %+v", st)
	}
	liveKept(t, ctx, obs, terms, locks, alive)
}
