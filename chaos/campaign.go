package main

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
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
	"github.com/advlock/advlock/internal/session"
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
}

// leaseFaultKinds replace the terminates in a lease campaign: a lease's row deleted (advlock break), and a link
// that slows down (a renewal answered late) and then goes silent past the lease's length, the moment a holder
// that counted its trust from an answer instead of a send would trust past the expiry the server gave.
var leaseFaultKinds = []string{"break_lease", "slow_then_silent"}

// Fault kinds the injector draws from; "cancel" (a ctx cancelled at a random moment of a wait) is fired by the
// workers themselves and counted with them, and "failover" is drawn only in a failover campaign.
var faultKinds = []string{"terminate_holder", "terminate_waiter", "cut", "blackhole", "latency", "slow_link", "sigstop",
	"sigkill", "restart_fast", "restart_immediate", "close_locker"}

// fault is one injected fault: when, what, and which worker it aimed at (-1: all of them).
type fault struct {
	Kind   string
	At     time.Time
	Until  time.Time
	Worker int
	Detail string
	PID    int32    // the backend it ended (terminate)
	Term   int64    // the lease it deleted (break_lease)
	Keys   []string // the advisory locks that backend held just before
	Held   int      // advisory locks its target (a worker, or every worker) held when it was injected
	Waits  int      // advisory locks its target waited for then (slow_link, aimed at a worker that waits)
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
	for _, k := range opt.Faults {
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
	if c.cluster, err = pgcluster.Start(settings...); err != nil {
		return nil, err
	}
	c.servers = []*pgcluster.Cluster{c.cluster}
	defer func() {
		for _, s := range c.servers {
			s.Remove()
		}
	}()
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
	c.logf("stopping the workers")
	c.runEnd = time.Now()
	c.stopAll()
	leaked := c.leftovers(ctx)
	c.logf("checking %s of history", time.Since(start).Round(time.Second))
	r, err := c.report(ctx, leaked)
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
	if c.opt.Failover {
		locks = c.multiHost(nil) // the worker's own look at pg_locks follows the primary
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
		WaitSlice: c.opt.WaitSlice}
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
		if !killed && (!stopped || err != nil) {
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

func (c *campaign) signal(s *slot, sig syscall.Signal) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if sig == syscall.SIGKILL {
		s.killed = true
		s.kills++
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
			p.Latency(0)
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

// sample reads pg_locks every 100 ms.
func (c *campaign) sample(ctx context.Context) {
	var conn *pgx.Conn
	defer func() {
		if conn != nil {
			conn.Close(context.Background())
		}
	}()
	t := time.NewTicker(100 * time.Millisecond)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
		qctx, cancel := context.WithTimeout(ctx, 2*time.Second)
		if conn == nil || conn.IsClosed() {
			var err error
			if conn, err = pgx.Connect(qctx, c.primary().URL); err != nil {
				conn = nil
				cancel()
				continue
			}
		}
		s, err := c.read(qctx, conn)
		cancel()
		if err != nil {
			conn.Close(context.Background())
			conn = nil
			continue
		}
		c.mu.Lock()
		c.samples = append(c.samples, s)
		c.mu.Unlock()
	}
}

// read samples what holds the workers' keys: pg_locks, or in a lease campaign the lease table.
func (c *campaign) read(ctx context.Context, conn *pgx.Conn) (Sample, error) {
	if c.opt.Leases {
		return readLeases(ctx, conn)
	}
	return readLocks(ctx, conn)
}

// readLeases samples the live leases and the live waits for them, each under the worker it names (its holder
// text ends with the worker's name), as readLocks samples pg_locks (no pid: a lease has no session).
func readLeases(ctx context.Context, conn *pgx.Conn) (Sample, error) {
	rows, err := conn.Query(ctx, `SELECT statement_timestamp(), clock_timestamp(), x.key, x.granted, x.holder, x.term
		FROM (SELECT 1) one LEFT JOIN (
			SELECT key, true AS granted, holder, term FROM public.advlock_lease WHERE expires > clock_timestamp()
			UNION ALL SELECT key, false, holder, 0 FROM public.advlock_lease_wait WHERE seen > clock_timestamp() - interval '3 seconds'
		) x ON true`)
	if err != nil {
		return Sample{}, err
	}
	s := Sample{Held: map[string][]Holder{}}
	for rows.Next() {
		var at, read time.Time
		var key *int64
		var granted *bool
		var holder *string
		var term *int64
		if err := rows.Scan(&at, &read, &key, &granted, &holder, &term); err != nil {
			return Sample{}, err
		}
		if s.At.IsZero() {
			s.At, s.Read = at, read
		}
		if key == nil {
			continue
		}
		app := *holder
		if i := strings.LastIndexByte(app, ' '); i >= 0 {
			app = app[i+1:]
		}
		k := canon(advlock.Int64Key(*key))
		s.Held[k] = append(s.Held[k], Holder{App: app, Granted: *granted, Term: *term})
	}
	if err := rows.Err(); err != nil {
		return Sample{}, err
	}
	if s.At.IsZero() {
		return Sample{}, errors.New("lease sample: no row")
	}
	return s, nil
}

func readLocks(ctx context.Context, conn *pgx.Conn) (Sample, error) {
	// pg_lock_status() is read once, as the scan starts; clock_timestamp() in each row comes after it. The outer
	// join from one row gives a row (of NULLs) when nothing is held, so an empty sample has its window too.
	rows, err := conn.Query(ctx, `SELECT statement_timestamp(), clock_timestamp(), l.classid, l.objid, l.objsubid,
			l.granted, coalesce(a.application_name, ''), l.pid
		FROM (SELECT 1) one LEFT JOIN (pg_locks l LEFT JOIN pg_stat_activity a ON a.pid = l.pid)
			ON l.locktype = 'advisory'`)
	if err != nil {
		return Sample{}, err
	}
	s := Sample{Held: map[string][]Holder{}}
	for rows.Next() {
		var at, read time.Time
		var classid, objid *uint32
		var sub *int16
		var granted *bool
		var app string
		var pid *int32
		if err := rows.Scan(&at, &read, &classid, &objid, &sub, &granted, &app, &pid); err != nil {
			return Sample{}, err
		}
		if s.At.IsZero() {
			s.At, s.Read = at, read // the first row's: the read came before it
		}
		if classid == nil || objid == nil || sub == nil || granted == nil || pid == nil {
			continue // nothing held
		}
		k, _ := advlock.KeyFromPgLocks(*classid, *objid, *sub)
		s.Held[canon(k)] = append(s.Held[canon(k)], Holder{App: app, PID: *pid, Granted: *granted})
	}
	if err := rows.Err(); err != nil {
		return Sample{}, err
	}
	if s.At.IsZero() {
		return Sample{}, errors.New("pg_locks sample: no row")
	}
	foldIntents(s)
	return s, nil
}

// intents maps the intent of each key the workers take exclusively to that key. A writer takes the key's intent (a
// lock on another int8 key) on the session that waits, when it finds the key held in shared mode or has waited a
// whole slice, and holds it across its wait and then with the key until its unlock (docs/locks.md): no section
// holds it in the workers' records.
var intents = func() map[string]string {
	m := map[string]string{}
	keys := append(append(slices.Clone(lockKeys), pairKeys...), queueKey, leadKey)
	for i := range 64 * 64 { // lock_cancel's keys of each worker's own (72000 + worker*64 + i)
		keys = append(keys, advlock.Int64Key(72000+int64(i)))
	}
	for _, k := range keys {
		n, _ := k.Int64()
		m[canon(advlock.Int64Key(session.ID{V: n}.Intent().V))] = canon(k)
	}
	return m
}()

// foldIntents drops from a sample each intent held by a backend that also holds or waits for its key there, and
// names the others "intent of KEY": an intent its writer's session holds without the key, in sample after
// sample, is a lock left behind (the leak rule), as in Inspect.
func foldIntents(s Sample) {
	for ik, key := range intents {
		rows, ok := s.Held[ik]
		if !ok {
			continue
		}
		delete(s.Held, ik)
		for _, r := range rows {
			if !slices.ContainsFunc(s.Held[key], func(k Holder) bool { return k.PID == r.PID }) {
				s.Held["intent of "+key] = append(s.Held["intent of "+key], r)
			}
		}
	}
}

func (c *campaign) record(f fault) {
	c.mu.Lock()
	c.faults = append(c.faults, f)
	c.mu.Unlock()
	c.logf("fault %s worker %d %s", f.Kind, f.Worker, f.Detail)
}

func sleepCtx(ctx context.Context, d time.Duration) bool {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-ctx.Done():
		return false
	case <-t.C:
		return true
	}
}

// inject draws faults from a deck of every kind, shuffled with the seed, until ctx ends. Each fault aims at what
// pg_locks shows holding a lock, when something does (a fault that hits nobody tests little), and is counted only
// once it took effect; the locks its target held then are recorded.
func (c *campaign) inject(ctx context.Context) {
	rng := rand.New(rand.NewPCG(c.opt.Seed, 1))
	var deck []string
	var proxied []*slot
	for _, s := range c.slots {
		if len(s.proxies) > 0 {
			proxied = append(proxied, s)
		}
	}
	ka := c.opt.Keepalive
	for sleepCtx(ctx, time.Duration(300+rng.IntN(900))*time.Millisecond) {
		if len(deck) == 0 {
			deck = append(deck, c.kinds()...)
			rng.Shuffle(len(deck), func(i, j int) { deck[i], deck[j] = deck[j], deck[i] })
		}
		kind := deck[0]
		deck = deck[1:]
		now := c.locksNow(ctx)
		target := c.pickHolder(now, c.slots, rng)
		long := 2*ka + time.Duration(rng.Int64N(int64(3*ka))) // past the server's 3-keepalive idle timeout, mostly
		f := fault{Kind: kind, At: time.Now(), Worker: target.cfg.ID, Held: heldIn(now, target.cfg.Name)}
		switch kind {
		case "terminate_holder", "terminate_waiter":
			// A waiter (or holder) may be there only now and then: look again for a while before giving up, and
			// then try again later in this round of the deck.
			done := false
			for try := 0; try < 10 && !done && ctx.Err() == nil; try++ {
				if try > 0 {
					sleepCtx(ctx, 100*time.Millisecond)
					now = c.locksNow(ctx)
				}
				pid, w, keys, ok := pickBackend(now, kind == "terminate_holder", rng)
				if !ok {
					continue
				}
				f.Worker, f.PID, f.Keys, f.Held, f.Detail = w, pid, keys, len(keys), fmt.Sprintf("pid %d holding %v", pid, keys)
				f.At = time.Now()
				// Counted only when it took effect: the backend was still there to be signalled.
				if n, err := c.execRows(ctx, `SELECT 1 WHERE pg_terminate_backend($1)`, pid); err == nil && n == 1 {
					c.record(f)
					done = true
				}
			}
			if !done {
				deck = append(deck, kind)
			}
		case "break_lease":
			// A live lease of a worker, its row deleted as advlock break does: its holder learns at its next
			// renewal, and another may take the key meanwhile (docs/leases.md). Looked for again for a while, as a
			// terminate is.
			done := false
			for try := 0; try < 10 && !done && ctx.Err() == nil; try++ {
				if try > 0 {
					sleepCtx(ctx, 100*time.Millisecond)
				}
				key, term, w, ok := c.breakLease(ctx)
				if !ok {
					continue
				}
				f.Worker, f.Term, f.Keys, f.Held, f.Detail = w, term, []string{key}, 1, fmt.Sprintf("term %d of %s", term, key)
				c.record(f)
				done = true
			}
			if !done {
				deck = append(deck, kind)
			}
		case "slow_then_silent":
			if len(proxied) == 0 {
				continue
			}
			s := c.pickHolder(now, proxied, rng)
			f.Worker, f.Held = s.cfg.ID, heldIn(now, s.cfg.Name)
			d := time.Duration(600+rng.IntN(300)) * time.Millisecond
			silent := c.opt.LeaseLength + time.Second
			for _, p := range s.proxies {
				p.Latency(d)
			}
			// Long enough that a renewal goes out and is answered (late) before the silence: a renewal period and
			// a slow round trip.
			sleepCtx(ctx, c.opt.LeaseLength/3+2*d+300*time.Millisecond)
			for _, p := range s.proxies {
				p.Blackhole(true)
			}
			sleepCtx(ctx, silent)
			for _, p := range s.proxies {
				p.Blackhole(false)
				p.Latency(0)
			}
			f.Until = time.Now()
			f.Detail = fmt.Sprintf("%v a chunk, then silent for %v, holding %d", d, silent, f.Held)
			c.record(f)
		case "cut", "blackhole", "latency", "slow_link":
			if len(proxied) == 0 {
				continue
			}
			s := c.pickHolder(now, proxied, rng)
			if kind == "slow_link" {
				s = c.pickWaiter(now, proxied, rng)
			}
			f.Worker, f.Held, f.Waits = s.cfg.ID, heldIn(now, s.cfg.Name), waitingIn(now, s.cfg.Name)
			switch kind {
			case "cut":
				for _, p := range s.proxies {
					p.Cut()
				}
				c.record(f)
			case "blackhole":
				for _, p := range s.proxies {
					p.Blackhole(true)
				}
				f.Detail = fmt.Sprintf("%v, holding %d", long, f.Held)
				sleepCtx(ctx, long)
				for _, p := range s.proxies {
					p.Blackhole(false)
				}
				f.Until = time.Now()
				c.record(f)
			case "latency":
				d := time.Duration(10+rng.IntN(70)) * time.Millisecond
				for _, p := range s.proxies {
					p.Latency(d)
				}
				f.Detail = d.String()
				sleepCtx(ctx, time.Duration(1000+rng.IntN(1000))*time.Millisecond)
				for _, p := range s.proxies {
					p.Latency(0)
				}
				f.Until = time.Now()
				c.record(f)
			case "slow_link":
				// Slow, not dead: a round trip of 0.4 to 1 s, for 1 to 3 s. A wait through it goes on (a Wait bound
				// ends not acquired, with no deadline its caller never set); the watcher of a lock held through it
				// may take it for dead (a keepalive round trip longer than the keepalive interval) and say so.
				d := time.Duration(200+rng.IntN(300)) * time.Millisecond
				for _, p := range s.proxies {
					p.Latency(d)
				}
				span := time.Duration(1000+rng.IntN(2000)) * time.Millisecond
				f.Detail = fmt.Sprintf("%v a chunk for %v, waiting for %d, holding %d", d, span, f.Waits, f.Held)
				sleepCtx(ctx, span)
				for _, p := range s.proxies {
					p.Latency(0)
				}
				f.Until = time.Now()
				c.record(f)
			}
		case "sigstop":
			// Some pauses are far past the bound: a stopped holder is what fencing must stop.
			long = 3*ka + 200*time.Millisecond + time.Duration(rng.Int64N(int64(2*ka))) // past the idle timeout, always
			if rng.IntN(3) == 0 {
				long = 4*(2*ka+time.Second) + time.Duration(rng.Int64N(int64(time.Second)))
			}
			f.Detail = fmt.Sprintf("%v, holding %d", long, f.Held)
			c.signal(target, syscall.SIGSTOP)
			sleepCtx(ctx, long)
			c.signal(target, syscall.SIGCONT)
			f.Until = time.Now()
			c.record(f)
			c.mu.Lock()
			c.pauses = append(c.pauses, Pause{Worker: target.cfg.ID, From: f.At, To: f.Until})
			c.mu.Unlock()
		case "sigkill":
			c.record(f)
			c.signal(target, syscall.SIGKILL)
		case "close_locker":
			if c.opt.Broken {
				continue
			}
			c.record(f)
			c.signal(target, syscall.SIGUSR1)
		case "restart_fast", "restart_immediate":
			// From the stop to the server accepting connections again (a crash recovery on a loaded machine can take
			// seconds): no Locker can read the server meanwhile.
			f.Worker, f.Held = -1, heldIn(now, "")
			p := c.primary()
			if err := p.Restart(strings.TrimPrefix(kind, "restart_")); err != nil {
				c.logf("restart: %v", err)
				_ = p.Start()
			}
			f.Until = time.Now()
			f.Detail = fmt.Sprintf("back after %v", f.Until.Sub(f.At).Round(time.Millisecond))
			c.record(f)
		case "failover":
			f.Worker, f.Held = -1, heldIn(now, "")
			c.failover(ctx, rng, f)
			// The new primary serves a while before anything else happens to it (a base backup and a crash
			// recovery aside cost the machine a burst of work, which back-to-back failovers would repeat).
			sleepCtx(ctx, 3*time.Second)
		}
	}
}

// breakLease deletes one live lease of a worker, picked at random: its key, term and worker.
func (c *campaign) breakLease(ctx context.Context) (key string, term int64, worker int, ok bool) {
	qctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	conn, err := pgx.Connect(qctx, c.primary().URL)
	if err != nil {
		return "", 0, 0, false
	}
	defer conn.Close(context.Background())
	var k int64
	var holder string
	err = conn.QueryRow(qctx, `DELETE FROM public.advlock_lease WHERE (space, key) = (SELECT space, key FROM public.advlock_lease
			WHERE expires > clock_timestamp() AND holder LIKE '% chaos-w%' ORDER BY random() LIMIT 1)
		RETURNING key, term, holder`).Scan(&k, &term, &holder)
	if err != nil {
		return "", 0, 0, false
	}
	if _, err := fmt.Sscanf(holder[strings.LastIndexByte(holder, ' ')+1:], "chaos-w%d", &worker); err != nil {
		return "", 0, 0, false
	}
	return canon(advlock.Int64Key(k)), term, worker, true
}

// kinds lists the fault kinds this campaign draws from.
func (c *campaign) kinds() []string {
	if len(c.opt.Faults) > 0 {
		return c.opt.Faults
	}
	kinds := slices.Clone(faultKinds)
	if c.opt.Leases {
		kinds = append(slices.DeleteFunc(kinds, func(k string) bool { return strings.HasPrefix(k, "terminate_") }),
			leaseFaultKinds...)
	}
	if c.opt.Failover {
		kinds = append(kinds, "failover")
	}
	return kinds
}

// pickHolder picks one of the slots whose sessions pg_locks shows holding a lock, or any of them when none does.
func (c *campaign) pickHolder(now Sample, slots []*slot, rng *rand.Rand) *slot {
	var holding []*slot
	for _, s := range slots {
		if heldIn(now, s.cfg.Name) > 0 {
			holding = append(holding, s)
		}
	}
	if len(holding) == 0 {
		holding = slots
	}
	return holding[rng.IntN(len(holding))]
}

// pickWaiter picks one of the slots whose sessions pg_locks shows waiting for a lock, or else a holder.
func (c *campaign) pickWaiter(now Sample, slots []*slot, rng *rand.Rand) *slot {
	var waiting []*slot
	for _, s := range slots {
		if waitingIn(now, s.cfg.Name) > 0 {
			waiting = append(waiting, s)
		}
	}
	if len(waiting) == 0 {
		return c.pickHolder(now, slots, rng)
	}
	return waiting[rng.IntN(len(waiting))]
}

// waitingIn counts the advisory locks the sessions named app wait for in a sample.
func waitingIn(s Sample, app string) int {
	n := 0
	for _, rows := range s.Held {
		for _, h := range rows {
			if !h.Granted && h.App == app {
				n++
			}
		}
	}
	return n
}

// heldIn counts the advisory locks granted to the sessions named app in a sample (every worker's: app "").
func heldIn(s Sample, app string) int {
	n := 0
	for _, rows := range s.Held {
		for _, h := range rows {
			if h.Granted && (h.App == app || app == "" && strings.HasPrefix(h.App, "chaos-w")) {
				n++
			}
		}
	}
	return n
}

// pickBackend picks a worker session that holds (or waits for) an advisory lock, one lock drawn at random, and
// lists the keys it holds.
func pickBackend(now Sample, holder bool, rng *rand.Rand) (pid int32, worker int, keys []string, ok bool) {
	type row struct {
		pid int32
		app string
		key string
	}
	var list []row // one per lock held (or waited for): a shared session holding many is picked as often
	held := map[int32][]string{}
	for key, rows := range now.Held {
		for _, h := range rows {
			if !strings.HasPrefix(h.App, "chaos-w") {
				continue
			}
			if h.Granted {
				held[h.PID] = append(held[h.PID], key)
			}
			if h.Granted == holder {
				list = append(list, row{h.PID, h.App, key})
			}
		}
	}
	if len(list) == 0 {
		return 0, 0, nil, false
	}
	sort.Slice(list, func(i, j int) bool { // the seed picks in one order
		return list[i].pid < list[j].pid || list[i].pid == list[j].pid && list[i].key < list[j].key
	})
	r := list[rng.IntN(len(list))]
	_, _ = fmt.Sscanf(r.app, "chaos-w%d", &worker)
	keys = held[r.pid]
	sort.Strings(keys)
	return r.pid, worker, keys, true
}

// locksNow reads pg_locks on a connection of its own (empty when the server does not answer).
func (c *campaign) locksNow(ctx context.Context) Sample {
	qctx, cancel := context.WithTimeout(ctx, 2*time.Second)
	defer cancel()
	conn, err := pgx.Connect(qctx, c.primary().URL)
	if err != nil {
		return Sample{}
	}
	defer conn.Close(context.Background())
	s, _ := c.read(qctx, conn)
	return s
}

// execRows runs sql on a connection of its own and says how many rows it returned or changed.
func (c *campaign) execRows(ctx context.Context, sql string, args ...any) (int64, error) {
	qctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	conn, err := pgx.Connect(qctx, c.primary().URL)
	if err != nil {
		return 0, err
	}
	defer conn.Close(context.Background())
	tag, err := conn.Exec(qctx, sql, args...)
	return tag.RowsAffected(), err
}

// leftovers lists the advisory locks still in pg_locks after every worker stopped. A session whose client died
// behind a blackhole ends at the server's idle timeout, so it waits for a while first.
func (c *campaign) leftovers(ctx context.Context) []string {
	for _, s := range c.slots {
		for _, p := range s.proxies {
			p.Cut()
		}
	}
	var out []string
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
					out = append(out, fmt.Sprintf("%s held by %q (granted %v) after the workers stopped", k, r.App, r.Granted))
				}
			}
		}
		cancel()
		if err != nil {
			out = append(out, "could not read pg_locks: "+err.Error())
		}
		if len(out) == 0 || time.Now().After(deadline) {
			sort.Strings(out)
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
