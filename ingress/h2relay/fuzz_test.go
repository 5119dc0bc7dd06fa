package h2relay

import (
	"context"
	"io"
	"net"
	"testing"
	"time"

	"golang.org/x/net/http2"
)

// nobody answers every request itself: the fuzzed client reaches no upstream.
type nobody struct{}

func (nobody) Direct(context.Context, *Head) (*Upstream, *Answer) {
	return nil, &Answer{Status: 403, Body: []byte("no")}
}

// FuzzClientFrames: whatever a client sends after its preface, the relay neither panics nor
// hangs: it answers, resets or closes, and its reader ends once the client is gone.
func FuzzClientFrames(f *testing.F) {
	var settings, headers []byte
	{
		w := &sliceWriter{}
		fr := http2.NewFramer(w, nil)
		_ = fr.WriteSettings()
		settings = append([]byte(nil), w.b...)
		w.b = w.b[:0]
		// GET / with literal fields, no Huffman: :method GET (index 2), :path / (4), :scheme https (7), :authority x.
		block := []byte{0x82, 0x84, 0x87, 0x41, 0x01, 'x'}
		_ = fr.WriteHeaders(http2.HeadersFrameParam{StreamID: 1, BlockFragment: block, EndStream: true, EndHeaders: true})
		headers = append([]byte(nil), w.b...)
	}
	f.Add(settings)
	f.Add(append(append([]byte(nil), settings...), headers...))
	f.Add(append(append([]byte(nil), settings...), 0, 0, 4, 8, 0, 0, 0, 0, 0, 0x7f, 0xff, 0xff, 0xff))
	f.Add([]byte{0, 0, 0, 4, 0, 0, 0, 0, 0, 0xff, 0xff, 0xff, 0xff})
	f.Fuzz(func(t *testing.T, data []byte) {
		r := New(Config{PrefaceTimeout: time.Second, IdleTimeout: time.Second})
		client, server := net.Pipe()
		r.ServeConn(context.Background(), server, nobody{})
		done := make(chan struct{})
		go func() { defer close(done); _, _ = io.Copy(io.Discard, client) }()
		_ = client.SetWriteDeadline(time.Now().Add(2 * time.Second))
		_, _ = client.Write([]byte(http2.ClientPreface))
		_, _ = client.Write(data)
		client.Close()
		<-done
		r.Wait()
	})
}

type sliceWriter struct{ b []byte }

func (w *sliceWriter) Write(p []byte) (int, error) { w.b = append(w.b, p...); return len(p), nil }
