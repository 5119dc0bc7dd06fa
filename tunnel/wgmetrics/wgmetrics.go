// Package wgmetrics exports the counters of a tunnel's inner TCP/IP stack (netstack.Stats:
// gVisor's netstack, or the kernel's stack behind a TUN device, package tundev) as Prometheus
// metrics. The counters are read once per scrape, all from one snapshot: the kernel stack's
// snapshot is a netlink dump of its nftables counters, so one read per scrape, not one per
// series. It counts nothing itself and knows no stack; tendril-server and tendril-agent give it
// their tunnel's StackStats.
package wgmetrics

import (
	"github.com/prometheus/client_golang/prometheus"

	"github.com/tendril-net/tendril/tunnel/netstack"
)

// Collector is a prometheus.Collector of one stack's counters.
type Collector struct {
	stats      func() netstack.Stats
	forwarding bool
	dropped    *prometheus.Desc
	refused    *prometheus.Desc
}

// New exports stats' counters under prefix (tendril_server_tunnel, tendril_agent_vpn):
//   - <prefix>_stack_dropped_total{reason}: packets dropped between WireGuard and the stack
//     (netstack.DropReason);
//   - with forwarding (the agent's stack, which forwards the seed's connections into the
//     shoot), <prefix>_stack_refused_total{reason}: connection attempts and UDP datagrams not
//     forwarded (netstack.RefuseReason).
//
// Every reason is exported from the start, at zero until it counts.
func New(prefix string, forwarding bool, stats func() netstack.Stats) *Collector {
	return &Collector{
		stats:      stats,
		forwarding: forwarding,
		dropped: prometheus.NewDesc(prefix+"_stack_dropped_total",
			"Packets dropped between WireGuard and the tunnel's TCP/IP stack, by reason (queue-full: the stack's queue to WireGuard was full, TCP retransmits; "+
				"not-ip: not an IP packet; not-tcp: a packet to a forwarded destination that nothing takes, or, on a TUN device, any packet its nftables table drops).",
			[]string{"reason"}, nil),
		refused: prometheus.NewDesc(prefix+"_stack_refused_total",
			"Connection attempts (and UDP datagrams) from the seed not forwarded into the shoot, by reason (outside-prefixes, local-port-closed, in-flight-limit: the SYN dropped, "+
				"handler, handshake, closed, udp-flow-limit).",
			[]string{"reason"}, nil),
	}
}

// Describe implements prometheus.Collector.
func (c *Collector) Describe(ch chan<- *prometheus.Desc) {
	ch <- c.dropped
	if c.forwarding {
		ch <- c.refused
	}
}

// Collect implements prometheus.Collector: one snapshot per scrape.
func (c *Collector) Collect(ch chan<- prometheus.Metric) {
	st := c.stats()
	for r, n := range st.Dropped {
		ch <- prometheus.MustNewConstMetric(c.dropped, prometheus.CounterValue, float64(n), netstack.DropReason(r).String())
	}
	if !c.forwarding {
		return
	}
	for r, n := range st.Refused {
		ch <- prometheus.MustNewConstMetric(c.refused, prometheus.CounterValue, float64(n), netstack.RefuseReason(r).String())
	}
}
