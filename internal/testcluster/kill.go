package testcluster

import (
	"context"
	"errors"
	"net"
	"sync"
	"sync/atomic"
	"testing"

	"google.golang.org/grpc"
	"k8s.io/client-go/rest"

	"maesh.dev/ichor/controller/app"
)

// errCut is what a connection through a cut Switch returns.
var errCut = errors.New("connection cut: the controller was killed")

// Switch carries every connection a controller opens, to the API server
// and to the Talos API, and cuts them all at once. Once Cut has returned no
// byte more leaves through it: no write in flight, no new connection. That
// is what killing the process (SIGKILL) does to its sockets, and a test can
// then be sure a killed controller makes no further call, whatever its
// goroutines still do before they notice.
type Switch struct {
	// writes hold gate shared; Cut takes it exclusively, so that it
	// returns only when no write is in flight.
	gate  sync.RWMutex
	cut   atomic.Bool
	mu    sync.Mutex
	conns map[*switchedConn]struct{}
	// refused counts the writes and dials refused after the cut.
	refused atomic.Int64
}

// NewSwitch returns a switch that lets everything through until Cut.
func NewSwitch() *Switch { return &Switch{conns: map[*switchedConn]struct{}{}} }

// DialContext dials through the switch (rest.Config.Dial's signature).
func (s *Switch) DialContext(ctx context.Context, network, address string) (net.Conn, error) {
	if s.cut.Load() {
		s.refused.Add(1)
		return nil, errCut
	}
	c, err := (&net.Dialer{}).DialContext(ctx, network, address)
	if err != nil {
		return nil, err
	}
	sc := &switchedConn{Conn: c, s: s}
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.cut.Load() {
		_ = c.Close()
		s.refused.Add(1)
		return nil, errCut
	}
	s.conns[sc] = struct{}{}
	return sc, nil
}

// DialTalos dials a Talos API endpoint through the switch
// (grpc.WithContextDialer's signature).
func (s *Switch) DialTalos(ctx context.Context, address string) (net.Conn, error) {
	return s.DialContext(ctx, "tcp", address)
}

// Cut closes every connection and refuses every later write and dial.
func (s *Switch) Cut() {
	s.cut.Store(true)
	s.mu.Lock()
	for c := range s.conns {
		_ = c.Conn.Close() // unblocks writes in flight
	}
	s.conns = map[*switchedConn]struct{}{}
	s.mu.Unlock()
	s.gate.Lock()
	defer s.gate.Unlock()
}

// Refused is how many writes and dials the cut refused: what the killed
// controller tried to send after its death.
func (s *Switch) Refused() int64 { return s.refused.Load() }

type switchedConn struct {
	net.Conn
	s *Switch
}

func (c *switchedConn) Write(p []byte) (int, error) {
	c.s.gate.RLock()
	defer c.s.gate.RUnlock()
	if c.s.cut.Load() {
		c.s.refused.Add(1)
		return 0, errCut
	}
	return c.Conn.Write(p)
}

func (c *switchedConn) Close() error {
	c.s.mu.Lock()
	delete(c.s.conns, c)
	c.s.mu.Unlock()
	return c.Conn.Close()
}

// StartKillable is StartController with every connection of the controller
// (the API server's and the Talos API's) through a Switch, so that Kill
// kills it as SIGKILL would: it stops at once, mid-step if it was in one,
// without releasing its leader Lease or anything else. A controller that
// stops by itself (it lost its leader election) is cut as soon as it has,
// as the binary exits then: steps still in flight send nothing more.
func StartKillable(t testing.TB, cfg *rest.Config, o app.Options) *Controller {
	t.Helper()
	sw := NewSwitch()
	cfg = rest.CopyConfig(cfg)
	cfg.Dial = sw.DialContext
	o.TalosDialOptions = append(o.TalosDialOptions, grpc.WithContextDialer(sw.DialTalos))
	c := StartController(t, cfg, o)
	c.sw = sw
	go func() {
		<-c.exited
		sw.Cut()
	}()
	return c
}

// Kill cuts a killable controller's connections, then stops it without
// waiting: after Kill returns it sends nothing more. Stop (at the end of
// the test) still waits for its goroutines.
func (c *Controller) Kill() {
	if c.sw == nil {
		panic("Kill needs a controller started with StartKillable")
	}
	c.sw.Cut()
	c.cancel()
}

// Switch is the killable controller's switch (nil for StartController's).
func (c *Controller) Switch() *Switch { return c.sw }
