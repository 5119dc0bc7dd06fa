package tunnel

import (
	"context"
	"fmt"
	"io"
	"net/http"
	"strings"
	"time"

	"github.com/prometheus/common/expfmt"
	"github.com/prometheus/common/model"
)

// InnerTCP is what tendril-server's inner TCP/IP stack (gVisor's) counted over one cell, from
// its metrics: the retransmission timeouts stall its connections to the shoot for at least the
// minimum RTO each, and a spurious one resent a window that had only waited in a queue. The
// figures are the seed side's: its sends are the to-shoot direction's data and the from-shoot
// direction's acknowledgements.
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
	return func(ctx context.Context) (InnerTCP, bool, error) {
		ctx, cancel := context.WithTimeout(ctx, 5*time.Second)
		defer cancel()
		req, err := http.NewRequestWithContext(ctx, http.MethodGet, url, nil)
		if err != nil {
			return InnerTCP{}, false, err
		}
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			return InnerTCP{}, false, err
		}
		defer resp.Body.Close()
		b, err := io.ReadAll(resp.Body)
		if err != nil {
			return InnerTCP{}, false, err
		}
		parser := expfmt.NewTextParser(model.UTF8Validation)
		fams, err := parser.TextToMetricFamilies(strings.NewReader(string(b)))
		if err != nil {
			return InnerTCP{}, false, fmt.Errorf("tendril-server's metrics: %w", err)
		}
		const prefix = "tendril_server_tunnel_stack_tcp_"
		value := func(name, direction string) (uint64, bool) {
			f, ok := fams[prefix+name]
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
