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
	tcp        tcpDescs
}

// tcpDescs are the userspace stack's TCP counters (netstack.TCPStats).
type tcpDescs struct {
	segments, retransmits, timeouts, spurious, fast *prometheus.Desc
}

// New exports stats' counters under prefix (tendril_server_tunnel, tendril_agent_vpn):
//   - <prefix>_stack_dropped_total{reason}: packets dropped between WireGuard and the stack
//     (netstack.DropReason);
//   - with forwarding (the agent's stack, which forwards the seed's connections into the
//     shoot), <prefix>_stack_refused_total{reason}: connection attempts and UDP datagrams not
//     forwarded (netstack.RefuseReason);
//   - for gVisor's stack (not the kernel's), its TCP counters over all the tunnel's inner
//     connections: <prefix>_stack_tcp_segments_total{direction}, _retransmitted_segments_total,
//     _timeouts_total, _spurious_timeouts_total and _fast_retransmits_total.
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
		tcp: tcpDescs{
			segments: prometheus.NewDesc(prefix+"_stack_tcp_segments_total",
				"TCP segments of the tunnel's inner connections, by direction (sent, received: valid ones).", []string{"direction"}, nil),
			retransmits: prometheus.NewDesc(prefix+"_stack_tcp_retransmitted_segments_total",
				"TCP segments of the tunnel's inner connections sent again (after a timeout, a fast retransmit or a loss probe).", nil, nil),
			timeouts: prometheus.NewDesc(prefix+"_stack_tcp_timeouts_total",
				"Retransmission timer expiries of the tunnel's inner TCP connections: a timeout stalled a connection for at least the minimum RTO (200 ms); "+
					"a connection whose reader stopped reading counts its zero-window probes here too.", nil, nil),
			spurious: prometheus.NewDesc(prefix+"_stack_tcp_spurious_timeouts_total",
				"Retransmission timeouts that the acknowledgements showed were not needed: the segments had waited in a queue, not been lost.", nil, nil),
			fast: prometheus.NewDesc(prefix+"_stack_tcp_fast_retransmits_total",
				"Losses of the tunnel's inner TCP connections repaired by duplicate acknowledgements, without a timeout.", nil, nil),
		},
	}
}

// Describe implements prometheus.Collector.
func (c *Collector) Describe(ch chan<- *prometheus.Desc) {
	ch <- c.dropped
	if c.forwarding {
		ch <- c.refused
	}
	for _, d := range []*prometheus.Desc{c.tcp.segments, c.tcp.retransmits, c.tcp.timeouts, c.tcp.spurious, c.tcp.fast} {
		ch <- d
	}
}

// Collect implements prometheus.Collector: one snapshot per scrape.
func (c *Collector) Collect(ch chan<- prometheus.Metric) {
	st := c.stats()
	for r, n := range st.Dropped {
		ch <- prometheus.MustNewConstMetric(c.dropped, prometheus.CounterValue, float64(n), netstack.DropReason(r).String())
	}
	if c.forwarding {
		for r, n := range st.Refused {
			ch <- prometheus.MustNewConstMetric(c.refused, prometheus.CounterValue, float64(n), netstack.RefuseReason(r).String())
		}
	}
	if t := st.TCP; t != nil {
		counter := func(d *prometheus.Desc, n uint64, labels ...string) {
			ch <- prometheus.MustNewConstMetric(d, prometheus.CounterValue, float64(n), labels...)
		}
		counter(c.tcp.segments, t.SegmentsSent, "sent")
		counter(c.tcp.segments, t.SegmentsReceived, "received")
		counter(c.tcp.retransmits, t.Retransmits)
		counter(c.tcp.timeouts, t.Timeouts)
		counter(c.tcp.spurious, t.SpuriousTimeouts)
		counter(c.tcp.fast, t.FastRetransmits)
	}
}
