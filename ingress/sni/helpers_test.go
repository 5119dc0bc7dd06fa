package sni

import (
	"bytes"
	"crypto/tls"
	"io"
	"net"
	"sync"
	"testing"
	"time"
)

// recordingConn remembers every byte written through it, before passing it on, so a reader on
// the other end can never observe bytes the recording lacks.
type recordingConn struct {
	net.Conn
	mu  sync.Mutex
	buf bytes.Buffer
}

func (c *recordingConn) Write(p []byte) (int, error) {
	c.mu.Lock()
	c.buf.Write(p)
	c.mu.Unlock()
	return c.Conn.Write(p)
}

func (c *recordingConn) written() []byte {
	c.mu.Lock()
	defer c.mu.Unlock()
	return bytes.Clone(c.buf.Bytes())
}

// captureGoHello runs a crypto/tls client handshake over net.Pipe and returns the records carrying
// its ClientHello. The framing is read here independently of ReadClientHello: Go sends a hello
// below 2^14 bytes as one record.
func captureGoHello(t testing.TB, cfg *tls.Config) []byte {
	t.Helper()
	client, server := net.Pipe()
	defer client.Close()
	defer server.Close()
	done := make(chan struct{})
	go func() {
		defer close(done)
		_ = tls.Client(client, cfg).Handshake() // fails once server is closed
	}()
	_ = server.SetReadDeadline(time.Now().Add(10 * time.Second))
	hdr := make([]byte, 5)
	if _, err := io.ReadFull(server, hdr); err != nil {
		t.Fatalf("reading record header: %v", err)
	}
	body := make([]byte, int(hdr[3])<<8|int(hdr[4]))
	if _, err := io.ReadFull(server, body); err != nil {
		t.Fatalf("reading record body: %v", err)
	}
	server.Close()
	client.Close()
	<-done
	if hdr[0] != 22 || len(body) < 4 || body[0] != 1 || int(body[1])<<16|int(body[2])<<8|int(body[3]) != len(body)-4 {
		t.Fatalf("captured record is not exactly one ClientHello: % x", hdr)
	}
	return append(hdr, body...)
}

// messageOf returns the handshake message carried by the single record rec.
func messageOf(rec []byte) []byte { return rec[5:] }

// frame splits a handshake message into handshake records of at most size bytes each.
func frame(msg []byte, size int) []byte {
	var out []byte
	for len(msg) > 0 {
		n := min(size, len(msg))
		out = append(out, 22, 3, 1, byte(n>>8), byte(n))
		out = append(out, msg[:n]...)
		msg = msg[n:]
	}
	return out
}

func u16(n int) []byte { return []byte{byte(n >> 8), byte(n)} }

// vec16 prefixes data with its 2-byte length.
func vec16(data ...[]byte) []byte {
	c := bytes.Join(data, nil)
	return append(u16(len(c)), c...)
}

// ext encodes one extension.
func ext(typ uint16, data []byte) []byte {
	return append(u16(int(typ)), vec16(data)...)
}

// sniExt encodes a server_name extension from already encoded entries.
func sniExt(entries ...[]byte) []byte { return ext(0, vec16(entries...)) }

// hostEntry encodes one ServerName entry.
func hostEntry(nameType byte, name string) []byte {
	return append([]byte{nameType}, vec16([]byte(name))...)
}

// helloParts are the fields of a synthetic ClientHello body; the zero value of each field gets
// a valid default.
type helloParts struct {
	version   []byte // default 3,3
	sessionID []byte // written with a 1-byte length
	suites    []byte // full vector incl. length; default one suite
	comp      []byte // full vector incl. length; default {1, 0}
	exts      []byte // full extensions block incl. length; nil: no block at all
	trailing  []byte
}

func (p helloParts) body() []byte {
	var b []byte
	if p.version == nil {
		p.version = []byte{3, 3}
	}
	b = append(b, p.version...)
	b = append(b, bytes.Repeat([]byte{0xab}, 32)...)
	b = append(b, byte(len(p.sessionID)))
	b = append(b, p.sessionID...)
	if p.suites == nil {
		p.suites = vec16([]byte{0x13, 0x01})
	}
	b = append(b, p.suites...)
	if p.comp == nil {
		p.comp = []byte{1, 0}
	}
	b = append(b, p.comp...)
	b = append(b, p.exts...)
	return append(b, p.trailing...)
}

// handshake wraps a body into a handshake message.
func handshake(typ byte, body []byte) []byte {
	n := len(body)
	return append([]byte{typ, byte(n >> 16), byte(n >> 8), byte(n)}, body...)
}

// synthHello returns a one-record ClientHello with the given extensions block.
func synthHello(exts []byte) []byte {
	return frame(handshake(1, helloParts{exts: exts}.body()), 1<<14)
}

// countingReader counts the bytes it hands out and serves an endless stream after data.
type countingReader struct {
	data []byte
	fill byte
	n    int
}

func (r *countingReader) Read(p []byte) (int, error) {
	n := copy(p, r.data)
	r.data = r.data[n:]
	for i := n; i < len(p); i++ {
		p[i] = r.fill
	}
	r.n += len(p)
	return len(p), nil
}
