// Package frame carries WireGuard packets over a byte stream (a TCP connection that an agent
// opened through an HTTP CONNECT proxy): each packet is a 2-byte big-endian length followed by
// that many bytes. It bounds what it reads and batches what it writes; it does not encrypt,
// authenticate or interpret the packets (WireGuard does), and it does not own the stream: the
// caller closes it.
//
// Wire format, repeated until the stream ends:
//
//	length  uint16, big endian, 1 … the reader's maximum (at most 65,535)
//	packet  length bytes: one WireGuard message
//
// Why two bytes suffice: a WireGuard message is never larger than 65,535 bytes, because
// wireguard-go sizes every message buffer to the largest UDP payload (device.MaxMessageSize =
// 2^16 − 1). A transport message is its 16-byte header, the inner packet padded to a multiple
// of 16 but never beyond the MTU, and a 16-byte Poly1305 tag, so it is at most MTU + 32 bytes;
// the tunnel allows inner MTUs up to 65,535 − 32 = 65,503 (60,000 + 32 = 60,032 < 65,535 for the
// default). Handshake messages are 148, 92 and 64 bytes.
//
// A zero length is invalid: WireGuard has no empty message, so a reader that sees one is
// reading garbage (or a future protocol this version does not speak) and stops with
// ErrInvalidLength rather than guess. A later version may give zero a meaning after
// negotiating it; this one never writes it.
package frame

import (
	"bufio"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
)

const (
	// HeaderSize is the length prefix: two bytes, big endian.
	HeaderSize = 2

	// MaxSize is the largest packet a frame can carry: the largest value of the 16-bit length,
	// which is also wireguard-go's largest message (device.MaxMessageSize = 2^16 − 1).
	MaxSize = 1<<16 - 1

	// bufferSize is the size of the read and write buffers: one frame of the largest size
	// with its header (65,537 bytes), so that a whole frame is always one buffer fill or flush.
	bufferSize = HeaderSize + MaxSize
)

var (
	// ErrInvalidLength reports a frame whose length prefix is zero.
	ErrInvalidLength = errors.New("frame: zero length")
	// ErrTooLarge reports a frame longer than the reader's or writer's maximum.
	ErrTooLarge = errors.New("frame: too large")
	// ErrShortBuffer reports a frame that does not fit the caller's buffer. The frame is not
	// consumed.
	ErrShortBuffer = errors.New("frame: buffer too small for frame")
)

// Reader reads frames from a stream into caller buffers. It does not allocate per frame. A
// Reader is not safe for concurrent use.
type Reader struct {
	br  *bufio.Reader
	max int
}

// NewReader returns a Reader over r that rejects frames longer than max bytes (max ≤ 0 or
// max > MaxSize means MaxSize). The Reader buffers, so it may read past the last frame it
// returns: once a Reader was used, read the stream only through it.
func NewReader(r io.Reader, max int) *Reader {
	if max <= 0 || max > MaxSize {
		max = MaxSize
	}
	return &Reader{br: bufio.NewReaderSize(r, bufferSize), max: max}
}

// Max reports the largest frame the Reader accepts.
func (r *Reader) Max() int { return r.max }

// PeekLen waits for the next frame's length prefix and returns it without consuming the frame,
// so that the caller can pick a buffer of the right size before ReadFrame. It returns
// ErrInvalidLength or ErrTooLarge (wrapped) for a prefix out of range: the stream cannot be
// resynchronised after that, and the caller should close it. A stream that ends cleanly between
// frames yields io.EOF; one that ends inside a prefix yields io.ErrUnexpectedEOF.
func (r *Reader) PeekLen() (int, error) {
	h, err := r.br.Peek(HeaderSize)
	if err != nil {
		if errors.Is(err, io.EOF) && len(h) > 0 {
			return 0, io.ErrUnexpectedEOF
		}
		return 0, err
	}
	n := int(binary.BigEndian.Uint16(h))
	switch {
	case n == 0:
		return 0, ErrInvalidLength
	case n > r.max:
		return 0, fmt.Errorf("%w: %d bytes, at most %d", ErrTooLarge, n, r.max)
	}
	return n, nil
}

// ReadFrame reads the next frame into buf and returns its length. A frame longer than buf
// yields ErrShortBuffer (wrapped) and stays unread; the other errors are those of PeekLen, and
// io.ErrUnexpectedEOF for a stream that ends inside a frame.
func (r *Reader) ReadFrame(buf []byte) (int, error) {
	n, err := r.PeekLen()
	if err != nil {
		return 0, err
	}
	if n > len(buf) {
		return 0, fmt.Errorf("%w: %d bytes into %d", ErrShortBuffer, n, len(buf))
	}
	if _, err := r.br.Discard(HeaderSize); err != nil {
		return 0, err
	}
	if _, err := io.ReadFull(r.br, buf[:n]); err != nil {
		if errors.Is(err, io.EOF) {
			err = io.ErrUnexpectedEOF
		}
		return 0, err
	}
	return n, nil
}

// AppendFrame appends p as one frame to dst and returns the extended slice, for callers that
// batch frames in their own buffer. It refuses an empty p (ErrInvalidLength) and one longer
// than max (ErrTooLarge; max ≤ 0 or max > MaxSize means MaxSize), returning dst unchanged.
func AppendFrame(dst, p []byte, max int) ([]byte, error) {
	if max <= 0 || max > MaxSize {
		max = MaxSize
	}
	switch {
	case len(p) == 0:
		return dst, ErrInvalidLength
	case len(p) > max:
		return dst, fmt.Errorf("%w: %d bytes, at most %d", ErrTooLarge, len(p), max)
	}
	dst = binary.BigEndian.AppendUint16(dst, uint16(len(p)))
	return append(dst, p...), nil
}

// Writer writes frames to a stream. WriteFrame only buffers; Flush (or WriteFrames, which
// flushes once at the end) writes everything buffered, so a batch of frames costs one write
// system call as long as it fits the 64 KiB buffer. A Writer is not safe for concurrent use;
// after an error every later call returns it.
type Writer struct {
	bw  *bufio.Writer
	max int
	hdr [HeaderSize]byte
}

// NewWriter returns a Writer to w that refuses frames longer than max bytes (max ≤ 0 or
// max > MaxSize means MaxSize).
func NewWriter(w io.Writer, max int) *Writer {
	if max <= 0 || max > MaxSize {
		max = MaxSize
	}
	return &Writer{bw: bufio.NewWriterSize(w, bufferSize), max: max}
}

// WriteFrame buffers p as one frame. It refuses an empty p (ErrInvalidLength) and one longer
// than the maximum (ErrTooLarge) without writing anything. When the buffer is full it writes
// what it holds to the stream.
func (w *Writer) WriteFrame(p []byte) error {
	switch {
	case len(p) == 0:
		return ErrInvalidLength
	case len(p) > w.max:
		return fmt.Errorf("%w: %d bytes, at most %d", ErrTooLarge, len(p), w.max)
	}
	binary.BigEndian.PutUint16(w.hdr[:], uint16(len(p)))
	if _, err := w.bw.Write(w.hdr[:]); err != nil {
		return err
	}
	_, err := w.bw.Write(p)
	return err
}

// Flush writes the buffered frames to the stream.
func (w *Writer) Flush() error { return w.bw.Flush() }

// WriteFrames buffers every packet of ps as a frame and flushes once. If a packet is refused,
// the frames before it are still flushed and the error is returned.
func (w *Writer) WriteFrames(ps [][]byte) error {
	var first error
	for _, p := range ps {
		if err := w.WriteFrame(p); err != nil {
			first = err
			break
		}
	}
	if err := w.bw.Flush(); err != nil {
		return err
	}
	return first
}
