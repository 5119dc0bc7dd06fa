package wgmetrics

import (
	"strings"
	"testing"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/tendril-net/tendril/tunnel/netstack"
)

// TestCollector: every reason is a series, the values are the snapshot's, the snapshot is read
// once per scrape, and a stack without forwarding exports no refusals.
func TestCollector(t *testing.T) {
	reads := 0
	stats := func() netstack.Stats {
		reads++
		var st netstack.Stats
		st.Dropped[netstack.DropQueueFull] = 3
		st.Dropped[netstack.DropNotTCP] = 5
		st.Refused[netstack.RefusedLocalPort] = 2
		st.Refused[netstack.RefusedUDPFlows] = 7
		return st
	}
	reg := prometheus.NewPedanticRegistry()
	reg.MustRegister(New("tendril_agent_vpn", true, stats))
	want := `
# HELP tendril_agent_vpn_stack_dropped_total x
# TYPE tendril_agent_vpn_stack_dropped_total counter
tendril_agent_vpn_stack_dropped_total{reason="not-ip"} 0
tendril_agent_vpn_stack_dropped_total{reason="not-tcp"} 5
tendril_agent_vpn_stack_dropped_total{reason="queue-full"} 3
# HELP tendril_agent_vpn_stack_refused_total x
# TYPE tendril_agent_vpn_stack_refused_total counter
tendril_agent_vpn_stack_refused_total{reason="closed"} 0
tendril_agent_vpn_stack_refused_total{reason="handler"} 0
tendril_agent_vpn_stack_refused_total{reason="handshake"} 0
tendril_agent_vpn_stack_refused_total{reason="in-flight-limit"} 0
tendril_agent_vpn_stack_refused_total{reason="local-port-closed"} 2
tendril_agent_vpn_stack_refused_total{reason="outside-prefixes"} 0
tendril_agent_vpn_stack_refused_total{reason="udp-flow-limit"} 7
`
	// The help texts are compared too: take them from the collector.
	mfs, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	for _, mf := range mfs {
		want = strings.Replace(want, "# HELP "+mf.GetName()+" x", "# HELP "+mf.GetName()+" "+mf.GetHelp(), 1)
	}
	reads = 0
	if err := testutil.GatherAndCompare(reg, strings.NewReader(want)); err != nil {
		t.Fatal(err)
	}
	if reads != 1 {
		t.Errorf("%d snapshots for one scrape, want 1", reads)
	}

	server := prometheus.NewPedanticRegistry()
	server.MustRegister(New("tendril_server_tunnel", false, stats))
	if n, err := testutil.GatherAndCount(server); err != nil || n != 3 {
		t.Errorf("server: %d series (%v), want the 3 drop reasons only", n, err)
	}
}

// TestCollectorTCP: a stack with TCP counters (gVisor's) exports them, one series per counter and
// direction, with the snapshot's values; a stack without (the kernel's) exports none.
func TestCollectorTCP(t *testing.T) {
	tcp := &netstack.TCPStats{SegmentsSent: 11, SegmentsReceived: 12, Retransmits: 13, Timeouts: 14, SpuriousTimeouts: 15, FastRetransmits: 16}
	reg := prometheus.NewPedanticRegistry()
	reg.MustRegister(New("tendril_server_tunnel", false, func() netstack.Stats { return netstack.Stats{TCP: tcp} }))
	want := map[string]float64{
		`tendril_server_tunnel_stack_tcp_segments_total{direction="sent"}`:     11,
		`tendril_server_tunnel_stack_tcp_segments_total{direction="received"}`: 12,
		`tendril_server_tunnel_stack_tcp_retransmitted_segments_total`:         13,
		`tendril_server_tunnel_stack_tcp_timeouts_total`:                       14,
		`tendril_server_tunnel_stack_tcp_spurious_timeouts_total`:              15,
		`tendril_server_tunnel_stack_tcp_fast_retransmits_total`:               16,
	}
	mfs, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	got := map[string]float64{}
	for _, mf := range mfs {
		if !strings.Contains(mf.GetName(), "_tcp_") {
			continue
		}
		for _, m := range mf.GetMetric() {
			name := mf.GetName()
			for _, l := range m.GetLabel() {
				name += `{` + l.GetName() + `="` + l.GetValue() + `"}`
			}
			got[name] = m.GetCounter().GetValue()
		}
	}
	if len(got) != len(want) {
		t.Errorf("series %v, want %v", got, want)
	}
	for k, v := range want {
		if got[k] != v {
			t.Errorf("%s = %v, want %v", k, got[k], v)
		}
	}
	kernel := prometheus.NewPedanticRegistry()
	kernel.MustRegister(New("tendril_server_tunnel", false, func() netstack.Stats { return netstack.Stats{} }))
	if n, err := testutil.GatherAndCount(kernel); err != nil || n != 3 {
		t.Errorf("kernel stack: %d series (%v), want the 3 drop reasons only", n, err)
	}
}
