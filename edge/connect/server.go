package connect

import (
	"bufio"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"time"

	"github.com/tendril-net/tendril/edge/pipe"
)

// The server half: one request read within a time and a size limit, refused with a status and a
// counted outcome, or answered 200 once the server's upstream is connected. The ingress's CONNECT
// listeners and tendril-server's CONNECT front-end both serve it; what they count and log a
// refusal as is theirs (Refusal carries the outcome, the label of their metrics).

// Outcomes of reading a request, the values of the servers' outcome labels.
const (
	OutcomeBadRequest     = "bad_request"
	OutcomeRequestTimeout = "request_timeout"
	OutcomeHeadersTooBig  = "request_headers_too_large"
)

// Refusal is a request the server does not tunnel: the outcome counted, and the status and body
// it is answered with (Status 0: the client went before a request, nothing to answer).
type Refusal struct {
	Outcome string
	Status  int
	Body    string
	Err     error
}

// ReadRequest reads one request from br, which reads c through limit, within timeout (a read
// deadline on c, cleared afterwards) and maxHeader bytes more of limit. Bytes br read past the
// request are the tunnel's first; once the request is read, the tunnel's bytes may be read from
// c itself, past the limit.
func ReadRequest(c net.Conn, br *bufio.Reader, limit *io.LimitedReader, maxHeader int, timeout time.Duration) (*http.Request, *Refusal) {
	limit.N += int64(maxHeader)
	_ = c.SetReadDeadline(time.Now().Add(timeout))
	req, err := http.ReadRequest(br)
	_ = c.SetReadDeadline(time.Time{})
	switch {
	case err == nil:
		return req, nil
	case pipe.IsTimeout(err):
		return nil, &Refusal{OutcomeRequestTimeout, http.StatusRequestTimeout, "request not complete within " + timeout.String() + "\n", err}
	case limit.N <= 0:
		return nil, &Refusal{OutcomeHeadersTooBig, http.StatusRequestHeaderFieldsTooLarge, fmt.Sprintf("request headers larger than %d bytes\n", maxHeader), err}
	case errors.Is(err, io.EOF):
		return nil, &Refusal{Outcome: OutcomeBadRequest, Err: err}
	default:
		return nil, &Refusal{OutcomeBadRequest, http.StatusBadRequest, "malformed request\n", err}
	}
}

// answerTimeout bounds the write of a refusal: a client that does not read it is closed anyway.
const answerTimeout = 5 * time.Second

// Answer writes r's status and body to c, if it has one, and asks the client to close; the
// caller closes c.
func (r *Refusal) Answer(c net.Conn) {
	if r.Status == 0 {
		return
	}
	_ = c.SetWriteDeadline(time.Now().Add(answerTimeout))
	fmt.Fprintf(c, "HTTP/1.1 %d %s\r\nContent-Type: text/plain\r\nContent-Length: %d\r\nConnection: close\r\n\r\n%s",
		r.Status, http.StatusText(r.Status), len(r.Body), r.Body)
}

// Established answers a request whose upstream is connected: the next byte on w is the
// tunnel's.
func Established(w io.Writer) error {
	_, err := io.WriteString(w, "HTTP/1.1 200 Connection established\r\n\r\n")
	return err
}
