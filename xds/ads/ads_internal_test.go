package ads

import (
	"errors"
	"testing"

	discoveryv3 "github.com/envoyproxy/go-control-plane/envoy/service/discovery/v3"
	resourcev3 "github.com/envoyproxy/go-control-plane/pkg/resource/v3"

	"github.com/tendril-net/tendril/xds/store"
)

// TestRequestAfterClose: a stream's reader may deliver one last request after the handler closed
// the stream; it must not bring the stream's ACK state back, where it would count as a client
// that never answers and never leaves.
func TestRequestAfterClose(t *testing.T) {
	st := store.New(store.Config{})
	s := New(st, Config{})
	st.Commit(store.NewChange())
	c := openStream(s, s.delta)
	req := &discoveryv3.DeltaDiscoveryRequest{TypeUrl: resourcev3.ClusterType}
	if err := s.deltaRequested(c, req); err != nil {
		t.Fatal(err)
	}
	if _, ok := s.acks.streams[c.id]; !ok {
		t.Fatal("an open stream's request left no ACK state")
	}
	s.closeDelta(c)
	if err := s.deltaRequested(c, req); !errors.Is(err, errStreamClosed) {
		t.Errorf("request after close: %v, want errStreamClosed", err)
	}
	if _, ok := s.acks.streams[c.id]; ok {
		t.Error("a request after close brought the stream's ACK state back")
	}
}
