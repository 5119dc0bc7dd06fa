package connect

import (
	"bufio"
	"net"
	"net/http"
	"strings"
	"testing"
	"time"
)

// TestOpen runs against net/http's own server as the CONNECT peer: a 200 leaves the tunnel's
// first bytes unread, anything else is an error naming the status.
func TestOpen(t *testing.T) {
	srv := &http.Server{Handler: http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.Header.Get("X-Dest") != "ok" {
			http.Error(w, "no", http.StatusServiceUnavailable)
			return
		}
		w.WriteHeader(http.StatusOK)
		c, rw, err := http.NewResponseController(w).Hijack()
		if err != nil {
			return
		}
		defer c.Close()
		_, _ = rw.WriteString("tunnel")
		_ = rw.Flush()
	})}
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	go func() { _ = srv.Serve(l) }()
	defer srv.Close()
	dial := func() net.Conn {
		c, err := net.Dial("tcp", l.Addr().String())
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
