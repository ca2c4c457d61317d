// Command chaos runs advlock under injected faults and checks the history afterwards.
//
//	go run ./chaos [-duration 2m] [-seed N] [-workers 6] [-json FILE] [-v] [-faults KIND,...|none] [-ops OP,...] [-failover] [-wait-slice D]
//	go run -tags advlock_mutants ./chaos -mutant NAME ...   (the library with one deliberate bug; see internal/mutant)
//
// It starts a private PostgreSQL cluster and PgBouncer (session pooling), runs worker processes (this binary
// again), each with its own Locker, in shared-session and session-per-lock mode, directly, through a fault proxy
// and through PgBouncer, all with fencing on. They loop over a few keys with TryLock, Lock with deadlines, Lock
// then cancel, RLock, Do, DoTx, Lead and a semaphore; inside each critical section they write to a ledger table
// guarded by the fencing token. Meanwhile faults are injected, drawn from the seed: pg_terminate_backend of
// holders and waiters, network cut, blackhole and latency, SIGSTOP and SIGCONT of a worker, SIGKILL of a worker
// (restarted), fast and immediate server restarts, a worker's Locker closed mid-flight, each aimed at what pg_locks
// shows holding a lock. With -failover the locks run on a primary and a streaming standby, the workers connect
// with a DSN naming both, and failovers are injected too: the standby made to lag, the primary stopped, the standby
// promoted, the old primary rebuilt as the new standby (PgBouncer's workers go through a proxy instead). Afterwards a checker reads the history, the ledger, pg_locks samples, the faults and the
// server's log of backend ends, and counts violations. Exit status: 0 with zero violations and zero leaked locks, 1
// otherwise (with examples printed) or when the run was not exercised (no write refused, no loss told inside a
// section, a kind of fault that never hit a holder), 2 when the campaign itself could not run.
package main

import (
	"context"
	"flag"
	"fmt"
	"os"
	"os/signal"
	"strings"
	"time"
)

func main() {
	if raw := os.Getenv(envWorker); raw != "" {
		os.Exit(runWorker(raw))
	}
	os.Exit(mainCampaign())
}

func mainCampaign() int {
	duration := flag.Duration("duration", 2*time.Minute, "how long the workers run under faults")
	seed := flag.Uint64("seed", uint64(time.Now().UnixNano()%1_000_000), "seed of the fault schedule and the workers' choices")
	workers := flag.Int("workers", 6, "worker processes (shared/dedicated x direct/proxy/PgBouncer, in turn)")
	jsonPath := flag.String("json", "", "also write the report as JSON to this file")
	verbose := flag.Bool("v", false, "log each fault as it is injected")
	keep := flag.Bool("keep", false, "keep the workers' histories and output (kept anyway when something was found)")
	mutantName := flag.String("mutant", "", "switch one deliberate bug on in the library (a build with -tags advlock_mutants)")
	opList := flag.String("ops", "", "run only these operations (comma-separated; default: the usual mix)")
	faultList := flag.String("faults", "", "inject only these fault kinds (comma-separated; none: no faults; default: every kind)")
	failover := flag.Bool("failover", false, "run the locks on a primary and a streaming standby, and inject failovers too (the ledger on a server of its own)")
	waitSlice := flag.Duration("wait-slice", 0, "shorten each statement of a wait in the server (default: the library's 0.9 s)")
	leases := flag.Bool("leases", false, "hold every lock as a lease (WithLeases), PgBouncer in transaction mode, and a lease's own faults (see leasefaults.go)")
	viaList := flag.String("via", "", "how the workers reach the server, in turn (comma-separated: direct, proxy, pgbouncer; default: each in turn)")
	sessions := flag.String("sessions", "", "every worker's locks on one kind of session: shared or dedicated (default: the workers take turns)")
	flag.Parse()
	if flag.NArg() > 0 || *duration <= 0 || *workers < 1 {
		flag.Usage()
		return 2
	}
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt)
	defer stop()
	opt := Options{Duration: *duration, Seed: *seed, Workers: *workers, Keep: *keep, Mutant: *mutantName, Failover: *failover,
		WaitSlice: *waitSlice, Leases: *leases, Sessions: *sessions}
	if *opList != "" {
		opt.Ops = strings.Split(*opList, ",")
	}
	if *viaList != "" {
		opt.Via = strings.Split(*viaList, ",")
	}
	switch *faultList {
	case "":
	case "none":
		opt.NoFaults = true
	default:
		opt.Faults = strings.Split(*faultList, ",")
	}
	if *verbose {
		opt.Log = os.Stderr
	}
	fmt.Fprintf(os.Stderr, "chaos: seed %d, %d workers, %s\n", *seed, *workers, *duration)
	r, err := Run(ctx, opt)
	if err != nil {
		fmt.Fprintln(os.Stderr, "chaos:", err)
		return 2
	}
	r.Print(os.Stdout)
	if *jsonPath != "" {
		if err := r.WriteJSON(*jsonPath); err != nil {
			fmt.Fprintln(os.Stderr, "chaos:", err)
			return 2
		}
	}
	if !r.OK() {
		return 1
	}
	return 0
}
