// Package faults is a small TCP proxy for injecting network faults between a client and PostgreSQL in tests: cut
// every connection, refuse new ones (as a server that is down), blackhole traffic (bytes vanish, sockets stay
// open, as when a network silently drops), or add latency, to every chunk or to each new connection's setup.
package faults

import (
	"net"
	"sync"
	"sync/atomic"
	"testing"
	"time"
)

// Proxy forwards connections from its own 127.0.0.1 port to a target address.
type Proxy struct {
	ln        net.Listener
	target    string
	blackhole atomic.Bool
	refuse    atomic.Bool
	latency   atomic.Int64 // nanoseconds added before each forwarded chunk
	answers   atomic.Int64 // nanoseconds added before each chunk from the server (AnswerLatency)
	setup     atomic.Int64 // nanoseconds added before the server's first chunk on each new connection
	dials     atomic.Int64 // connections accepted

	mu      sync.Mutex
	closed  bool
	links   map[net.Conn]net.Conn // client side -> server side
	swallow []net.Conn            // sockets whose peer closed while the blackhole was on
	wg      sync.WaitGroup
}

// Start listens on a free 127.0.0.1 port, forwards to target (host:port), and closes when the test ends.
func Start(tb testing.TB, target string) *Proxy {
	tb.Helper()
	p, err := New(target)
	if err != nil {
		tb.Fatal(err)
	}
	tb.Cleanup(p.Close)
	return p
}

// New listens on a free 127.0.0.1 port and forwards to target (host:port) until Close.
func New(target string) (*Proxy, error) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return nil, err
	}
	p := &Proxy{ln: ln, target: target, links: map[net.Conn]net.Conn{}}
	p.wg.Add(1)
	go p.accept()
	return p, nil
}

// Addr is the proxy's host:port.
func (p *Proxy) Addr() string { return p.ln.Addr().String() }

// Port is the proxy's port.
func (p *Proxy) Port() int { return p.ln.Addr().(*net.TCPAddr).Port }

func (p *Proxy) accept() {
	defer p.wg.Done()
	for {
		c, err := p.ln.Accept()
		if err != nil {
			return
		}
		p.dials.Add(1)
		if p.refuse.Load() {
			c.Close()
			continue
		}
		s, err := net.DialTimeout("tcp", p.target, 5*time.Second)
		if err != nil {
			c.Close()
			continue
		}
		p.mu.Lock()
		if p.closed {
			p.mu.Unlock()
			c.Close()
			s.Close()
			return
		}
		p.links[c] = s
		p.mu.Unlock()
		p.wg.Add(2)
		go p.pipe(c, s, 0, nil)
		go p.pipe(s, c, time.Duration(p.setup.Load()), &p.answers)
	}
}

// pipe forwards from's bytes to to; first delays the first chunk (see SetupLatency), and extra, when not nil, each
// chunk (see AnswerLatency).
func (p *Proxy) pipe(from, to net.Conn, first time.Duration, extra *atomic.Int64) {
	defer p.wg.Done()
	buf := make([]byte, 32<<10)
	for {
		n, err := from.Read(buf)
		if n > 0 && !p.blackhole.Load() {
			d := time.Duration(p.latency.Load()) + first
			if extra != nil {
				d += time.Duration(extra.Load())
			}
			if d > 0 {
				time.Sleep(d)
			}
			first = 0
			if p.blackhole.Load() {
				continue
			}
			if _, werr := to.Write(buf[:n]); werr != nil {
				err = werr
			}
		}
		if err != nil {
			from.Close()
			if p.blackhole.Load() { // a blackhole swallows the close too, until it ends (see Blackhole)
				p.mu.Lock()
				p.swallow = append(p.swallow, to)
				p.mu.Unlock()
			} else {
				to.Close()
			}
			return
		}
	}
}

// Cut closes every current connection on both sides, as a network reset would.
func (p *Proxy) Cut() {
	p.mu.Lock()
	defer p.mu.Unlock()
	for c, s := range p.links {
		c.Close()
		s.Close()
		delete(p.links, c)
	}
}

// Blackhole makes every byte in both directions, on current and new connections, vanish while on; sockets stay
// open, so neither side learns anything until its own timeouts fire. When it goes off, a side whose peer closed
// meanwhile is closed too, as a real network would tell it at once when packets flow again (the peer's host
// answers with a reset): without that, the proxy would keep a server session whose client is long gone alive for
// ever, where a real blackhole ends it at the server's TCP keepalive.
func (p *Proxy) Blackhole(on bool) {
	p.blackhole.Store(on)
	if on {
		return
	}
	p.mu.Lock()
	swallowed := p.swallow
	p.swallow = nil
	p.mu.Unlock()
	for _, c := range swallowed {
		c.Close()
	}
}

// Refuse makes the proxy close every new connection at once, before it reaches the server, while on: a client
// sees its connection closed before the server's first answer, as from a server that is down or restarting.
// Connections already open are left alone (Cut ends them).
func (p *Proxy) Refuse(on bool) { p.refuse.Store(on) }

// Latency delays every forwarded chunk by d.
func (p *Proxy) Latency(d time.Duration) { p.latency.Store(int64(d)) }

// AnswerLatency delays every chunk from the server by d, and nothing the client sends: a request reaches the server
// at once, its answer d later (a link slow one way, or an answer held up on its way back).
func (p *Proxy) AnswerLatency(d time.Duration) { p.answers.Store(int64(d)) }

// SetupLatency delays the server's first answer on each connection made from now on by d, as a loaded server
// is slow to start a session, or a far one to finish a handshake; later bytes flow as usual.
func (p *Proxy) SetupLatency(d time.Duration) { p.setup.Store(int64(d)) }

// Dials is how many connections the proxy has accepted.
func (p *Proxy) Dials() int { return int(p.dials.Load()) }

// Close stops the proxy and closes every connection.
func (p *Proxy) Close() {
	p.mu.Lock()
	p.closed = true
	p.mu.Unlock()
	p.ln.Close()
	p.Cut()
	p.Blackhole(false)
	p.wg.Wait()
}
