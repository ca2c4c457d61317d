package main

import (
	"bufio"
	"cmp"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"sort"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/advlock/advlock"
	"github.com/advlock/advlock/internal/mutant"
	"github.com/advlock/advlock/internal/pgcluster"
	"github.com/advlock/advlock/internal/testkit/faults"
	"github.com/jackc/pgx/v5"
)

// Options configure a campaign.
type Options struct {
	Duration  time.Duration
	Seed      uint64
	Workers   int
	Keepalive time.Duration
	NoFaults  bool // the checker's own test: a broken locker needs no help
	Broken    bool // every worker uses the deliberately wrong locker
	Log       io.Writer
	Keep      bool // keep the workers' histories and output (kept anyway when something was found)
	// Mutant switches one deliberate bug on in every worker (internal/mutant); the workers must be a build with
	// the tag advlock_mutants: Binary names one (by default this executable, which must then be such a build).
	Mutant string
	Binary string
	// Faults, when not empty, are the only fault kinds injected, and Ops the only operations the workers run (a
	// mutant's short campaign aims at its bug).
	Faults []string
	Ops    []string
	// WaitSlice, when not zero, shortens each statement of a wait in the server (the library's default is 0.9 s):
	// below the readers' holds (300 to 900 ms), readers let in at each end of a writer's slice outlast its next
	// one, which is how readers that ignore a writer's intent starve it.
	WaitSlice time.Duration
	// Failover runs the locks on a primary and a streaming standby (the ledger on a server of its own), the
	// workers with a DSN that names both (target_session_attrs=read-write), and adds the fault kind "failover":
	// the standby made to lag, the primary stopped (immediate), the standby promoted, the old primary rebuilt as
	// the new standby; the campaign goes on with the roles swapped (see failover.go). With Leases, PgBouncer
	// stays on its workers' path, repointed at each promoted server, and each lost primary's lease log is read
	// before it is rebuilt.
	Failover bool
	// Leases runs every worker's locks as leases (advlock.WithLeases, LeaseLength long), PgBouncer in transaction
	// mode on its path, the operations leases offer, and the fault kind "break_lease" (a lease's row deleted, as
	// advlock break does) in place of the terminates; the checker judges each holder by the lease table's own
	// record of when its lease ended (see checkLeases).
	Leases      bool
	LeaseLength time.Duration
	// Via, when not empty, is how the workers reach the server, worker i by Via[i%len(Via)] ("direct", "proxy" or
	// "pgbouncer"; by default the paths take turns): a short campaign aimed at one path's fault puts every worker
	// on it.
	Via []string
	// Sessions, when not empty, puts every worker's locks on one kind of session: "shared" (a Locker's shared
	// sessions, WithSharedSessions) or "dedicated" (a session of its own per lock); by default the workers take
	// turns. A mutant of one kind's loss handling is caught only by losses on that kind.
	Sessions string
	// DeadlockBound, when not zero, is how long the checker lets a cycle of waits last (DeadlockBound by default):
	// the mutation suite runs beside every other test package on a 2-core machine, where a Locker's readings of
	// the lock graph come late, and its bound only has to tell detection from none (the pairs' waits end at twice
	// the bound, or pairWait when that is longer).
	DeadlockBound time.Duration
}

// via says how a worker reaches the server.
func via(i int) (shared bool, path string) {
	return i%2 == 0, []string{"direct", "direct", "proxy", "proxy", "pgbouncer", "pgbouncer"}[i%6]
}

type slot struct {
	cfg     workerConfig
	proxies []*faults.Proxy // the worker's path to the server (to each server, in a failover campaign); nil: direct
	stderr  *os.File
	mu      sync.Mutex
	cmd     *exec.Cmd
	killed  bool // by the injector: restart it
	stopped bool // by the end of the campaign
	exited  chan struct{}
	probs   []Violation
	kills   int
}

type campaign struct {
	opt     Options
	dir     string
	cluster *pgcluster.Cluster // the server the locks are on: in a failover campaign, the primary now (srvMu)
	bouncer *pgcluster.Bouncer
	slots   []*slot
	self    string

	errors map[string]int // what the operations that failed with "error" said, by class

	runEnd time.Time // when the workers were told to stop
	waits  []*Wait   // read by history: the recorded waits (pairs', readers' and writers')
	// read by history: when each worker's calls failed to connect (the server, or the pooler in front of it, not
	// taking connections yet on that worker's path)
	unreachable map[int][]time.Time

	mu      sync.Mutex
	faults  []fault
	pauses  []Pause
	samples []Sample

	// A failover campaign (failover.go); cluster changes with each failover, under srvMu.
	srvMu     sync.Mutex
	standby   *pgcluster.Cluster   // the streaming standby; nil while it is being rebuilt
	repl      *faults.Proxy        // the standby's replication stream goes through it
	servers   []*pgcluster.Cluster // every server that held locks: their logs are evidence
	ledgerDB  *pgcluster.Cluster   // the resource, on a server of its own that never fails over
	failovers int
	// lostLeaseLog: what each primary lost to a failover had in its lease log (a lease campaign), read before
	// it was rebuilt.
	lostLeaseLog   []leaseEntry
	lostLogsUnread int
	// clockOffset is how far the primary's clock is from the real one (clock_step; the injector's alone).
	clockOffset time.Duration
	killedPIDs  map[int32]bool // the workers' processes the injector killed (under mu)
}

// wasKilled reports whether the injector killed the worker process pid.
func (c *campaign) wasKilled(pid int32) bool {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.killedPIDs[pid]
}

// primary is the server the locks are on now.
func (c *campaign) primary() *pgcluster.Cluster {
	c.srvMu.Lock()
	defer c.srvMu.Unlock()
	return c.cluster
}

// ledgerURL is where the protected resource (the ledger) lives: the lock server, or a server of its own in a
// failover campaign (a failover loses the commits its standby had not received, which the checker must not lose).
func (c *campaign) ledgerURL() string {
	if c.ledgerDB != nil {
		return c.ledgerDB.URL
	}
	return c.cluster.URL
}

func (c *campaign) logf(f string, a ...any) {
	if c.opt.Log != nil {
		fmt.Fprintf(c.opt.Log, "%s "+f+"\n", append([]any{time.Now().Format("15:04:05.000")}, a...)...)
	}
}

// Run runs a campaign and returns its report.
func Run(ctx context.Context, opt Options) (*Report, error) {
	if opt.Workers < 1 {
		return nil, errors.New("chaos: need at least one worker")
	}
	if opt.Keepalive == 0 {
		opt.Keepalive = 500 * time.Millisecond
	}
	self, err := os.Executable()
	if err != nil {
		return nil, err
	}
	if opt.Binary != "" {
		self = opt.Binary
	} else if opt.Mutant != "" && !mutant.Enabled {
		return nil, fmt.Errorf("chaos: mutant %q needs a build with -tags advlock_mutants", opt.Mutant)
	}
	if opt.Mutant != "" && !slices.Contains(mutant.All, opt.Mutant) {
		return nil, fmt.Errorf("chaos: no mutant %q (there are: %s)", opt.Mutant, strings.Join(mutant.All, ", "))
	}
	for _, op := range opt.Ops {
		if !slices.ContainsFunc(opWeights, func(o opWeight) bool { return o.op == op }) {
			return nil, fmt.Errorf("chaos: no operation %q", op)
		}
		if opt.Leases && !slices.Contains(leaseOps, op) {
			return nil, fmt.Errorf("chaos: operation %q is not one leases offer (%s)", op, strings.Join(leaseOps, ", "))
		}
	}
	if opt.Leases && opt.LeaseLength == 0 {
		opt.LeaseLength = 2 * time.Second
	}
	for _, v := range opt.Via {
		if v != "direct" && v != "proxy" && v != "pgbouncer" {
			return nil, fmt.Errorf("chaos: no path %q (there are: direct, proxy, pgbouncer)", v)
		}
	}
	if opt.Sessions != "" && opt.Sessions != "shared" && opt.Sessions != "dedicated" {
		return nil, fmt.Errorf("chaos: no session kind %q (there are: shared, dedicated)", opt.Sessions)
	}
	for _, k := range opt.Faults {
		if k == "clock_step" && opt.Failover {
			return nil, errors.New("chaos: clock_step is not drawn in a failover campaign (a promoted server's quiet " +
				"period is measured on its own clock: the one place a lease relies on a server's clock)")
		}
		if opt.Leases && strings.HasPrefix(k, "terminate_") {
			return nil, fmt.Errorf("chaos: fault kind %q has nothing to end in a lease campaign (break_lease is its kind)", k)
		}
		if slices.Contains(leaseFaultKinds, k) && opt.Leases {
			continue
		}
		if !slices.Contains(faultKinds, k) && !(k == "failover" && opt.Failover) {
			return nil, fmt.Errorf("chaos: no fault kind %q (there are: %s, and failover with -failover)", k,
				strings.Join(faultKinds, ", "))
		}
	}
	dir, err := os.MkdirTemp("", "advlock-chaos-")
	if err != nil {
		return nil, err
	}
	keep := false
	defer func() {
		if !keep {
			os.RemoveAll(dir)
		}
	}()
	c := &campaign{opt: opt, dir: dir, self: self}
	c.logf("starting a private cluster")
	// The server's log says when each backend ended, by pid and application name: evidence the checker reads.
	settings := []string{"max_connections = 300", "log_disconnections = on", "log_line_prefix = '%n|%p|%a|'"}
	if opt.Failover {
		// The standby copies these with its base backup. A standby whose stream broke retries after this long,
		// and a promotion that comes meanwhile may wait for it (5 s by default).
		settings = append(settings, "wal_retrieve_retry_interval = '200ms'")
	}
	if opt.Leases {
		// Grants and renewals commit without waiting for their WAL to be flushed: what the WAL writer has not
		// written out when the server crashes is lost (with fsync off, what it wrote survives a crash of the
		// server). Its round is 200 ms by default; at 1 s a crash takes back the last few seconds of them, holders
		// still in their sections among them, as a server tuned so (or with a slow disk) loses.
		settings = append(settings, "wal_writer_delay = '"+walWriterDelay.String()+"'")
	}
	if c.stepsClock() {
		// The primary's wall clock steps (clock_step): it runs under libfaketime, and the ledger, whose clock stamps
		// the holders' writes, on a server of its own whose clock does not.
		c.cluster, err = pgcluster.StartFaketime(settings...)
	} else {
		c.cluster, err = pgcluster.Start(settings...)
	}
	if err != nil {
		return nil, err
	}
	c.servers = []*pgcluster.Cluster{c.cluster}
	defer func() {
		for _, s := range c.servers {
			s.Remove()
		}
	}()
	if c.stepsClock() {
		if c.ledgerDB, err = pgcluster.Start("max_connections = 100"); err != nil {
			return nil, err
		}
		defer c.ledgerDB.Remove()
	}
	if opt.Failover {
		if err := c.startFailover(); err != nil {
			return nil, err
		}
		defer c.stopFailover()
	}
	if err := c.setupLedger(ctx); err != nil {
		return nil, err
	}
	needBouncer := false
	for i := range opt.Workers {
		if _, p := c.via(i); p == "pgbouncer" {
			needBouncer = true
		}
	}
	if needBouncer {
		// PgBouncer's defaults but one: after a server restart it refuses logins for server_login_retry (15 s);
		// 1 s keeps its workers in the campaign.
		mode := "session"
		if opt.Leases {
			mode = "transaction" // where session locks cannot live: what leases are for
		}
		if c.bouncer, err = pgcluster.StartBouncer(c.cluster.URL, mode, "server_login_retry = 1"); err != nil {
			return nil, err
		}
		defer func() { c.bouncer.Stop(); os.RemoveAll(c.bouncer.Dir) }()
	}
	for i := range opt.Workers {
		s, err := c.newSlot(i)
		if err != nil {
			return nil, err
		}
		for _, p := range s.proxies {
			defer p.Close()
		}
		defer s.stderr.Close()
		c.slots = append(c.slots, s)
	}
	start := time.Now()
	for _, s := range c.slots {
		if err := c.start(s); err != nil {
			return nil, err
		}
	}
	runCtx, cancel := context.WithTimeout(ctx, opt.Duration)
	defer cancel()
	var bg sync.WaitGroup
	bg.Add(2)
	go func() { defer bg.Done(); c.sample(runCtx) }()
	go func() {
		defer bg.Done()
		if !opt.NoFaults {
			c.inject(runCtx)
		}
	}()
	bg.Wait()
	if c.clockOffset != 0 { // the server's clock back to the real one, for what comes after the run
		if err := c.stepClock(ctx, 0); err != nil {
			c.logf("setting the server's clock back: %v", err)
		}
	}
	c.logf("stopping the workers")
	c.runEnd = time.Now()
	c.stopAll()
	leaked := c.leftovers(ctx)
	c.logf("checking %s of history", time.Since(start).Round(time.Second))
	r, err := c.report(ctx, leaked)
	if b, jerr := json.Marshal(c.faults); jerr == nil { // the faults as injected, kept with the histories
		_ = os.WriteFile(filepath.Join(dir, "faults.json"), b, 0o644)
	}
	if err == nil && (!r.OK() || c.opt.Keep) {
		keep, r.Dir = true, dir // the workers' histories and output, for the examples
	}
	return r, err
}

// setupLedger makes the ledger's tables. In a failover campaign the lock server has them too (the standby gets
// them by replication): DoTx writes in its own transaction, on the server its lock is on, and those writes are
// not read (a failover loses the last commits of the old primary, with their locks).
func (c *campaign) setupLedger(ctx context.Context) error {
	urls := []string{c.ledgerURL()}
	if c.ledgerDB != nil {
		urls = append(urls, c.cluster.URL)
	}
	for _, u := range urls {
		conn, err := pgx.Connect(ctx, u)
		if err != nil {
			return err
		}
		_, err = conn.Exec(ctx, `CREATE TABLE chaos_fence (key text PRIMARY KEY, fence bigint NOT NULL);
			CREATE TABLE chaos_writes (id bigserial PRIMARY KEY, key text NOT NULL, token bigint NOT NULL,
				cs text NOT NULL, worker int NOT NULL, mode text NOT NULL, accepted bool, at timestamptz NOT NULL)`)
		if err == nil && c.opt.Leases {
			_, err = conn.Exec(ctx, leaseLogDDL)
		}
		conn.Close(ctx)
		if err != nil {
			return err
		}
	}
	return nil
}

// leaseLogDDL makes the lease tables, and a record of every change to a lease's row with the server's clock (a
// trigger's): when each lease was granted, renewed until when, deleted; the checker's evidence in a lease campaign.
// It commits with the change it records, so it says what the server holds, crash or not.
var leaseLogDDL = "CREATE SEQUENCE IF NOT EXISTS public.advlock_fence; " + advlock.LeaseTableSQL + `;
	CREATE TABLE chaos_lease_log (id bigserial PRIMARY KEY, at timestamptz NOT NULL DEFAULT clock_timestamp(),
		op text NOT NULL, key int8 NOT NULL, term int8 NOT NULL, expires timestamptz NOT NULL, holder text NOT NULL);
	CREATE FUNCTION chaos_lease_audit() RETURNS trigger LANGUAGE plpgsql AS $f$
	BEGIN
		IF TG_OP = 'DELETE' THEN
			INSERT INTO chaos_lease_log (op, key, term, expires, holder) VALUES ('D', OLD.key, OLD.term, OLD.expires, OLD.holder);
		ELSE
			INSERT INTO chaos_lease_log (op, key, term, expires, holder) VALUES (left(TG_OP, 1), NEW.key, NEW.term, NEW.expires, NEW.holder);
		END IF;
		RETURN NULL;
	END $f$;
	CREATE TRIGGER chaos_lease_audit AFTER INSERT OR UPDATE OR DELETE ON public.advlock_lease
		FOR EACH ROW EXECUTE FUNCTION chaos_lease_audit()`

// via says how worker i reaches the server; a failover campaign of session locks has no PgBouncer, its workers go
// through a proxy instead. A lease campaign keeps its PgBouncer (in transaction mode), repointed at the promoted
// server at each failover, as an operator does.
func (c *campaign) via(i int) (shared bool, path string) {
	shared, path = via(i)
	if c.opt.Sessions != "" {
		shared = c.opt.Sessions == "shared"
	}
	if len(c.opt.Via) > 0 {
		path = c.opt.Via[i%len(c.opt.Via)]
	}
	if c.opt.Failover && !c.opt.Leases && path == "pgbouncer" {
		path = "proxy"
	}
	return shared, path
}

func (c *campaign) newSlot(i int) (*slot, error) {
	shared, path := c.via(i)
	s := &slot{}
	dsn, locks := c.cluster.URL, ""
	servers := []*pgcluster.Cluster{c.cluster}
	if c.opt.Failover {
		servers = append(servers, c.standby)
	}
	switch path {
	case "direct":
		if c.opt.Failover {
			dsn = c.multiHost(nil)
		}
	case "proxy":
		var addrs []string
		for _, srv := range servers {
			p, err := faults.New(fmt.Sprintf("127.0.0.1:%d", srv.Port))
			if err != nil {
				return nil, err
			}
			s.proxies = append(s.proxies, p)
			addrs = append(addrs, p.Addr())
		}
		if c.opt.Failover {
			dsn = c.multiHost(addrs)
		} else {
			u, _ := url.Parse(dsn)
			u.Host = addrs[0]
			dsn = u.String()
		}
	case "pgbouncer":
		dsn = c.bouncer.URL
	}
	switch {
	case c.opt.Failover:
		locks = c.multiHost(nil) // the worker's own look at pg_locks follows the primary
	case c.ledgerDB != nil:
		locks = c.cluster.URL // the ledger is on a server of its own
	}
	dsn += "&pool_max_conns=10"
	f, err := os.Create(filepath.Join(c.dir, fmt.Sprintf("w%d.stderr", i)))
	if err != nil {
		return nil, err
	}
	s.stderr = f
	s.cfg = workerConfig{ID: i, Name: fmt.Sprintf("chaos-w%d", i), DSN: dsn, Ledger: c.ledgerURL(), Locks: locks, Shared: shared,
		Broken: c.opt.Broken, Seed: c.opt.Seed*1000 + uint64(i), Keepalive: c.opt.Keepalive,
		History: filepath.Join(c.dir, fmt.Sprintf("w%d.jsonl", i)), Goroutines: 4, Ops: c.opt.Ops,
		WaitSlice: c.opt.WaitSlice, PairWait: pairWaitFor(cmp.Or(c.opt.DeadlockBound, DeadlockBound))}
	if c.opt.Leases {
		s.cfg.LeaseLength = c.opt.LeaseLength
	}
	return s, nil
}

func (c *campaign) start(s *slot) error {
	s.mu.Lock()
	if s.stopped { // the campaign ended while this worker was being restarted
		s.mu.Unlock()
		return nil
	}
	raw, _ := json.Marshal(s.cfg)
	cmd := exec.Command(c.self)
	cmd.Env = append(os.Environ(), envWorker+"="+string(raw), mutant.Env+"="+c.opt.Mutant)
	cmd.Stdout = s.stderr
	cmd.Stderr = s.stderr
	if err := cmd.Start(); err != nil {
		s.mu.Unlock()
		return err
	}
	s.cmd, s.killed, s.exited = cmd, false, make(chan struct{})
	exited := s.exited
	s.mu.Unlock()
	go func() {
		err := cmd.Wait()
		s.mu.Lock()
		killed, stopped := s.killed, s.stopped
		// A worker ended by the stop's SIGTERM itself was stopped before it began: it catches SIGTERM first thing
		// (runWorker), before any operation, so only one that was still starting (one just restarted after a
		// SIGKILL, say, under CI's load) dies of it.
		if !killed && (!stopped || err != nil && !terminated(err)) {
			out, _ := os.ReadFile(s.stderr.Name())
			if len(out) > 2000 {
				out = out[len(out)-2000:]
			}
			s.probs = append(s.probs, Violation{VDied, fmt.Sprintf("worker %d (incarnation %d) exited: %v; its output ends:\n%s",
				s.cfg.ID, s.cfg.Inc, err, out)})
		}
		restart := !stopped
		if restart {
			s.cfg.Inc++
		}
		s.mu.Unlock()
		close(exited)
		if restart {
			time.Sleep(50 * time.Millisecond)
			if err := c.start(s); err != nil {
				s.mu.Lock()
				s.probs = append(s.probs, Violation{VDied, fmt.Sprintf("worker %d: restart: %v", s.cfg.ID, err)})
				s.mu.Unlock()
			}
		}
	}()
	return nil
}

// terminated reports whether a process's exit error says SIGTERM ended it.
func terminated(err error) bool {
	var ee *exec.ExitError
	if !errors.As(err, &ee) {
		return false
	}
	ws, ok := ee.Sys().(syscall.WaitStatus)
	return ok && ws.Signaled() && ws.Signal() == syscall.SIGTERM
}

func (c *campaign) signal(s *slot, sig syscall.Signal) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if sig == syscall.SIGKILL {
		s.killed = true
		s.kills++
		c.mu.Lock()
		if c.killedPIDs == nil {
			c.killedPIDs = map[int32]bool{}
		}
		c.killedPIDs[int32(s.cmd.Process.Pid)] = true
		c.mu.Unlock()
	}
	_ = s.cmd.Process.Signal(sig)
}

func (c *campaign) stopAll() {
	for _, s := range c.slots {
		s.mu.Lock()
		s.stopped = true
		s.mu.Unlock()
	}
	for _, s := range c.slots {
		for _, p := range s.proxies {
			p.Blackhole(false)
			p.Partition(false)
			p.Latency(0)
			p.AnswerLatency(0)
		}
		c.signal(s, syscall.SIGCONT)
		c.signal(s, syscall.SIGTERM)
	}
	for _, s := range c.slots {
		s.mu.Lock()
		exited := s.exited
		s.mu.Unlock()
		select {
		case <-exited:
		case <-time.After(90 * time.Second):
			c.signal(s, syscall.SIGQUIT) // its stacks go to its stderr
			s.mu.Lock()
			s.probs = append(s.probs, Violation{VHang, fmt.Sprintf("worker %d did not exit within 90 s of SIGTERM", s.cfg.ID)})
			s.mu.Unlock()
			select {
			case <-exited:
			case <-time.After(5 * time.Second):
				c.signal(s, syscall.SIGKILL)
				<-exited
			}
		}
	}
}

// leftovers lists the advisory locks still in pg_locks after every worker stopped. A session whose client died
// behind a blackhole ends at the server's idle timeout, so it waits for a while first.
func (c *campaign) leftovers(ctx context.Context) []Leftover {
	for _, s := range c.slots {
		for _, p := range s.proxies {
			p.Cut()
		}
	}
	var out []Leftover
	deadline := time.Now().Add(3*c.opt.Keepalive + c.opt.LeaseLength + 10*time.Second)
	for {
		out = out[:0]
		qctx, cancel := context.WithTimeout(ctx, 5*time.Second)
		conn, err := pgx.Connect(qctx, c.primary().URL)
		if err == nil {
			var s Sample
			s, err = c.read(qctx, conn)
			conn.Close(context.Background())
			for k, rows := range s.Held {
				for _, r := range rows {
					if r.Term != 0 && c.wasKilled(r.PID) {
						continue // a lease stays until taken over: one a killed process held is no leak
					}
					out = append(out, Leftover{Key: k, App: r.App, Granted: r.Granted, Term: r.Term, PID: r.PID})
				}
			}
		}
		cancel()
		if err != nil {
			out = append(out, Leftover{Key: "could not read pg_locks: " + err.Error()})
		}
		if len(out) == 0 || time.Now().After(deadline) {
			sort.Slice(out, func(i, j int) bool { return out[i].String() < out[j].String() })
			return out
		}
		time.Sleep(200 * time.Millisecond)
	}
}

// sessionEnds reads the servers' logs: one piece of evidence per backend of a worker that ended
// (log_disconnections, with the prefix "epoch.ms|pid|application_name|"). Backend pids are the machine's process
// ids, which two servers on one machine never share at once.
func (c *campaign) sessionEnds() []Evidence {
	var out []Evidence
	for _, s := range c.servers {
		out = append(out, logEnds(s.LogFile())...)
	}
	return out
}

func logEnds(file string) []Evidence {
	f, err := os.Open(file)
	if err != nil {
		return nil
	}
	defer f.Close()
	var out []Evidence
	sc := bufio.NewScanner(f)
	sc.Buffer(make([]byte, 1<<20), 1<<24)
	for sc.Scan() {
		line := sc.Text()
		if !strings.Contains(line, "disconnection: session time") {
			continue
		}
		parts := strings.SplitN(line, "|", 4)
		if len(parts) < 4 {
			continue
		}
		var w int
		if _, err := fmt.Sscanf(parts[2], "chaos-w%d", &w); err != nil || strings.HasSuffix(parts[2], "-ledger") {
			continue
		}
		sec, err1 := strconv.ParseFloat(parts[0], 64)
		pid, err2 := strconv.ParseInt(parts[1], 10, 32)
		if err1 != nil || err2 != nil {
			continue
		}
		out = append(out, Evidence{Kind: "session_end", At: time.UnixMilli(int64(sec*1000 + 0.5)), Worker: w, PID: int32(pid)})
	}
	return out
}

// history reads the workers' files.
func (c *campaign) history() (map[string]*CS, map[string]map[string]int, []Violation, int64, error) {
	c.errors = map[string]int{}
	c.waits = nil
	c.unreachable = map[int][]time.Time{}
	css := map[string]*CS{}
	ops := map[string]map[string]int{}
	var probs []Violation
	var cancels int64
	for _, s := range c.slots {
		f, err := os.Open(s.cfg.History)
		if err != nil {
			if os.IsNotExist(err) {
				continue
			}
			return nil, nil, nil, 0, err
		}
		sc := bufio.NewScanner(f)
		sc.Buffer(make([]byte, 1<<20), 1<<24)
		waits := map[string]*Wait{} // by ID and CS: a pair's wait has no ID, and one at a time per CS
		for sc.Scan() {
			var e event
			if json.Unmarshal(sc.Bytes(), &e) != nil {
				continue // a line cut short by SIGKILL
			}
			switch e.T {
			case "op":
				if ops[e.Op] == nil {
					ops[e.Op] = map[string]int{}
				}
				ops[e.Op][e.Result]++
				if e.Result == "error" {
					c.errors[errClass(e.Err)]++
				}
				if strings.Contains(e.Err, "failed to connect") || strings.Contains(e.Err, "server_login_retry") {
					c.unreachable[e.W] = append(c.unreachable[e.W], time.Unix(0, e.End))
				}
				if e.Result == "deadlock" && e.Op != "pair" {
					probs = append(probs, Violation{VFalseDeadlock, fmt.Sprintf("worker %d: %s, which never waits while holding, ended with ErrDeadlock: %s", e.W, e.Op, e.Err)})
				}
			case "begin":
				css[e.CS] = &CS{ID: e.CS, Worker: e.W, Op: e.Op, Key: e.Key, Mode: e.Mode, Token: e.Token, Begin: time.Unix(0, e.At),
					PID: e.PID, Wait: e.Wait}
			case "end":
				if cs := css[e.CS]; cs != nil {
					cs.Ended, cs.Cause, cs.Unlock, cs.Clean, cs.ToldBy = true, e.Cause, e.Unlock, e.Clean, e.ToldBy
					cs.Session = e.Session
					cs.End = time.Unix(0, e.At)
					if e.Start != 0 {
						cs.Release = time.Unix(0, e.Start)
					}
					if e.Told != 0 {
						cs.Told = time.Unix(0, e.Told)
					}
				}
			case "wait":
				wt := &Wait{ID: e.Wait, CS: e.CS, Worker: e.W, Op: e.Op, Key: e.Key, Mode: e.Mode, Start: time.Unix(0, e.At)}
				waits[e.Wait+"/"+e.CS] = wt
				c.waits = append(c.waits, wt)
			case "waited":
				if wt := waits[e.Wait+"/"+e.CS]; wt != nil {
					wt.End, wt.Result, wt.Err = time.Unix(0, e.At), e.Result, e.Err
				}
			case "hang":
				probs = append(probs, Violation{VHang, fmt.Sprintf("worker %d: %s did not return within its bound", e.W, e.Op)})
			case "exit":
				if e.Counts != nil {
					cancels += e.Counts.Cancels
				}
				for _, l := range e.Leaks {
					probs = append(probs, Violation{VLeak, fmt.Sprintf("worker %d after its operations ended: %s", e.W, l)})
				}
				if e.Goroutines != "" {
					probs = append(probs, Violation{VGoroutines, fmt.Sprintf("worker %d: %s", e.W, firstLines(e.Goroutines, 60))})
				}
			}
		}
		f.Close()
		if err := sc.Err(); err != nil {
			return nil, nil, nil, 0, err
		}
		s.mu.Lock()
		probs = append(probs, s.probs...)
		s.mu.Unlock()
		out, _ := os.ReadFile(s.stderr.Name())
		if i := strings.Index(string(out), "panic:"); i >= 0 {
			probs = append(probs, Violation{VPanic, fmt.Sprintf("worker %d: %s", s.cfg.ID, firstLines(string(out[i:]), 12))})
		}
		if i := strings.Index(string(out), "WARNING: DATA RACE"); i >= 0 {
			probs = append(probs, Violation{VPanic, fmt.Sprintf("worker %d: %s", s.cfg.ID, firstLines(string(out[i:]), 20))})
		}
	}
	return css, ops, probs, cancels, nil
}

func firstLines(s string, n int) string {
	lines := strings.SplitN(s, "\n", n+1)
	if len(lines) > n {
		lines = lines[:n]
	}
	return strings.Join(lines, "\n")
}

func (c *campaign) ledger(ctx context.Context) ([]Write, error) {
	var conn *pgx.Conn
	var err error
	for range 20 { // the last restart may still be finishing
		qctx, cancel := context.WithTimeout(ctx, 5*time.Second)
		conn, err = pgx.Connect(qctx, c.ledgerURL())
		cancel()
		if err == nil {
			break
		}
		time.Sleep(500 * time.Millisecond)
	}
	if err != nil {
		return nil, err
	}
	defer conn.Close(context.Background())
	rows, err := conn.Query(ctx, `SELECT id, key, token, cs, worker, mode, accepted, at FROM chaos_writes ORDER BY id`)
	if err != nil {
		return nil, err
	}
	return pgx.CollectRows(rows, func(r pgx.CollectableRow) (Write, error) {
		var w Write
		err := r.Scan(&w.ID, &w.Key, &w.Token, &w.CS, &w.Worker, &w.Mode, &w.Accepted, &w.At)
		return w, err
	})
}

// errClass shortens an error message to a class: digits (pids, ports, keys, durations) are dropped.
func errClass(msg string) string {
	var b strings.Builder
	for _, r := range msg {
		if r >= '0' && r <= '9' {
			continue
		}
		b.WriteRune(r)
	}
	out := b.String()
	if len(out) > 160 {
		out = out[:160]
	}
	return out
}
