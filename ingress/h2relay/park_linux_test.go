//go:build linux

package h2relay

import (
	"context"
	"crypto/tls"
	"io"
	"net"
	"net/http"
	"strings"
	"sync"
	"testing"
	"time"

	"golang.org/x/net/http2"
)

// TestLotWakesEach: more parked connections than one wait takes events of are each woken by
// their own request and served, on their own connection; connections closed while parked
// (by their client, by the relay's drain) leave the lot, whose epoll instance and goroutine
// end once none is parked, and come anew with the next park.
func TestLotWakesEach(t *testing.T) {
	const n = 150 // over two waits' worth of events (64 each)
	r := newRig(t, Config{ParkAfter: 20 * time.Millisecond}, http.HandlerFunc(echo))
	tr := r.client.Transport.(*http.Transport)
	addr := relayAddr(t, tr)
	open := func() *http2.ClientConn {
		c, err := net.Dial("tcp", addr)
		if err != nil {
			t.Fatal(err)
		}
		tc := tls.Client(c, &tls.Config{RootCAs: tr.TLSClientConfig.RootCAs, ServerName: "relay.test", NextProtos: []string{"h2"}})
		cc, err := (&http2.Transport{}).NewClientConn(tc)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { cc.Close() })
		return cc
	}
	post := func(cc *http2.ClientConn, body string) {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		req, _ := http.NewRequestWithContext(ctx, "POST", "https://relay.test/echo", strings.NewReader(body))
		resp, err := cc.RoundTrip(req)
		if err != nil {
			t.Error(err)
			return
		}
		got, err := io.ReadAll(resp.Body)
		resp.Body.Close()
		if err != nil || string(got) != body {
			t.Errorf("got %q (%v), want %q", got, err, body)
		}
	}
	ccs := make([]*http2.ClientConn, n)
	for i := range ccs {
		ccs[i] = open()
		post(ccs[i], "first")
	}
	waitParked(t, r.relay, n)
	var wg sync.WaitGroup
	for i, cc := range ccs {
		wg.Go(func() { post(cc, strings.Repeat("x", i+1)) })
	}
	wg.Wait()
	waitParked(t, r.relay, n)
	for _, cc := range ccs {
		if st := cc.State(); st.StreamsActive != 0 || st.Closed {
			t.Fatalf("a connection's state after its requests: %+v", st)
		}
	}
	for _, cc := range ccs[:n/2] {
		cc.Close()
	}
	waitParked(t, r.relay, n-n/2)
	if err := r.relay.Shutdown(context.Background()); err != nil {
		t.Fatal(err)
	}
	waitParked(t, r.relay, 0)
	r.relay.lot.mu.Lock()
	ep, left := r.relay.lot.ep, len(r.relay.lot.parked)
	r.relay.lot.mu.Unlock()
	if ep != nil || left != 0 {
		t.Fatalf("the lot after its last connection closed: epoll %v, %d in its map; want none", ep, left)
	}
	// Its goroutine ended too: the relay's Wait returns once the upstream's readers end.
	r.up.Close()
	done := make(chan struct{})
	go func() { r.relay.Wait(); close(done) }()
	select {
	case <-done:
	case <-time.After(10 * time.Second):
		t.Fatal("the relay's goroutines did not end after the drain")
	}
}
