package faults

import (
	"bufio"
	"errors"
	"io"
	"net"
	"os"
	"strings"
	"testing"
	"time"

	"go.uber.org/goleak"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

// server accepts connections on 127.0.0.1 and hands each to the test.
func server(t *testing.T) (string, <-chan net.Conn) {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { ln.Close() })
	conns := make(chan net.Conn, 8)
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			t.Cleanup(func() { c.Close() })
			conns <- c
		}
	}()
	return ln.Addr().String(), conns
}

// proxied starts a server and a proxy to it, and returns the proxy and both ends of one connection through it
// (closed as the test ends).
func proxied(t *testing.T) (*Proxy, net.Conn, net.Conn) {
	t.Helper()
	addr, conns := server(t)
	p := Start(t, addr)
	c, err := net.Dial("tcp", p.Addr())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	return p, c, <-conns
}

// nothingWithin fails the test if r yields a line within d.
func nothingWithin(t *testing.T, c net.Conn, r *bufio.Reader, d time.Duration, what string) {
	t.Helper()
	_ = c.SetReadDeadline(time.Now().Add(d))
	if line, err := r.ReadString('\n'); !errors.Is(err, os.ErrDeadlineExceeded) {
		t.Fatalf("%s during the partition: %q, %v", what, line, err)
	}
	_ = c.SetReadDeadline(time.Time{})
}

// readLine reads one line within 5 s.
func readLine(t *testing.T, c net.Conn, r *bufio.Reader) string {
	t.Helper()
	_ = c.SetReadDeadline(time.Now().Add(5 * time.Second))
	line, err := r.ReadString('\n')
	if err != nil {
		t.Fatalf("read: %q, %v", line, err)
	}
	return strings.TrimSpace(line)
}

// A partition holds the bytes of both directions and delivers them, in order, as it ends; a close made during it
// reaches the other side after the bytes sent before it. The connection goes on afterwards.
func TestPartitionDeliversWhenItEnds(t *testing.T) {
	p, c, s := proxied(t)
	cr, sr := bufio.NewReader(c), bufio.NewReader(s)

	p.Partition(true)
	if _, err := io.WriteString(c, "request 1\nrequest 2\n"); err != nil {
		t.Fatal(err)
	}
	if _, err := io.WriteString(s, "answer\n"); err != nil {
		t.Fatal(err)
	}
	nothingWithin(t, s, sr, 300*time.Millisecond, "the server read")
	nothingWithin(t, c, cr, 300*time.Millisecond, "the client read")
	p.Partition(false)
	if got := readLine(t, s, sr) + "," + readLine(t, s, sr); got != "request 1,request 2" {
		t.Fatalf("the server read %q after the partition, want both requests in order", got)
	}
	if got := readLine(t, c, cr); got != "answer" {
		t.Fatalf("the client read %q after the partition", got)
	}
	if _, err := io.WriteString(c, "after\n"); err != nil {
		t.Fatal(err)
	}
	if got := readLine(t, s, sr); got != "after" {
		t.Fatalf("the server read %q after the partition ended", got)
	}

	// A client that writes and gives up during a partition: the server gets the request, then the close.
	p.Partition(true)
	if _, err := io.WriteString(c, "last\n"); err != nil {
		t.Fatal(err)
	}
	c.Close()
	nothingWithin(t, s, sr, 300*time.Millisecond, "the server read")
	p.Partition(false)
	if got := readLine(t, s, sr); got != "last" {
		t.Fatalf("the server read %q after the partition", got)
	}
	_ = s.SetReadDeadline(time.Now().Add(5 * time.Second))
	if _, err := sr.ReadByte(); err != io.EOF {
		t.Fatalf("after the request, the server read %v, want the client's close (EOF)", err)
	}
}

// A blackhole throws the bytes away: nothing sent during it arrives after it ends.
func TestBlackholeDrops(t *testing.T) {
	p, c, s := proxied(t)
	sr := bufio.NewReader(s)
	p.Blackhole(true)
	if _, err := io.WriteString(c, "lost\n"); err != nil {
		t.Fatal(err)
	}
	time.Sleep(100 * time.Millisecond) // the proxy has read it
	p.Blackhole(false)
	if _, err := io.WriteString(c, "kept\n"); err != nil {
		t.Fatal(err)
	}
	if got := readLine(t, s, sr); got != "kept" {
		t.Fatalf("the server read %q, want only what was sent after the blackhole", got)
	}
}

// A connection made during a partition is set up when it ends.
func TestPartitionHoldsNewConnections(t *testing.T) {
	addr, conns := server(t)
	p := Start(t, addr)
	p.Partition(true)
	c, err := net.Dial("tcp", p.Addr())
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	s := <-conns
	if _, err := io.WriteString(c, "hello\n"); err != nil {
		t.Fatal(err)
	}
	sr := bufio.NewReader(s)
	nothingWithin(t, s, sr, 300*time.Millisecond, "the server read")
	p.Partition(false)
	if got := readLine(t, s, sr); got != "hello" {
		t.Fatalf("the server read %q", got)
	}
}
