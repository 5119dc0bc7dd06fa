// Package sni reads the server name from a TLS ClientHello without terminating TLS. It does not
// set deadlines or dial anything; the caller owns the connection.
package sni

import (
	"errors"
	"fmt"
	"io"
	"strings"
)

// Wire-format sizes and code points (RFC 8446 §4, §5.1; RFC 6066 §3).
const (
	recordHeaderLen    = 5       // ContentType(1) + legacy_record_version(2) + length(2)
	handshakeHeaderLen = 4       // HandshakeType(1) + uint24 length
	maxPlaintext       = 1 << 14 // RFC 8446 §5.1: TLSPlaintext.length MUST NOT exceed 2^14 = 16384

	recordTypeHandshake = 22
	typeClientHello     = 1
	extServerName       = 0
	nameTypeHostName    = 0
	maxHostNameLen      = 255 // a DNS name is at most 255 octets (RFC 1035 §3.1)
	maxSessionIDLen     = 32  // opaque legacy_session_id<0..32>
	randomLen           = 32
)

// MaxHelloSize is the most bytes ReadClientHello reads from the wire, record headers included:
// one maximal TLS record, 5 + 2^14 = 16389 bytes.
//
// Why this is enough for real clients: a ClientHello is normally sent in a single record, and
// the largest one any record can carry is 2^14 bytes (handshake header included). Real hellos
// are far smaller: Go 1.26 and OpenSSL 3.5 with the hybrid X25519MLKEM768 key share
// (1184-byte ML-KEM encapsulation key + 32-byte X25519 key, plus an extra 32-byte X25519 share)
// come to about 1.3–1.8 KB (Go 1.26's default hello measures about 1.5 KB), and browser hellos
// with GREASE, ECH and padding stay near 2 KB.
//
// Why it also admits fragmented hellos: a hello of L bytes split into k records costs L + 5k
// bytes, accepted while L + 5k <= 16389. A 1,800-byte hello may be split into as many as
// (16389-1800)/5 = 2917 records, so even a hello cut into 1-byte records fits
// (1800*(1+5) = 10800), which covers clients and middleboxes that fragment the hello to defeat
// SNI filtering. A 2^14-byte hello must come in one record.
//
// Memory: no single allocation exceeds MaxHelloSize. raw grows record by record up to at most
// MaxHelloSize (a record header claiming a longer record is rejected before its body is read),
// and a fragmented hello is also reassembled into one buffer of at most 2^14 bytes.
const MaxHelloSize = recordHeaderLen + maxPlaintext // 5 + 16384 = 16389

var (
	ErrNotTLS    = errors.New("sni: not a TLS handshake") // first record is not a TLS handshake record (e.g. plain HTTP)
	ErrMalformed = errors.New("sni: malformed ClientHello")
	ErrTooLarge  = errors.New("sni: ClientHello too large") // would need more than MaxHelloSize bytes
)

// ReadClientHello reads from r exactly the bytes of the TLS records that carry one ClientHello
// (possibly fragmented over several handshake records) and no more, and returns the server name
// from the server_name extension, lower-cased ("" when the hello has no SNI), and every byte it read
// (which the caller replays to the upstream). A stream that ends early returns an error wrapping
// io.ErrUnexpectedEOF; the caller's read deadline surfaces as the reader's error, wrapped.
// The errors above are returned wrapped with detail (use %w), so errors.Is works.
//
// Further details callers rely on:
//   - raw holds every byte consumed from r also when err != nil (e.g. the first 5 bytes of a
//     plain HTTP request after ErrNotTLS), and is always a prefix of the stream.
//   - A stream that ends before its first byte returns an error wrapping both
//     io.ErrUnexpectedEOF and io.EOF, so health checks that connect and close can be told apart.
//   - The name is lower-cased ASCII but otherwise as sent: a trailing dot is kept, so "a.b." and
//     "a.b" are different names (routes match exactly). Only bytes 0x21..0x7e are accepted.
//   - With ECH the returned name is the outer (public) name, which is all a passthrough sees.
//   - The hello must end exactly at a record boundary: a record carrying bytes past the
//     ClientHello, or a non-handshake record between fragments, is ErrMalformed.
//   - More than one host_name entry in server_name (RFC 6066 §3 "MUST NOT") is ErrMalformed, so
//     the name routed on cannot differ from the one an upstream would pick.
func ReadClientHello(r io.Reader) (serverName string, raw []byte, err error) {
	var (
		hsHdr   [handshakeHeaderLen]byte // the handshake header may straddle records
		nHsHdr  int
		msgLen  = -1 // handshake header + body, known once hsHdr is complete
		have    int  // handshake bytes read so far, across records
		records int
		h       = make([]byte, recordHeaderLen) // one per call: a read into it escapes via r
	)
	for msgLen < 0 || have < msgLen {
		// Refuse before reading or allocating when even the cheapest framing of what is
		// still missing (full records, one header each) cannot fit in MaxHelloSize.
		need := recordHeaderLen + 1
		if msgLen >= 0 {
			rem := msgLen - have
			need = rem + recordHeaderLen*((rem+maxPlaintext-1)/maxPlaintext)
		}
		if len(raw)+need > MaxHelloSize {
			if msgLen >= 0 {
				return "", raw, fmt.Errorf("%w: %d-byte handshake message needs at least %d bytes, limit %d",
					ErrTooLarge, msgLen, len(raw)+need, MaxHelloSize)
			}
			return "", raw, fmt.Errorf("%w: %d bytes read and handshake header still incomplete, limit %d",
				ErrTooLarge, len(raw), MaxHelloSize)
		}

		n, err := io.ReadFull(r, h)
		if err != nil {
			raw = append(raw, h[:n]...)
			return "", raw, readError("record header", err, len(raw) == 0)
		}
		recLen := int(h[3])<<8 | int(h[4])
		if err := checkRecordHeader(h, recLen, records); err != nil {
			return "", append(raw, h...), err
		}
		if msgLen >= 0 && recLen > msgLen-have {
			return "", append(raw, h...), fmt.Errorf("%w: %d-byte record extends past the ClientHello (%d bytes missing)",
				ErrMalformed, recLen, msgLen-have)
		}
		if len(raw)+recordHeaderLen+recLen > MaxHelloSize {
			return "", append(raw, h...), fmt.Errorf("%w: %d bytes read, next record of %d bytes exceeds limit %d",
				ErrTooLarge, len(raw)+recordHeaderLen, recLen, MaxHelloSize)
		}

		raw = grow(raw, recordHeaderLen+recLen)
		raw = append(raw, h...)
		start := len(raw)
		raw = raw[:start+recLen]
		n, err = io.ReadFull(r, raw[start:])
		if err != nil {
			raw = raw[:start+n]
			return "", raw, readError("record body", err, false)
		}
		records++
		have += recLen

		if msgLen < 0 {
			for body := raw[start:]; nHsHdr < handshakeHeaderLen && len(body) > 0; body = body[1:] {
				hsHdr[nHsHdr] = body[0]
				nHsHdr++
			}
			if nHsHdr == handshakeHeaderLen {
				if hsHdr[0] != typeClientHello {
					return "", raw, fmt.Errorf("%w: handshake type %d, want client_hello (1)", ErrMalformed, hsHdr[0])
				}
				msgLen = handshakeHeaderLen + (int(hsHdr[1])<<16 | int(hsHdr[2])<<8 | int(hsHdr[3]))
				if have > msgLen {
					return "", raw, fmt.Errorf("%w: %d bytes after the ClientHello in its record", ErrMalformed, have-msgLen)
				}
				if rem := msgLen - have; rem > 0 {
					// Fragmented: reserve room for the rest, assuming the sender keeps this
					// record size, so that raw is usually allocated only twice. Nothing is
					// reserved for a hello that cannot fit; the check at the loop top refuses it.
					want := len(raw) + rem + recordHeaderLen*((rem+recLen-1)/recLen)
					if want <= MaxHelloSize {
						raw = grow(raw, want-len(raw))
					}
				}
			}
		}
	}

	msg := raw[recordHeaderLen:]
	if records > 1 {
		msg = reassemble(raw, msgLen)
	}
	name, err := parseClientHello(msg[handshakeHeaderLen:])
	if err != nil {
		return "", raw, err
	}
	return name, raw, nil
}

// checkRecordHeader validates one record header. The first record decides whether the stream is
// TLS at all; later ones are fragments of a hello already under way.
func checkRecordHeader(h []byte, recLen, records int) error {
	if records == 0 && (h[0] != recordTypeHandshake || h[1] != 3) {
		return fmt.Errorf("%w: stream starts with %q", ErrNotTLS, string(h))
	}
	if h[0] != recordTypeHandshake {
		// RFC 8446 §5.1: handshake messages MUST NOT be interleaved with other record types.
		return fmt.Errorf("%w: record type %d inside a fragmented ClientHello", ErrMalformed, h[0])
	}
	if h[1] != 3 {
		return fmt.Errorf("%w: record version %d.%d", ErrMalformed, h[1], h[2])
	}
	if recLen == 0 {
		// RFC 8446 §5.1: zero-length fragments of handshake types MUST NOT be sent.
		return fmt.Errorf("%w: empty handshake record", ErrMalformed)
	}
	if recLen > maxPlaintext {
		return fmt.Errorf("%w: record length %d exceeds %d", ErrMalformed, recLen, maxPlaintext)
	}
	return nil
}

// readError wraps a read error. io.ReadFull reports a stream that ends before the first byte of
// a read as io.EOF; inside a ClientHello that is still a truncated hello.
func readError(what string, err error, nothingRead bool) error {
	if err == io.EOF {
		if nothingRead {
			return fmt.Errorf("sni: stream closed before any data (%w): %w", io.EOF, io.ErrUnexpectedEOF)
		}
		err = io.ErrUnexpectedEOF
	}
	return fmt.Errorf("sni: reading %s: %w", what, err)
}

// grow returns raw with room for n more bytes. It doubles like append but never allocates beyond
// MaxHelloSize; callers have checked len(raw)+n <= MaxHelloSize.
func grow(raw []byte, n int) []byte {
	if cap(raw)-len(raw) >= n {
		return raw
	}
	c := min(max(2*cap(raw), len(raw)+n), MaxHelloSize)
	b := make([]byte, len(raw), c)
	copy(b, raw)
	return b
}

// reassemble concatenates the bodies of the records in raw, which ReadClientHello has already
// validated, into one handshake message of msgLen bytes.
func reassemble(raw []byte, msgLen int) []byte {
	msg := make([]byte, 0, msgLen)
	for len(raw) >= recordHeaderLen {
		n := int(raw[3])<<8 | int(raw[4])
		msg = append(msg, raw[recordHeaderLen:recordHeaderLen+n]...)
		raw = raw[recordHeaderLen+n:]
	}
	return msg
}

func malformed(format string, args ...any) error {
	return fmt.Errorf("%w: "+format, append([]any{ErrMalformed}, args...)...)
}

// parseClientHello parses a ClientHello body (RFC 8446 §4.1.2, RFC 5246 §7.4.1.2) and returns
// the lower-cased host_name, or "" without server_name.
func parseClientHello(body []byte) (string, error) {
	s := cursor(body)
	vers, ok := s.bytes(2)
	if !ok {
		return "", malformed("short legacy_version")
	}
	if vers[0] != 3 {
		return "", malformed("legacy_version %d.%d", vers[0], vers[1])
	}
	if !s.skip(randomLen) {
		return "", malformed("short random")
	}
	sid, ok := s.vec8()
	if !ok || len(sid) > maxSessionIDLen {
		return "", malformed("bad legacy_session_id")
	}
	suites, ok := s.vec16()
	if !ok || len(suites) < 2 || len(suites)%2 != 0 {
		return "", malformed("bad cipher_suites")
	}
	comp, ok := s.vec8()
	if !ok || len(comp) < 1 {
		return "", malformed("bad legacy_compression_methods")
	}
	if len(s) == 0 {
		// TLS 1.2 and older allow a hello without an extensions block; it has no SNI.
		return "", nil
	}
	exts, ok := s.vec16()
	if !ok {
		return "", malformed("bad extensions length")
	}
	if len(s) != 0 {
		return "", malformed("%d bytes after extensions", len(s))
	}

	var (
		seen extSet
		name string
	)
	for len(exts) > 0 {
		typ, ok := exts.u16()
		if !ok {
			return "", malformed("truncated extension type")
		}
		data, ok := exts.vec16()
		if !ok {
			return "", malformed("extension %d overruns the extensions block", typ)
		}
		// Duplicates are forbidden (RFC 8446 §4.2) and would let us and the upstream disagree.
		if !seen.add(typ) {
			return "", malformed("duplicate extension %d", typ)
		}
		if typ == extServerName {
			var err error
			if name, err = parseServerName(data); err != nil {
				return "", err
			}
		}
	}
	return name, nil
}

// parseServerName parses the server_name extension data (RFC 6066 §3).
func parseServerName(data cursor) (string, error) {
	list, ok := data.vec16()
	if !ok || len(data) != 0 || len(list) == 0 {
		return "", malformed("bad server_name list")
	}
	var host []byte
	found := false
	for len(list) > 0 {
		// Every NameType defined so far (only host_name) carries a uint16-prefixed value;
		// like Go's crypto/tls, assume unknown types do too.
		nt, ok := list.u8()
		if !ok {
			return "", malformed("truncated server_name entry")
		}
		v, ok := list.vec16()
		if !ok {
			return "", malformed("server_name entry overruns its list")
		}
		if nt != nameTypeHostName {
			continue
		}
		if found {
			return "", malformed("more than one host_name in server_name")
		}
		found, host = true, v
	}
	if !found {
		return "", nil
	}
	if len(host) == 0 || len(host) > maxHostNameLen {
		return "", malformed("host_name length %d", len(host))
	}
	var b strings.Builder
	b.Grow(len(host))
	for _, c := range host {
		if c < 0x21 || c > 0x7e {
			return "", malformed("host_name byte %#02x", c)
		}
		if 'A' <= c && c <= 'Z' {
			c += 'a' - 'A'
		}
		b.WriteByte(c)
	}
	return b.String(), nil
}

// extSet records extension types seen in one hello. Real hellos carry fewer than 32 extensions,
// found by a linear scan of a fixed array; a hostile hello with thousands of them switches to an
// 8 KiB bitmap so that duplicate detection stays linear.
type extSet struct {
	n     int
	small [32]uint16
	big   *[1 << 16 / 64]uint64
}

// add records t and reports whether it was new.
func (s *extSet) add(t uint16) bool {
	if s.big == nil {
		for _, u := range s.small[:s.n] {
			if u == t {
				return false
			}
		}
		if s.n < len(s.small) {
			s.small[s.n] = t
			s.n++
			return true
		}
		s.big = new([1 << 16 / 64]uint64)
		for _, u := range s.small {
			s.big[u/64] |= 1 << (u % 64)
		}
	}
	if s.big[t/64]&(1<<(t%64)) != 0 {
		return false
	}
	s.big[t/64] |= 1 << (t % 64)
	return true
}

// cursor reads big-endian TLS vectors from a byte slice; every method fails rather than
// reading past the end.
type cursor []byte

func (c *cursor) bytes(n int) ([]byte, bool) {
	if n < 0 || len(*c) < n {
		return nil, false
	}
	b := (*c)[:n]
	*c = (*c)[n:]
	return b, true
}

func (c *cursor) skip(n int) bool {
	_, ok := c.bytes(n)
	return ok
}

func (c *cursor) u8() (uint8, bool) {
	b, ok := c.bytes(1)
	if !ok {
		return 0, false
	}
	return b[0], true
}

func (c *cursor) u16() (uint16, bool) {
	b, ok := c.bytes(2)
	if !ok {
		return 0, false
	}
	return uint16(b[0])<<8 | uint16(b[1]), true
}

// vec8 reads an opaque vector with a 1-byte length prefix.
func (c *cursor) vec8() (cursor, bool) {
	n, ok := c.u8()
	if !ok {
		return nil, false
	}
	b, ok := c.bytes(int(n))
	return b, ok
}

// vec16 reads an opaque vector with a 2-byte length prefix.
func (c *cursor) vec16() (cursor, bool) {
	n, ok := c.u16()
	if !ok {
		return nil, false
	}
	b, ok := c.bytes(int(n))
	return b, ok
}
