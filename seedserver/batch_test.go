package seedserver

import (
	"bytes"
	"crypto/tls"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"sync/atomic"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/tendril-net/tendril/internal/pki/testpki"
	"github.com/tendril-net/tendril/internal/testing/testnet"
	"github.com/tendril-net/tendril/internal/testing/testwait"
)

// countingConn counts the bytes written to it.
type countingConn struct {
	net.Conn
	n atomic.Int64
}

func (c *countingConn) Write(p []byte) (int, error) {
	n, err := c.Conn.Write(p)
	c.n.Add(int64(n))
	return n, err
}

// tlsPair returns a TLS client and the server end as serveConnect reads it (readAhead under
// TLS, recordBatcher over it), over loopback TCP, handshake done; the client's socket counts
// what it sent, and raw is the server's socket.
func tlsPair(t *testing.T) (client *tls.Conn, sent *countingConn, server *recordBatcher, raw *net.TCPConn) {
	t.Helper()
	ca, err := testpki.NewCA("batch")
	if err != nil {
		t.Fatal(err)
	}
	leaf, err := ca.Leaf("tendril-server")
	if err != nil {
		t.Fatal(err)
	}
	cc, sc := testnet.TCPPair(t)
	sent = &countingConn{Conn: cc}
	client = tls.Client(sent, &tls.Config{RootCAs: ca.Pool, ServerName: "tendril-server"})
	st := tls.Server(&readAhead{Conn: sc}, &tls.Config{Certificates: []tls.Certificate{leaf}})
	t.Cleanup(func() { client.Close(); st.Close() })
	done := make(chan error, 1)
	go func() { done <- st.Handshake() }()
	if err := client.Handshake(); err != nil {
		t.Fatal(err)
	}
	if err := <-done; err != nil {
		t.Fatal(err)
	}
	return client, sent, &recordBatcher{Conn: st}, sc
}

// queued is the number of bytes in c's socket receive queue.
func queued(t *testing.T, c *net.TCPConn) int {
	t.Helper()
	rc, err := c.SyscallConn()
	if err != nil {
		t.Fatal(err)
	}
	var n int
	var ierr error
	if err := rc.Control(func(fd uintptr) { n, ierr = unix.IoctlGetInt(int(fd), unix.SIOCINQ) }); err != nil || ierr != nil {
		t.Fatal(err, ierr)
	}
	return n
}

func TestReadTakesEveryRecordThatArrived(t *testing.T) {
	client, sent, server, raw := tlsPair(t)
	// 96 KiB in one write: several records (TLS writes at most 16 KiB per record, and fewer
	// after idle). Once all of them are in the server's socket, one Read returns all of them,
	// not just the first record. 96 KiB and the records' overhead fit one read-ahead.
	payload := bytes.Repeat([]byte("0123456789abcdef"), 6<<10)
	before := sent.n.Load()
	if _, err := client.Write(payload); err != nil {
		t.Fatal(err)
	}
	records := int(sent.n.Load() - before)
	testwait.For(t, "all records in the server's socket", func() error {
		if q := queued(t, raw); q != records {
			return fmt.Errorf("%d of %d bytes", q, records)
		}
		return nil
	})
	buf := make([]byte, 256<<10)
	n, err := server.Read(buf)
	if err != nil || n != len(payload) || !bytes.Equal(buf[:n], payload) {
		t.Fatalf("one Read returned %d bytes (%v), want all %d", n, err, len(payload))
	}

	// A small write is returned at once: the Read does not wait to fill its buffer.
	_ = server.SetReadDeadline(time.Now().Add(30 * time.Second))
	if _, err := client.Write([]byte("ping")); err != nil {
		t.Fatal(err)
	}
	if n, err := server.Read(buf); err != nil || string(buf[:n]) != "ping" {
		t.Fatalf("read %q (%v), want ping", buf[:n], err)
	}

	// The caller's deadline is back after a batch: with nothing sent, the next Read ends at it.
	_ = server.SetReadDeadline(time.Now().Add(50 * time.Millisecond))
	if _, err := server.Read(buf); !errors.Is(err, os.ErrDeadlineExceeded) {
		t.Fatalf("read without data: %v, want the deadline", err)
	}
	// A timed-out Read leaves the connection usable, and the end comes after the last bytes.
	_ = server.SetReadDeadline(time.Time{})
	if _, err := client.Write([]byte("last")); err != nil {
		t.Fatal(err)
	}
	client.Close()
	got, err := io.ReadAll(server)
	if err != nil || string(got) != "last" {
		t.Fatalf("read %q (%v), want \"last\" then the end", got, err)
	}
}

func TestReadAheadHoldsNoBufferWhenEmpty(t *testing.T) {
	client, _, server, _ := tlsPair(t)
	if _, err := client.Write(bytes.Repeat([]byte("x"), 100<<10)); err != nil {
		t.Fatal(err)
	}
	buf := make([]byte, 256<<10)
	for got := 0; got < 100<<10; {
		n, err := server.Read(buf)
		if err != nil {
			t.Fatal(err)
		}
		got += n
	}
	if ra := server.Conn.NetConn().(*readAhead); ra.buf != nil {
		t.Errorf("readAhead keeps its %d-byte buffer with nothing in it", readAheadSize)
	}
}

// TestWaitReadableAfterDrain: once a Read has taken everything TLS and readAhead held, the
// relay waits for the socket without a buffer; before that (or with bytes possibly in TLS)
// it must not wait.
func TestWaitReadableAfterDrain(t *testing.T) {
	client, _, server, _ := tlsPair(t)
	returns := func(what string) error {
		t.Helper()
		done := make(chan error, 1)
		go func() { done <- server.WaitReadable(time.Time{}) }()
		return testwait.Receive(t, what, done)
	}
	if err := returns("before any Read"); err != nil {
		t.Fatal(err)
	}
	buf := make([]byte, 128<<10)
	if _, err := client.Write([]byte("ping")); err != nil {
		t.Fatal(err)
	}
	if n, err := server.Read(buf); err != nil || string(buf[:n]) != "ping" {
		t.Fatalf("read %q (%v), want ping", buf[:n], err)
	}
	done := make(chan error, 1)
	go func() { done <- server.WaitReadable(time.Time{}) }()
	select {
	case err := <-done:
		t.Fatalf("drained, nothing sent: WaitReadable returned %v", err)
	case <-time.After(100 * time.Millisecond):
	}
	if _, err := client.Write([]byte("pong")); err != nil {
		t.Fatal(err)
	}
	if err := testwait.Receive(t, "WaitReadable after the client wrote", done); err != nil {
		t.Fatal(err)
	}
	if n, err := server.Read(buf); err != nil || string(buf[:n]) != "pong" {
		t.Fatalf("read %q (%v), want pong", buf[:n], err)
	}
	// The caller's read deadline ends the wait.
	_ = server.SetReadDeadline(time.Now().Add(50 * time.Millisecond))
	if err := returns("deadline"); !errors.Is(err, os.ErrDeadlineExceeded) {
		t.Fatalf("wait past the deadline: %v", err)
	}
	// A Read whose buffer filled may have left records in TLS: no wait.
	_ = server.SetReadDeadline(time.Time{})
	if _, err := client.Write(bytes.Repeat([]byte("y"), 64<<10)); err != nil {
		t.Fatal(err)
	}
	if _, err := server.Read(buf[:1024]); err != nil {
		t.Fatal(err)
	}
	if err := returns("records left in TLS"); err != nil {
		t.Fatal(err)
	}
}
