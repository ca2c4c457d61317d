// Package faults is a small TCP proxy for injecting network faults between a client and PostgreSQL in tests: cut
// every connection, refuse new ones (as a server that is down), partition (bytes held back and delivered when it
// ends, as TCP retransmits them when a network heals), blackhole traffic (bytes vanish, sockets stay open), or add
// latency, to every chunk or to each new connection's setup.
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
	partition atomic.Bool
	healed    chan struct{} // closed as a partition ends; replaced as one begins (under mu)
	holding   atomic.Int64  // pipes holding what they read for a partition's end, or writing it since
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
	p := &Proxy{ln: ln, target: target, links: map[net.Conn]net.Conn{}, healed: make(chan struct{})}
	close(p.healed)
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
		p.holding.Add(1)
		p.held() // what was read, or the peer's close, passes once a partition ends
		if n > 0 && !p.blackhole.Load() {
			d := time.Duration(p.latency.Load()) + first
			if extra != nil {
				d += time.Duration(extra.Load())
			}
			if d > 0 {
				time.Sleep(d)
				p.held() // a partition that began during the delay holds the chunk too
			}
			first = 0
			if p.blackhole.Load() {
				p.holding.Add(-1)
				continue
			}
			if _, werr := to.Write(buf[:n]); werr != nil {
				err = werr
			}
		}
		p.holding.Add(-1)
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

// held returns once no partition is on (or the proxy is closed). While one is, the pipe holds the chunk it read
// and reads no more, so that the sender's socket buffers fill as they do when packets go unacknowledged.
func (p *Proxy) held() {
	for p.partition.Load() {
		p.mu.Lock()
		healed := p.healed
		p.mu.Unlock()
		<-healed
	}
}

// Partition holds every byte in both directions, on current and new connections, while on, and delivers them in
// order when it goes off, with any close that came meanwhile: a network partition as TCP lives through it (the
// sender retransmits until the network heals). Requests sent during it reach the server late, perhaps after their
// sender gave up; answers reach a client that may have gone on. New connections are accepted and wait. Close ends
// a partition.
func (p *Proxy) Partition(on bool) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if on == p.partition.Load() || on && p.closed {
		return
	}
	if on {
		p.healed = make(chan struct{})
		p.partition.Store(true)
		return
	}
	p.partition.Store(false)
	close(p.healed)
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

// EndBlackholeReset ends a blackhole and closes every connection that lived through it, at once: what it threw
// away cannot be sent again, as a network that lost a connection's bytes ends it. A connection made afterwards
// passes.
func (p *Proxy) EndBlackholeReset() {
	p.mu.Lock()
	p.blackhole.Store(false)
	for c, s := range p.links {
		c.Close()
		s.Close()
		delete(p.links, c)
	}
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

// Close stops the proxy and closes every connection. A partition on ends first, and what it held is delivered
// (for up to a second) before the connections close, as a network that heals delivers what was sent.
func (p *Proxy) Close() {
	p.Partition(false)
	for deadline := time.Now().Add(time.Second); p.holding.Load() > 0 && time.Now().Before(deadline); {
		time.Sleep(5 * time.Millisecond)
	}
	p.mu.Lock()
	p.closed = true
	p.mu.Unlock()
	p.ln.Close()
	p.Cut()
	p.Blackhole(false)
	p.Partition(false)
	p.wg.Wait()
}
