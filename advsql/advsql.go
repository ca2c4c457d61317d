// Package advsql gives database/sql programs the advisory locks of package advlock: the same [advlock.Locker],
// over a *sql.DB, with the same guarantees, plus transaction-scoped locks over a *sql.Tx. It works with the pgx
// driver (github.com/jackc/pgx/v5/stdlib) and with lib/pq (github.com/lib/pq).
//
// Each held lock pins a connection with db.Conn. A connection is returned to the pool (Conn.Close) only after the
// server confirmed the unlock; on any doubt it is discarded instead, by returning driver.ErrBadConn from Conn.Raw
// (Conn.Close alone would pool it still holding the lock).
//
// With either driver many locks share a few sessions, and a lost shared session is seen at once, as with pgxpool.
// lib/pq gives no access to its socket: a shared session's connection is taken over from lib/pq (read by
// reflection from the fields lib/pq keeps it in; lib/pq never uses it again). A lock that had to wait keeps the
// session it waited on: with pgx's driver its watcher reads the idle connection; with lib/pq a loss there is
// noticed by the keepalive round trip, within about twice the keepalive interval ([advlock.WithKeepalive]), and,
// for a connection not proved to be a direct one (through a pooler), the first lock on each new connection takes a
// second connection for a moment to prove that no transaction-mode pooler sits in between.
//
// [New] locks through the application's *sql.DB (shared sessions take at most half of its connections, and waits in
// the server at most half of what they leave: see New); [Open] gives locks a *sql.DB of their own.
//
//	db, err := sql.Open("pgx", dsn) // or "postgres" with lib/pq
//	if err != nil { ... }
//	l := advsql.New(db)
//	defer l.Close()
//	err := l.Do(ctx, advlock.NameKey("billing-sync"), func(ctx context.Context) error { ... })
package advsql

import (
	"bufio"
	"bytes"
	"context"
	"database/sql"
	"database/sql/driver"
	"errors"
	"fmt"
	"io"
	"math"
	"net"
	"net/url"
	"reflect"
	"regexp"
	"slices"
	"strings"
	"sync"
	"time"
	"unsafe"

	"github.com/advlock/advlock"
	"github.com/advlock/advlock/internal/config"
	"github.com/advlock/advlock/internal/pgxwait"
	"github.com/advlock/advlock/internal/session"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgconn/ctxwatch"
	"github.com/jackc/pgx/v5/pgproto3"
	"github.com/jackc/pgx/v5/stdlib"
)

// New returns a Locker over db, which the caller owns and closes after [advlock.Locker.Close]. A nil db gives a
// Locker whose every call returns advlock.ErrNoPool. When db has a limit (SetMaxOpenConns), the Locker's shared
// sessions take at most half of its connections, and its waits in the server (each keeping its session for the
// lock it gets) at most half of what they leave (none over a pool of 2): more waits wait in this process, so that
// the application (fn's own queries among them) always has the rest; see advlock.New. With advlock.WithSharedSessions(0) every held lock takes one
// of db's connections. Locker.DoTx is not available on it; use [DoTx]. Its Inspect,
// Leader and LockTable read through db.
func New(db *sql.DB, opts ...advlock.Option) *advlock.Locker {
	if db == nil {
		return advlock.New(nil, opts...)
	}
	backend := &pool{db: db, verified: map[any]*mark{}}
	return advlock.New(nil, append(opts, option(func(o *config.Options) { o.Backend, o.Querier = backend, querier{db} }))...)
}

// Open opens a *sql.DB for locking only, with driverName ("pgx" for github.com/jackc/pgx/v5/stdlib, "postgres"
// for github.com/lib/pq) and dsn as that driver reads it, and returns a Locker that owns it: [advlock.Locker.Close] closes it. It is to database/sql what
// [advlock.Open] is to pgxpool: locks never compete with the application's own queries for connections, since
// they have a pool of their own, of at most advlock.DefaultOpenConns connections ([advlock.WithMaxConns] sets
// another size; all kept idle when free), shared out as advlock.Open's are (one shared session, which carries
// every lock taken without waiting, one connection kept for the Locker's reads, three for waits), and each lock
// session gets the
// settings advlock.Open sets (no statement or lock timeout, idle_session_timeout of 3
// keepalive intervals, server keepalives, client_connection_check_interval, and application_name=advlock unless
// dsn names one), once per connection, after it is proved to be a server session of its own. The driver must be
// registered (import it). Needs PostgreSQL 14 or later.
//
// Like advlock.Open it does not connect: it fails only when the driver is not registered or refuses dsn
// (advlock.ErrInvalidDSN, which never shows dsn; with pgx's driver also for a dsn that parses other than meant, a
// host holding an '@'), never
// because the server is down; the first call that needs the server reports that, and the Locker works once the
// server answers. [advlock.Locker.Ping] checks at start. ctx bounds nothing here.
func Open(ctx context.Context, driverName, dsn string, opts ...advlock.Option) (*advlock.Locker, error) {
	db, err := sql.Open(driverName, dsn)
	if err != nil {
		if slices.Contains(sql.Drivers(), driverName) { // the driver refused dsn; its error may show part of it
			return nil, session.InvalidDSN(err)
		}
		return nil, fmt.Errorf("advlock: open: %w", err)
	}
	if strings.HasPrefix(dsn, "postgres://") || strings.HasPrefix(dsn, "postgresql://") {
		// lib/pq parses a URL when it first connects, and its error then shows the whole URL, password and all.
		if _, err := url.Parse(dsn); err != nil {
			_ = db.Close()
			return nil, session.InvalidDSN(err)
		}
	}
	if _, ok := db.Driver().(*stdlib.Driver); ok {
		// pgx's parser ends a URL's user information at its first '@': refuse what it would read other than meant.
		cfg, err := pgx.ParseConfig(dsn)
		if err == nil {
			err = session.CheckDSN(&cfg.Config)
		} else {
			err = session.InvalidDSN(err)
		}
		if err != nil {
			_ = db.Close()
			return nil, err
		}
	}
	o := config.Defaults()
	for _, opt := range opts {
		config.ApplyOption(opt, &o)
	}
	conns := advlock.DefaultOpenConns
	if o.MaxConns > 0 {
		conns = o.MaxConns
	}
	db.SetMaxOpenConns(conns)
	db.SetMaxIdleConns(conns)
	// The server ends a lock session silent for FrozenAfter(keepalive) (idle_session_timeout, set below), idle
	// pooled ones too, and lib/pq would hand such a dead connection out unchecked: database/sql closes them first.
	db.SetConnMaxIdleTime(session.FrozenAfter(o.Keepalive) * 2 / 3)
	backend := &pool{db: db, verified: map[any]*mark{}, dial: &dialSpec{driverName: driverName, dsn: dsn}}
	named := appNameRE.MatchString(dsn)
	var appName string // for a lease's holder
	if named {
		if cfg, err := pgconn.ParseConfig(dsn); err == nil {
			appName = cfg.RuntimeParams["application_name"]
		}
	}
	return advlock.New(nil, append(opts, option(func(o *config.Options) {
		o.Backend, o.Querier, o.AppName = backend, querier{db}, appName
		o.Settings = session.OpenSettings(o.Keepalive)
		o.OwnPool = true
		if !named {
			o.Settings = append(o.Settings, session.Setting{Name: "application_name", Value: "advlock"})
		}
		o.OnClose = func() { _ = db.Close() }
	}))...), nil
}

// appNameRE finds application_name in a key=value or URL connection string (not fallback_application_name).
var appNameRE = regexp.MustCompile(`(^|[\s?&])application_name=`)

type pool struct {
	db       *sql.DB
	dial     *dialSpec // what Open opened db with, for Dial; nil for New's db
	mu       sync.Mutex
	verified map[any]*mark // driver connections proved to be sessions of their own (drivers without a pid)
	uses     uint64        // a clock for mark.used
}

// mark is what is known of one driver connection: it was proved a server session of its own, and whether direct.
type mark struct {
	direct   bool
	pid      uint32          // the server session's pid
	used     uint64          // when it was last looked at (pool.uses)
	prepared map[string]bool // the statements its session prepared (session.Conn.Prepared)
}

func (p *pool) Acquire(ctx context.Context) (session.Conn, error) {
	c, err := p.db.Conn(ctx)
	if err != nil {
		return nil, err
	}
	a := &conn{c: c, p: p, intr: make(chan struct{}), abort: make(chan struct{})}
	_ = c.Raw(func(dc any) error {
		a.dc = dc
		if pc, ok := dc.(interface{ Conn() *pgx.Conn }); ok { // pgx's stdlib driver
			a.pgx = &pgxwait.Reader{PC: pc.Conn().PgConn()}
		} else {
			a.pid = libpqPID(dc)
		}
		return nil
	})
	return a, nil
}

// DialsInCall says that db makes a new connection in the caller's context (and drops it half made when that context
// ends): advlock lets the making outlive a call that ran out of time, for the next call (see session.Waits).
func (p *pool) DialsInCall() bool { return true }

// dialSpec is the driver and dsn a *sql.DB was opened with.
type dialSpec struct{ driverName, dsn string }

// Dial opens a connection outside the pool (a *sql.DB of one connection, on Open's driver and dsn) for deadlock
// detection's readings when every connection of the pool is taken: they may be the very cycle to find. A *sql.DB
// given to New offers none, its dsn being unknown.
func (p *pool) Dial(ctx context.Context) (session.TextConn, error) {
	if p.dial == nil {
		return nil, errors.New("advlock: a *sql.DB given to advsql.New cannot open a connection outside itself")
	}
	db, err := sql.Open(p.dial.driverName, p.dial.dsn)
	if err != nil {
		return nil, err
	}
	db.SetMaxOpenConns(1)
	c, err := (&pool{db: db, verified: map[any]*mark{}}).Acquire(ctx)
	if err != nil {
		_ = db.Close()
		return nil, err
	}
	return &dialed{c: c.(*conn), db: db}, nil
}

// dialed is Dial's connection; it closes its *sql.DB with it.
type dialed struct {
	c  *conn
	db *sql.DB
}

func (d *dialed) QueryText(ctx context.Context, q string) (string, error) {
	return d.c.QueryText(ctx, q)
}

func (d *dialed) Close() {
	d.c.Destroy()
	_ = d.db.Close()
}

// Wires reports whether db's driver can give its connection to a shared session: pgx's, and lib/pq's (libpqConn).
func (p *pool) Wires() bool {
	if _, ok := p.db.Driver().(*stdlib.Driver); ok {
		return true
	}
	return reflect.TypeOf(p.db.Driver()).String() == "*pq.Driver" // see libpqConn
}

// Stats reads db.Stats.
func (p *pool) Stats() session.PoolStats {
	st := p.db.Stats()
	return session.PoolStats{Max: st.MaxOpenConnections, Open: st.OpenConnections, InUse: st.InUse, Idle: st.Idle,
		WaitCount: st.WaitCount}
}

// Wire runs f inside Conn.Raw with pgx's connection, or with lib/pq's taken over (libpqConn); with other drivers
// it reports session.ErrNoWire.
func (a *conn) Wire(f func(pc *pgconn.PgConn) error) error {
	if a.pgx != nil {
		return a.c.Raw(func(any) error { return f(a.pgx.PC) })
	}
	return a.c.Raw(func(dc any) error {
		pc, err := libpqConn(dc)
		if err != nil {
			return err // ErrNoWire for a connection laid out otherwise; a passing state of this one, not
		}
		return f(pc)
	})
}

// libpqConn takes lib/pq's connection dc over for a shared session, which drives the protocol on its socket from
// then on, as it does pgx's: a pgconn.PgConn over the same socket. lib/pq gives no access to it, so it is read by
// reflection from the fields lib/pq keeps it in (its socket, and its read buffer, whose unread bytes are read first);
// anything laid out otherwise (another lib/pq version) is refused, and the Locker then takes a session per lock.
// lib/pq never uses the connection again: a shared session is never pooled, its end closes it.
func libpqConn(dc any) (*pgconn.PgConn, error) {
	v := reflect.ValueOf(dc)
	if v.Kind() != reflect.Pointer || v.IsNil() || v.Type().String() != "*pq.conn" || v.Elem().Kind() != reflect.Struct {
		return nil, fmt.Errorf("%w: %T is not lib/pq's connection", session.ErrNoWire, dc)
	}
	c, buf := v.Elem().FieldByName("c"), v.Elem().FieldByName("buf")
	if !c.IsValid() || c.Type() != reflect.TypeFor[net.Conn]() || !buf.IsValid() || buf.Type() != reflect.TypeFor[*bufio.Reader]() {
		return nil, fmt.Errorf("%w: lib/pq's connection is not laid out as this version of advlock knows it", session.ErrNoWire)
	}
	nc, _ := reflect.NewAt(c.Type(), unsafe.Pointer(c.UnsafeAddr())).Elem().Interface().(net.Conn)
	br, _ := reflect.NewAt(buf.Type(), unsafe.Pointer(buf.UnsafeAddr())).Elem().Interface().(*bufio.Reader)
	if nc == nil || br == nil {
		return nil, errors.New("lib/pq's connection has no socket") // closed: this open fails, the next tries another
	}
	// What lib/pq read but has not handled (a message the server sent after its last answer: a notification, a
	// FATAL) is read first, then the socket.
	pending, err := br.Peek(br.Buffered())
	if err != nil {
		return nil, fmt.Errorf("lib/pq's read buffer: %w", err)
	}
	pending = bytes.Clone(pending)
	return pgconn.Construct(&pgconn.HijackedConn{
		Conn: nc, PID: libpqPID(dc), TxStatus: 'I', Frontend: pgproto3.NewFrontend(nc, nc),
		Config: &pgconn.Config{
			BuildFrontend: func(r io.Reader, w io.Writer) *pgproto3.Frontend {
				return pgproto3.NewFrontend(io.MultiReader(bytes.NewReader(pending), r), w)
			},
			BuildContextWatcherHandler: func(pc *pgconn.PgConn) ctxwatch.Handler {
				return &pgconn.DeadlineContextWatcherHandler{Conn: pc.Conn()}
			},
			// pgconn sends a cancel request when a statement of its own is cut short (a shared session's setup
			// past its bound), dialing with this: none is sent, the session is closed anyway.
			DialFunc: func(context.Context, string, string) (net.Conn, error) {
				return nil, errors.New("no cancel request for a shared session over lib/pq")
			},
		},
	})
}

// conn is one pinned *sql.Conn.
type conn struct {
	c   *sql.Conn
	p   *pool
	dc  any             // the driver connection
	pgx *pgxwait.Reader // nil unless the driver is pgx
	pid uint32          // lib/pq: the startup pid (libpqPID)

	mu    sync.Mutex
	intr  chan struct{} // closed by Interrupt (drivers other than pgx)
	stuck chan struct{} // closed when a statement that outlived its ctx ends (drivers other than pgx)
	abort chan struct{} // closed by Abort (drivers other than pgx)
	once  sync.Once
}

func (a *conn) QueryInt(ctx context.Context, q string, args ...any) (int64, error) {
	if len(args) == 0 && a.pgx != nil {
		var v int64
		err := a.c.Raw(func(any) error {
			var err error
			v, err = a.pgx.ExecInt(ctx, q)
			return err
		})
		return v, err
	}
	v, err := a.bounded(ctx, func(ctx context.Context) (int64, error) {
		var v int64
		err := a.c.QueryRowContext(ctx, q, args...).Scan(&v)
		return v, err
	})
	return v, session.TranslateErr(err)
}

// QueryText runs q and returns the text in the first column of its one row.
func (a *conn) QueryText(ctx context.Context, q string) (string, error) {
	if a.pgx != nil { // over the simple protocol, as QueryInt without arguments
		return a.rawText(func() (string, error) { return a.pgx.ExecText(ctx, q) })
	}
	var v string
	_, err := a.bounded(ctx, func(ctx context.Context) (int64, error) {
		return 0, a.c.QueryRowContext(ctx, q).Scan(&v)
	})
	return v, session.TranslateErr(err)
}

// QueryTextUntil is QueryText bounded by deadline (session.UntilQuerier): on the socket's deadline with pgx's
// driver, else with a context that ends then.
func (a *conn) QueryTextUntil(ctx context.Context, deadline time.Time, q string) (string, error) {
	if a.pgx == nil {
		ctx, cancel := context.WithDeadline(context.WithoutCancel(ctx), deadline)
		defer cancel()
		return a.QueryText(ctx, q)
	}
	return a.rawText(func() (string, error) { return a.pgx.ExecTextUntil(deadline, q) })
}

// rawText runs f, a statement on pgx's own connection, with the driver connection held (database/sql's Raw).
func (a *conn) rawText(f func() (string, error)) (string, error) {
	var v string
	err := a.c.Raw(func(any) error {
		var err error
		v, err = f()
		return err
	})
	return v, err
}

// bounded runs f, a statement on the connection under the ctx it is given, and returns when it does or when ctx
// ends (or Abort is called), whichever is first. pgx honours ctx itself; lib/pq answers a cancelled ctx only once
// the server does, which on a dead network is never. f's ctx ends with ctx or with Abort, so lib/pq sends its
// cancel request either way. A statement left running marks the connection stuck: Destroy then discards it once
// the statement ends, and Cancel waits for that.
func (a *conn) bounded(ctx context.Context, f func(context.Context) (int64, error)) (int64, error) {
	if a.pgx != nil {
		return f(ctx)
	}
	fctx, cancel := context.WithCancel(ctx)
	defer cancel()
	type result struct {
		v   int64
		err error
	}
	done := make(chan result, 1)
	go func() {
		v, err := f(fctx)
		done <- result{v, err}
		close(done)
	}()
	var gaveUp error
	select {
	case r := <-done:
		return r.v, r.err
	case <-ctx.Done():
		gaveUp = ctx.Err()
	case <-a.abort:
		gaveUp = errAborted
		cancel() // lib/pq sends its cancel request
	}
	select {
	case r := <-done:
		return r.v, r.err
	default:
	}
	a.stuck = make(chan struct{})
	go func(stuck chan struct{}) {
		for range done {
		}
		close(stuck)
	}(a.stuck)
	return 0, gaveUp
}

var errAborted = errors.New("statement abandoned: the Locker was closed")

// Abort closes the socket (pgx) or abandons the running statement (other drivers; see bounded).
func (a *conn) Abort() {
	if a.pgx != nil {
		a.pgx.CloseSocket()
		return
	}
	a.once.Do(func() { close(a.abort) })
}

func (a *conn) Wait(deadline time.Time) error {
	if a.pgx != nil {
		var err error
		if rerr := a.c.Raw(func(any) error {
			err = a.pgx.Wait(deadline)
			return nil
		}); rerr != nil {
			return fmt.Errorf("session ended: %w", rerr) // the *sql.Conn was closed under the watcher
		}
		return err
	}
	// No access to the socket: wait out the interval; the keepalive that follows checks the session.
	a.mu.Lock()
	intr := a.intr
	a.mu.Unlock()
	t := time.NewTimer(time.Until(deadline))
	defer t.Stop()
	select {
	case <-t.C:
	case <-intr:
	}
	return session.ErrWaitTimeout
}

func (a *conn) Interrupt() {
	if a.pgx != nil {
		a.pgx.Interrupt()
		return
	}
	a.mu.Lock()
	defer a.mu.Unlock()
	select {
	case <-a.intr:
	default:
		close(a.intr)
	}
}

func (a *conn) ClearDeadline() {
	if a.pgx != nil {
		a.pgx.ClearDeadline()
		return
	}
	a.mu.Lock()
	defer a.mu.Unlock()
	select {
	case <-a.intr:
		a.intr = make(chan struct{})
	default:
	}
}

func (a *conn) Ping(ctx context.Context) error {
	_, err := a.bounded(ctx, func(ctx context.Context) (int64, error) {
		var one int64
		return one, a.c.QueryRowContext(ctx, "SELECT 1").Scan(&one)
	})
	return err
}

func (a *conn) Release() { _ = a.c.Close() }

// Destroy discards the connection: driver.ErrBadConn from Raw makes database/sql close it instead of pooling it.
// With pgx the socket is closed first, so the server ends the backend at once.
func (a *conn) Destroy() {
	a.p.mu.Lock()
	delete(a.p.verified, a.dc)
	a.p.mu.Unlock()
	discard := func() {
		_ = a.c.Raw(func(any) error {
			if a.pgx != nil {
				a.pgx.CloseSocket()
			}
			return driver.ErrBadConn
		})
		_ = a.c.Close()
	}
	if a.stuck == nil {
		discard()
		return
	}
	// A statement still runs on it (see bounded); database/sql lets nobody else at the connection until it ends.
	go func() {
		<-a.stuck
		discard()
	}()
}

func (a *conn) ClientPID() uint32 {
	if a.pgx != nil {
		return a.pgx.ClientPID()
	}
	return a.pid
}

// libpqPID is the pid lib/pq's connection got at startup (BackendKeyData), which lib/pq keeps for its cancel
// requests but does not export: it is read from its unexported field. With it a direct connection is proved to be
// a session of its own without a second connection, as with pgx. Any other driver, or a lib/pq whose connection
// no longer has the field, gives 0: a second connection is then asked for, as before.
func libpqPID(dc any) uint32 {
	v := reflect.ValueOf(dc)
	if v.Kind() != reflect.Pointer || v.IsNil() || v.Type().String() != "*pq.conn" || v.Elem().Kind() != reflect.Struct {
		return 0
	}
	f := v.Elem().FieldByName("pid")
	if !f.IsValid() || !f.CanInt() || f.Int() <= 0 || f.Int() > math.MaxUint32 {
		return 0
	}
	return uint32(f.Int())
}

func (a *conn) ServerPID() uint32 {
	if a.pgx != nil {
		return a.pgx.ServerPID()
	}
	a.p.mu.Lock()
	defer a.p.mu.Unlock()
	if m := a.p.verified[a.dc]; m != nil {
		return m.pid
	}
	return 0
}

func (a *conn) Verified() (ok, direct bool) {
	if a.pgx != nil {
		return a.pgx.Verified()
	}
	a.p.mu.Lock()
	defer a.p.mu.Unlock()
	m := a.p.verified[a.dc]
	if m == nil {
		return false, false
	}
	a.p.uses++
	m.used = a.p.uses
	return true, m.direct
}

// Prepared reports what MarkPrepared recorded for the connection (nothing for one not verified).
func (a *conn) Prepared(name string) bool {
	if a.pgx != nil {
		return a.pgx.Prepared(name)
	}
	a.p.mu.Lock()
	defer a.p.mu.Unlock()
	m := a.p.verified[a.dc]
	if m == nil {
		return false
	}
	a.p.uses++
	m.used = a.p.uses // a connection in use keeps its mark (trimLocked)
	return m.prepared[name]
}

// MarkPrepared records with the connection's mark whether its session prepared name (a connection not verified
// keeps no record).
func (a *conn) MarkPrepared(name string, ok bool) {
	if a.pgx != nil {
		a.pgx.MarkPrepared(name, ok)
		return
	}
	a.p.mu.Lock()
	defer a.p.mu.Unlock()
	m := a.p.verified[a.dc]
	if m == nil {
		return
	}
	if !ok {
		delete(m.prepared, name)
		return
	}
	if m.prepared == nil {
		m.prepared = map[string]bool{}
	}
	m.prepared[name] = true
}

func (a *conn) MarkVerified(direct bool, pid uint32) {
	if a.pgx != nil {
		a.pgx.MarkVerified(direct, pid)
		return
	}
	a.p.mu.Lock()
	defer a.p.mu.Unlock()
	a.p.uses++
	a.p.verified[a.dc] = &mark{direct: direct, pid: pid, used: a.p.uses}
	a.p.trimLocked()
}

// trimLocked bounds the marks by the connections that can be alive. database/sql closes connections without
// telling (idle too long, too old, too many idle), and their marks would keep them referenced for ever: past twice
// the pool's connections (at least 16), the least recently used half goes. A mark dropped from a live connection
// costs only a second check of it.
func (p *pool) trimLocked() {
	st := p.db.Stats()
	limit := max(16, 2*max(st.MaxOpenConnections, st.OpenConnections))
	if len(p.verified) <= limit {
		return
	}
	used := make([]uint64, 0, len(p.verified))
	for _, m := range p.verified {
		used = append(used, m.used)
	}
	slices.Sort(used)
	cut := used[len(used)-limit/2] // keep the limit/2 most recently used
	for dc, m := range p.verified {
		if m.used < cut {
			delete(p.verified, dc)
		}
	}
}

// Cancel sends a cancel request with pgx's driver. lib/pq sends its own when a statement's ctx ends, and the
// statement ends once the server has answered it: Cancel waits for that (see bounded), until ctx ends.
func (a *conn) Cancel(ctx context.Context) {
	if a.pgx != nil {
		a.pgx.Cancel(ctx)
		return
	}
	if a.stuck == nil {
		return // no statement outlived its ctx
	}
	select {
	case <-a.stuck:
	case <-ctx.Done():
	}
}

var errNilTx = errors.New("nil transaction")

// option makes an advlock.Option of f (see config.NewOption).
func option(f func(*config.Options)) advlock.Option { return config.NewOption(f).(advlock.Option) }
