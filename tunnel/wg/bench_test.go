package wg

import (
	"context"
	"errors"
	"io"
	"net"
	"net/netip"
	"strconv"
	"syscall"
	"testing"
	"time"

	"golang.zx2c4.com/wireguard/tun"
	wgnetstack "golang.zx2c4.com/wireguard/tun/netstack"

	"github.com/tendril-net/tendril/internal/host/netns"
	"github.com/tendril-net/tendril/internal/testing/testnet"
	"github.com/tendril-net/tendril/tunnel/netstack"
)

// benchIO is the application's read and write size in the throughput benchmark. gVisor's
// gonet connections cost a wakeup and a lock round per call, so small calls dominate: at MTU
// 60000 on this machine, 8 KiB reads (what io.Copy into io.Discard uses) gave 260 MB/s,
// 32 KiB writes (io.Copy's default buffer) 400 MB/s, 1 MiB both ways 590 MB/s. Code that
// copies to or from a tunnel connection should use io.CopyBuffer with a large buffer.
const benchIO = 1 << 20

// BenchmarkThroughput moves 64 MiB per operation from the server to the agent (path 4: seed to
// shoot) over one inner TCP connection:
//
//   - mtu-N: to a listener on the agent's inner address, at three MTUs;
//   - wireguard-netstack-mtu-60000: the same with wireguard-go's tun/netstack on both ends
//     instead of package netstack (what tunnel/wg used before), for comparison;
//   - forward-mtu-60000: to a shoot address that the agent's forwarder terminates, relaying
//     (edge/loops) to a real loopback TCP server, as the agent reaches pods;
//   - direct-tcp: plain loopback TCP, the ceiling.
//
// The MB/s column is the figure. design.md has the reference numbers for wireguard-go's
// netstack (1420 ≈ 78, 8000 ≈ 305, 60000 ≈ 706, loopback ≈ 1660 MB/s on a 2-vCPU machine).
func BenchmarkThroughput(b *testing.B) {
	const size = 64 << 20
	toAgent := func(o worldOpts) func(b *testing.B) {
		return func(b *testing.B) {
			w := newWorld(b, o)
			received := make(chan int64, 1)
			testnet.Serve(b, listen(b, w.agent, agentAddr, 9000), func(c net.Conn) { received <- drain(c) })
			benchTransfer(b, size, received, func() (net.Conn, error) {
				return dial(b, w.server, agentAddr, 9000, 10*time.Second)
			})
		}
	}
	for _, mtu := range []int{1420, 8000, 60000} {
		b.Run("mtu-"+strconv.Itoa(mtu), toAgent(worldOpts{mtu: mtu}))
	}
	b.Run("wireguard-netstack-mtu-60000", toAgent(worldOpts{mtu: 60000, newStack: newWireguardStack}))
	b.Run("forward-mtu-60000", func(b *testing.B) {
		received := make(chan int64, 1)
		w, _ := newForwardWorld(b, worldOpts{mtu: 60000}, func(c net.Conn) { received <- drain(c) })
		benchTransfer(b, size, received, func() (net.Conn, error) {
			return dialAddr(b, w.server, netip.MustParseAddrPort("10.123.0.5:9000"), 10*time.Second)
		})
	})
	b.Run("kernel-mtu-60000", func(b *testing.B) {
		k := newKernelNet(b)
		w := newWorld(b, worldOpts{mtu: 60000, kernel: &[2]string{k.seed, k.shoot}})
		var ln net.Listener
		if err := netns.In(k.shoot, func() (err error) { ln, err = w.agent.ListenTCP(netip.AddrPortFrom(agentAddr, 9000)); return err }); err != nil {
			b.Fatal(err)
		}
		received := make(chan int64, 1)
		testnet.Serve(b, ln, func(c net.Conn) { received <- drain(c) })
		benchTransfer(b, size, received, func() (c net.Conn, err error) {
			err = errors.Join(err, netns.In(k.seed, func() error { c, err = dial(b, w.server, agentAddr, 9000, 10*time.Second); return nil }))
			return c, err
		})
	})
	b.Run("direct-tcp", func(b *testing.B) {
		ln, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			b.Fatal(err)
		}
		received := make(chan int64, 1)
		testnet.Serve(b, ln, func(c net.Conn) { received <- drain(c) })
		benchTransfer(b, size, received, func() (net.Conn, error) {
			return net.Dial("tcp", ln.Addr().String())
		})
	})
}

// benchTransfer opens a connection per operation, writes size bytes in benchIO writes,
// half-closes, and waits until the receiver has counted them all.
func benchTransfer(b *testing.B, size int64, received <-chan int64, dial func() (net.Conn, error)) {
	chunk := make([]byte, benchIO)
	b.SetBytes(size)
	b.ResetTimer()
	cpu0 := cpuTime(b)
	defer func() {
		// CPU per megabyte (both ends, the sender and the receiver included): on a shared
		// 2-vCPU machine throughput swings with the neighbours; the CPU a megabyte costs
		// swings much less, and it is what the netstack changes.
		b.ReportMetric(float64(cpuTime(b)-cpu0)/float64(time.Millisecond)/(float64(b.N)*float64(size)/1e6), "cpu-ms/MB")
	}()
	for range b.N {
		c, err := dial()
		if err != nil {
			b.Fatal(err)
		}
		for sent := int64(0); sent < size; sent += int64(len(chunk)) {
			if _, err := c.Write(chunk); err != nil {
				b.Fatal(err)
			}
		}
		if err := c.(interface{ CloseWrite() error }).CloseWrite(); err != nil {
			b.Fatal(err)
		}
		if n := <-received; n != size {
			b.Fatalf("receiver counted %d bytes, want %d", n, size)
		}
		c.Close()
	}
}

// cpuTime is the process's user and system CPU time so far.
func cpuTime(b *testing.B) time.Duration {
	var ru syscall.Rusage
	if err := syscall.Getrusage(syscall.RUSAGE_SELF, &ru); err != nil {
		b.Fatal(err)
	}
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}

// drain reads c to its end in benchIO reads and returns the byte count (-1 on an error other
// than end of stream).
func drain(c net.Conn) int64 {
	buf := make([]byte, benchIO)
	var n int64
	for {
		m, err := c.Read(buf)
		n += int64(m)
		if errors.Is(err, io.EOF) {
			return n
		}
		if err != nil {
			return -1
		}
	}
}

// wireguardStack is wireguard-go's tun/netstack behind innerStack: the benchmark's comparison
// with what tunnel/wg used before package netstack. It cannot forward.
type wireguardStack struct {
	tun.Device
	net *wgnetstack.Net
}

func newWireguardStack(cfg netstack.Config) (innerStack, error) {
	dev, n, err := wgnetstack.CreateNetTUN(cfg.Addresses, nil, cfg.MTU)
	if err != nil {
		return nil, err
	}
	return &wireguardStack{Device: dev, net: n}, nil
}

func (w *wireguardStack) DialContext(ctx context.Context, network, addr string) (net.Conn, error) {
	return w.net.DialContext(ctx, network, addr)
}

func (w *wireguardStack) ListenTCP(addr netip.AddrPort) (net.Listener, error) {
	return w.net.ListenTCPAddrPort(addr)
}

func (w *wireguardStack) ListenUDP(addr netip.AddrPort) (net.PacketConn, error) {
	return w.net.ListenUDPAddrPort(addr)
}

func (w *wireguardStack) StopForwarding() {}

func (w *wireguardStack) Stats() netstack.Stats { return netstack.Stats{} }
