package controlplane

import (
	"io"
	"net"
	"testing"
	"time"
)

// backend is a server that answers each connection with its name.
func backend(t *testing.T, name string) net.Listener {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = l.Close() })
	go func() {
		for {
			c, err := l.Accept()
			if err != nil {
				return
			}
			_, _ = c.Write([]byte(name))
			_ = c.Close()
		}
	}()
	return l
}

// answer is what a connection through b reads ("" when it is closed
// without a word).
func answer(t *testing.T, b *Balancer) string {
	t.Helper()
	c, err := net.DialTimeout("tcp", b.Address(), time.Second)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	_ = c.SetDeadline(time.Now().Add(5 * time.Second))
	got, err := io.ReadAll(c)
	if err != nil {
		t.Fatalf("read through the balancer: %v", err)
	}
	return string(got)
}

// TestBalancer: connections go round robin to the backends that are up,
// skip one that is marked up but refuses, and with none up are closed at
// once.
func TestBalancer(t *testing.T) {
	a, b := backend(t, "a"), backend(t, "b")
	lb, err := NewBalancer("127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer lb.Close()
	lb.SetUp(a.Addr().String(), true)
	lb.SetUp(b.Addr().String(), true)
	seen := map[string]int{}
	for range 4 {
		seen[answer(t, lb)]++
	}
	if seen["a"] != 2 || seen["b"] != 2 {
		t.Fatalf("answers %v; want a and b twice each", seen)
	}

	lb.SetUp(a.Addr().String(), false)
	for range 3 {
		if got := answer(t, lb); got != "b" {
			t.Fatalf("with a down the balancer answered %q; want b", got)
		}
	}

	lb.SetUp(a.Addr().String(), true)
	_ = b.Close() // b stops answering before it is marked down
	for range 3 {
		if got := answer(t, lb); got != "a" {
			t.Fatalf("with b refusing the balancer answered %q; want a", got)
		}
	}

	lb.SetUp(a.Addr().String(), false)
	lb.SetUp(b.Addr().String(), false)
	if got := answer(t, lb); got != "" {
		t.Fatalf("with no backend up the balancer answered %q", got)
	}
	if up := lb.Up(); len(up) != 0 {
		t.Fatalf("up %v", up)
	}
}
