package terminate

import (
	"bytes"
	"strconv"
	"strings"
)

// framing follows the request boundaries of an HTTP/1.1 byte stream as net/http reads them, to
// find the requests that net/http accepts but a proxy must refuse: one with both Content-Length
// and Transfer-Encoding. RFC 9112 (6.1) lets a server take Transfer-Encoding and drop
// Content-Length, as net/http does, but calls the message a possible smuggling attempt that
// "ought to be handled as an error"; net/http's handler never sees that there were both, so the
// bytes are read here on their way to it.
//
// It only tracks: it never changes or holds bytes. It frames a body as net/http does
// (Transfer-Encoding chunked first, else Content-Length, else none) so that it stays at the
// same request as net/http. It stops following (and so finds nothing more) where net/http stops
// parsing HTTP anyway or where the stream leaves HTTP: a head larger than maxHead, a malformed
// length, an unsupported transfer coding, an upgrade.
type framing struct {
	state    frameState
	line     []byte // the line being read (head lines, chunk sizes, trailers)
	head     headInfo
	headSize int
	left     int64 // body or chunk bytes still to pass
	maxHead  int
	requests int // heads completed
	conflict int // the first request (1-based) with both lengths; 0: none
}

type frameState int

const (
	frameHead frameState = iota
	frameBody
	frameChunkSize
	frameChunkData
	frameChunkEnd // the CRLF after a chunk's data
	frameTrailer
	frameDone // no longer followed
)

// maxLine bounds a chunk-size or trailer line; net/http refuses longer ones too.
const maxLine = 4 << 10

// headInfo is what a head says about its body.
type headInfo struct {
	lines         int
	contentLength []string
	transfer      []string
	hasUpgrade    bool
	connUpgrade   bool
}

func newFraming(maxHead int) *framing { return &framing{maxHead: maxHead} }

// feed follows b, the next bytes of the stream.
func (f *framing) feed(b []byte) {
	for len(b) > 0 && f.state != frameDone {
		switch f.state {
		case frameBody, frameChunkData:
			n := min(int64(len(b)), f.left)
			b, f.left = b[n:], f.left-n
			if f.left == 0 {
				if f.state == frameBody {
					f.state = frameHead
				} else {
					f.state = frameChunkEnd
				}
			}
		default:
			i := bytes.IndexByte(b, '\n')
			if i < 0 {
				f.addLine(b)
				return
			}
			f.addLine(b[:i+1]) // with its '\n', counted in a head's size
			b = b[i+1:]
			if f.state != frameDone {
				f.endLine(string(bytes.TrimSuffix(bytes.TrimSuffix(f.line, []byte{'\n'}), []byte{'\r'})))
				f.line = f.line[:0]
			}
		}
	}
}

// addLine adds part of a line, stopping when a head or line grows past its bound.
func (f *framing) addLine(b []byte) {
	if f.state == frameHead {
		f.headSize += len(b)
		if f.headSize > f.maxHead {
			f.state = frameDone
			return
		}
	} else if len(f.line)+len(b) > maxLine+1 {
		f.state = frameDone
		return
	}
	f.line = append(f.line, b...)
}

// endLine takes one complete line (without its line end).
func (f *framing) endLine(l string) {
	switch f.state {
	case frameHead:
		if l != "" {
			f.headLine(l)
			return
		}
		if f.head.lines == 0 {
			return // net/http refuses an empty request line; nothing to follow
		}
		f.endHead()
	case frameChunkSize:
		size, _, _ := strings.Cut(l, ";")
		n, err := strconv.ParseInt(strings.TrimSpace(size), 16, 64)
		switch {
		case err != nil || n < 0:
			f.state = frameDone
		case n == 0:
			f.state = frameTrailer
		default:
			f.state, f.left = frameChunkData, n
		}
	case frameChunkEnd:
		if l != "" {
			f.state = frameDone // net/http wants CRLF after the data
			return
		}
		f.state = frameChunkSize
	case frameTrailer:
		if l == "" {
			f.state = frameHead
		}
	}
}

func (f *framing) headLine(l string) {
	f.head.lines++
	if f.head.lines == 1 || l[0] == ' ' || l[0] == '\t' {
		return // the request line; a continuation line (net/http refuses those)
	}
	name, value, ok := strings.Cut(l, ":")
	if !ok {
		return
	}
	value = strings.TrimSpace(value)
	switch {
	case strings.EqualFold(name, "Content-Length"):
		f.head.contentLength = append(f.head.contentLength, value)
	case strings.EqualFold(name, "Transfer-Encoding"):
		f.head.transfer = append(f.head.transfer, value)
	case strings.EqualFold(name, "Upgrade"):
		f.head.hasUpgrade = value != ""
	case strings.EqualFold(name, "Connection"):
		for _, t := range strings.Split(value, ",") {
			if strings.EqualFold(strings.TrimSpace(t), "upgrade") {
				f.head.connUpgrade = true
			}
		}
	}
}

// endHead frames the body of the head just read.
func (f *framing) endHead() {
	f.requests++
	h := f.head
	f.head, f.headSize = headInfo{}, 0
	if len(h.contentLength) > 0 && len(h.transfer) > 0 && f.conflict == 0 {
		f.conflict = f.requests
	}
	switch {
	case h.connUpgrade && h.hasUpgrade:
		f.state = frameDone // after a 101 the stream is no longer HTTP
	case len(h.transfer) > 0:
		codings := strings.Split(strings.Join(h.transfer, ","), ",")
		if !strings.EqualFold(strings.TrimSpace(codings[len(codings)-1]), "chunked") {
			f.state = frameDone // net/http refuses it and closes
			return
		}
		f.state = frameChunkSize
	case len(h.contentLength) > 0:
		n, err := strconv.ParseInt(h.contentLength[0], 10, 64)
		switch {
		case err != nil || n < 0:
			f.state = frameDone // net/http refuses it and closes
		case n > 0:
			f.state, f.left = frameBody, n
		}
	}
}
