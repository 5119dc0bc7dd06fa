package server_test

import (
	"context"
	"fmt"
	"net/netip"
	"os"
	"runtime"
	"runtime/metrics"
	"runtime/pprof"
	"strconv"
	"sync/atomic"
	"testing"
	"time"

	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	"github.com/go-logr/logr"

	"github.com/tendril-net/tendril/xds/model"
	"github.com/tendril-net/tendril/xds/model/modeltest"
	"github.com/tendril-net/tendril/xds/server"
)

// TestMemoryAtScale loads the shoots of `tendril-bench xds` (bench/xdsbench.Shoot: 7 resources
// each) into a server, connects 3 delta clients that ACK and drop every response, waits until
// every shoot is programmed on all of them, makes some single-shoot changes and reports the Go
// heap in use. It runs only when XDS_MEM_SHOOTS is set (e.g. 10000); XDS_HEAP_PROFILE names a
// file for a heap profile taken at the end.
//
//	XDS_MEM_SHOOTS=10000 XDS_HEAP_PROFILE=/tmp/heap.pb.gz go test -run TestMemoryAtScale -v ./xds/server
func TestMemoryAtScale(t *testing.T) {
	n, _ := strconv.Atoi(os.Getenv("XDS_MEM_SHOOTS"))
	if n <= 0 {
		t.Skip("XDS_MEM_SHOOTS not set")
	}
	const clients = 3
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	// The peak of the heap in use, sampled every 10 ms (RSS follows it).
	var peak atomic.Uint64
	go func() {
		sample := []metrics.Sample{{Name: "/memory/classes/heap/objects:bytes"}, {Name: "/memory/classes/heap/unused:bytes"}}
		for ctx.Err() == nil {
			metrics.Read(sample)
			if v := sample[0].Value.Uint64() + sample[1].Value.Uint64(); v > peak.Load() {
				peak.Store(v)
			}
			time.Sleep(10 * time.Millisecond)
		}
	}()
	report := func(what string) {
		runtime.GC()
		var ms runtime.MemStats
		runtime.ReadMemStats(&ms)
		t.Logf("%s: heap in use %.1f MiB after a GC (peak so far %.1f MiB), live objects %d", what, float64(ms.HeapInuse)/(1<<20), float64(peak.Load())/(1<<20), ms.HeapObjects)
	}
	s := server.New(server.Config{Log: logr.Discard()})
	set := make([]model.Shoot, n)
	for i := range set {
		set[i] = modeltest.Shoot(i)
	}
	if _, err := s.Apply(set); err != nil {
		t.Fatal(err)
	}
	report("applied")
	addr := startServer(t, s)
	for i := range clients {
		go ackAll(openDelta(t, addr, &corev3.Node{Id: fmt.Sprintf("replica-%d", i)}, nil))
	}
	waitProgrammed := func(names ...string) {
		t.Helper()
		deadline := time.Now().Add(2 * time.Minute)
		for _, name := range names {
			for {
				st := s.ShootStatus(name)
				if st.State == model.StateProgrammed && st.Clients == clients {
					break
				}
				if time.Now().After(deadline) {
					t.Fatalf("%s: %v with %d clients", name, st.State, st.Clients)
				}
				time.Sleep(5 * time.Millisecond)
			}
		}
	}
	start := time.Now()
	for _, sh := range set {
		waitProgrammed(sh.Name)
	}
	t.Logf("%d shoots programmed on %d clients in %v", n, clients, time.Since(start))
	report("loaded")

	// Single-shoot changes as the bench makes them: an endpoint change, a shoot added and removed.
	for i := range 30 {
		switch i % 3 {
		case 0:
			set[i].APIServers = []netip.AddrPort{netip.AddrPortFrom(modeltest.Addr(10, 64, i), 443)}
			if _, err := s.Apply(set); err != nil {
				t.Fatal(err)
			}
			waitProgrammed(set[i].Name)
		case 1:
			set = append(set, modeltest.Shoot(1<<20+i))
			if _, err := s.Apply(set); err != nil {
				t.Fatal(err)
			}
			waitProgrammed(set[len(set)-1].Name)
		case 2:
			set = set[:len(set)-1]
			if _, err := s.Apply(set); err != nil {
				t.Fatal(err)
			}
			time.Sleep(20 * time.Millisecond)
		}
	}
	report("after changes")
	if f := os.Getenv("XDS_HEAP_PROFILE"); f != "" {
		w, err := os.Create(f)
		if err != nil {
			t.Fatal(err)
		}
		defer w.Close()
		runtime.GC()
		if err := pprof.Lookup("heap").WriteTo(w, 0); err != nil {
			t.Fatal(err)
		}
	}
	runtime.KeepAlive(s)
}
