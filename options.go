package advlock

import (
	"time"

	"github.com/advlock/advlock/internal/config"
	"github.com/jackc/pgx/v5/pgxpool"
)

// Option configures a Locker made by [New] or [Open] (or advsql.New, advsql.Open). Use the With functions of this
// package.
type Option interface {
	apply(*config.Options)
}

type option func(*config.Options)

func (f option) apply(o *config.Options) { f(o) }

func init() {
	// What the adapters and the test kit need to make and read options (see config.NewOption).
	config.NewOption = func(f func(*config.Options)) any { return option(f) }
	config.ApplyOption = func(opt any, o *config.Options) { opt.(Option).apply(o) }
}

// WithKeepalive sets how long a held lock's session may stay silent before the Locker makes a keepalive round
// trip, and how long that round trip may take. A network that silently drops the connection is noticed within
// about twice this; a terminated session or a server shutdown is noticed at once whatever its value.
// Default 5s. Values <= 0 keep the default.
func WithKeepalive(d time.Duration) Option {
	return option(func(o *config.Options) {
		if d > 0 {
			o.Keepalive = d
		}
	})
}

// WithReleaseTimeout bounds each unlock that [Locker.Close] and [Locker.Do] make on their own (after the caller's
// context ended, or at Close). When it expires the session is closed instead, which also releases the lock.
// Default 5s. Values <= 0 keep the default.
func WithReleaseTimeout(d time.Duration) Option {
	return option(func(o *config.Options) {
		if d > 0 {
			o.ReleaseTimeout = d
		}
	})
}

// WithPoolConfig lets [Open] adjust the pool configuration after advlock applied its defaults, for example to
// set MaxConns: the Locker's budget of connections, which it shares out between shared sessions, one kept for its
// own reads and sessions of their own for waits (see [Open] and [DefaultOpenConns]). New ignores it.
func WithPoolConfig(f func(*pgxpool.Config)) Option {
	return option(func(o *config.Options) { o.PoolConfig = f })
}

// WithMaxConns sets the size of the pool a Locker owns ([Open], advsql.Open): its budget of connections, which it
// shares out between shared sessions, one kept for its own reads and sessions of their own for waits (see
// [DefaultOpenConns], the default). With Open a pool_max_conns in the DSN, and WithPoolConfig, come after it. New
// and advsql.New ignore it: their pool is the application's. Values <= 0 keep the default.
func WithMaxConns(n int) Option {
	return option(func(o *config.Options) {
		if n > 0 {
			o.MaxConns = n
		}
	})
}

// WithSharedSessions sets how many shared sessions a Locker may open: sessions that each hold many locks, so that
// thousands of locks need a handful of connections. TryLock, TryRLock and the first attempt of Lock, RLock and Do
// are made on them; a Lock that must wait for a key held elsewhere waits on a session of its own and keeps the
// lock there. Requests from many goroutines share round trips. A shared session that is lost (terminated, network
// loss, server restart) ends every lock on it at once, each reporting ErrLockLost.
//
// Default 4; for a Locker from [Open] (or advsql.Open), a quarter of its pool, at least 1 and at most 4 (1 with
// [DefaultOpenConns]). Never more than half of the pool's connections are shared sessions. 0 gives every lock a
// session of its own. With database/sql and lib/pq, which gives no access to its
// connection, it has no effect: every lock has a session of its own.
func WithSharedSessions(n int) Option {
	return option(func(o *config.Options) {
		if n >= 0 {
			o.SharedSessions, o.SharedSet = n, true
		}
	})
}

// WithFencing makes every grant of a session lock (exclusive or shared, on a shared session or one of its own,
// through TryLock, Lock, Do and the rest) carry a fencing token ([Lock.Token], [FenceToken] inside Do): a number
// strictly greater than every token handed out before, for any key, by any client, process or Locker of the same
// database, including after a server restart or crash. It is drawn in the grant's own statement (no extra round
// trip) from the sequence public.advlock_fence, which the Locker creates on first use if it is missing (that needs
// CREATE on schema public; for a role without it, create it once as one that has it: CREATE SEQUENCE
// public.advlock_fence; GRANT USAGE ON SEQUENCE public.advlock_fence TO <role>). Without it a lock call fails with
// ErrFencing saying so; any other failure of that check (a connection lost, no answer within 10 s) is returned as
// it is, and the next call checks again. Many processes may create the sequence at once. Default off: Token is 0.
//
// A token is the server's timeline in its high bits and the sequence's value in its low 48 (timeline<<48 +
// nextval): a promotion starts a greater timeline, so a promoted standby whose sequence lost the old primary's last
// values still hands out only greater tokens, and a deposed primary that keeps running only lower ones. Two servers
// promoted onto the same timeline (a split brain among standbys) hand out tokens that do not order.
//
// A protected resource checks the token and refuses a stale holder, for example UPDATE ... SET fence = $token
// WHERE id = $1 AND fence < $token: a holder that was paused past the loss of its lock (a GC pause, SIGSTOP) and
// then writes is refused once a later holder has written. [FenceSQL] creates a function that does this check for
// resources written in SQL.
func WithFencing() Option {
	return option(func(o *config.Options) { o.Fencing = true })
}

// WithLeases makes every lock of the Locker a lease: a row of the table public.advlock_lease instead of a session
// lock, so that it needs no session of its own. Every statement is one short autocommit statement without
// parameters, which any pooler (PgBouncer in transaction mode, Supabase's and Neon's pooled ports, RDS Proxy) and
// any driver carries. A lease lasts 15 s on the server's clock and is renewed every 5 s; its holder trusts it until
// its own clock, counted from when it sent the last renewal the server confirmed, reaches 14 s, and Done closes
// then at the latest. A holder that dies holds its key until its lease expires.
//
// A lease excludes other leases of the same key, not pg_advisory_lock users of the same number: a key must be
// taken as a lease by everyone who takes it. Its fencing token is its term (WithFencing changes nothing).
// Shared locks (RLock, TryRLock) are refused with errors.ErrUnsupported, and so is a wait without a bound (Wait
// or a ctx deadline) whose caller holds locks (inside Do's fn, or with Holding): leases have no deadlock
// detection. The table (and the fencing sequence) are created on first use where the role may: LeaseTableSQL is
// what to run where DDL goes through migrations. Inspect, Leader and advlock ls list the leases held
// (LockInfo.Lease), and BreakLease (advlock break) deletes one. See docs/leases.md.
func WithLeases() Option {
	return option(func(o *config.Options) { o.Leases = true })
}

// WithLeaseHolder adds name to how the Locker's leases name their holder (see [WithLeases]), after the host and
// process id: advlock ls, Inspect's LeaseInfo.Holder and Leader show it. Printable ASCII is kept (other characters
// become '?'). advlock run --leases adds its KEY. The application_name of the connection string, when it names
// one (with [Open], advsql.Open, or [New] over a pgxpool; not advsql.New, which cannot see it), comes between
// them.
func WithLeaseHolder(name string) Option {
	return option(func(o *config.Options) { o.LeaseHolder = name })
}

// WithLeaseLength sets the length of the Locker's leases (see [WithLeases]): renewed every third of it, trusted
// by the holder until a fifteenth of it before it ends. Values < 1s keep the default of 15s.
func WithLeaseLength(d time.Duration) Option {
	return option(func(o *config.Options) {
		if d >= time.Second {
			o.LeaseLength = d
		}
	})
}

// CallOption adjusts one call of Lock, RLock, Do (not TryLock, TryRLock or TryDo, which never wait).
type CallOption func(*callOpts)

type callOpts struct {
	wait    time.Duration
	waitSet bool
	hold    time.Duration
}

func callOptions(opts []CallOption) callOpts {
	var c callOpts
	for _, o := range opts {
		o(&c)
	}
	return c
}

// HoldAtLeast keeps the key held until at least d after its grant, even when the caller unlocks sooner (or Do's fn
// returns sooner). Such an Unlock asks the server whether the lock is still held (one round trip on its session,
// or one statement on a lease's row), marks it held past its work, and returns: nil when held, ErrLockLost when it
// was lost, or an error matching ErrUnlockFailed and ctx's error when no answer came before ctx ended (the lock
// then stays held as asked); Do's result says the same. The lock is released in the background when d has passed
// since the grant. Meanwhile it stays a normal lock: Done and Err tell a loss, observers hear of its end when it
// really ends, [Locker.Stats] counts it, [Inspect] marks it Lingering and advlock ls shows it held past its work,
// fencing tokens are as usual, and this Locker's other callers of the key wait or fail as for any held lock.
// [Locker.Close] releases it at once. It is what makes a scheduled job run once per tick on several replicas whose
// clocks or start times differ (with [TickKey]): see docs/locks.md, "Scheduled jobs". d <= 0 holds nothing past
// the unlock. The last HoldAtLeast given counts.
func HoldAtLeast(d time.Duration) CallOption {
	return func(c *callOpts) { c.hold = d }
}

// Wait bounds how long a call waits for the key, apart from its ctx: when d elapses without a grant the call
// returns ErrNotAcquired (not a context error), while ctx keeps governing the wait (and, for Do, fn's run: fn's
// context is not cut when d elapses). Wait(0) or less tries once. The server bounds the wait itself
// (lock_timeout), so a wait that runs out keeps its session. The call returns when the server's answer comes:
// about d after the call on a healthy link; on a link that stalls as d elapses, when the late answer arrives, at
// most d plus the slowest round trip the wait has seen plus the keepalive bound (WithKeepalive, 5 s by default)
// after the call, after which the server counts as gone and the session is closed (a 3 s stall ending a Wait(2s)
// returns after about 4.5 s, with ErrNotAcquired). The last Wait given counts.
func Wait(d time.Duration) CallOption {
	return func(c *callOpts) { c.wait, c.waitSet = d, true }
}
