package seedserver

import (
	"context"
	"fmt"
	"net/netip"
	"slices"
	"sync"
	"time"

	"github.com/tendril-net/tendril/tunnel/wg"
)

// High availability: several agents (replicas of the shoot's vpn Deployment, each with its own
// key and inner address) may keep a tunnel to one server. The shoot's CIDRs are routed to one
// of them at a time, the active agent, by moving the CIDRs between the agents' WireGuard peers
// (wg.Tunnel.Route).
//
// Why move the CIDRs rather than pick an agent per dial: WireGuard routes by destination
// address alone and keeps each prefix with exactly one peer, in both directions (it also drops
// a packet whose source address is not inside its sender's prefixes). Choosing an agent per dial
// would need one WireGuard device and netstack per agent (and the server cannot tell which
// agent a new stream belongs to before WireGuard authenticated it), or address translation
// between per-agent aliases of the shoot's networks; both cost memory per agent and code, for a
// gain (spreading load over replicas) that the reversed VPN does not need: one agent carries
// every connection, the others stand by with a live tunnel, and a failover is a single
// configuration change of the running device.
//
// The active agent stays active while it is live, even when another has a fresher handshake:
// moving the CIDRs ends every connection through the previous agent (their packets now reach an
// agent that does not know them and answers with a reset). When the active agent has been dead
// for a grace period (closedStreamGrace when its stream ended, failoverGrace when it went
// silent), the live agent with the freshest handshake takes over and the dead agent's stream is
// closed, so that what WireGuard still queued for it fails at once (and an agent that was merely
// slow reconnects). A new dial then goes to the new agent; a connection through the dead one
// fails. Before the active agent made its first handshake (the server's start), the first live
// agent takes the CIDRs at once: nothing goes through the one configured first yet.
//
// An agent is live while its stream is attached, its last handshake is younger than
// HandshakeFresh, and WireGuard accepted a packet of it within Config.AgentTimeout (frames it did
// not accept do not count: wg.PeerStatus.LastAuthenticated). The agent sends a heartbeat every
// second (and WireGuard keepalives), so silence for a few seconds means the path is gone even
// when no TCP connection noticed (a proxy that stopped forwarding).
//
// A killed agent is seen at once: its TCP connection closes, the ingress closes the stream to
// the server, and the end of every stream triggers a check (acceptTunnel), so the grace starts
// within milliseconds of the kill rather than at the next watchEvery.

// closedStreamGrace is how long the active agent's stream may be gone before the CIDRs move: an
// agent whose stream broke (an ingress replica restarted, a NAT dropped the connection) but which
// is alive dials again, and the connections through it survive if it is back in time (WireGuard
// carries on over the new stream; moving the CIDRs would end them). Its return takes the agent's
// first backoff after a healthy stream (0.1–0.2 s, agent/vpn Run) plus a TCP handshake, the
// CONNECT through the ingress and the WireGuard handshake initiation reaching the server: 2.5
// round trips. 0.6 s covers a path of up to (0.6 s − 0.2 s) / 2.5 = 160 ms round trip, and a kill
// costs 0.6 s plus one dial, within the goal of 1 s with room for a busy node's scheduling.
const closedStreamGrace = 600 * time.Millisecond

// failoverGrace is how long the active agent may be silent (its stream attached, nothing
// authenticated for AgentTimeout) before the CIDRs move: the agent gives up on a silent path
// after its PathTimeout (5 s, as AgentTimeout) and its next heartbeat tick (1 s), then dials
// again; the grace lets that new stream arrive. The path has been dead for AgentTimeout already
// when it counts as dead.
const failoverGrace = time.Second

// watchEvery is how often the server checks its agents besides the checks a stream's end
// triggers: a silent active agent fails over within AgentTimeout + watchEvery + failoverGrace
// of its last packet. Each check reads the device's state once (a few hundred bytes per agent).
const watchEvery = 250 * time.Millisecond

// agents tracks which agent the shoot's CIDRs are routed to.
type agents struct {
	mu        sync.Mutex
	keys      []wg.Key // in configuration order
	active    wg.Key
	live      map[wg.Key]bool
	failovers uint64
	// deadSince is when the active agent was first seen dead, closedSince when it was first
	// seen without a stream; zero while it is live (closedSince: while its stream is attached).
	// silentFirst: it was seen dead while its stream was still attached.
	deadSince, closedSince time.Time
	silentFirst            bool
	// settled: the active agent has been live, or made a handshake. Until then the active one is
	// only the first in configuration order, which need not be the first to come up (the agents
	// of a shoot start together, and a server that restarts finds them in any order): the first
	// live agent takes the CIDRs at once, without a grace, a failover counted or a stream closed.
	settled bool
	// check asks the watch loop for a check now (a stream ended); capacity 1, a pending ask
	// covers later ones.
	check chan struct{}
	// up is closed the first time an agent is live (TunnelUp).
	up     chan struct{}
	upOnce sync.Once
}

// AgentStatus is one agent as the server sees it.
type AgentStatus struct {
	wg.PeerStatus
	// Live: the agent's stream is attached, its handshake fresh and an authenticated packet of
	// it seen within AgentTimeout.
	Live bool
	// Active: the shoot's CIDRs are routed to this agent.
	Active bool
}

// Agents returns every configured agent's status, in configuration order.
func (s *Server) Agents() ([]AgentStatus, error) {
	peers, err := s.tun.Peers()
	if err != nil {
		return nil, fmt.Errorf("server: %w", err)
	}
	s.agents.mu.Lock()
	active := s.agents.active
	s.agents.mu.Unlock()
	now := time.Now()
	out := make([]AgentStatus, 0, len(peers))
	for _, p := range peers {
		out = append(out, AgentStatus{PeerStatus: p, Live: s.live(p, now), Active: p.PublicKey == active})
	}
	return out, nil
}

// TunnelUp is closed the first time an agent is live, as the watch loop of ServeTunnel sees it
// (within watchEvery of the agent's first handshake): the end of the server's bring-up.
func (s *Server) TunnelUp() <-chan struct{} { return s.agents.up }

// Failovers is how often the shoot's CIDRs moved from a dead agent to a live one.
func (s *Server) Failovers() uint64 {
	s.agents.mu.Lock()
	defer s.agents.mu.Unlock()
	return s.agents.failovers
}

func (s *Server) live(p wg.PeerStatus, now time.Time) bool {
	return p.Attached && !p.LastHandshake.IsZero() && now.Sub(p.LastHandshake) < HandshakeFresh &&
		now.Sub(p.LastAuthenticated) < s.cfg.AgentTimeout
}

// routineWatchAgents checks the agents every watchEvery, when a stream ends (checkAgentsSoon)
// and when a failover grace runs out, until ctx ends: it moves the shoot's CIDRs away from a dead
// active agent and closes streams no agent uses any more.
func (s *Server) routineWatchAgents(ctx context.Context) error {
	tick := time.NewTicker(watchEvery)
	defer tick.Stop()
	due := time.NewTimer(time.Hour)
	due.Stop()
	defer due.Stop()
	for {
		select {
		case <-ctx.Done():
			return nil
		case <-tick.C:
		case <-s.agents.check:
		case <-due.C:
		}
		if wait := s.checkAgents(); wait > 0 {
			due.Reset(wait)
		}
		// A stream that is no agent's endpoint and has carried no authenticated packet for twice
		// the agent timeout: a path its agent gave up on without the TCP connection ending.
		// (Streams that never authenticated end at the Bind's AuthTimeout, junk or not.)
		if n, err := s.tun.PruneStreams(2 * s.cfg.AgentTimeout); err != nil {
			s.log.Error(err, "Pruning tunnel streams failed")
		} else if n > 0 {
			s.log.Info("Closed tunnel streams no agent uses", "streams", n)
		}
	}
}

// checkAgentsSoon makes the watch loop check the agents now rather than at its next tick.
func (s *Server) checkAgentsSoon() {
	select {
	case s.agents.check <- struct{}{}:
	default: // a check is pending already; it reads the state after this call
	}
}

// checkAgents updates liveness and fails over if the active agent is dead and another is live.
// It returns how long until the active agent's grace runs out if a failover is pending (another
// agent is live), else 0.
func (s *Server) checkAgents() time.Duration {
	peers, err := s.tun.Peers()
	if err != nil {
		s.log.Error(err, "Reading the agents' state failed")
		return 0
	}
	now := time.Now()
	a := &s.agents
	a.mu.Lock()
	defer a.mu.Unlock()
	var next *wg.PeerStatus
	activeLive, activeAttached := false, false
	for i, p := range peers {
		live := s.live(p, now)
		if live != a.live[p.PublicKey] {
			s.log.Info("Agent liveness changed", "agent", p.PublicKey.String(), "live", live, "endpoint", p.Endpoint, "attached", p.Attached)
		}
		a.live[p.PublicKey] = live
		if live {
			a.upOnce.Do(func() { close(a.up) })
		}
		s.metrics.agentLive.WithLabelValues(p.PublicKey.String()).Set(boolGauge(live))
		if p.PublicKey == a.active {
			activeLive, activeAttached = live, p.Attached
			// Up once, even between two checks: whatever it carried would be cut now. (A
			// live agent, and the one a switch below makes active, has a handshake: the
			// next check settles it before it decides anything.)
			a.settled = a.settled || !p.LastHandshake.IsZero()
		} else if live && (next == nil || p.LastHandshake.After(next.LastHandshake)) {
			next = &peers[i]
		}
	}
	if activeLive {
		a.deadSince, a.closedSince, a.silentFirst = time.Time{}, time.Time{}, false
		return 0
	}
	if a.deadSince.IsZero() {
		a.deadSince, a.silentFirst = now, activeAttached
	}
	switch {
	case activeAttached:
		a.closedSince = time.Time{}
	case a.closedSince.IsZero():
		a.closedSince = now
	}
	if next == nil {
		return 0
	}
	if left := failoverDue(a.deadSince, a.closedSince, a.silentFirst).Sub(now); a.settled && left > 0 {
		return left
	}
	old, deadFor, initial := a.active, now.Sub(a.deadSince), !a.settled
	if err := s.tun.Route(next.PublicKey, s.cfg.ShootCIDRs); err != nil {
		s.log.Error(err, "Failover failed", "from", old.String(), "to", next.PublicKey.String())
		return watchEvery
	}
	a.active = next.PublicKey
	a.deadSince, a.closedSince, a.silentFirst = time.Time{}, time.Time{}, false
	for _, k := range a.keys {
		s.metrics.agentActive.WithLabelValues(k.String()).Set(boolGauge(k == a.active))
	}
	if initial {
		// The first agent up, not a failover: the one configured first never made a
		// handshake, and its stream, if it has just come, stays as a standby's.
		s.log.Info("The shoot's networks route to the first live agent", "agent", next.PublicKey.String(),
			"endpoint", next.Endpoint, "configuredFirst", old.String())
		return 0
	}
	a.failovers++
	s.metrics.failovers.Inc()
	closed, err := s.tun.DetachPeer(old)
	if err != nil {
		s.log.Error(err, "Closing the dead agent's stream failed", "agent", old.String())
	}
	s.log.Info("Failover: the shoot's networks now route to another agent", "from", old.String(), "to", next.PublicKey.String(),
		"endpoint", next.Endpoint, "closedOldStream", closed, "deadFor", deadFor.Round(time.Millisecond).String())
	return 0
}

// failoverDue is when the CIDRs leave a dead active agent: closedStreamGrace after its stream
// was first seen gone (closedSince, zero while attached), failoverGrace after it was first seen
// dead (deadSince) if it went silent first; the later of the two when both apply. An agent that
// gives up on a silent path closes its stream itself to dial again, and that close must not cut
// the silent path's grace short.
func failoverDue(deadSince, closedSince time.Time, silentFirst bool) time.Time {
	var due time.Time
	if !closedSince.IsZero() {
		due = closedSince.Add(closedStreamGrace)
	}
	if silentFirst {
		if d := deadSince.Add(failoverGrace); d.After(due) {
			due = d
		}
	}
	return due
}

// initAgents routes the shoot's CIDRs to the first configured agent, until a live one shows up.
func (s *Server) initAgents() error {
	a := &s.agents
	a.live = make(map[wg.Key]bool)
	a.up = make(chan struct{})
	a.check = make(chan struct{}, 1)
	for _, p := range s.cfg.Tunnel.Peers {
		a.keys = append(a.keys, p.PublicKey)
	}
	if len(a.keys) == 0 {
		return nil
	}
	a.active = a.keys[0]
	if err := s.tun.Route(a.active, s.cfg.ShootCIDRs); err != nil {
		return fmt.Errorf("server: %w", err)
	}
	for _, k := range a.keys {
		s.metrics.agentActive.WithLabelValues(k.String()).Set(boolGauge(k == a.active))
		s.metrics.agentLive.WithLabelValues(k.String()).Set(0)
	}
	return nil
}

func boolGauge(b bool) float64 {
	if b {
		return 1
	}
	return 0
}

// checkAgentPrefixes refuses an agent whose own AllowedIPs overlap the shoot's CIDRs when
// there are several agents: the CIDRs move between agents, and a moved prefix that was also an
// agent's own address would cut that agent off. A prefix equal to one of the CIDRs (a
// single-agent configuration that lists them as the peer's AllowedIPs) is dropped from the peer
// instead: the server routes the CIDRs itself.
func checkAgentPrefixes(cfg *Config) error {
	if len(cfg.Tunnel.Peers) < 2 {
		return nil
	}
	peers := slices.Clone(cfg.Tunnel.Peers)
	for i := range peers {
		var own []netip.Prefix
		for _, p := range peers[i].AllowedIPs {
			if slices.Contains(cfg.ShootCIDRs, p) {
				continue
			}
			for _, c := range cfg.ShootCIDRs {
				if c.Overlaps(p) {
					return fmt.Errorf("server: agent %s: its address %s overlaps the shoot's network %s", peers[i].PublicKey, p, c)
				}
			}
			own = append(own, p)
		}
		peers[i].AllowedIPs = own
	}
	// Two agents sharing an address would take it from each other: WireGuard keeps a prefix
	// with one peer.
	for i := range peers {
		for j := range i {
			for _, p := range peers[i].AllowedIPs {
				for _, q := range peers[j].AllowedIPs {
					if p.Overlaps(q) {
						return fmt.Errorf("server: agents %s and %s: addresses %s and %s overlap", peers[j].PublicKey, peers[i].PublicKey, q, p)
					}
				}
			}
		}
	}
	cfg.Tunnel.Peers = peers
	return nil
}
