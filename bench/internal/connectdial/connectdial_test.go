package connectdial

import (
	"bufio"
	"context"
	"errors"
	"io"
	"net"
	"net/http"
	"strings"
	"testing"
	"time"
)

// front serves one CONNECT per connection on a loopback listener: it checks
// the request and writes answer, then keeps the connection until the client
// closes it.
func front(t *testing.T, answer string) string {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	done := make(chan struct{})
	t.Cleanup(func() { l.Close(); <-done })
	go func() {
		defer close(done)
		for {
			c, err := l.Accept()
			if err != nil {
				return
			}
			req, err := http.ReadRequest(bufio.NewReader(c))
			if err != nil || req.Method != http.MethodConnect || req.Host != "pod:8081" {
				t.Errorf("request %+v, %v", req, err)
				c.Close()
				continue
			}
			if answer != "" {
				io.WriteString(c, answer)
			}
			io.Copy(io.Discard, c) // until the client closes
			c.Close()
		}
	}()
	return l.Addr().String()
}

func TestGreetingWithTheAnswer(t *testing.T) {
	addr := front(t, "HTTP/1.1 200 Connection established\r\n\r\nhello")
	c, err := Dialer("tcp", addr, nil, "pod:8081")(t.Context())
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	_ = c.SetReadDeadline(time.Now().Add(5 * time.Second))
	b := make([]byte, 5)
	if _, err := io.ReadFull(c, b); err != nil || string(b) != "hello" {
		t.Fatalf("read %q, %v; want the greeting that came with the answer", b, err)
	}
}

func TestRefused(t *testing.T) {
	addr := front(t, "HTTP/1.1 403 Forbidden\r\nContent-Length: 7\r\n\r\nno route")
	_, err := Dialer("tcp", addr, nil, "pod:8081")(t.Context())
	if err == nil || !strings.Contains(err.Error(), "403") {
		t.Fatalf("err %v, want the 403", err)
	}
}

func TestAnswerThatDoesNotCome(t *testing.T) {
	addr := front(t, "")
	ctx, cancel := context.WithTimeout(t.Context(), 200*time.Millisecond)
	defer cancel()
	_, err := Dialer("tcp", addr, nil, "pod:8081")(ctx)
	if !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("err %v, want the context's deadline", err)
	}
}
