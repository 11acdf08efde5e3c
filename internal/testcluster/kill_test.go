package testcluster

import (
	"context"
	"io"
	"net"
	"testing"
)

// TestSwitch: connections through a switch carry bytes until Cut; after it
// no write and no dial gets through, and both are counted.
func TestSwitch(t *testing.T) {
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer lis.Close()
	got := make(chan []byte, 1)
	go func() {
		c, err := lis.Accept()
		if err != nil {
			return
		}
		b, _ := io.ReadAll(c)
		got <- b
	}()
	sw := NewSwitch()
	c, err := sw.DialContext(context.Background(), "tcp", lis.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	if _, err := c.Write([]byte("before")); err != nil {
		t.Fatal(err)
	}
	sw.Cut()
	if _, err := c.Write([]byte("after")); err == nil {
		t.Fatal("a write got through a cut switch")
	}
	if _, err := sw.DialTalos(context.Background(), lis.Addr().String()); err == nil {
		t.Fatal("a dial got through a cut switch")
	}
	if b := <-got; string(b) != "before" {
		t.Fatalf("the server read %q; want only what was written before the cut", b)
	}
	if n := sw.Refused(); n != 2 {
		t.Fatalf("refused %d; want the write and the dial", n)
	}
}
