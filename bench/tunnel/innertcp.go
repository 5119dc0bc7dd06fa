package tunnel

import (
	"bufio"
	"context"
	"fmt"
	"io"
	"net"
	"net/http"
	"strings"
	"time"

	"github.com/prometheus/common/expfmt"
	"github.com/prometheus/common/model"

	"github.com/tendril-net/tendril/internal/host/netns"
)

// InnerTCP is what one end's inner TCP/IP stack (gVisor's) counted over one cell, from its
// metrics: the retransmission timeouts stall its connections for at least the minimum RTO each,
// and a spurious one resent a window that had only waited in a queue. tendril-server's sends are
// the to-shoot direction's data, tendril-agent's the from-shoot direction's.
type InnerTCP struct {
	SegmentsSent     uint64 `json:"segments_sent"`
	Retransmits      uint64 `json:"retransmitted_segments"`
	Timeouts         uint64 `json:"timeouts"`
	SpuriousTimeouts uint64 `json:"spurious_timeouts"`
}

func (a InnerTCP) minus(b InnerTCP) InnerTCP {
	return InnerTCP{SegmentsSent: a.SegmentsSent - b.SegmentsSent, Retransmits: a.Retransmits - b.Retransmits,
		Timeouts: a.Timeouts - b.Timeouts, SpuriousTimeouts: a.SpuriousTimeouts - b.SpuriousTimeouts}
}

// String is the cell table's entry: the timeouts, with the spurious ones.
func (a *InnerTCP) String() string {
	if a == nil {
		return "–"
	}
	return fmt.Sprintf("%d (%d spurious)", a.Timeouts, a.SpuriousTimeouts)
}

// innerTCPCounters reads tendril-server's inner TCP counters from its metrics at url; ok is
// false where its stack has none (the kernel's, with --tun).
func innerTCPCounters(url string) func(ctx context.Context) (c InnerTCP, ok bool, err error) {
	return innerTCPFrom("tendril_server_tunnel", func(ctx context.Context) (string, error) {
		req, err := http.NewRequestWithContext(ctx, http.MethodGet, url, nil)
		if err != nil {
			return "", err
		}
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			return "", err
		}
		defer resp.Body.Close()
		b, err := io.ReadAll(resp.Body)
		return string(b), err
	})
}

// agentInnerTCPCounters reads tendril-agent's, whose metrics *addr serves inside network
// namespace ns (the shoot's, which only the carrier reaches from the seed): the connection is
// made in ns, the request written on it by hand (net/http would dial from another thread).
func agentInnerTCPCounters(ns string, addr *string) func(ctx context.Context) (c InnerTCP, ok bool, err error) {
	return innerTCPFrom("tendril_agent_vpn", func(ctx context.Context) (string, error) {
		var c net.Conn
		if err := netns.In(ns, func() (err error) {
			c, err = net.DialTimeout("tcp", *addr, 5*time.Second)
			return err
		}); err != nil {
			return "", err
		}
		defer c.Close()
		if d, ok := ctx.Deadline(); ok {
			_ = c.SetDeadline(d)
		}
		if _, err := io.WriteString(c, "GET /metrics HTTP/1.1\r\nHost: agent\r\nConnection: close\r\n\r\n"); err != nil {
			return "", err
		}
		resp, err := http.ReadResponse(bufio.NewReader(c), nil)
		if err != nil {
			return "", err
		}
		defer resp.Body.Close()
		b, err := io.ReadAll(resp.Body)
		return string(b), err
	})
}

// innerTCPFrom parses the counters under prefix (tendril_server_tunnel, tendril_agent_vpn) out of
// the metrics text fetch returns.
func innerTCPFrom(prefix string, fetch func(ctx context.Context) (string, error)) func(ctx context.Context) (InnerTCP, bool, error) {
	return func(ctx context.Context) (InnerTCP, bool, error) {
		ctx, cancel := context.WithTimeout(ctx, 5*time.Second)
		defer cancel()
		text, err := fetch(ctx)
		if err != nil {
			return InnerTCP{}, false, err
		}
		parser := expfmt.NewTextParser(model.UTF8Validation)
		fams, err := parser.TextToMetricFamilies(strings.NewReader(text))
		if err != nil {
			return InnerTCP{}, false, fmt.Errorf("%s metrics: %w", prefix, err)
		}
		value := func(name, direction string) (uint64, bool) {
			f, ok := fams[prefix+"_stack_tcp_"+name]
			if !ok {
				return 0, false
			}
			for _, m := range f.GetMetric() {
				if direction == "" || (len(m.GetLabel()) == 1 && m.GetLabel()[0].GetValue() == direction) {
					return uint64(m.GetCounter().GetValue()), true
				}
			}
			return 0, false
		}
		var c InnerTCP
		var ok [4]bool
		c.SegmentsSent, ok[0] = value("segments_total", "sent")
		c.Retransmits, ok[1] = value("retransmitted_segments_total", "")
		c.Timeouts, ok[2] = value("timeouts_total", "")
		c.SpuriousTimeouts, ok[3] = value("spurious_timeouts_total", "")
		return c, ok == [4]bool{true, true, true, true}, nil
	}
}
