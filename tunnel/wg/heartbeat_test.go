package wg

import (
	"context"
	"net/netip"
	"sync"
	"testing"
	"time"

	"github.com/tendril-net/tendril/internal/testing/testwait"
)

// TestHeartbeatEcho: the accepting side echoes small datagrams on HeartbeatPort and ignores
// large ones.
func TestHeartbeatEcho(t *testing.T) {
	w := newWorld(t, worldOpts{})
	ctx, cancel := context.WithCancel(t.Context())
	var wg sync.WaitGroup
	wg.Add(1)
	go func() {
		defer wg.Done()
		if err := w.server.ServeHeartbeat(ctx); err != nil {
			t.Error(err)
		}
	}()
	defer func() { cancel(); wg.Wait() }()
	c, err := w.agent.DialContext(ctx, "udp", netip.AddrPortFrom(serverAddr, HeartbeatPort).String())
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	buf := make([]byte, 2*MaxHeartbeatSize)
	// The responder may not be listening yet: send until an echo comes back.
	testwait.Until(t, "an echo", func() bool {
		if _, err := c.Write([]byte("beat")); err != nil {
			t.Fatal(err)
		}
		_ = c.SetReadDeadline(time.Now().Add(100 * time.Millisecond))
		n, err := c.Read(buf)
		return err == nil && string(buf[:n]) == "beat"
	})
	if _, err := c.Write(make([]byte, MaxHeartbeatSize+1)); err != nil {
		t.Fatal(err)
	}
	_ = c.SetReadDeadline(time.Now().Add(300 * time.Millisecond))
	if n, err := c.Read(buf); err == nil {
		t.Fatalf("an oversized heartbeat was echoed (%d bytes)", n)
	}
}
