package session

import "sync/atomic"

// Events receives what happens to sessions: event is "open", "close" (back to the pool, or a shared session
// closed with its Locker) or "destroy" (closed on doubt: lost, failed, or its state unknown); mode is "shared" or
// "dedicated"; reason says why a session was destroyed.
type Events func(event, mode, reason string)

// observedConn reports its session's end to Events, once.
type observedConn struct {
	Conn
	events Events
	mode   string
	ended  atomic.Bool
	reason atomic.Pointer[string]
}

// observe reports conn's opening and wraps it so that its end is reported too. Without events it returns conn.
func observe(conn Conn, events Events, mode string) Conn {
	if events == nil {
		return conn
	}
	events("open", mode, "")
	return &observedConn{Conn: conn, events: events, mode: mode}
}

func (c *observedConn) Release() {
	if c.ended.CompareAndSwap(false, true) {
		c.events("close", c.mode, "")
	}
	c.Conn.Release()
}

func (c *observedConn) Destroy() {
	if c.ended.CompareAndSwap(false, true) {
		event, reason := "destroy", "in doubt"
		if p := c.reason.Load(); p != nil {
			reason = *p
		}
		if reason == "" {
			event = "close"
		}
		c.events(event, c.mode, reason)
	}
	c.Conn.Destroy()
}

// because records why conn is about to be destroyed (the first reason wins); "" means it is an ordinary close (a
// shared session closed with its Locker).
func because(conn Conn, reason string) {
	if c, ok := conn.(*observedConn); ok {
		c.reason.CompareAndSwap(nil, &reason)
	}
}

// becauseErr is because with an error's text.
func becauseErr(conn Conn, what string, err error) {
	if c, ok := conn.(*observedConn); ok && err != nil {
		because(c, what+": "+err.Error())
	} else if ok {
		because(c, what)
	}
}
