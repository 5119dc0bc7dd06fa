package sni

import (
	"bytes"
	"errors"
	"io"
	"testing"
	"testing/iotest"
)

// FuzzReadClientHello checks invariants on arbitrary streams. The seed corpus in
// testdata/fuzz/FuzzReadClientHello holds a real Go 1.26 hello (one record and fragmented),
// plain HTTP and an empty stream; the seeds below add hand-built edge cases.
func FuzzReadClientHello(f *testing.F) {
	f.Add(synthHello(vec16(sniExt(hostEntry(0, "Seed.Example")))))
	f.Add(frame(handshake(1, helloParts{}.body()), 3))
	f.Add(synthHello(vec16(sniExt(hostEntry(7, "x"), hostEntry(0, "a.b.")), ext(0x23, nil))))
	f.Add([]byte{22, 3, 1, 0, 4, 1, 0xff, 0xff, 0xff})

	f.Fuzz(func(t *testing.T, data []byte) {
		name, raw, err := ReadClientHello(bytes.NewReader(data))
		if len(raw) > MaxHelloSize {
			t.Fatalf("read %d bytes, more than MaxHelloSize", len(raw))
		}
		if !bytes.HasPrefix(data, raw) {
			t.Fatalf("raw is not a prefix of the input")
		}

		// Framing must not depend on how the reader chunks the stream.
		name1, raw1, err1 := ReadClientHello(iotest.OneByteReader(bytes.NewReader(data)))
		if name1 != name || !bytes.Equal(raw1, raw) || errString(err1) != errString(err) {
			t.Fatalf("one-byte reads differ: %q %d %v vs %q %d %v", name1, len(raw1), err1, name, len(raw), err)
		}

		if err != nil {
			if name != "" {
				t.Fatalf("name %q with error %v", name, err)
			}
			if !errors.Is(err, ErrNotTLS) && !errors.Is(err, ErrMalformed) && !errors.Is(err, ErrTooLarge) &&
				!errors.Is(err, io.ErrUnexpectedEOF) {
				t.Fatalf("unexpected error class: %v", err)
			}
			if errors.Is(err, io.ErrUnexpectedEOF) && len(raw) != len(data) {
				t.Fatalf("ErrUnexpectedEOF after consuming %d of %d bytes: %v", len(raw), len(data), err)
			}
			return
		}

		if len(name) > 255 {
			t.Fatalf("name of %d bytes", len(name))
		}
		for i := range len(name) {
			if c := name[i]; c < 0x21 || c > 0x7e || ('A' <= c && c <= 'Z') {
				t.Fatalf("name %q has byte %#02x", name, c)
			}
		}
		name2, raw2, err2 := ReadClientHello(bytes.NewReader(raw))
		if err2 != nil || name2 != name || !bytes.Equal(raw2, raw) {
			t.Fatalf("round trip: %q %v, want %q", name2, err2, name)
		}
	})
}

func errString(err error) string {
	if err == nil {
		return ""
	}
	return err.Error()
}
