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
