package advlocktest

import (
	"context"
	"errors"
	"fmt"
	"net"
	neturl "net/url"
	"os"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/advlock/advlock"
	"github.com/advlock/advlock/internal/pgcluster"
	"github.com/advlock/advlock/internal/testkit/faults"
	"github.com/jackc/pgx/v5"
)

// known returns the admin DSNs of every server the kit has handed out (the binary's, each live [Server]), and
// ADVLOCK_TEST_DATABASE_URL when set.
func known() []string {
	serversMu.Lock()
	defer serversMu.Unlock()
	var out []string
	add := func(dsn string) {
		for _, d := range out {
			if d == dsn {
				return
			}
		}
		out = append(out, dsn)
	}
	for _, d := range servers {
		add(d)
	}
	for d := range fresh {
		add(d)
	}
	for s := range private {
		if !s.stopped {
			add(s.c.URL)
		}
	}
	return out
}

// stopped reports whether admin is a Server's that is stopped now.
func stopped(admin string) bool {
	serversMu.Lock()
	defer serversMu.Unlock()
	for s := range private {
		if s.c.URL == admin {
			return s.stopped
		}
	}
	return false
}

// keyArgs is key as pg_locks shows it: classid, objid and objsubid (see keyWhere).
func keyArgs(key advlock.Key) (classid, objid int64, objsubid int16) {
	if v, ok := key.Int64(); ok {
		return int64(uint64(v) >> 32), int64(uint32(v)), 1
	}
	a, b, _ := key.Pair()
	return int64(uint32(a)), int64(uint32(b)), 2
}

// keyWhere is the condition on pg_locks (l) of a granted key whose keyArgs are a query's $2, $3 and $4.
const keyWhere = `l.locktype = 'advisory' AND l.granted AND l.classid = $2::int8::oid AND l.objid = $3::int8::oid
	AND l.objsubid = $4 AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database())`

// Lose makes lk lost as production loses a lock: its server session is ended with pg_terminate_backend (or, for a
// lease, its row is deleted, as advlock break does). It returns once the server has ended the session and lk's
// Done has closed, and fails the test when either takes longer than 30 s (a Locker behind a [Link] that is cut off
// is told within its keepalive bound).
//
// As in production, every lock on that server session is lost with it: a Locker's shared session carries many of
// its locks. The code under test sees exactly what a loss looks like: Done closes, Err matches
// [advlock.ErrLockLost], Do's ctx ends, Unlock returns the loss.
func Lose(t TB, lk *advlock.Lock) {
	t.Helper()
	select {
	case <-lk.Done(): // never end a session by a pid and key that this lock no longer holds: others may
		t.Fatalf("advlocktest: Lose: the lock of %s had already ended: %v", lk.Key(), lk.Err())
	default:
	}
	ctx, cancel := context.WithTimeout(context.Background(), bound)
	defer cancel()
	found := false
	var errs []string
	for _, admin := range known() {
		ok, err := loseOn(ctx, admin, lk)
		if err != nil { // a server that does not answer (stopped by another test) holds nothing of this lock
			errs = append(errs, err.Error())
			continue
		}
		if ok {
			found = true
			break
		}
	}
	if !found {
		t.Fatalf("advlocktest: Lose: no server the kit knows holds %s for this lock (open its Locker on advlocktest.DSN, "+
			"a Link to it, or a Server's DSN)%s", lk.Key(), strings.Join(append([]string{""}, errs...), "; "))
	}
	select {
	case <-lk.Done():
	case <-ctx.Done():
		t.Fatalf("advlocktest: Lose: the server ended the lock of %s, and its Locker was not told within %v", lk.Key(), bound)
	}
}

// loseOn ends lk on the server at admin, if that server holds it: true when it did.
func loseOn(ctx context.Context, admin string, lk *advlock.Lock) (bool, error) {
	conn, err := connect(ctx, admin, "advlocktest")
	if err != nil {
		return false, err
	}
	defer conn.Close(context.Background())
	if lk.PID() == 0 { // a lease: broken as advlock break does, if this database has it
		rows, err := advlock.Inspect(ctx, conn)
		if err != nil {
			return false, err
		}
		for _, r := range rows {
			if r.Granted && r.Lease != nil && r.Key.Equal(lk.Key()) && r.Lease.Token == lk.Token() {
				return advlock.BreakLease(ctx, conn, lk.Key(), lk.Token())
			}
		}
		return false, nil
	}
	c, o, s := keyArgs(lk.Key())
	var ended bool
	err = conn.QueryRow(ctx, `SELECT coalesce(bool_or(pg_terminate_backend(l.pid)), false) FROM pg_locks l
		WHERE l.pid = $1 AND `+keyWhere, int64(lk.PID()), c, o, s).Scan(&ended)
	if err != nil || !ended {
		return false, err
	}
	return true, sessionsGone(ctx, conn, []uint32{lk.PID()})
}

// sessionsGone waits until none of pids is a server session any more.
func sessionsGone(ctx context.Context, conn *pgx.Conn, pids []uint32) error {
	for {
		var left int
		if err := conn.QueryRow(ctx, "SELECT count(*) FROM pg_stat_activity WHERE pid = ANY($1)", pids).Scan(&left); err != nil {
			return err
		}
		if left == 0 {
			return nil
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("server sessions %v still there after pg_terminate_backend", pids)
		case <-time.After(5 * time.Millisecond):
		}
	}
}

// connect opens a connection of the kit's own to dsn, named name in application_name (never a test's tag, so that
// the check for locks left held does not count it).
func connect(ctx context.Context, dsn, name string) (*pgx.Conn, error) {
	cfg, err := pgx.ParseConfig(dsn)
	if err != nil {
		return nil, errors.New("the connection string does not parse") // never the string: it may hold a password
	}
	cfg.RuntimeParams["application_name"] = name
	return pgx.ConnectConfig(ctx, cfg)
}

// LoseKey ends whatever holds key in the database at dsn, as an operator's advlock break does: every server session
// that holds it is ended with pg_terminate_backend and its lease, if any, is deleted. It returns once those sessions
// have ended (a Lock that waited for the key may be granted it at once). Use it where the code under test holds a
// lock it does not hand out, as a leader does.
func LoseKey(t TB, dsn string, key advlock.Key) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), bound)
	defer cancel()
	conn, err := connect(ctx, dsn, "advlocktest")
	if err != nil {
		t.Fatalf("advlocktest: LoseKey: %v", err)
	}
	defer conn.Close(context.Background())
	rows, err := advlock.Inspect(ctx, conn) // sessions and leases, in this database
	var pids []uint32
	for _, r := range rows {
		if err != nil || !r.Granted || !r.Key.Equal(key) {
			continue
		}
		if r.Lease != nil {
			_, err = advlock.BreakLease(ctx, conn, key, r.Lease.Token)
		} else if !slices.Contains(pids, uint32(r.PID)) {
			pids = append(pids, uint32(r.PID))
		}
	}
	if err == nil && len(pids) > 0 {
		if _, err = conn.Exec(ctx, "SELECT pg_terminate_backend(pid) FROM unnest($1::int4[]) AS pid", pids); err == nil {
			err = sessionsGone(ctx, conn, pids)
		}
	}
	if err != nil {
		t.Fatalf("advlocktest: LoseKey %s: %v", key, err)
	}
}

// A Holder holds a key from a server session of its own, as another process would, until Release or the end of the
// test: as a session lock and as a lease at once, so that the code under test meets the key held whichever kind of
// lock it takes.
type Holder struct {
	t      TB
	key    advlock.Key
	conn   *pgx.Conn
	pid    uint32
	leases *advlock.Locker // holds lease
	lease  *advlock.Lock
	once   sync.Once
}

// Hold takes key exclusively on a new server session to dsn (waiting for it if another holds it, for at most 30 s)
// and holds it until [Holder.Release] or the end of the test: the code under test meets a key held elsewhere
// (ErrNotAcquired from a try, a Lock that waits). It holds the key's lease too (a Locker of its own with
// [advlock.WithLeases], which creates the lease tables in the database if they are missing and the role may): a
// Locker of leases meets the key held as well. Where no lease can be taken (the tables missing and the role may not
// create them, a standby), it holds the session lock alone.
func Hold(t TB, dsn string, key advlock.Key) *Holder {
	t.Helper()
	return hold(t, dsn, key, false)
}

// HoldShared is [Hold] in shared mode: readers pass, writers wait. Its lease is held as a lease is (leases have no
// shared mode): a Locker of leases, whose every lock is exclusive, waits.
func HoldShared(t TB, dsn string, key advlock.Key) *Holder {
	t.Helper()
	return hold(t, dsn, key, true)
}

func hold(t TB, dsn string, key advlock.Key, shared bool) *Holder {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), bound)
	defer cancel()
	conn, err := connect(ctx, dsn, "advlocktest holder")
	if err != nil {
		t.Fatalf("advlocktest: Hold: %v", err)
	}
	fn := "pg_advisory_lock"
	if shared {
		fn = "pg_advisory_lock_shared"
	}
	if _, err := conn.Exec(ctx, "SELECT "+fn+"("+keySQL(key)+")"); err != nil {
		conn.Close(context.Background())
		t.Fatalf("advlocktest: Hold %s: %v%s", key, err, holdersOf(dsn, key))
	}
	h := &Holder{t: t, key: key, conn: conn, pid: conn.PgConn().PID()}
	// Named apart from the test's own Lockers, as the holder's session is: the check for leases left held at the
	// test's end is for the code under test's, and Release ends this one.
	ldsn, err := withParam(dsn, "application_name", "advlocktest holder")
	if err != nil {
		t.Fatalf("advlocktest: %v", err)
	}
	if h.leases, err = advlock.Open(ctx, ldsn, advlock.WithLeases(), advlock.WithLeaseHolder("advlocktest holder")); err == nil {
		h.lease, err = h.leases.Lock(ctx, key)
	}
	if errors.Is(err, advlock.ErrLeaseTable) || errors.Is(err, advlock.ErrStandby) {
		err = nil // no lease can be taken there (the tables missing and not to be made, a standby): nor by the code under test
	}
	if err != nil {
		h.release()
		t.Fatalf("advlocktest: Hold %s: the key's lease: %v", key, err)
	}
	t.Cleanup(h.Release)
	return h
}

// holdersOf says which server sessions hold key in the database at dsn, for a message.
func holdersOf(dsn string, key advlock.Key) string {
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	conn, err := connect(ctx, dsn, "advlocktest")
	if err != nil {
		return ""
	}
	defer conn.Close(context.Background())
	c, o, s := keyArgs(key)
	var who []string
	err = conn.QueryRow(ctx, `SELECT coalesce(array_agg(l.pid || ' (' || coalesce(a.application_name, '') || ')'), '{}')
		FROM pg_locks l LEFT JOIN pg_stat_activity a USING (pid) WHERE l.pid <> $1 AND `+keyWhere,
		int64(conn.PgConn().PID()), c, o, s).Scan(&who)
	if err != nil || len(who) == 0 {
		return ""
	}
	return " (held by server sessions " + strings.Join(who, ", ") + ")"
}

// keySQL is key's arguments to the advisory lock functions, as literals.
func keySQL(key advlock.Key) string {
	if v, ok := key.Int64(); ok {
		return strconv.FormatInt(v, 10) + "::int8"
	}
	a, b, _ := key.Pair()
	return strconv.Itoa(int(a)) + "::int4, " + strconv.Itoa(int(b)) + "::int4"
}

// PID is the holder's server session.
func (h *Holder) PID() uint32 { return h.pid }

// Release ends the holder's server session, and with it the hold, and returns once the server has let the key go.
// Calling it again does nothing.
func (h *Holder) Release() { h.once.Do(h.release) }

func (h *Holder) release() {
	conn := h.conn
	ctx, cancel := context.WithTimeout(context.Background(), bound)
	defer cancel()
	if h.lease != nil {
		if err := h.lease.Unlock(ctx); err != nil {
			h.t.Errorf("advlocktest: release the lease of %s: %v", h.key, err)
		}
	}
	if h.leases != nil {
		h.leases.Close()
	}
	_ = conn.Close(ctx)
	obs, err := connect(ctx, conn.Config().ConnString(), "advlocktest")
	if err == nil {
		defer obs.Close(context.Background())
		err = sessionsGone(ctx, obs, []uint32{h.pid})
	}
	if err != nil {
		h.t.Errorf("advlocktest: release the hold of %s: %v", h.key, err)
	}
}

// A Link is a TCP proxy between a Locker and its server that injects network faults: open the Locker on
// [Link.DSN].
type Link struct {
	p   *faults.Proxy
	dsn string

	mu      sync.Mutex
	dropped bool // Drop is on: Restore resets the connections
}

// NewLink starts a proxy to the server dsn names (over TCP: not a Unix socket) and returns it; it closes when the
// test ends. Its DSN keeps everything else of dsn, the test's application_name included.
func NewLink(t TB, dsn string) *Link {
	t.Helper()
	cfg, err := pgx.ParseConfig(dsn)
	if err != nil {
		t.Fatalf("advlocktest: NewLink: the connection string does not parse")
	}
	if strings.HasPrefix(cfg.Host, "/") {
		t.Fatalf("advlocktest: NewLink: %s is a Unix socket; a Link needs a TCP address", cfg.Host)
	}
	target := net.JoinHostPort(cfg.Host, strconv.Itoa(int(cfg.Port)))
	p, err := faults.New(target)
	if err != nil {
		t.Fatalf("advlocktest: NewLink: %v", err)
	}
	t.Cleanup(p.Close)
	l := &Link{p: p}
	if isURL(dsn) {
		u, err := neturl.Parse(dsn)
		if err != nil {
			t.Fatalf("advlocktest: NewLink: the connection string does not parse as a URL")
		}
		u.Host = p.Addr()
		q := u.Query() // host and port given as parameters would win over the URL's: the link would be bypassed
		for _, k := range []string{"host", "hostaddr", "port"} {
			q.Del(k)
		}
		u.RawQuery = q.Encode()
		l.dsn = u.String()
	} else {
		l.dsn = dsn + " host=127.0.0.1 hostaddr=127.0.0.1 port=" + strconv.Itoa(p.Port())
	}
	return l
}

// DSN is the connection string through the link.
func (l *Link) DSN() string { return l.dsn }

// Cut closes every connection through the link at once, on both sides, as a network reset does: the server ends
// their sessions (and their locks), and their Lockers are told at once. New connections pass.
func (l *Link) Cut() { l.p.Cut() }

// Blackhole partitions the network: nothing passes the link, in either direction (a chunk already on its way
// under [Link.Latency] is held too), and every socket stays open,
// as when a network goes silent, or a holder freezes as the server and other processes see it (its sessions hold
// their locks and answer nothing). As TCP does, the link keeps what was sent meanwhile and delivers it, in order,
// when [Link.Restore] ends the partition: requests that arrive after their sender gave up on them (an unlock, a
// renewal, a statement whose ctx ended), answers to a client that went on, a close made during it. A Locker behind
// it learns of the loss within its keepalive bound; the server keeps its sessions, and their locks, until the link
// is restored (and then ends those whose client closed them) or closed. New connections wait for the partition to
// end. A partition still on when the test ends is ended as the link closes, what it held delivered first.
func (l *Link) Blackhole() { l.p.Partition(true) }

// Drop makes every byte through the link vanish, in both directions, with every socket left open, until
// [Link.Restore] resets the connections that lived through it (both sides closed, as a network that lost their
// bytes ends them): the server ends their sessions and their locks. New connections made during it hang, and are
// reset too. A lease's release that a drop threw away never reaches the server: the lease stays held until it
// runs out, and a test that ends then fails the check for leases left held (see [DSN]).
func (l *Link) Drop() {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.dropped = true
	l.p.Blackhole(true)
}

// Latency delays every chunk of bytes through the link by d (0: none).
func (l *Link) Latency(d time.Duration) { l.p.Latency(d) }

// Restore ends a blackhole (its bytes delivered), a drop (its connections reset) and any latency.
func (l *Link) Restore() {
	l.mu.Lock()
	dropped := l.dropped
	l.dropped = false
	l.mu.Unlock()
	if dropped {
		l.p.EndBlackholeReset()
	}
	l.p.Blackhole(false)
	l.p.Partition(false)
	l.p.Latency(0)
}

// A Server is a PostgreSQL of a test's own, to restart or stop: see [StartServer].
type Server struct {
	c       *pgcluster.Cluster
	stopped bool // under serversMu
}

var private = map[*Server]bool{} // under serversMu

// StartServer starts a throwaway PostgreSQL for the test from the installed server binaries (initdb), with extra
// postgresql.conf lines (name = value), and removes it when the test ends (or, if the test binary is killed, once
// it has exited). It takes a few seconds. Without the
// binaries the test is skipped ([Require] fails it instead).
func StartServer(t TB, settings []string, opts ...Option) *Server {
	t.Helper()
	o := collect(opts)
	c, err := pgcluster.StartRemovedWhenGone(os.Getpid(), append([]string{"max_connections = 200"}, settings...)...)
	if err != nil {
		noneFor(t, o, fmt.Errorf("no throwaway PostgreSQL could be started from the installed server binaries (initdb): %v", err))
		return nil
	}
	s := &Server{c: c}
	serversMu.Lock()
	private[s] = true
	serversMu.Unlock()
	t.Cleanup(func() {
		serversMu.Lock()
		delete(private, s)
		serversMu.Unlock()
		c.Remove()
	})
	return s
}

// DSN returns a connection string for the test's locks on this server, checked as [DSN]'s are: a lock still held
// by one of its sessions when the test ends fails it.
func (s *Server) DSN(t TB) string {
	t.Helper()
	tag := newTag()
	dsn, err := withParam(s.c.URL, "application_name", tag)
	if err != nil {
		t.Fatalf("advlocktest: %v", err)
	}
	t.Cleanup(func() { checkLeftHeld(t, s.c.URL, s.c.URL, tag) })
	return dsn
}

// Restart stops the server as an operator does (a fast shutdown: every session ends, and every lock with it) and
// starts it again on the same port.
func (s *Server) Restart(t TB) {
	t.Helper()
	if err := s.c.Restart("fast"); err != nil {
		t.Fatalf("advlocktest: restart: %v", err)
	}
}

// Crash stops the server as a crash does (an immediate shutdown) and starts it again: it recovers from its WAL.
func (s *Server) Crash(t TB) {
	t.Helper()
	if err := s.c.Restart("immediate"); err != nil {
		t.Fatalf("advlocktest: crash and restart: %v", err)
	}
}

// Stop stops the server (fast) until [Server.Start]: connections are refused meanwhile.
func (s *Server) Stop(t TB) {
	t.Helper()
	if err := s.c.Stop("fast"); err != nil {
		t.Fatalf("advlocktest: stop: %v", err)
	}
	serversMu.Lock()
	s.stopped = true
	serversMu.Unlock()
}

// Start starts a stopped server again on its port.
func (s *Server) Start(t TB) {
	t.Helper()
	if err := s.c.Start(); err != nil {
		t.Fatalf("advlocktest: start: %v", err)
	}
	serversMu.Lock()
	s.stopped = false
	serversMu.Unlock()
}
