// Package h2relay relays HTTP/2 requests frame by frame from client connections to upstream
// HTTP/2 connections, with one goroutine per connection (its reader): a request's header block is
// decoded, shown to a Director (which may rewrite its fields and names the upstream, or answers it
// itself), and encoded again for a stream of an upstream connection; DATA goes on as it comes,
// within each hop's own flow control, a stream's data held at most up to the window the relay
// granted its sender; each connection's frames are gathered and written once per wake-up of its
// writer, so that many streams' frames share a TLS record and a system call.
//
// It does not do HTTP/1.1, upgrades (extended CONNECT), server push, or priorities (ignored), and
// it does not authenticate: the Director decides.
//
// ingress/terminate serves a terminating shoot's HTTP/2 clients with it (docs/design-notes/
// l7-terminate.md).
package h2relay

import (
	"bufio"
	"cmp"
	"context"
	"crypto/tls"
	"errors"
	"io"
	"net"
	"strconv"
	"sync"
	"time"

	"github.com/go-logr/logr"
	"golang.org/x/net/http2"
	"golang.org/x/net/http2/hpack"
)

// Config tunes a Relay; its zero value works.
type Config struct {
	Log logr.Logger
	// MaxStreams bounds a client connection's concurrent streams (default 250).
	MaxStreams uint32
	// StreamWindow is the flow-control window the relay grants a sender per stream, and so the
	// most it holds of one stream's data in one direction (default 1 MiB).
	StreamWindow uint32
	// MaxHeaderListSize bounds a header block, decoded (default 1 MiB, as kube-apiserver's).
	MaxHeaderListSize uint32
	// PrefaceTimeout bounds the client's preface and first SETTINGS (default 10 s).
	PrefaceTimeout time.Duration
	// WriteTimeout closes a connection whose peer takes longer to take a batch (default 30 s).
	WriteTimeout time.Duration
	// IdleTimeout closes a client connection that has had no stream for this long (default 1 h).
	IdleTimeout time.Duration
	// ParkAfter parks a client connection from which nothing came for this long (up to half of
	// it more: quiet checks share timers), with streams open or not: its reader goroutine ends,
	// and the relay's one epoll instance waits for the socket to become readable (Linux only;
	// default 250 ms; negative: never).
	// Most client connections are quiet most of their lives, and a blocked reader's stack is the
	// largest part of one that the relay owns (park.go).
	ParkAfter time.Duration
	// OnUpstreamFailure, if set, is told of every request answered 502 because its replica
	// failed (a dial, or the connection lost before the response began).
	OnUpstreamFailure func(error)
	// BadGateway is the answer to those requests (default: 502, a line of text).
	BadGateway *Answer
}

func (c Config) withDefaults() Config {
	c.MaxStreams = cmp.Or(c.MaxStreams, 250)
	c.StreamWindow = cmp.Or(c.StreamWindow, 1<<20)
	c.MaxHeaderListSize = cmp.Or(c.MaxHeaderListSize, 1<<20)
	c.PrefaceTimeout = cmp.Or(c.PrefaceTimeout, 10*time.Second)
	c.WriteTimeout = cmp.Or(c.WriteTimeout, 30*time.Second)
	c.IdleTimeout = cmp.Or(c.IdleTimeout, time.Hour)
	c.ParkAfter = cmp.Or(c.ParkAfter, 250*time.Millisecond)
	if c.BadGateway == nil {
		c.BadGateway = &Answer{Status: 502, ContentType: "text/plain", Body: []byte("upstream failed\n")}
	}
	return c
}

// connWindow is the connection-level window the relay grants a peer: every stream's full window,
// so that the connection's never holds a stream back that its own would let through.
func (c Config) connWindow() uint32 {
	return uint32(min(uint64(c.MaxStreams)*uint64(c.StreamWindow), 1<<31-1))
}

// Head is a request's head as the client sent it.
type Head struct {
	Method, Scheme, Authority, Path string
	// Fields are the regular header fields, names lower-case; the Director may change them.
	Fields []hpack.HeaderField
	// EndStream: the request has no body.
	EndStream bool
}

// Answer is a response the relay sends itself.
type Answer struct {
	Status      int
	ContentType string
	Body        []byte
}

// Director decides each request of a client connection: the upstream it goes to, or an answer.
type Director interface {
	Direct(ctx context.Context, h *Head) (*Upstream, *Answer)
}

// writer gathers a connection's frames and writes them in batches: whoever adds a frame while
// no batch is being written starts a goroutine that writes until nothing is left (one system
// call for all the frames added meanwhile).
type writer struct {
	conn    net.Conn
	timeout time.Duration
	mu      sync.Mutex
	buf     []byte
	spare   []byte
	fr      *http2.Framer // writes into buf; made when needed (release drops it)
	enc     *hpack.Encoder
	encBuf  bufferWriter
	running bool
	err     error
	// closed is called once when a write fails.
	onError func(error)
}

// bufferWriter appends to a byte slice.
type bufferWriter struct{ b *[]byte }

func (w bufferWriter) Write(p []byte) (int, error) {
	*w.b = append(*w.b, p...)
	return len(p), nil
}

func newWriter(c net.Conn, timeout time.Duration, onError func(error)) *writer {
	w := &writer{conn: c, timeout: timeout, onError: onError}
	var hb []byte
	w.encBuf = bufferWriter{&hb}
	w.enc = hpack.NewEncoder(w.encBuf)
	return w
}

// frames runs f with the framer and encoder under the writer's lock, then makes sure a batch
// writer runs.
func (w *writer) frames(f func(fr *http2.Framer) error) error {
	w.mu.Lock()
	if w.err != nil {
		err := w.err
		w.mu.Unlock()
		return err
	}
	if w.fr == nil {
		w.fr = http2.NewFramer(bufferWriter{&w.buf}, nil)
	}
	err := f(w.fr)
	start := !w.running && len(w.buf) > 0
	if start {
		w.running = true
	}
	w.mu.Unlock()
	if start {
		go w.run()
	}
	return err
}

// headers encodes fields as one header block on stream id, split into HEADERS and CONTINUATION
// frames of at most maxFrame bytes. It must run inside frames (the encoder's table is the
// connection's, in the order the blocks are sent).
func (w *writer) headers(fr *http2.Framer, id uint32, fields []hpack.HeaderField, endStream bool, maxFrame uint32) error {
	*w.encBuf.b = (*w.encBuf.b)[:0]
	for _, f := range fields {
		if err := w.enc.WriteField(f); err != nil {
			return err
		}
	}
	block := *w.encBuf.b
	first := true
	for first || len(block) > 0 {
		n := min(len(block), int(maxFrame))
		frag, end := block[:n], n == len(block)
		block = block[n:]
		var err error
		if first {
			err = fr.WriteHeaders(http2.HeadersFrameParam{StreamID: id, BlockFragment: frag, EndStream: endStream, EndHeaders: end})
			first = false
		} else {
			err = fr.WriteContinuation(id, end, frag)
		}
		if err != nil {
			return err
		}
	}
	return nil
}

// keepBufSize is the most of a batch buffer a writer keeps while its connection is quiet: a
// few small frames' worth (a request's head, a WINDOW_UPDATE, a PING).
const keepBufSize = 4 << 10

func (w *writer) run() {
	for {
		w.mu.Lock()
		if len(w.buf) == 0 || w.err != nil {
			w.running = false
			// A connection that goes quiet keeps no large batch's buffers: most client
			// connections sit idle most of the time, and one LIST's response grows them.
			if cap(w.buf) > keepBufSize {
				w.buf = nil
			}
			if cap(w.spare) > keepBufSize {
				w.spare = nil
			}
			w.mu.Unlock()
			return
		}
		batch := w.buf
		w.buf = w.spare[:0]
		w.mu.Unlock()
		_ = w.conn.SetWriteDeadline(time.Now().Add(w.timeout))
		_, err := w.conn.Write(batch)
		w.mu.Lock()
		w.spare = batch[:0]
		if err != nil && w.err == nil {
			w.err = err
			w.running = false
			w.mu.Unlock()
			w.onError(err)
			return
		}
		w.mu.Unlock()
	}
}

// release drops the writer's framer, whose frame buffer is as large as the largest frame it
// wrote (a LIST's DATA: 16 KiB), and its batch buffers unless a batch is being written: a
// parked connection keeps none.
func (w *writer) release() {
	w.mu.Lock()
	defer w.mu.Unlock()
	w.fr, *w.encBuf.b = nil, nil
	if !w.running {
		w.buf, w.spare = nil, nil
	}
}

// flow is one direction of a stream: what is held for the receiving peer until its windows
// allow, and how much the receiving peer lets the relay send on the stream.
type flow struct {
	held      []byte
	heldEnd   bool                // END_STREAM after held
	trailers  []hpack.HeaderField // sent after held, with END_STREAM
	window    int64               // the receiver's stream window for the relay
	ended     bool                // END_STREAM sent to the receiver
	unacked   uint32              // bytes sent on, not yet granted back to the sender
	queued    bool                // in the receiving connection's blocked list
	receivedN int64               // bytes received from the sender (its window use)
}

var errClosed = errors.New("h2relay: connection closed")

// readBufSize is the read buffer of a connection without TLS: one maximal frame (16 KiB payload
// + 9 header).
const readBufSize = 16<<10 + 9

// frameSource is what a connection's frames are read from. A TLS connection is read as it is:
// it holds a decrypted record already, so a frame header's 9 bytes cost no system call, and a
// buffer of its own would be 16 KiB more per idle connection and one copy more per frame.
func frameSource(c net.Conn) io.Reader {
	if _, ok := c.(*tls.Conn); ok {
		return c
	}
	return bufio.NewReaderSize(c, readBufSize)
}

// newReadFramer reads frames from r, header blocks decoded with dec.
func newReadFramer(r io.Reader, dec *hpack.Decoder, maxHeaderList uint32) *http2.Framer {
	fr := http2.NewFramer(nil, r)
	fr.SetMaxReadFrameSize(16 << 10) // what the relay advertises (the default)
	fr.ReadMetaHeaders = dec
	fr.MaxHeaderListSize = maxHeaderList
	return fr
}

// statusFields are a response head's fields for an Answer.
func statusFields(a *Answer) []hpack.HeaderField {
	fs := []hpack.HeaderField{{Name: ":status", Value: strconv.Itoa(a.Status)}}
	if a.ContentType != "" {
		fs = append(fs, hpack.HeaderField{Name: "content-type", Value: a.ContentType})
	}
	return append(fs, hpack.HeaderField{Name: "content-length", Value: strconv.Itoa(len(a.Body))})
}
