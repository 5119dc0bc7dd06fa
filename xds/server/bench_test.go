package server_test

import (
	"context"
	"fmt"
	"slices"
	"testing"
	"time"

	"github.com/go-logr/logr"
	"google.golang.org/grpc"
	"google.golang.org/protobuf/proto"

	"github.com/tendril-net/tendril/xds/ads"
	"github.com/tendril-net/tendril/xds/model"
	"github.com/tendril-net/tendril/xds/server"
)

// BenchmarkShootChange measures one shoot's change at scale: with N shoots loaded and K delta
// clients subscribed over real gRPC, each iteration adds or removes one host of one shoot and
// waits until every client has received the response and sent its ACK. It reports the change →
// last-ACK latency (p50, p99), the bytes one client receives per change, and the allocations of
// the whole round trip (server and in-process clients).
func BenchmarkShootChange(b *testing.B) {
	for _, n := range []int{1000, 10000} {
		for _, k := range []int{1, 3} {
			b.Run(fmt.Sprintf("shoots=%d/clients=%d", n, k), func(b *testing.B) { benchShootChange(b, n, k) })
		}
	}
}

func benchShootChange(b *testing.B, n, k int) {
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	s := server.New(server.Config{Log: logr.Discard()})
	set := make([]model.Shoot, n)
	for i := range set {
		set[i] = shoot(i, 2)
	}
	if _, err := s.Apply(set); err != nil {
		b.Fatal(err)
	}
	addr := startServer(b, s)

	clients := make([]*deltaClient, k)
	for i := range clients {
		clients[i] = newDeltaClient(ctx, b, dialADS(b, addr, grpc.WithDefaultCallOptions(grpc.MaxCallRecvMsgSize(ads.MaxRecvMsgSize))))
		clients[i].recvAll(b, s) // initial state, in pieces at 10,000 shoots
	}

	lat := make([]time.Duration, 0, b.N)
	var bytes int
	b.ReportAllocs()
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		target := i % n
		hosts := set[target].Hosts
		if i%2 == 0 {
			set[target].Hosts = append(hosts, "extra.example.com")
		} else {
			set[target].Hosts = hosts[:len(hosts)-1]
		}
		start := time.Now()
		if _, err := s.Apply(set); err != nil {
			b.Fatal(err)
		}
		for j, c := range clients {
			r := c.recv(b)
			if j == 0 {
				bytes += proto.Size(r)
			}
		}
		lat = append(lat, time.Since(start))
		// Put the shoot back as it was, untimed: a shoot changed again once i wraps around n
		// would otherwise lose a host each time, and a shoot needs one.
		b.StopTimer()
		set[target].Hosts = slices.Clone(hosts)
		if _, err := s.Apply(set); err != nil {
			b.Fatal(err)
		}
		for _, c := range clients {
			c.recv(b)
		}
		b.StartTimer()
	}
	b.StopTimer()
	slices.Sort(lat)
	b.ReportMetric(float64(lat[len(lat)/2].Microseconds())/1000, "p50-ms")
	b.ReportMetric(float64(lat[len(lat)*99/100].Microseconds())/1000, "p99-ms")
	b.ReportMetric(float64(bytes)/float64(b.N), "B/change")
}
