package impair

import (
	"bytes"
	"context"
	"crypto/rand"
	"fmt"
	"io"
	"net"
	"net/netip"
	"os"
	"testing"
	"time"

	"github.com/tendril-net/tendril/internal/host/netns"
)

// TestLinkBetweenNamespaces joins this process's namespace to a new one by a Link that delays
// each direction by 20 ms and loses 1 % of the packets: a TCP echo across it round-trips in
// at least 40 ms and carries 1 MB intact (TCP retransmits the losses), and the counts show
// the packets carried and lost.
func TestLinkBetweenNamespaces(t *testing.T) {
	if err := netns.Check(); err != nil {
		t.Skip(err)
	}
	pid := os.Getpid()
	ns := fmt.Sprintf("impairtest-%d", pid)
	ctx := context.Background()
	if err := netns.IP(ctx, "netns", "add", ns); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = netns.IP(context.Background(), "netns", "del", ns) })
	if err := netns.IP(ctx, "-n", ns, "link", "set", "lo", "up"); err != nil {
		t.Fatal(err)
	}
	n := byte(pid%250 + 1)
	local, far := netip.AddrFrom4([4]byte{10, 239, n, 1}), netip.AddrFrom4([4]byte{10, 239, n, 2})
	const oneWay = 20 * time.Millisecond
	imp := Config{Delay: oneWay, Loss: 0.01, Seed: 3}
	l, err := NewLink(LinkConfig{
		A:    End{Name: fmt.Sprintf("imt%da", pid%100000), Addr: netip.PrefixFrom(local, 30)},
		B:    End{NS: ns, Name: fmt.Sprintf("imt%db", pid%100000), Addr: netip.PrefixFrom(far, 30)},
		AtoB: imp, BtoA: imp,
	})
	if err != nil {
		t.Fatal(err)
	}
	closed := false
	t.Cleanup(func() {
		if !closed {
			l.Close()
		}
	})

	ln, err := netns.Listen(ns, netip.AddrPortFrom(far, 0).String())
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			go func() { defer c.Close(); io.Copy(c, c) }()
		}
	}()
	c, err := net.DialTimeout("tcp", ln.Addr().String(), 5*time.Second)
	if err != nil {
		t.Fatalf("dial across the link: %v", err)
	}
	defer c.Close()
	c.SetDeadline(time.Now().Add(30 * time.Second))

	// One small round trip: at least both directions' delay.
	begin := time.Now()
	if _, err := c.Write([]byte("ping")); err != nil {
		t.Fatal(err)
	}
	if _, err := io.ReadFull(c, make([]byte, 4)); err != nil {
		t.Fatal(err)
	}
	if rtt := time.Since(begin); rtt < 2*oneWay {
		t.Errorf("round trip %v across a link of %v each way", rtt, oneWay)
	}

	// 1 MB out and back, through 1 % loss each way.
	want := make([]byte, 1<<20)
	rand.Read(want)
	errc := make(chan error, 1)
	go func() { _, err := c.Write(want); errc <- err }()
	got := make([]byte, len(want))
	if _, err := io.ReadFull(c, got); err != nil {
		t.Fatalf("echo: %v", err)
	}
	if err := <-errc; err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(got, want) {
		t.Fatal("the echo differs from what was sent")
	}
	c.Close()
	closed = true
	if err := l.Close(); err != nil {
		t.Errorf("Close: %v", err)
	}
	ab, ba := l.Stats()
	t.Logf("A→B %+v, B→A %+v", ab, ba)
	// 2 MB in 1,500-byte packets is ~1,400 packets; at 1 % each direction loses some.
	if ab.Packets < 700 || ba.Packets < 700 {
		t.Errorf("carried %d and %d packets, want ~1,400 each way for 2 MB", ab.Packets, ba.Packets)
	}
	if ab.Dropped[ReasonLoss]+ba.Dropped[ReasonLoss] == 0 {
		t.Error("no packet lost at 1 % loss")
	}
	for _, name := range []string{fmt.Sprintf("imt%da", pid%100000)} {
		if _, err := net.InterfaceByName(name); err == nil {
			t.Errorf("device %s outlives Close", name)
		}
	}
}
