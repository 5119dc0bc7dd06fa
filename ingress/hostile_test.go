package ingress

import (
	"bufio"
	"io"
	"net"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/tendril-net/tendril/xds/translate"
)

// connectOfSize is a CONNECT request for a cluster header of exactly size bytes (request line,
// headers and the blank line), padded with an X-Pad header.
func connectOfSize(t *testing.T, header, value string, size int) string {
	t.Helper()
	head := "CONNECT x:443 HTTP/1.1\r\nHost: x:443\r\n" + header + ": " + value + "\r\nX-Pad: "
	tail := "\r\n\r\n"
	pad := size - len(head) - len(tail)
	if pad < 1 {
		t.Fatalf("size %d too small", size)
	}
	return head + strings.Repeat("a", pad) + tail
}

// TestConnectHeaderLimitOnBothListeners sends CONNECT requests of exactly the header limit and
// one byte more to the proxy listener (which reads an optional PROXY header first) and to the
// tunnel listener (which does not): both accept the first and answer 431 to the second. The
// proxy listener used to keep the PROXY header's allowance when none came and took ~20 KB.
func TestConnectHeaderLimitOnBothListeners(t *testing.T) {
	t.Parallel()
	w, _ := inClusterWorld(t)
	const limit = translate.MaxRequestHeadersKB << 10
	for _, tc := range []struct{ listener, addr, header string }{
		{"proxy", w.proxy, translate.GardenerDestinationHeader},
		{"tunnel", w.tunnel, translate.ReversedVPNHeader},
	} {
		for _, size := range []int{limit, limit + 1} {
			c, err := net.DialTimeout("tcp", tc.addr, 5*time.Second)
			if err != nil {
				t.Fatal(err)
			}
			_ = c.SetDeadline(time.Now().Add(20 * time.Second))
			if _, err := io.WriteString(c, connectOfSize(t, tc.header, translate.VPNServerWireName("shoot--t--alpha"), size)); err != nil {
				t.Fatal(err)
			}
			resp, err := http.ReadResponse(bufio.NewReader(c), nil)
			c.Close()
			if err != nil {
				t.Fatalf("%s, %d bytes of request: %v", tc.listener, size, err)
			}
			want := http.StatusOK
			if size > limit {
				want = http.StatusRequestHeaderFieldsTooLarge
			}
			if resp.StatusCode != want {
				t.Errorf("%s, %d bytes of request (limit %d): %s, want %d", tc.listener, size, limit, resp.Status, want)
			}
		}
		if got := promtestConn(t, w, tc.listener, outcomeHeadersTooBig); got != 1 {
			t.Errorf("%s: %s %v, want 1", tc.listener, outcomeHeadersTooBig, got)
		}
	}
}
