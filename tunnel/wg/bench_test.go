package wg

import (
	"errors"
	"io"
	"net"
	"strconv"
	"testing"
	"time"
)

// benchIO is the application's read and write size in the throughput benchmark. gVisor's
// gonet connections cost a wakeup and a lock round per call, so small calls dominate: at MTU
// 60000 on this machine, 8 KiB reads (what io.Copy into io.Discard uses) gave 260 MB/s,
// 32 KiB writes (io.Copy's default buffer) 400 MB/s, 1 MiB both ways 590 MB/s. Code that
// copies to or from a tunnel connection should use io.CopyBuffer with a large buffer.
const benchIO = 1 << 20

// BenchmarkThroughput moves 64 MiB per operation from the server to the agent (path 4: seed to
// shoot) over one inner TCP connection, at three MTUs, and over plain loopback TCP as the
// baseline. The MB/s column is the figure; design.md has the reference numbers
// (1420 ≈ 78, 8000 ≈ 305, 60000 ≈ 706, loopback ≈ 1660 MB/s on a 2-vCPU machine).
func BenchmarkThroughput(b *testing.B) {
	const size = 64 << 20
	for _, mtu := range []int{1420, 8000, 60000} {
		b.Run("mtu-"+strconv.Itoa(mtu), func(b *testing.B) {
			w := newWorld(b, worldOpts{mtu: mtu})
			received := make(chan int64, 1)
			serve(b, listen(b, w.agent, agentAddr, 9000), func(c net.Conn) { received <- drain(c) })
			benchTransfer(b, size, received, func() (net.Conn, error) {
				return dial(b, w.server, agentAddr, 9000, 10*time.Second)
			})
		})
	}
	b.Run("direct-tcp", func(b *testing.B) {
		ln, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			b.Fatal(err)
		}
		received := make(chan int64, 1)
		serve(b, ln, func(c net.Conn) { received <- drain(c) })
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
