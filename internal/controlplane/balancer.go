package controlplane

import (
	"fmt"
	"io"
	"net"
	"slices"
	"sync"
	"time"
)

// Balancer is one endpoint for several API servers, as KubePrism is on a
// Talos machine: a TCP proxy on loopback that hands each connection to the
// next API server that is up (round robin, trying the others when a dial
// fails). TLS passes through, so clients verify the API server's own
// certificate, which names the balancer's address. With none up it
// accepts and closes at once: the endpoint does not answer.
type Balancer struct {
	l    net.Listener
	mu   sync.Mutex
	up   []string // backends that are up, host:port
	next int
	wg   sync.WaitGroup
	done chan struct{}
}

// NewBalancer listens on addr ("127.0.0.1:0" for a free port).
func NewBalancer(addr string) (*Balancer, error) {
	l, err := net.Listen("tcp", addr)
	if err != nil {
		return nil, fmt.Errorf("API endpoint: listen on %s: %w", addr, err)
	}
	b := &Balancer{l: l, done: make(chan struct{})}
	b.wg.Add(1)
	go b.serve()
	return b, nil
}

// Address is where the balancer listens (host:port).
func (b *Balancer) Address() string { return b.l.Addr().String() }

// SetUp marks a backend up (it receives connections) or down.
func (b *Balancer) SetUp(backend string, up bool) {
	b.mu.Lock()
	defer b.mu.Unlock()
	i := slices.Index(b.up, backend)
	switch {
	case up && i < 0:
		b.up = append(b.up, backend)
	case !up && i >= 0:
		b.up = slices.Delete(b.up, i, i+1)
	}
}

// Up are the backends that are up.
func (b *Balancer) Up() []string {
	b.mu.Lock()
	defer b.mu.Unlock()
	return slices.Clone(b.up)
}

// Close stops listening and ends the connections it carries.
func (b *Balancer) Close() {
	select {
	case <-b.done:
		return
	default:
	}
	close(b.done)
	_ = b.l.Close()
	b.wg.Wait()
}

func (b *Balancer) serve() {
	defer b.wg.Done()
	for {
		c, err := b.l.Accept()
		if err != nil {
			return
		}
		b.wg.Add(1)
		go func() {
			defer b.wg.Done()
			b.proxy(c)
		}()
	}
}

// candidates are the backends that are up, starting with the next in turn.
func (b *Balancer) candidates() []string {
	b.mu.Lock()
	defer b.mu.Unlock()
	if len(b.up) == 0 {
		return nil
	}
	start := b.next % len(b.up)
	b.next++
	return append(slices.Clone(b.up[start:]), b.up[:start]...)
}

func (b *Balancer) proxy(c net.Conn) {
	defer c.Close()
	var up net.Conn
	for _, backend := range b.candidates() {
		var err error
		if up, err = net.DialTimeout("tcp", backend, time.Second); err == nil {
			break
		}
	}
	if up == nil {
		return
	}
	defer up.Close()
	// Either side closing, or the balancer closing, ends both.
	ended := make(chan struct{}, 2)
	pipe := func(dst, src net.Conn) {
		_, _ = io.Copy(dst, src)
		ended <- struct{}{}
	}
	go pipe(up, c)
	go pipe(c, up)
	select {
	case <-ended:
	case <-b.done:
	}
}
