// Package connect is HTTP CONNECT as tendril speaks it, both halves; the header and destination
// names it carries are package wire's. The client half (Open) is how tendril's shoot agents open
// a tunnel through the ingress over an open connection: one request, one answer, and nothing of
// the tunnel's own bytes consumed with the answer; it does not dial and sets no deadlines. The
// server half (ReadRequest, Refusal, Established) is the ingress's CONNECT listeners' and
// tendril-server's CONNECT front-end's: one request read within a time and a size limit, then a
// refusal with its status and counted outcome, or 200. Neither half dials or relays; the caller
// owns the connection.
package connect

import (
	"bufio"
	"bytes"
	"fmt"
	"io"
	"net/http"
)

// MaxAnswer bounds the answer's head: an ingress answers 200 with no headers.
const MaxAnswer = 4096

// Open sends CONNECT target with the header name: value on c and reads the answer. It returns nil
// only for 200; then the next byte on c is the tunnel's. target must be an authority
// (host:port), though the ingress routes by the header.
func Open(c io.ReadWriter, target, name, value string) error {
	if _, err := fmt.Fprintf(c, "CONNECT %s HTTP/1.1\r\nHost: %s\r\n%s: %s\r\n\r\n", target, target, name, value); err != nil {
		return fmt.Errorf("CONNECT: %w", err)
	}
	head, err := readHead(c)
	if err != nil {
		return fmt.Errorf("CONNECT answer: %w", err)
	}
	resp, err := http.ReadResponse(bufio.NewReader(bytes.NewReader(head)), nil)
	if err != nil {
		return fmt.Errorf("CONNECT answer: %w", err)
	}
	if resp.StatusCode != http.StatusOK {
		return fmt.Errorf("CONNECT refused: %s", resp.Status)
	}
	return nil
}

// readHead reads an answer through its blank line, byte by byte so that it never reads past it.
func readHead(r io.Reader) ([]byte, error) {
	head := make([]byte, 0, 128)
	b := make([]byte, 1)
	for len(head) < MaxAnswer {
		if _, err := io.ReadFull(r, b); err != nil {
			return nil, err
		}
		head = append(head, b[0])
		if bytes.HasSuffix(head, []byte("\r\n\r\n")) {
			return head, nil
		}
	}
	return nil, fmt.Errorf("answer head longer than %d bytes", MaxAnswer)
}
