package connect

import (
	"bufio"
	"io"
	"net"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/tendril-net/tendril/internal/testing/testnet"
)

// pair is a connected pair of loopback TCP connections.
func pair(t *testing.T) (client, server net.Conn) {
	t.Helper()
	return testnet.TCPPair(t)
}

// TestReadRequest: each way a request can fail has its outcome and status, the answer is a
// complete HTTP response the client can read, and a request that is read leaves the bytes sent
// behind it (the tunnel's first) to the caller.
func TestReadRequest(t *testing.T) {
	for _, tc := range []struct {
		name, send string
		closeAfter bool
		outcome    string
		status     int
	}{
		{name: "ok", send: "CONNECT x:443 HTTP/1.1\r\nHost: x:443\r\n\r\ntunnel"},
		{name: "malformed", send: "NOT HTTP\r\n\r\n", outcome: OutcomeBadRequest, status: http.StatusBadRequest},
		{name: "closed before a request", closeAfter: true, outcome: OutcomeBadRequest},
		{name: "too large", send: "CONNECT x:443 HTTP/1.1\r\nX: " + strings.Repeat("a", 2000) + "\r\n\r\n", outcome: OutcomeHeadersTooBig, status: http.StatusRequestHeaderFieldsTooLarge},
		{name: "timeout", send: "CONNECT x:443 HTTP/1.1\r\n", outcome: OutcomeRequestTimeout, status: http.StatusRequestTimeout},
	} {
		t.Run(tc.name, func(t *testing.T) {
			client, server := pair(t)
			if _, err := io.WriteString(client, tc.send); err != nil {
				t.Fatal(err)
			}
			if tc.closeAfter {
				client.Close()
			}
			limit := &io.LimitedReader{R: server}
			br := bufio.NewReaderSize(limit, 4096)
			req, r := ReadRequest(server, br, limit, 1024, 200*time.Millisecond)
			if tc.outcome == "" {
				if r != nil {
					t.Fatalf("refused: %+v", r)
				}
				if req.Method != http.MethodConnect || req.Host != "x:443" {
					t.Errorf("request %s %s", req.Method, req.Host)
				}
				if got, _ := br.Peek(br.Buffered()); string(got) != "tunnel" {
					t.Errorf("bytes behind the request: %q", got)
				}
				if err := Established(server); err != nil {
					t.Fatal(err)
				}
				resp, err := http.ReadResponse(bufio.NewReader(client), nil)
				if err != nil || resp.StatusCode != http.StatusOK {
					t.Fatalf("answer: %v %v", resp, err)
				}
				return
			}
			if r == nil || r.Outcome != tc.outcome || r.Status != tc.status || r.Err == nil {
				t.Fatalf("refusal %+v, want %s %d with an error", r, tc.outcome, tc.status)
			}
			r.Answer(server)
			server.Close()
			if tc.status == 0 {
				return
			}
			resp, err := http.ReadResponse(bufio.NewReader(client), nil)
			if err != nil {
				t.Fatal(err)
			}
			body, _ := io.ReadAll(resp.Body)
			if resp.StatusCode != tc.status || string(body) != r.Body || !resp.Close {
				t.Errorf("answer %d %q (%v), want %d %q", resp.StatusCode, body, resp.Header, tc.status, r.Body)
			}
		})
	}
}
