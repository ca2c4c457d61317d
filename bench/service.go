package main

// The service measurement: the README's request-scoped pattern (examples/http) run as two processes, each with one
// Locker from advlock.Open and an application pool of pgxpool's default size, against one PostgreSQL:
//
//	cd bench && go run . -service
//
// Each process runs its share of the clients. A client picks one of the ids at random and syncs it: 80% of the
// time with TryDo (a sync already running anywhere answers "busy"), 20% with Do and Wait(2s). A sync is a short
// piece of work (-service-work) between two ledger statements on the application's pool: the first claims the
// id's row (holder IS NULL, else an overlap), the second frees it and records the sync's interval, from the
// server's clock. After the run the ledger is checked again: no two recorded intervals of one id overlap. The
// parent samples pg_stat_activity meanwhile for the peak number of server connections each process uses.

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"math/rand/v2"
	"os"
	"os/exec"
	"slices"
	"sort"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/advlock/advlock"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
)

var (
	flagService        = flag.Bool("service", false, "run the service measurement instead of the benchmark (see service.go)")
	flagServiceProcs   = flag.Int("service-procs", 2, "processes of the service measurement")
	flagServiceClients = flag.Int("service-clients", 100, "clients of the service measurement, in all processes")
	flagServiceIDs     = flag.Int("service-ids", 60, "ids the clients sync")
	flagServiceWork    = flag.Duration("service-work", 100*time.Millisecond, "how long one sync's work takes")
	flagServiceDur     = flag.Duration("service-dur", 30*time.Second, "how long the service measurement runs")
	flagServiceThink   = flag.Duration("service-think", 10*time.Millisecond, "how long a client pauses after a sync that did not run (busy, timed out, failed)")
	flagServicePool    = flag.Int("service-pool", 0, "pool_max_conns of each process's Locker (0: Open's default)")
	flagServiceShared  = flag.Int("service-shared", -1, "WithSharedSessions of each process's Locker (-1: the default)")
	flagServiceChild   = flag.Int("service-child", -1, "internal: run as process N of the service measurement")
	flagServiceRun     = flag.String("service-run", "", "internal: the run's tag")
	flagServiceStart   = flag.Int64("service-start", 0, "internal: when the clients start (Unix nanoseconds)")
)

const serviceClass = 7 // PairKey(serviceClass, id)

// serviceReport is what one process of the service measurement tells the parent.
type serviceReport struct {
	Proc       int            `json:"proc"`
	Syncs      int64          `json:"syncs"`
	Attempts   int64          `json:"attempts"`
	Errors     map[string]int `json:"errors"` // by kind
	Samples    []string       `json:"samples,omitempty"`
	Overlaps   int64          `json:"overlaps"` // a claim that found the id claimed, or a release that found another holder
	Stats      advlock.Stats  `json:"stats"`
	MaxWaitMS  float64        `json:"max_wait_ms"` // the longest a Do waited for its key and ran
	DoSyncs    int64          `json:"do_syncs"`
	TryDoSyncs int64          `json:"trydo_syncs"`
}

func lockerURL(pgURL, app string, pool int) string {
	sep := "?"
	if strings.Contains(pgURL, "?") {
		sep = "&"
	}
	u := pgURL + sep + "application_name=" + app
	if pool > 0 {
		u += fmt.Sprintf("&pool_max_conns=%d", pool)
	}
	return u
}

func appURL(pgURL, app string) string {
	sep := "?"
	if strings.Contains(pgURL, "?") {
		sep = "&"
	}
	return pgURL + sep + "application_name=" + app // pgxpool's default size: max(4, GOMAXPROCS)
}

func pgURLFlag() string {
	if *flagPG != "" {
		return *flagPG
	}
	if u := os.Getenv("ADVLOCK_TEST_DATABASE_URL"); u != "" {
		return u
	}
	return "postgres://postgres@127.0.0.1:5432/test?sslmode=disable"
}

// serviceMain runs the parent of the service measurement and prints its report.
func serviceMain(ctx context.Context) error {
	pgURL := pgURLFlag()
	obs, err := pgx.Connect(ctx, pgURL)
	if err != nil {
		return fmt.Errorf("PostgreSQL at -pg: %w", err)
	}
	defer obs.Close(ctx)
	run := strconv.FormatInt(time.Now().UnixNano()%1e9, 36)
	for _, q := range []string{
		`CREATE TABLE IF NOT EXISTS bench_service_ledger (run text, id int, holder text, since timestamptz,
			syncs bigint NOT NULL DEFAULT 0, PRIMARY KEY (run, id))`,
		`CREATE TABLE IF NOT EXISTS bench_service_syncs (run text, id int, proc int, during tstzrange)`,
		`DELETE FROM bench_service_ledger`,
		`DELETE FROM bench_service_syncs`,
	} {
		if _, err := obs.Exec(ctx, q); err != nil {
			return fmt.Errorf("ledger: %w", err)
		}
	}
	if _, err := obs.Exec(ctx, `INSERT INTO bench_service_ledger (run, id) SELECT $1, g FROM generate_series(0, $2 - 1) g`,
		run, *flagServiceIDs); err != nil {
		return fmt.Errorf("ledger: %w", err)
	}
	exe, err := os.Executable()
	if err != nil {
		return err
	}
	start := time.Now().Add(2 * time.Second) // every process connected and ready
	var outs []*bytes.Buffer
	var cmds []*exec.Cmd
	for p := range *flagServiceProcs {
		args := []string{"-service-child", strconv.Itoa(p), "-service-run", run, "-service-start",
			strconv.FormatInt(start.UnixNano(), 10), "-pg", pgURL}
		flag.Visit(func(f *flag.Flag) {
			if strings.HasPrefix(f.Name, "service-") && f.Name != "service-child" && f.Name != "service-run" &&
				f.Name != "service-start" {
				args = append(args, "-"+f.Name+"="+f.Value.String())
			}
		})
		cmd := exec.CommandContext(ctx, exe, args...)
		var out bytes.Buffer
		cmd.Stdout, cmd.Stderr = &out, os.Stderr
		if err := cmd.Start(); err != nil {
			return err
		}
		outs, cmds = append(outs, &out), append(cmds, cmd)
	}
	// Sample the server's sessions of each process until they exit.
	type peak struct{ lockTotal, all int }
	var pk peak
	perProc := map[string]int{}
	done := make(chan struct{})
	var sampler sync.WaitGroup
	sampler.Add(1)
	go func() {
		defer sampler.Done()
		tick := time.NewTicker(20 * time.Millisecond)
		defer tick.Stop()
		for {
			select {
			case <-done:
				return
			case <-tick.C:
			}
			rows, err := obs.Query(ctx, `SELECT application_name, count(*) FROM pg_stat_activity
				WHERE application_name LIKE 'svc-%-' || $1 GROUP BY 1`, run)
			if err != nil {
				continue
			}
			lockTotal, all := 0, 0
			for rows.Next() {
				var app string
				var n int
				if rows.Scan(&app, &n) != nil {
					continue
				}
				perProc[app] = max(perProc[app], n)
				all += n
				if strings.HasPrefix(app, "svc-lock-") {
					lockTotal += n
				}
			}
			rows.Close()
			pk.lockTotal, pk.all = max(pk.lockTotal, lockTotal), max(pk.all, all)
		}
	}()
	var reps []serviceReport
	var failed error
	for i, cmd := range cmds {
		if err := cmd.Wait(); err != nil {
			failed = errors.Join(failed, fmt.Errorf("process %d: %w", i, err))
			continue
		}
		var r serviceReport
		if err := json.Unmarshal(outs[i].Bytes(), &r); err != nil {
			failed = errors.Join(failed, fmt.Errorf("process %d: %w: %q", i, err, outs[i].String()))
			continue
		}
		reps = append(reps, r)
	}
	close(done)
	sampler.Wait()
	if failed != nil {
		return failed
	}
	// The ledger's own verdict: no two syncs of one id overlap, every sync was recorded, no id left claimed.
	var overlapping, recorded, claimed int64
	if err := obs.QueryRow(ctx, `SELECT count(*) FROM bench_service_syncs a JOIN bench_service_syncs b
		ON a.run = b.run AND a.id = b.id AND a.ctid < b.ctid AND a.during && b.during WHERE a.run = $1`, run).Scan(&overlapping); err != nil {
		return err
	}
	if err := obs.QueryRow(ctx, `SELECT count(*) FROM bench_service_syncs WHERE run = $1`, run).Scan(&recorded); err != nil {
		return err
	}
	if err := obs.QueryRow(ctx, `SELECT count(*) FROM bench_service_ledger WHERE run = $1 AND holder IS NOT NULL`, run).Scan(&claimed); err != nil {
		return err
	}
	var syncs, attempts, overlaps, doSyncs, tryDoSyncs int64
	errs := map[string]int{}
	var samples []string
	maxWait := 0.0
	for _, r := range reps {
		syncs += r.Syncs
		attempts += r.Attempts
		overlaps += r.Overlaps
		doSyncs += r.DoSyncs
		tryDoSyncs += r.TryDoSyncs
		maxWait = max(maxWait, r.MaxWaitMS)
		for k, v := range r.Errors {
			errs[k] += v
		}
		samples = append(samples, r.Samples...)
	}
	secs := flagServiceDur.Seconds()
	ceiling := float64(*flagServiceIDs) / flagServiceWork.Seconds()
	pool := "Open's default (DefaultOpenConns)"
	if *flagServicePool > 0 {
		pool = fmt.Sprintf("pool_max_conns=%d", *flagServicePool)
	}
	fmt.Printf("\nadvlock service measurement: %d processes, %d clients, %d ids, %v of work per sync, %v; Locker: Open, %s",
		*flagServiceProcs, *flagServiceClients, *flagServiceIDs, *flagServiceWork, *flagServiceDur, pool)
	if *flagServiceShared >= 0 {
		fmt.Printf(", WithSharedSessions(%d)", *flagServiceShared)
	}
	fmt.Printf("\n\n  syncs/s                 %.0f (ceiling %.0f/s: %d ids / %v); TryDo %d, Do %d\n", float64(syncs)/secs,
		ceiling, *flagServiceIDs, *flagServiceWork, tryDoSyncs, doSyncs)
	fmt.Printf("  attempts                %d\n", attempts)
	fmt.Printf("  overlaps                %d seen by the clients, %d in the ledger afterwards (%d syncs recorded of %d; %d ids left claimed)\n",
		overlaps, overlapping, recorded, syncs, claimed)
	var kinds []string
	for k := range errs {
		kinds = append(kinds, k)
	}
	sort.Strings(kinds)
	fmt.Printf("  outcomes other than a sync:")
	if len(kinds) == 0 {
		fmt.Printf(" none")
	}
	fmt.Println()
	for _, k := range kinds {
		fmt.Printf("    %-22s%d\n", k, errs[k])
	}
	for _, s := range samples {
		fmt.Printf("    e.g. %s\n", s)
	}
	fmt.Printf("  longest Do (wait + work) %.0f ms\n", maxWait)
	var apps []string
	for a := range perProc {
		apps = append(apps, a)
	}
	sort.Strings(apps)
	fmt.Printf("  server connections      peak %d for the Lockers of all processes at once, %d with the application pools\n",
		pk.lockTotal, pk.all)
	for _, a := range apps {
		fmt.Printf("    %-22s peak %d\n", a, perProc[a])
	}
	for _, r := range reps {
		fmt.Printf("    process %d's Locker: Stats().PeakConns %d (Pool.Max %d, MaxOwnSessions %d)\n", r.Proc,
			r.Stats.PeakConns, r.Stats.Pool.Max, r.Stats.MaxOwnSessions)
	}
	if overlaps > 0 || overlapping > 0 {
		return fmt.Errorf("%d overlapping syncs", max(overlaps, overlapping))
	}
	return nil
}

// serviceChild is one process of the service measurement: it prints its serviceReport as JSON on stdout.
func serviceChild(ctx context.Context) error {
	p, run := *flagServiceChild, *flagServiceRun
	pgURL := pgURLFlag()
	var opts []advlock.Option
	if *flagServiceShared >= 0 {
		opts = append(opts, advlock.WithSharedSessions(*flagServiceShared))
	}
	l, err := advlock.Open(ctx, lockerURL(pgURL, fmt.Sprintf("svc-lock-%d-%s", p, run), *flagServicePool), opts...)
	if err != nil {
		return err
	}
	defer l.Close()
	app, err := pgxpool.New(ctx, appURL(pgURL, fmt.Sprintf("svc-app-%d-%s", p, run)))
	if err != nil {
		return err
	}
	defer app.Close()
	if err := l.Ping(ctx); err != nil {
		return err
	}
	if err := app.Ping(ctx); err != nil {
		return err
	}
	me := func(c int) string { return fmt.Sprintf("%d/%d", p, c) }
	rep := serviceReport{Proc: p, Errors: map[string]int{}}
	var mu sync.Mutex
	var syncs, attempts, overlaps, doSyncs, tryDoSyncs atomic.Int64
	var maxWait atomic.Int64
	fail := func(kind string, err error) {
		mu.Lock()
		defer mu.Unlock()
		rep.Errors[kind]++
		if err != nil && len(rep.Samples) < 3 && !slices.ContainsFunc(rep.Samples, func(s string) bool { return strings.HasPrefix(s, kind) }) {
			rep.Samples = append(rep.Samples, kind+": "+err.Error())
		}
	}
	// sync is one sync of id under its lock: claim the ledger row, work, free it and record the interval.
	sync1 := func(ctx context.Context, c, id int) error {
		lctx := context.WithoutCancel(ctx) // the ledger's statements run even if the lock is lost meanwhile
		tag, err := app.Exec(lctx, `UPDATE bench_service_ledger SET holder = $3, since = clock_timestamp()
			WHERE run = $1 AND id = $2 AND holder IS NULL`, run, id, me(c))
		if err != nil {
			return fmt.Errorf("ledger: %w", err)
		}
		if tag.RowsAffected() != 1 {
			overlaps.Add(1)
			return errors.New("overlap: the id was claimed already")
		}
		time.Sleep(*flagServiceWork)
		tag, err = app.Exec(lctx, `WITH u AS (UPDATE bench_service_ledger SET holder = NULL, syncs = syncs + 1
			WHERE run = $1 AND id = $2 AND holder = $3 RETURNING since)
			INSERT INTO bench_service_syncs SELECT $1, $2, $4, tstzrange(since, clock_timestamp()) FROM u`, run, id, me(c), p)
		if err != nil {
			return fmt.Errorf("ledger: %w", err)
		}
		if tag.RowsAffected() != 1 {
			overlaps.Add(1)
			return errors.New("overlap: another holder claimed the id meanwhile")
		}
		return nil
	}
	start := time.Unix(0, *flagServiceStart)
	end := start.Add(*flagServiceDur)
	time.Sleep(time.Until(start))
	n := *flagServiceClients / *flagServiceProcs
	if p < *flagServiceClients%*flagServiceProcs {
		n++
	}
	var wg sync.WaitGroup
	for c := range n {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for time.Now().Before(end) {
				id := rand.IntN(*flagServiceIDs)
				key := advlock.PairKey(serviceClass, int32(id))
				attempts.Add(1)
				fn := func(ctx context.Context) error { return sync1(ctx, c, id) }
				var err error
				do := rand.IntN(5) == 0
				t0 := time.Now()
				if do {
					err = l.Do(ctx, key, fn, advlock.Wait(2*time.Second))
				} else {
					err = l.TryDo(ctx, key, fn)
				}
				switch {
				case err == nil:
					syncs.Add(1)
					if do {
						doSyncs.Add(1)
						d := time.Since(t0).Microseconds()
						for {
							m := maxWait.Load()
							if d <= m || maxWait.CompareAndSwap(m, d) {
								break
							}
						}
					} else {
						tryDoSyncs.Add(1)
					}
					continue
				case errors.Is(err, advlock.ErrNotAcquired) && do:
					fail("Do not granted in 2s", nil)
				case errors.Is(err, advlock.ErrNotAcquired):
					fail("TryDo busy", nil)
				case errors.Is(err, advlock.ErrPoolExhausted):
					fail("pool exhausted", err)
				case errors.Is(err, advlock.ErrDeadlock):
					fail("deadlock", err)
				case errors.Is(err, advlock.ErrLockLost):
					fail("lock lost", err)
				case strings.Contains(err.Error(), "overlap:"):
					fail("overlap", err)
				default:
					fail("other", err)
				}
				time.Sleep(*flagServiceThink)
			}
		}()
	}
	wg.Wait()
	rep.Syncs, rep.Attempts, rep.Overlaps = syncs.Load(), attempts.Load(), overlaps.Load()
	rep.DoSyncs, rep.TryDoSyncs = doSyncs.Load(), tryDoSyncs.Load()
	rep.MaxWaitMS = float64(maxWait.Load()) / 1000
	rep.Stats = l.Stats()
	return json.NewEncoder(os.Stdout).Encode(rep)
}

// runService runs the parent of the service measurement, or one of its processes.
func runService(ctx context.Context) error {
	if *flagServiceChild >= 0 {
		return serviceChild(ctx)
	}
	return serviceMain(ctx)
}
