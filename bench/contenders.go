package main

import (
	"context"
	"database/sql"
	"fmt"
	"strings"
	"sync"
	"time"

	"github.com/advlock/advlock"
	"github.com/advlock/advlock/advsql"
	"github.com/go-redsync/redsync/v4"
	"github.com/go-redsync/redsync/v4/redis/goredis/v9"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	_ "github.com/jackc/pgx/v5/stdlib"
	goredislib "github.com/redis/go-redis/v9"
	clientv3 "go.etcd.io/etcd/client/v3"
	"go.etcd.io/etcd/client/v3/concurrency"
	"go.uber.org/zap"
)

// client is one process's view of a lock service: it takes and releases locks by name.
type client interface {
	// lock blocks until key is held and returns its release.
	lock(ctx context.Context, key string) (func(context.Context) error, error)
	// cycle takes key (blocking), runs during (when not nil) while it is held, and releases it, the way a caller of
	// this client's API does it: lock and unlock, or for advlock Do one call of Do.
	cycle(ctx context.Context, key string, during func()) error
	close()
}

// lockCycle is cycle through lock and its release.
func lockCycle(ctx context.Context, c client, key string, during func()) error {
	un, err := c.lock(ctx, key)
	if err != nil {
		return err
	}
	if during != nil {
		during()
	}
	return un(ctx)
}

// contender makes clients of one kind.
type contender struct {
	name string
	// blocking: lock waits in the service; false for try-only contenders, which skip the contended workloads.
	blocking bool
	pg       bool // PostgreSQL-based (has a server session to terminate)
	shares   bool // advlock with shared sessions: holds thousands of locks on a few connections
	optIn    bool // runs only when -only names it
	polls    bool // a lease: waits try again every poll, so fewer handoff samples
	new      func(ctx context.Context) (client, error)
}

// sessionPerLock is advlock with WithSharedSessions(0): every lock on a session of its own.
const sessionPerLock = "advlock Lock, session per lock"

// The Open contenders: a Locker from advlock.Open with its own pool, of the default size (DefaultOpenConns) or of
// the 24 connections that were the default before. The second runs only when -only names it: with every other
// contender connected at once, its clients would take the server past max_connections=100.
const (
	openDefault = "advlock Open"
	open24      = "advlock Open, pool of 24"
)

// openURL is url with pool_max_conns=n added (n 0: url as it is).
func openURL(url string, n int) string {
	if n == 0 {
		return url
	}
	sep := "?"
	if strings.Contains(url, "?") {
		sep = "&"
	}
	return fmt.Sprintf("%s%spool_max_conns=%d", url, sep, n)
}

func pgKey(key string) int64 { v, _ := advlock.NameKey("bench-" + key).Int64(); return v }

type env struct {
	pgURL      string
	bouncerURL string // PgBouncer in transaction mode in front of pgURL ("" when pgbouncer is not installed)
	poolURL    string // pgURL with a pool big enough to hold 50 locks at once
	redis      *goredislib.Client
	etcdURLs   []string
}

// poolSizeKey in a ctx given to contender.new overrides the pool size of the pool it makes.
type poolSizeKey struct{}

// newPool makes a pool on e.poolURL (64 connections) or with the size ctx carries.
func (e *env) newPool(ctx context.Context) (*pgxpool.Pool, error) {
	cfg, err := pgxpool.ParseConfig(e.poolURL)
	if err != nil {
		return nil, err
	}
	if n, ok := ctx.Value(poolSizeKey{}).(int); ok {
		cfg.MaxConns = int32(n)
	}
	return pgxpool.NewWithConfig(ctx, cfg)
}

func contenders(e *env) []contender {
	return append([]contender{
		{name: "raw pgx (dedicated conn)", blocking: true, pg: true, new: func(ctx context.Context) (client, error) {
			c, err := pgx.Connect(ctx, e.pgURL)
			return &rawPgx{c: c}, err
		}},
		{name: "raw pgxpool", blocking: true, pg: true, new: func(ctx context.Context) (client, error) {
			p, err := e.newPool(ctx)
			return &rawPool{p: p}, err
		}},
		{name: "advlock TryLock", pg: true, shares: true, new: func(ctx context.Context) (client, error) {
			p, err := e.newPool(ctx)
			return &advClient{p: p, l: advlock.New(p), try: true}, err
		}},
		{name: "advlock Lock", blocking: true, pg: true, shares: true, new: func(ctx context.Context) (client, error) {
			p, err := e.newPool(ctx)
			return &advClient{p: p, l: advlock.New(p)}, err
		}},
		{name: sessionPerLock, blocking: true, pg: true, new: func(ctx context.Context) (client, error) {
			p, err := e.newPool(ctx)
			return &advClient{p: p, l: advlock.New(p, advlock.WithSharedSessions(0))}, err
		}},
		{name: "advlock Do", blocking: true, pg: true, shares: true, new: func(ctx context.Context) (client, error) {
			p, err := e.newPool(ctx)
			return &advClient{p: p, l: advlock.New(p), do: true}, err
		}},
		{name: openDefault, blocking: true, pg: true, shares: true, new: func(ctx context.Context) (client, error) {
			l, err := advlock.Open(ctx, e.pgURL)
			return &advClient{l: l}, err
		}},
		{name: open24, blocking: true, pg: true, shares: true, optIn: true, new: func(ctx context.Context) (client, error) {
			l, err := advlock.Open(ctx, openURL(e.pgURL, 24))
			return &advClient{l: l}, err
		}},
		{name: "advlock database/sql", blocking: true, pg: true, shares: true, new: func(ctx context.Context) (client, error) {
			db, err := sql.Open("pgx", e.pgURL)
			return &advClient{db: db, l: advsql.New(db)}, err
		}},
		{name: "redsync (Redis)", blocking: true, new: func(ctx context.Context) (client, error) {
			return &redsyncClient{rs: redsync.New(goredis.NewPool(e.redis))}, nil
		}},
		{name: "etcd concurrency.Mutex", blocking: true, new: func(ctx context.Context) (client, error) {
			c, err := clientv3.New(clientv3.Config{Endpoints: e.etcdURLs, DialTimeout: 5 * time.Second, Logger: zap.NewNop()})
			if err != nil {
				return nil, err
			}
			s, err := concurrency.NewSession(c, concurrency.WithTTL(10))
			if err != nil {
				c.Close()
				return nil, err
			}
			return &etcdClient{c: c, s: s}, nil
		}},
	}, leaseContenders(e)...)
}

type rawPgx struct{ c *pgx.Conn }

func (r *rawPgx) lock(ctx context.Context, key string) (func(context.Context) error, error) {
	k := pgKey(key)
	if _, err := r.c.Exec(ctx, "SELECT pg_advisory_lock($1)", k); err != nil {
		return nil, err
	}
	return func(ctx context.Context) error {
		var ok bool
		if err := r.c.QueryRow(ctx, "SELECT pg_advisory_unlock($1)", k).Scan(&ok); err != nil || !ok {
			return fmt.Errorf("unlock: %v %v", ok, err)
		}
		return nil
	}, nil
}

func (r *rawPgx) cycle(ctx context.Context, key string, during func()) error {
	return lockCycle(ctx, r, key, during)
}

func (r *rawPgx) close() { r.c.Close(context.Background()) }

type rawPool struct{ p *pgxpool.Pool }

func (r *rawPool) lock(ctx context.Context, key string) (func(context.Context) error, error) {
	k := pgKey(key)
	c, err := r.p.Acquire(ctx)
	if err != nil {
		return nil, err
	}
	if _, err := c.Exec(ctx, "SELECT pg_advisory_lock($1)", k); err != nil {
		c.Release()
		return nil, err
	}
	return func(ctx context.Context) error {
		defer c.Release()
		var ok bool
		if err := c.QueryRow(ctx, "SELECT pg_advisory_unlock($1)", k).Scan(&ok); err != nil || !ok {
			return fmt.Errorf("unlock: %v %v", ok, err)
		}
		return nil
	}, nil
}

func (r *rawPool) cycle(ctx context.Context, key string, during func()) error {
	return lockCycle(ctx, r, key, during)
}

func (r *rawPool) close() { r.p.Close() }

type advClient struct {
	p       *pgxpool.Pool
	db      *sql.DB
	l       *advlock.Locker
	try, do bool
}

func (a *advClient) lock(ctx context.Context, key string) (func(context.Context) error, error) {
	k := advlock.NameKey("bench-" + key)
	var lk *advlock.Lock
	var err error
	if a.try {
		lk, err = a.l.TryLock(ctx, k)
	} else {
		lk, err = a.l.Lock(ctx, k) // also the Do contenders' holder in the handoff workload
	}
	if err != nil {
		return nil, err
	}
	return lk.Unlock, nil
}

// cycle is one call of Do for the Do contenders (fn runs during), else lock and unlock.
func (a *advClient) cycle(ctx context.Context, key string, during func()) error {
	if !a.do {
		return lockCycle(ctx, a, key, during)
	}
	return a.l.Do(ctx, advlock.NameKey("bench-"+key), func(context.Context) error {
		if during != nil {
			during()
		}
		return nil
	})
}

func (a *advClient) close() {
	a.l.Close()
	if a.p != nil {
		a.p.Close()
	}
	if a.db != nil {
		a.db.Close()
	}
}

type redsyncClient struct{ rs *redsync.Redsync }

func (r *redsyncClient) lock(ctx context.Context, key string) (func(context.Context) error, error) {
	m := r.rs.NewMutex("bench-"+key, redsync.WithExpiry(30*time.Second), redsync.WithTries(10000))
	if err := m.LockContext(ctx); err != nil {
		return nil, err
	}
	return func(ctx context.Context) error {
		ok, err := m.UnlockContext(ctx)
		if err == nil && !ok {
			err = fmt.Errorf("redsync unlock returned false")
		}
		return err
	}, nil
}

func (r *redsyncClient) cycle(ctx context.Context, key string, during func()) error {
	return lockCycle(ctx, r, key, during)
}

func (r *redsyncClient) close() {}

type etcdClient struct {
	c *clientv3.Client
	s *concurrency.Session
}

func (e *etcdClient) lock(ctx context.Context, key string) (func(context.Context) error, error) {
	m := concurrency.NewMutex(e.s, "/bench/"+key)
	if err := m.Lock(ctx); err != nil {
		return nil, err
	}
	return m.Unlock, nil
}

func (e *etcdClient) cycle(ctx context.Context, key string, during func()) error {
	return lockCycle(ctx, e, key, during)
}

func (e *etcdClient) close() {
	e.s.Close()
	e.c.Close()
}

// rawConns is raw pgx for one process whose goroutines share n dedicated connections (goroutine g uses connection
// g mod n): the hand-written alternative to a Locker for many request-scoped locks.
type rawConns struct {
	conns []*pgx.Conn
	mu    []sync.Mutex
}

func newRawConns(ctx context.Context, url string, n int) (*rawConns, error) {
	r := &rawConns{mu: make([]sync.Mutex, n)}
	for range n {
		c, err := pgx.Connect(ctx, url)
		if err != nil {
			r.close()
			return nil, err
		}
		r.conns = append(r.conns, c)
	}
	return r, nil
}

// cycle locks and unlocks key on connection g mod n.
func (r *rawConns) cycle(ctx context.Context, g int, key int64) error {
	i := g % len(r.conns)
	r.mu[i].Lock()
	defer r.mu[i].Unlock()
	var ok bool
	if err := r.conns[i].QueryRow(ctx, "SELECT pg_try_advisory_lock($1)", key).Scan(&ok); err != nil || !ok {
		return fmt.Errorf("lock: %v %v", ok, err)
	}
	if err := r.conns[i].QueryRow(ctx, "SELECT pg_advisory_unlock($1)", key).Scan(&ok); err != nil || !ok {
		return fmt.Errorf("unlock: %v %v", ok, err)
	}
	return nil
}

// cycleWait locks key on connection g mod n, waiting in the server, and unlocks it.
func (r *rawConns) cycleWait(ctx context.Context, g int, key int64) error {
	i := g % len(r.conns)
	r.mu[i].Lock()
	defer r.mu[i].Unlock()
	if _, err := r.conns[i].Exec(ctx, "SELECT pg_advisory_lock($1)", key); err != nil {
		return fmt.Errorf("lock: %v", err)
	}
	var ok bool
	if err := r.conns[i].QueryRow(ctx, "SELECT pg_advisory_unlock($1)", key).Scan(&ok); err != nil || !ok {
		return fmt.Errorf("unlock: %v %v", ok, err)
	}
	return nil
}

func (r *rawConns) close() {
	for _, c := range r.conns {
		c.Close(context.Background())
	}
}
