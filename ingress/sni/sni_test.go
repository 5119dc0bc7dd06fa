package sni

import (
	"bytes"
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"errors"
	"fmt"
	"io"
	"math/big"
	"net"
	"os"
	"os/exec"
	"runtime"
	"strings"
	"testing"
	"testing/iotest"
	"time"
)

var readers = []struct {
	name string
	wrap func(io.Reader) io.Reader
}{
	{"plain", func(r io.Reader) io.Reader { return r }},
	{"one-byte", iotest.OneByteReader},
	{"half", iotest.HalfReader},
}

func TestGoClientHellos(t *testing.T) {
	tests := []struct {
		name string
		cfg  *tls.Config
		want string
	}{
		{"server name", &tls.Config{ServerName: "example.com"}, "example.com"},
		{"upper-case server name", &tls.Config{ServerName: "Foo.Example.COM"}, "foo.example.com"},
		{"no server name", &tls.Config{InsecureSkipVerify: true}, ""},
		{"IP address", &tls.Config{ServerName: "127.0.0.1"}, ""}, // crypto/tls sends no SNI for IPs
		{"post-quantum key share", &tls.Config{ServerName: "pq.example",
			CurvePreferences: []tls.CurveID{tls.X25519MLKEM768, tls.X25519}}, "pq.example"},
		{"TLS 1.2 only", &tls.Config{ServerName: "old.example", MaxVersion: tls.VersionTLS12}, "old.example"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			rec := captureGoHello(t, tt.cfg)
			t.Logf("Go ClientHello: %d bytes", len(rec))
			if tt.cfg.CurvePreferences != nil && len(rec) < 1216 {
				t.Errorf("hello of %d bytes cannot hold an X25519MLKEM768 key share", len(rec))
			}
			framings := map[string][]byte{
				"one record":       rec,
				"100-byte records": frame(messageOf(rec), 100),
				"1-byte records":   frame(messageOf(rec), 1),
			}
			for fname, input := range framings {
				for _, rd := range readers {
					t.Run(fname+"/"+rd.name, func(t *testing.T) {
						br := bytes.NewReader(append(bytes.Clone(input), "EXTRA"...))
						name, raw, err := ReadClientHello(rd.wrap(br))
						if err != nil {
							t.Fatalf("ReadClientHello: %v", err)
						}
						if name != tt.want {
							t.Errorf("name = %q, want %q", name, tt.want)
						}
						if !bytes.Equal(raw, input) {
							t.Errorf("raw (%d bytes) differs from the %d bytes written", len(raw), len(input))
						}
						if rest, _ := io.ReadAll(br); string(rest) != "EXTRA" {
							t.Errorf("left in stream %q, want %q", rest, "EXTRA")
						}
					})
				}
			}
			// A reader that returns io.EOF together with the last bytes.
			name, raw, err := ReadClientHello(iotest.DataErrReader(bytes.NewReader(rec)))
			if err != nil || name != tt.want || !bytes.Equal(raw, rec) {
				t.Errorf("DataErrReader: name %q, err %v, raw equal %v", name, err, bytes.Equal(raw, rec))
			}
		})
	}
}

// TestLiveTCP reads a hello straight off a loopback TCP connection, where the kernel may split
// it arbitrarily, and compares raw with what the client wrote.
func TestLiveTCP(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	rc := make(chan *recordingConn, 1)
	done := make(chan struct{})
	go func() {
		defer close(done)
		c, err := net.Dial("tcp", ln.Addr().String())
		if err != nil {
			rc <- nil
			return
		}
		conn := &recordingConn{Conn: c}
		rc <- conn
		defer conn.Close()
		_ = tls.Client(conn, &tls.Config{ServerName: "Live.Example"}).Handshake()
	}()
	server, err := ln.Accept()
	if err != nil {
		t.Fatal(err)
	}
	defer server.Close()
	client := <-rc
	if client == nil {
		t.Fatal("dial failed")
	}
	_ = server.SetReadDeadline(time.Now().Add(10 * time.Second))
	name, raw, err := ReadClientHello(server)
	if err != nil {
		t.Fatalf("ReadClientHello: %v", err)
	}
	if name != "live.example" {
		t.Errorf("name = %q", name)
	}
	if w := client.written(); !bytes.Equal(raw, w) {
		t.Errorf("raw (%d bytes) != written (%d bytes)", len(raw), len(w))
	}
	server.Close()
	<-done
}

// TestPassthroughHandshake replays raw to a real crypto/tls server, as the ingress does, and
// checks that the handshake completes and the server sees the same name.
func TestPassthroughHandshake(t *testing.T) {
	cert := selfSigned(t)
	seen := make(chan string, 1)
	upstreamCfg := &tls.Config{
		Certificates: []tls.Certificate{cert},
		GetConfigForClient: func(chi *tls.ClientHelloInfo) (*tls.Config, error) {
			seen <- chi.ServerName
			return nil, nil
		},
	}
	up, err := tls.Listen("tcp", "127.0.0.1:0", upstreamCfg)
	if err != nil {
		t.Fatal(err)
	}
	defer up.Close()
	go func() {
		c, err := up.Accept()
		if err != nil {
			return
		}
		defer c.Close()
		buf := make([]byte, 4)
		if _, err := io.ReadFull(c, buf); err == nil {
			_, _ = c.Write(bytes.ToUpper(buf))
		}
	}()

	front, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer front.Close()
	routed := make(chan string, 1)
	go func() {
		c, err := front.Accept()
		if err != nil {
			return
		}
		defer c.Close()
		_ = c.SetReadDeadline(time.Now().Add(10 * time.Second))
		name, raw, err := ReadClientHello(c)
		routed <- fmt.Sprint(name, err)
		if err != nil {
			return
		}
		_ = c.SetReadDeadline(time.Time{})
		u, err := net.Dial("tcp", up.Addr().String())
		if err != nil {
			return
		}
		defer u.Close()
		if _, err := u.Write(raw); err != nil {
			return
		}
		go func() { _, _ = io.Copy(u, c) }()
		_, _ = io.Copy(c, u)
	}()

	conn, err := tls.Dial("tcp", front.Addr().String(), &tls.Config{ServerName: "Up.Example", InsecureSkipVerify: true})
	if err != nil {
		t.Fatalf("handshake through passthrough: %v", err)
	}
	defer conn.Close()
	if _, err := conn.Write([]byte("ping")); err != nil {
		t.Fatal(err)
	}
	buf := make([]byte, 4)
	if _, err := io.ReadFull(conn, buf); err != nil || string(buf) != "PING" {
		t.Fatalf("echo: %q, %v", buf, err)
	}
	if r := <-routed; r != "up.example<nil>" {
		t.Errorf("routed on %q", r)
	}
	if s := <-seen; !strings.EqualFold(s, "up.example") {
		t.Errorf("upstream saw %q", s)
	}
}

func selfSigned(t *testing.T) tls.Certificate {
	t.Helper()
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	tmpl := &x509.Certificate{
		SerialNumber: big.NewInt(1),
		Subject:      pkix.Name{CommonName: "up.example"},
		DNSNames:     []string{"up.example"},
		NotBefore:    time.Now().Add(-time.Hour),
		NotAfter:     time.Now().Add(time.Hour),
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, &key.PublicKey, key)
	if err != nil {
		t.Fatal(err)
	}
	return tls.Certificate{Certificate: [][]byte{der}, PrivateKey: key}
}

// TestOpenSSL reads hellos sent by `openssl s_client` to a loopback listener.
func TestOpenSSL(t *testing.T) {
	bin, err := exec.LookPath("openssl")
	if err != nil {
		t.Skip("openssl not installed")
	}
	tests := []struct {
		name string
		args []string
		want string
	}{
		{"servername", []string{"-servername", "Foo.Example.COM"}, "foo.example.com"},
		{"noservername", []string{"-noservername"}, ""},
		{"TLS 1.2", []string{"-servername", "Foo.Example.COM", "-tls1_2"}, "foo.example.com"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			ln, err := net.Listen("tcp", "127.0.0.1:0")
			if err != nil {
				t.Fatal(err)
			}
			defer ln.Close()
			type result struct {
				name string
				raw  []byte
				err  error
			}
			res := make(chan result, 1)
			go func() {
				c, err := ln.Accept()
				if err != nil {
					res <- result{err: err}
					return
				}
				defer c.Close()
				_ = c.SetReadDeadline(time.Now().Add(20 * time.Second))
				name, raw, err := ReadClientHello(c)
				res <- result{name, raw, err}
			}()

			ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
			defer cancel()
			args := append([]string{"s_client", "-connect", ln.Addr().String()}, tt.args...)
			cmd := exec.CommandContext(ctx, bin, args...)
			var out bytes.Buffer
			cmd.Stdout, cmd.Stderr = &out, &out
			stdin, err := cmd.StdinPipe() // kept open so s_client does not quit on stdin EOF
			if err != nil {
				t.Fatal(err)
			}
			if err := cmd.Start(); err != nil {
				t.Fatal(err)
			}
			defer func() {
				stdin.Close()
				_ = cmd.Process.Kill()
				_ = cmd.Wait()
			}()

			var r result
			select {
			case r = <-res:
			case <-ctx.Done():
				t.Fatalf("no hello from openssl; output:\n%s", out.String())
			}
			if r.err != nil {
				t.Fatalf("ReadClientHello: %v", r.err)
			}
			t.Logf("openssl ClientHello: %d bytes", len(r.raw))
			if r.name != tt.want {
				t.Errorf("name = %q, want %q", r.name, tt.want)
			}
			// The same bytes re-framed into small records still parse to the same name.
			msg := reassemble(r.raw, len(r.raw))
			name, _, err := ReadClientHello(bytes.NewReader(frame(msg, 7)))
			if err != nil || name != tt.want {
				t.Errorf("re-framed openssl hello: %q, %v", name, err)
			}
		})
	}
}

// TestSynthetic covers valid hellos Go's client does not produce.
func TestSynthetic(t *testing.T) {
	many := func(n int) [][]byte {
		var exts [][]byte
		for i := range n {
			exts = append(exts, ext(uint16(1000+i), nil))
		}
		return exts
	}
	tests := []struct {
		name  string
		input []byte
		want  string
	}{
		{"no extensions block", frame(handshake(1, helloParts{}.body()), 1<<14), ""},
		{"empty extensions block", synthHello(vec16()), ""},
		{"no server_name", synthHello(vec16(ext(10, []byte{0, 2, 0, 29}))), ""},
		{"trailing dot kept", synthHello(vec16(sniExt(hostEntry(0, "A.B.")))), "a.b."},
		{"255-byte name", synthHello(vec16(sniExt(hostEntry(0, strings.Repeat("x", 255))))), strings.Repeat("x", 255)},
		{"printable edges", synthHello(vec16(sniExt(hostEntry(0, "!~Z")))), "!~z"},
		{"unknown name type first", synthHello(vec16(sniExt(hostEntry(7, "ignored"), hostEntry(0, "host")))), "host"},
		{"only unknown name types", synthHello(vec16(sniExt(hostEntry(7, "ignored")))), ""},
		{"unknown name type may be empty or odd", synthHello(vec16(sniExt(hostEntry(9, ""), hostEntry(0, "h"), hostEntry(8, " \x00")))), "h"},
		{"session id 32", frame(handshake(1, helloParts{sessionID: make([]byte, 32),
			exts: vec16(sniExt(hostEntry(0, "s.example")))}.body()), 1<<14), "s.example"},
		{"TLS 1.0 legacy_version", frame(handshake(1, helloParts{version: []byte{3, 1},
			exts: vec16(sniExt(hostEntry(0, "v.example")))}.body()), 1<<14), "v.example"},
		{"40 extensions", synthHello(vec16(append(many(40), sniExt(hostEntry(0, "m.example")))...)), "m.example"},
		{"3000 extensions", synthHello(vec16(append(many(3000), sniExt(hostEntry(0, "m.example")))...)), "m.example"},
		{"handshake header split over records", frame(messageOf(synthHello(vec16(sniExt(hostEntry(0, "split"))))), 3), "split"},
		{"record of exactly 2^14 bytes", synthHello(vec16(ext(21, make([]byte, 1<<14-4-41-4-2)))), ""},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			name, raw, err := ReadClientHello(bytes.NewReader(append(bytes.Clone(tt.input), 0x17)))
			if err != nil {
				t.Fatalf("ReadClientHello: %v", err)
			}
			if name != tt.want {
				t.Errorf("name = %q, want %q", name, tt.want)
			}
			if !bytes.Equal(raw, tt.input) {
				t.Errorf("raw differs from input")
			}
		})
	}
	if in := synthHello(vec16(ext(21, make([]byte, 1<<14-4-41-4-2)))); len(in) != MaxHelloSize {
		t.Errorf("maximal hello is %d bytes, want MaxHelloSize", len(in))
	}
}

func TestBadInputs(t *testing.T) {
	good := handshake(1, helloParts{exts: vec16(sniExt(hostEntry(0, "ok.example")))}.body())
	withExts := func(exts []byte) []byte { return synthHello(exts) }
	withParts := func(p helloParts) []byte { return frame(handshake(1, p.body()), 1<<14) }
	// twoRecords puts msg (fragmented in two) with a second record header of type typ.
	twoRecords := func(typ byte) []byte {
		in := frame(good, 10)[:15]
		rest := good[10:]
		return append(append(in, typ, 3, 3, byte(len(rest)>>8), byte(len(rest))), rest...)
	}
	// A valid hello of about 3000 bytes in 1-byte records would need 18000 bytes on the wire. It is
	// refused after k records, once 6k bytes read plus the rest of the message in one more record
	// cannot fit: 6k + (L-k) + 5 > MaxHelloSize.
	tooFineMsg := handshake(1, helloParts{exts: vec16(ext(21, make([]byte, 2950)), sniExt(hostEntry(0, "x")))}.body())
	tooFineRead := 6 * ((MaxHelloSize-5-len(tooFineMsg))/5 + 1)

	tests := []struct {
		name    string
		input   []byte
		want    error
		wantRaw int // bytes consumed; -1: all of input
	}{
		{"plain HTTP", []byte("GET / HTTP/1.1\r\nHost: example.com\r\n\r\n"), ErrNotTLS, 5},
		{"SSLv2 compatible hello", []byte{0x80, 0x2e, 0x01, 0x03, 0x01, 0, 0}, ErrNotTLS, 5},
		{"record type alert", []byte{21, 3, 3, 0, 2, 2, 40}, ErrNotTLS, 5},
		{"record version 2", append([]byte{22, 2, 0, 0, byte(len(good))}, good...), ErrNotTLS, 5},
		{"record length 0", append([]byte{22, 3, 1, 0, 0}, good...), ErrMalformed, 5},
		{"record length 2^14+1", append([]byte{22, 3, 1, 0x40, 0x01}, make([]byte, 1<<14+1)...), ErrMalformed, 5},
		{"record length 0xffff", append([]byte{22, 3, 1, 0xff, 0xff}, make([]byte, 0xffff)...), ErrMalformed, 5},
		{"handshake type 2", frame(append([]byte{2}, good[1:]...), 1<<14), ErrMalformed, -1},
		{"handshake type 2 in 1-byte records", frame(append([]byte{2}, good[1:]...), 1), ErrMalformed, 24},
		{"handshake length 0", frame([]byte{1, 0, 0, 0}, 100), ErrMalformed, -1},
		{"bytes after hello in its record", frame(append(bytes.Clone(good), 0), 1<<14), ErrMalformed, -1},
		{"second record past hello", append(frame(good, len(good)-1)[:5+len(good)-1], 22, 3, 1, 0, 2, good[len(good)-1], 0),
			ErrMalformed, 5 + len(good) - 1 + 5},
		{"alert between fragments", twoRecords(21), ErrMalformed, 20},
		{"change_cipher_spec between fragments", twoRecords(20), ErrMalformed, 20},
		{"bad version in later record", func() []byte { b := twoRecords(22); b[16] = 4; return b }(), ErrMalformed, 20},
		{"empty later record", append(frame(good, 10)[:15], 22, 3, 1, 0, 0), ErrMalformed, 20},
		{"handshake length 2^24-1", []byte{22, 3, 1, 0, 4, 1, 0xff, 0xff, 0xff}, ErrTooLarge, 9},
		{"handshake length just over one record", append([]byte{22, 3, 1, 0, 4}, handshake(1, make([]byte, 1<<14-3))[:4]...), ErrTooLarge, 9},
		{"1-byte records too many", frame(tooFineMsg, 1), ErrTooLarge, tooFineRead},
		{"legacy_version 2.0", withParts(helloParts{version: []byte{2, 0}}), ErrMalformed, -1},
		{"short random", frame(handshake(1, append([]byte{3, 3}, make([]byte, 18)...)), 100), ErrMalformed, -1},
		{"session id 33", withParts(helloParts{sessionID: make([]byte, 33)}), ErrMalformed, -1},
		{"cipher suites empty", withParts(helloParts{suites: vec16()}), ErrMalformed, -1},
		{"cipher suites odd", withParts(helloParts{suites: vec16([]byte{0x13, 1, 0})}), ErrMalformed, -1},
		{"cipher suites overrun", withParts(helloParts{suites: []byte{0xff, 0xfe, 0x13, 1}}), ErrMalformed, -1},
		{"compression empty", withParts(helloParts{comp: []byte{0}}), ErrMalformed, -1},
		{"compression overrun", withParts(helloParts{comp: []byte{9, 0}}), ErrMalformed, -1},
		{"extensions length 1 byte", withParts(helloParts{exts: []byte{0}}), ErrMalformed, -1},
		{"extensions block overrun", withExts([]byte{0, 10, 0, 0, 0, 0}), ErrMalformed, -1},
		{"extensions block short", withExts(append(u16(2), ext(0x23, nil)...)), ErrMalformed, -1},
		{"extension length overrun", withExts(vec16([]byte{0, 0x23, 0, 9, 1})), ErrMalformed, -1},
		{"truncated extension type", withExts(vec16(ext(0x23, nil), []byte{0})), ErrMalformed, -1},
		{"truncated extension length", withExts(vec16(ext(0x23, nil), []byte{0, 1, 0})), ErrMalformed, -1},
		{"trailing garbage", withParts(helloParts{exts: vec16(sniExt(hostEntry(0, "a"))), trailing: []byte{0}}), ErrMalformed, -1},
		{"duplicate extension", withExts(vec16(ext(0x23, nil), ext(0x23, nil))), ErrMalformed, -1},
		{"duplicate server_name", withExts(vec16(sniExt(hostEntry(0, "a")), sniExt(hostEntry(0, "a")))), ErrMalformed, -1},
		{"duplicate in 3000 extensions", withExts(vec16(func() (e [][]byte) {
			for i := range 3000 {
				e = append(e, ext(uint16(i+1), nil))
			}
			return append(e, ext(2999, nil))
		}()...)), ErrMalformed, -1},
		{"server_name empty data", withExts(vec16(ext(0, nil))), ErrMalformed, -1},
		{"server_name empty list", withExts(vec16(ext(0, vec16()))), ErrMalformed, -1},
		{"server_name list overrun", withExts(vec16(ext(0, append(u16(20), hostEntry(0, "a")...)))), ErrMalformed, -1},
		{"server_name bytes after list", withExts(vec16(ext(0, append(vec16(hostEntry(0, "a")), 0)))), ErrMalformed, -1},
		{"server_name entry overrun", withExts(vec16(ext(0, vec16([]byte{0, 0, 5, 'a'})))), ErrMalformed, -1},
		{"server_name truncated entry", withExts(vec16(ext(0, vec16([]byte{0, 0})))), ErrMalformed, -1},
		{"two host names", withExts(vec16(sniExt(hostEntry(0, "a"), hostEntry(0, "b")))), ErrMalformed, -1},
		{"empty host name", withExts(vec16(sniExt(hostEntry(0, "")))), ErrMalformed, -1},
		{"256-byte host name", withExts(vec16(sniExt(hostEntry(0, strings.Repeat("a", 256))))), ErrMalformed, -1},
		{"space in host name", withExts(vec16(sniExt(hostEntry(0, "a b")))), ErrMalformed, -1},
		{"NUL in host name", withExts(vec16(sniExt(hostEntry(0, "a\x00b")))), ErrMalformed, -1},
		{"DEL in host name", withExts(vec16(sniExt(hostEntry(0, "a\x7f")))), ErrMalformed, -1},
		{"UTF-8 in host name", withExts(vec16(sniExt(hostEntry(0, "bücher.example")))), ErrMalformed, -1},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			for _, rd := range readers {
				cr := &countingReader{data: tt.input}
				name, raw, err := ReadClientHello(rd.wrap(cr))
				if !errors.Is(err, tt.want) {
					t.Fatalf("%s: err = %v, want %v", rd.name, err, tt.want)
				}
				if name != "" {
					t.Errorf("%s: name %q on error", rd.name, name)
				}
				wantRaw := tt.wantRaw
				if wantRaw < 0 {
					wantRaw = len(tt.input)
				}
				if len(raw) != wantRaw || cr.n != wantRaw {
					t.Errorf("%s: consumed %d bytes, raw %d bytes, want %d", rd.name, cr.n, len(raw), wantRaw)
				}
				if !bytes.Equal(raw, tt.input[:min(len(raw), len(tt.input))]) {
					t.Errorf("%s: raw is not a prefix of the input", rd.name)
				}
			}
		})
	}
}

func TestTruncated(t *testing.T) {
	rec := captureGoHello(t, &tls.Config{ServerName: "trunc.example"})
	for fname, input := range map[string][]byte{
		"one record":       rec,
		"100-byte records": frame(messageOf(rec), 100),
		"3-byte records":   frame(messageOf(rec), 3),
	} {
		t.Run(fname, func(t *testing.T) {
			for n := range len(input) {
				_, raw, err := ReadClientHello(bytes.NewReader(input[:n]))
				if !errors.Is(err, io.ErrUnexpectedEOF) {
					t.Fatalf("prefix %d: err = %v, want io.ErrUnexpectedEOF", n, err)
				}
				if !bytes.Equal(raw, input[:n]) {
					t.Fatalf("prefix %d: raw has %d bytes", n, len(raw))
				}
				if (n == 0) != errors.Is(err, io.EOF) {
					t.Fatalf("prefix %d: errors.Is(err, io.EOF) = %v", n, errors.Is(err, io.EOF))
				}
			}
		})
	}
}

func TestReadDeadline(t *testing.T) {
	rec := captureGoHello(t, &tls.Config{ServerName: "slow.example"})
	client, server := net.Pipe()
	defer client.Close()
	defer server.Close()
	go func() { _, _ = client.Write(rec[:len(rec)/2]) }()
	_ = server.SetReadDeadline(time.Now().Add(100 * time.Millisecond))
	_, raw, err := ReadClientHello(server)
	if !errors.Is(err, os.ErrDeadlineExceeded) {
		t.Fatalf("err = %v, want deadline exceeded", err)
	}
	if !bytes.Equal(raw, rec[:len(rec)/2]) {
		t.Errorf("raw has %d bytes, want the %d written", len(raw), len(rec)/2)
	}
}

// TestOversizeDoesNotAllocate checks that a claimed 16 MiB hello is refused from its header
// alone, without reading or allocating anything near that size.
func TestOversizeDoesNotAllocate(t *testing.T) {
	input := []byte{22, 3, 1, 0, 4, 1, 0xff, 0xff, 0xff}
	const runs = 200
	var before, after runtime.MemStats
	runtime.GC()
	runtime.ReadMemStats(&before)
	for range runs {
		cr := &countingReader{data: input}
		if _, _, err := ReadClientHello(cr); !errors.Is(err, ErrTooLarge) || cr.n != len(input) {
			t.Fatalf("err = %v after reading %d bytes", err, cr.n)
		}
	}
	runtime.ReadMemStats(&after)
	if per := (after.TotalAlloc - before.TotalAlloc) / runs; per > 4<<10 {
		t.Errorf("allocated %d bytes per call", per)
	}
}

func BenchmarkReadClientHello(b *testing.B) {
	rec := captureGoHello(b, &tls.Config{ServerName: "bench.example.com"})
	for _, bc := range []struct {
		name  string
		input []byte
	}{
		{"one record", rec},
		{"100-byte records", frame(messageOf(rec), 100)},
	} {
		b.Run(bc.name, func(b *testing.B) {
			b.SetBytes(int64(len(bc.input)))
			b.ReportAllocs()
			r := bytes.NewReader(bc.input)
			for b.Loop() {
				r.Reset(bc.input)
				if name, _, err := ReadClientHello(r); err != nil || name != "bench.example.com" {
					b.Fatal(name, err)
				}
			}
		})
	}
}
