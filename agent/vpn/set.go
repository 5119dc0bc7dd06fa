package vpn

import (
	"context"
	"errors"
	"fmt"
	"strings"

	"github.com/prometheus/client_golang/prometheus"
	"golang.org/x/sync/errgroup"
)

// Set keeps a tunnel to each of several servers: an HA shoot's tendril-server replicas, each
// reached through the ingress by its own destination. Each destination gets an Agent of its own
// (its own WireGuard device, netstack and stream), so that a server that goes away takes only its
// tunnel and the shoot stays reachable through the others; every server sees the same agent key
// and routes the shoot's networks to it as to any agent (docs/design-notes/ha.md).
type Set struct {
	agents []*Agent
	dests  []string
}

// NewSet starts one Agent per destination, each with cfg and that Destination. With more than one,
// each agent's metrics carry a destination label; the process's own (NoProcessMetrics) are the
// first agent's. Several destinations need the ingress's CONNECT (not Direct) and the netstack
// (not TUN, whose one device a second tunnel could not share).
func NewSet(cfg Config, destinations []string) (*Set, error) {
	switch {
	case len(destinations) == 0:
		return nil, errors.New("vpn: no destination")
	case len(destinations) > 1 && cfg.Direct:
		return nil, errors.New("vpn: several destinations are reached through the ingress's CONNECT, not directly")
	case len(destinations) > 1 && cfg.TUN != "":
		return nil, errors.New("vpn: several destinations need the userspace netstack, not a TUN device")
	}
	s := &Set{dests: destinations}
	for i, d := range destinations {
		c := cfg
		c.Destination = d
		if len(destinations) > 1 {
			if cfg.Registry != nil {
				c.Registry = prometheus.WrapRegistererWith(prometheus.Labels{"destination": d}, cfg.Registry)
			}
			c.NoProcessMetrics = cfg.NoProcessMetrics || i > 0
			c.Log = cfg.Log.WithValues("destination", d)
		}
		a, err := New(c)
		if err != nil {
			s.Close()
			return nil, fmt.Errorf("destination %s: %w", d, err)
		}
		s.agents = append(s.agents, a)
	}
	return s, nil
}

// Agents are the set's agents, in the order of the destinations.
func (s *Set) Agents() []*Agent { return s.agents }

// Run runs every agent until ctx ends.
func (s *Set) Run(ctx context.Context) error {
	g, ctx := errgroup.WithContext(ctx)
	for _, a := range s.agents {
		g.Go(func() error { return a.Run(ctx) })
	}
	return g.Wait()
}

// Ready reports whether at least one tunnel is up: one server is enough to reach the shoot.
// Otherwise it says what each agent lacks.
func (s *Set) Ready() (bool, string) {
	var why []string
	for i, a := range s.agents {
		ok, reason := a.Ready()
		if ok {
			return true, ""
		}
		if len(s.agents) > 1 {
			reason = s.dests[i] + ": " + reason
		}
		why = append(why, reason)
	}
	return false, strings.Join(why, "; ")
}

// Close stops every tunnel.
func (s *Set) Close() error {
	var errs []error
	for _, a := range s.agents {
		errs = append(errs, a.Close())
	}
	return errors.Join(errs...)
}
