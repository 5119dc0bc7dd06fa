package terminate

import (
	"bufio"
	"io"
	"net/http"
	"strings"
	"testing"
)

var framingCases = []struct {
	name      string
	stream    string
	requests  int
	conflict  int
	following bool // still following at the end
}{
	{"one GET", "GET / HTTP/1.1\r\nHost: a\r\n\r\n", 1, 0, true},
	{"bare LF lines", "GET / HTTP/1.1\nHost: a\n\n", 1, 0, true},
	{"body by length, then a GET", "POST / HTTP/1.1\r\nHost: a\r\nContent-Length: 22\r\n\r\nGET /x HTTP/1.1\r\n\r\n\r\nGET / HTTP/1.1\r\n\r\n", 2, 0, true},
	{"chunked body with extensions and a trailer", "POST / HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n5;ext=1\r\nhello\r\n0\r\nX-T: 1\r\n\r\nGET / HTTP/1.1\r\n\r\n", 2, 0, true},
	{"both lengths", "POST / HTTP/1.1\r\nContent-Length: 4\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\nGET /admin HTTP/1.1\r\n\r\n", 2, 1, true},
	{"both lengths, any case, on the second request", "GET / HTTP/1.1\r\n\r\nPOST / HTTP/1.1\r\ncontent-length: 4\r\nTRANSFER-ENCODING: chunked\r\n\r\n0\r\n\r\n", 2, 2, true},
	{"upgrade ends the HTTP", "GET / HTTP/1.1\r\nConnection: keep-alive, Upgrade\r\nUpgrade: SPDY/3.1\r\n\r\nContent-Length: 1\r\nTransfer-Encoding: chunked\r\n\r\n", 1, 0, false},
	{"unsupported coding", "POST / HTTP/1.1\r\nTransfer-Encoding: gzip\r\n\r\n", 1, 0, false},
	{"bad length", "POST / HTTP/1.1\r\nContent-Length: -1\r\n\r\n", 1, 0, false},
	{"bad chunk size", "POST / HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n", 1, 0, false},
	{"no CRLF after chunk data", "POST / HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n2\r\nabcd\r\n", 1, 0, false},
	{"head too large", "GET / HTTP/1.1\r\nX: " + strings.Repeat("a", 300) + "\r\n\r\n", 0, 0, false},
	{"unfinished head", "GET / HTTP/1.1\r\nHost: a\r\n", 0, 0, true},
}

// TestFraming: requests and conflicts found, whole and fed a byte at a time.
func TestFraming(t *testing.T) {
	for _, tc := range framingCases {
		for _, step := range []int{len(tc.stream), 1, 7} {
			f := newFraming(256)
			for b := []byte(tc.stream); len(b) > 0; {
				n := min(step, len(b))
				f.feed(b[:n])
				b = b[n:]
			}
			if f.requests != tc.requests || f.conflict != tc.conflict || (f.state != frameDone) != tc.following {
				t.Errorf("%s (by %d): %d requests, conflict at %d, following %v; want %d, %d, %v",
					tc.name, step, f.requests, f.conflict, f.state != frameDone, tc.requests, tc.conflict, tc.following)
			}
		}
	}
}

// TestFramingAgreesWithNetHTTP: on the well-formed streams, net/http's own reader finds as many
// requests as framing (its boundaries are net/http's).
func TestFramingAgreesWithNetHTTP(t *testing.T) {
	for _, tc := range framingCases {
		if !tc.following || tc.conflict != 0 {
			continue
		}
		br := bufio.NewReader(strings.NewReader(tc.stream))
		n := 0
		for {
			req, err := http.ReadRequest(br)
			if err != nil {
				break
			}
			n++
			_, _ = io.Copy(io.Discard, req.Body)
		}
		if n != tc.requests {
			t.Errorf("%s: net/http reads %d requests, framing %d", tc.name, n, tc.requests)
		}
	}
}

// FuzzFraming: any bytes, split anywhere, give the same result as fed whole, and never panic.
func FuzzFraming(f *testing.F) {
	for _, tc := range framingCases {
		f.Add([]byte(tc.stream), uint16(3))
	}
	f.Fuzz(func(t *testing.T, b []byte, split uint16) {
		whole := newFraming(1 << 10)
		whole.feed(b)
		parts := newFraming(1 << 10)
		at := int(split) % (len(b) + 1)
		parts.feed(b[:at])
		parts.feed(b[at:])
		if whole.requests != parts.requests || whole.conflict != parts.conflict || whole.state != parts.state {
			t.Fatalf("split at %d: %d/%d/%d, whole %d/%d/%d", at, parts.requests, parts.conflict, parts.state, whole.requests, whole.conflict, whole.state)
		}
	})
}
