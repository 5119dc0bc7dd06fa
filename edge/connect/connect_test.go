package connect

import (
	"bufio"
	"net"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/tendril-net/tendril/internal/testing/testnet"
)

// TestOpen runs against net/http's own server as the CONNECT peer: a 200 leaves the tunnel's
// first bytes unread, anything else is an error naming the status.
func TestOpen(t *testing.T) {
	addr := testnet.ConnectProxy(t, func(r *http.Request) bool { return r.Header.Get("X-Dest") == "ok" }, func(_ net.Conn, rw *bufio.ReadWriter) {
		_, _ = rw.WriteString("tunnel")
		_ = rw.Flush()
	})
	dial := func() net.Conn {
		c, err := net.Dial("tcp", addr)
		if err != nil {
			t.Fatal(err)
		}
		_ = c.SetDeadline(time.Now().Add(10 * time.Second))
		return c
	}
	c := dial()
	defer c.Close()
	if err := Open(c, "x:443", "X-Dest", "ok"); err != nil {
		t.Fatal(err)
	}
	if got, _ := bufio.NewReader(c).ReadString('l'); got != "tunnel" {
		t.Fatalf("tunnel bytes after the answer: %q", got)
	}
	c2 := dial()
	defer c2.Close()
	if err := Open(c2, "x:443", "X-Dest", "no"); err == nil || !strings.Contains(err.Error(), "503") {
		t.Fatalf("refused CONNECT: %v", err)
	}
}
