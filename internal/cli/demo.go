package cli

import (
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"os/signal"
	"strconv"
	"sync"
	"syscall"
	"time"

	"github.com/advlock/advlock"
	"github.com/advlock/advlock/internal/pgcluster"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
)

// demoWorkerCmd is the hidden subcommand the demo's worker processes run.
const demoWorkerCmd = "__demo-worker"

const (
	demoWorkers = 3
	demoJobs    = 2
	demoRun     = 2 * time.Second        // how long the workers compete
	demoJobTime = 250 * time.Millisecond // one job's work
)

func demoJobKey(i int) advlock.Key { return advlock.NameKey("advlock-demo-job-" + strconv.Itoa(i)) }

func demoCmd(ctx context.Context, args []string, std Stdio) int {
	fs := newFlags("demo", "[--dsn DSN]", `
Exit status: 0; 1 a step failed; 69 the server answered with an error (a missing database or role, a refused
password), or no server answered and none could be started; 2 usage error.
`)
	flagDSN := fs.String("dsn", "", "connection string (default $DATABASE_URL, then the PG* variables, then a throwaway server)")
	if code, done := parse(fs, args, std); done {
		return code
	}
	if fs.NArg() != 0 {
		return usageError(std, "demo: takes no arguments")
	}
	dsn, code, bad := connString(std, "demo", *flagDSN)
	if bad {
		return code
	}
	// SIGPIPE too: a closed output (advlock demo | head) must still remove a throwaway server.
	ctx, stop := signal.NotifyContext(ctx, os.Interrupt, syscall.SIGTERM, syscall.SIGHUP, syscall.SIGPIPE)
	defer stop()
	d := &demo{std: std}
	conn, cleanup, err := d.server(ctx, dsn)
	if err != nil {
		fmt.Fprintf(std.Err, "advlock: demo: %s\n", describe(err))
		return exitUnavailable
	}
	defer cleanup()
	d.conn = conn
	for _, step := range []func(context.Context) error{d.poolReuse, d.workers, d.handoff} {
		if err := step(ctx); err != nil {
			fmt.Fprintf(std.Err, "advlock: demo: %s\n", describe(err))
			return exitFailure
		}
	}
	fmt.Fprintln(std.Out, "\nDone. Run it yourself: advlock run --no-wait billing-sync -- ./sync.sh ; advlock ls")
	return exitOK
}

type demo struct {
	std  Stdio
	conn string // connection string for every session of the demo; never printed
}

func (d *demo) say(format string, a ...any) { fmt.Fprintf(d.std.Out, format+"\n", a...) }

// server finds a PostgreSQL that answers, or starts a throwaway one when nothing answered at all. A server that
// answered with an error (no such database or role, a refused password) is the user's real problem: it is
// reported, and no throwaway server hides it.
func (d *demo) server(ctx context.Context, conn string) (string, func(), error) {
	cctx, cancel := context.WithTimeout(ctx, 3*time.Second)
	defer cancel()
	cfg, err := pgx.ParseConfig(conn)
	if err != nil {
		return "", nil, err
	}
	c, err := pgx.ConnectConfig(cctx, cfg)
	if pgErr := (*pgconn.PgError)(nil); errors.As(err, &pgErr) {
		return "", nil, fmt.Errorf("the server at %s:%d answered: %w", cfg.Host, cfg.Port, err)
	}
	if err == nil {
		var version string
		_ = c.QueryRow(cctx, "SHOW server_version").Scan(&version)
		c.Close(cctx)
		db := cfg.Database
		if db == "" {
			db = cfg.User
		}
		d.say("advlock demo: PostgreSQL %s at %s:%d, database %s, user %s", version, cfg.Host, cfg.Port, db, cfg.User)
		return conn, func() {}, nil
	}
	d.say("advlock demo: no PostgreSQL answered at %s:%d; starting a throwaway server (removed at the end)...", cfg.Host, cfg.Port)
	tc, err := pgcluster.Start()
	if err != nil {
		return "", nil, fmt.Errorf("no server answered and none could be started: %w", err)
	}
	d.say("advlock demo: throwaway PostgreSQL on 127.0.0.1:%d", tc.Port)
	return tc.URL, tc.Remove, nil
}

// poolReuse reproduces the pool-reuse failure with naive code, then shows advlock refusing the second holder.
func (d *demo) poolReuse(ctx context.Context) error {
	d.say("\n1. The pool-reuse bug: naive code locks through a pool (here, of one connection)")
	cfg, err := pgxpool.ParseConfig(d.conn)
	if err != nil {
		return err
	}
	cfg.MaxConns = 1
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		return err
	}
	defer pool.Close()
	key := advlock.NameKey("advlock-demo-nightly-report")
	v, _ := key.Int64()
	var a, b bool
	if err := pool.QueryRow(ctx, "SELECT pg_try_advisory_lock($1)", v).Scan(&a); err != nil {
		return err
	}
	d.say("   request A: pool.QueryRow(\"SELECT pg_try_advisory_lock(...)\") -> %v   A runs the report", a)
	d.say("              A's connection goes back to the pool, still holding the lock")
	if err := pool.QueryRow(ctx, "SELECT pg_try_advisory_lock($1)", v).Scan(&b); err != nil {
		return err
	}
	d.say("   request B: pool.QueryRow(\"SELECT pg_try_advisory_lock(...)\") -> %v   B runs the report too", b)
	if a && b {
		d.say("   => TWO HOLDERS AT ONCE: PostgreSQL re-grants a lock to the session that holds it, and both")
		d.say("      requests used the same pooled session.")
	}
	// Clean up the naive pool's leftovers: its session holds the lock twice. Unlocked on that session first (the
	// pool has one), so that the key is free when advlock tries it: a closed connection's locks go only once the
	// server has noticed the close.
	if _, err := pool.Exec(ctx, "SELECT pg_advisory_unlock_all()"); err != nil {
		return err
	}
	pool.Reset()

	l := advlock.New(pool)
	defer l.Close()
	lkA, err := l.TryLock(ctx, key)
	if err != nil {
		return err
	}
	d.say("   with advlock, same key, same one-connection pool:")
	d.say("   request A: l.TryLock -> held (its own pinned session)")
	_, err = l.TryLock(ctx, key)
	d.say("   request B: l.TryLock -> %v", errString(err))
	if err == nil {
		return errors.New("advlock granted the key twice")
	}
	if err := lkA.Unlock(ctx); err != nil {
		return err
	}
	d.say("   A unlocks: pg_advisory_unlock returned true, so the session went back to the pool clean")
	return nil
}

func errString(err error) string {
	if err == nil {
		return "held"
	}
	return err.Error()
}

// workers starts worker processes that compete for the same jobs, samples pg_locks while they run, and prints
// advlock ls once.
func (d *demo) workers(ctx context.Context) error {
	d.say("\n2. %d worker processes compete for %d jobs for %v; each job runs under its own lock", demoWorkers, demoJobs, demoRun)
	exe, err := os.Executable()
	if err != nil {
		return err
	}
	var procs []*exec.Cmd
	for w := 1; w <= demoWorkers; w++ {
		cmd := exec.CommandContext(ctx, exe, demoWorkerCmd, strconv.Itoa(w))
		cmd.Env = append(os.Environ(), "DATABASE_URL="+d.conn) // not in argv, where ps would show it
		cmd.Stdout, cmd.Stderr = d.std.Out, d.std.Err
		if err := cmd.Start(); err != nil {
			return err
		}
		procs = append(procs, cmd)
	}
	names := map[advlock.Key]advlock.Key{}
	for j := 1; j <= demoJobs; j++ {
		k := demoJobKey(j)
		v, _ := k.Int64()
		names[advlock.Int64Key(v)] = k
	}
	obs, err := pgx.Connect(ctx, d.conn)
	if err != nil {
		return err
	}
	defer obs.Close(context.WithoutCancel(ctx))
	samples, maxHolders := 0, 0
	shown := false
	start := time.Now()
	for time.Since(start) < demoRun+500*time.Millisecond {
		rows, err := advlock.Inspect(ctx, obs)
		if err != nil {
			return err
		}
		held := map[advlock.Key]int{}
		var ours []advlock.LockInfo
		for _, r := range rows {
			if name, ok := names[r.Key]; ok {
				r.Key = name
				ours = append(ours, r)
				if r.Granted {
					held[name]++
					maxHolders = max(maxHolders, held[name])
				}
			}
		}
		samples++
		if !shown && time.Since(start) > demoRun/2 && len(ours) > 0 {
			shown = true
			d.say("   advlock ls, while they run:")
			printTable(&indent{w: d.std.Out}, ours, time.Now())
		}
		time.Sleep(10 * time.Millisecond)
	}
	for _, p := range procs {
		if err := p.Wait(); err != nil {
			return fmt.Errorf("worker: %w", err)
		}
	}
	d.say("   pg_locks sampled %d times: at most %s of any job at once", samples, countOf(maxHolders, "%d holder", "%d holders"))
	if maxHolders > 1 {
		return errors.New("two holders of one job")
	}
	return nil
}

// indent prefixes every line written through it.
type indent struct {
	w       io.Writer
	midLine bool
}

func (i *indent) Write(p []byte) (int, error) {
	out := make([]byte, 0, len(p)+16)
	for _, c := range p {
		if !i.midLine {
			out = append(out, "   "...)
		}
		out = append(out, c)
		i.midLine = c != '\n'
	}
	if _, err := i.w.Write(out); err != nil {
		return 0, err
	}
	return len(p), nil
}

// demoWorker is one worker process: for demoRun it claims whichever job is free, works, and releases.
func demoWorker(ctx context.Context, args []string, std Stdio) int {
	if len(args) != 1 {
		return exitUsage
	}
	id := args[0]
	l, err := open(ctx, os.Getenv("DATABASE_URL"), "advlock demo worker "+id)
	if err != nil {
		fmt.Fprintf(std.Err, "worker %s: %s\n", id, describe(err))
		return exitUnavailable
	}
	defer l.Close()
	deadline := time.Now().Add(demoRun)
	for j := 1; time.Now().Before(deadline); j = j%demoJobs + 1 {
		lk, err := l.TryLock(ctx, demoJobKey(j))
		if errors.Is(err, advlock.ErrNotAcquired) {
			time.Sleep(20 * time.Millisecond)
			continue
		}
		if err != nil {
			fmt.Fprintf(std.Err, "worker %s: %s\n", id, describe(err))
			return exitFailure
		}
		fmt.Fprintf(std.Out, "   [worker %s] job-%d: acquired, working %v\n", id, j, demoJobTime)
		time.Sleep(demoJobTime)
		if err := lk.Unlock(ctx); err != nil {
			fmt.Fprintf(std.Err, "worker %s: %s\n", id, describe(err))
			return exitFailure
		}
		time.Sleep(30 * time.Millisecond) // let the others in
	}
	return exitOK
}

// handoff kills a holder's backend and shows the holder told and the waiter granted within milliseconds.
func (d *demo) handoff(ctx context.Context) error {
	d.say("\n3. A holder's session is killed: the holder is told at once, and the lock passes to the waiter")
	key := advlock.NameKey("advlock-demo-leader")
	holder, err := open(ctx, d.conn, "advlock demo holder")
	if err != nil {
		return err
	}
	defer holder.Close()
	waiter, err := open(ctx, d.conn, "advlock demo waiter")
	if err != nil {
		return err
	}
	defer waiter.Close()
	h, err := holder.Lock(ctx, key)
	if err != nil {
		return err
	}
	var wg sync.WaitGroup
	var granted time.Time
	var wlk *advlock.Lock
	var werr error
	wg.Add(1)
	go func() {
		defer wg.Done()
		wlk, werr = waiter.Lock(ctx, key)
		granted = time.Now()
	}()
	obs, err := pgx.Connect(ctx, d.conn)
	if err != nil {
		return err
	}
	defer obs.Close(context.WithoutCancel(ctx))
	var rows []advlock.LockInfo
	for waited := false; !waited; time.Sleep(5 * time.Millisecond) {
		all, err := advlock.Inspect(ctx, obs)
		if err != nil {
			return err
		}
		rows = rows[:0]
		for _, r := range all {
			if r.Key.Equal(key) {
				r.Key = key
				rows = append(rows, r)
				waited = waited || !r.Granted
			}
		}
	}
	printTable(&indent{w: d.std.Out}, rows, time.Now())
	var holderPID int32
	for _, r := range rows {
		if r.Granted {
			holderPID = r.PID
		}
	}
	time.Sleep(20 * time.Millisecond) // the holder's watcher is running by now
	kill := time.Now()
	if _, err := obs.Exec(ctx, "SELECT pg_terminate_backend($1)", holderPID); err != nil {
		return err
	}
	d.say("   pg_terminate_backend(%d)", holderPID)
	select {
	case <-h.Done():
		d.say("   holder told after %v: %v", time.Since(kill).Round(10*time.Microsecond), h.Err())
	case <-time.After(5 * time.Second):
		return errors.New("holder not told of the loss within 5s")
	}
	wg.Wait()
	if werr != nil {
		return werr
	}
	d.say("   waiter granted %v after the kill (it waited inside PostgreSQL, no polling)", granted.Sub(kill).Round(10*time.Microsecond))
	_ = h.Unlock(ctx)
	return wlk.Unlock(ctx)
}
