package server_test

import (
	"net/netip"
	"testing"

	"github.com/go-logr/logr"

	"github.com/tendril-net/tendril/xds/server"
)

// BenchmarkApply measures Apply alone at 10,000 shoots, no client connected: each iteration moves
// one shoot's kube-apiserver endpoint and applies the whole set, as a source does. It is the
// part of a change that validates, translates and commits.
func BenchmarkApply(b *testing.B) {
	s := server.New(server.Config{Log: logr.Discard()})
	set := shoots(10000)
	if _, err := s.Apply(set); err != nil {
		b.Fatal(err)
	}
	b.ReportAllocs()
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		j := i % len(set)
		sh := set[j]
		sh.APIServer = netip.AddrPortFrom(sh.APIServer.Addr(), uint16(1000+i%2))
		set[j] = sh
		st, err := s.Apply(set)
		if err != nil {
			b.Fatal(err)
		}
		if st.Translated != 1 {
			b.Fatalf("%d shoots translated, want 1", st.Translated)
		}
	}
}
