package server

import (
	"net/netip"
	"testing"
	"time"

	"github.com/tendril-net/tendril/xds/model"
)

// TestApplyValidatesOutsideTheStoreLock: the streams' ACK handling holds the store's lock; Apply
// validates, admits claims and translates without it and takes it only to commit. A set Apply
// refuses never gets that far, so it is refused while another goroutine holds the lock.
func TestApplyValidatesOutsideTheStoreLock(t *testing.T) {
	s := New(Config{})
	a := model.Shoot{Name: "a", Hosts: []string{"a.example"}, APIServers: []netip.AddrPort{netip.MustParseAddrPort("10.0.0.1:443")}}
	if _, err := s.Apply([]model.Shoot{a}); err != nil {
		t.Fatal(err)
	}
	b := model.Shoot{Name: "b", Hosts: []string{"a.example"}, APIServers: []netip.AddrPort{netip.MustParseAddrPort("10.0.0.2:443")}}
	s.store.Lock()
	done := make(chan error, 1)
	go func() {
		_, err := s.Apply([]model.Shoot{a, b})
		done <- err
	}()
	select {
	case err := <-done:
		s.store.Unlock()
		if err == nil {
			t.Fatal("a set with a host claimed twice was applied")
		}
	case <-time.After(10 * time.Second):
		s.store.Unlock()
		<-done
		t.Fatal("Apply waited for the store's lock to refuse a set")
	}
}
