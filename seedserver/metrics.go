package seedserver

import (
	"errors"
	"fmt"
	"strconv"
	"strings"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/tendril-net/tendril/edge/pipe"
	"github.com/tendril-net/tendril/tunnel/bind"
	"github.com/tendril-net/tendril/tunnel/wgmetrics"
)

type metrics struct {
	dials       *prometheus.CounterVec
	dialSeconds prometheus.Histogram
	bytes       *prometheus.CounterVec
	active      prometheus.Gauge
	agentActive *prometheus.GaugeVec
	agentLive   *prometheus.GaugeVec
	failovers   prometheus.Counter
}

func newMetrics(reg prometheus.Registerer, s *Server) *metrics {
	m := &metrics{
		dials: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "tendril_server_dials_total", Help: "Egress CONNECTs by outcome.",
		}, []string{"outcome"}),
		dialSeconds: prometheus.NewHistogram(prometheus.HistogramOpts{
			Name: "tendril_server_dial_seconds", Help: "Time to dial a target through the tunnel.",
			Buckets: prometheus.ExponentialBuckets(0.0002, 2, 16),
		}),
		bytes: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "tendril_server_bytes_total", Help: "Egress bytes by direction (to_shoot, from_shoot), counted when a connection ends.",
		}, []string{"direction"}),
		active: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "tendril_server_active_connections", Help: "Egress connections open through the tunnel.",
		}),
		agentActive: prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Name: "tendril_server_agent_active", Help: "1 for the agent (by WireGuard public key) the shoot's networks are routed to, 0 for the others.",
		}, []string{"agent"}),
		agentLive: prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Name: "tendril_server_agent_live", Help: "1 while an agent's stream is attached, its handshake fresh and its authenticated packets (heartbeats, keepalives) arriving.",
		}, []string{"agent"}),
		failovers: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "tendril_server_agent_failovers_total", Help: "Times the shoot's networks moved from a dead agent to a live one.",
		}),
	}
	if reg == nil {
		return m
	}
	reg.MustRegister(m.dials, m.dialSeconds, m.bytes, m.active, m.agentActive, m.agentLive, m.failovers,
		prometheus.NewGaugeFunc(prometheus.GaugeOpts{
			Name: "tendril_server_tunnel_handshake_age_seconds",
			Help: "Seconds since the last WireGuard handshake with an agent (-1: none yet).",
		}, func() float64 {
			age, ok := s.handshakeAge()
			if !ok {
				return -1
			}
			return age.Seconds()
		}),
		prometheus.NewGaugeFunc(prometheus.GaugeOpts{
			Name: "tendril_server_tunnel_live",
			Help: "1 while an agent's stream is attached and WireGuard accepted a packet of it within the live window (keepalive × 2 + 1 s): what /readyz reports.",
		}, func() float64 {
			ok, _ := s.Ready()
			return boolGauge(ok)
		}),
		prometheus.NewCounterFunc(prometheus.CounterOpts{
			Name: "tendril_server_tunnel_streams_total",
			Help: "Streams attached since start (agents' and any other sender's); more than the agents means reconnects or strangers.",
		}, func() float64 { return float64(s.tun.BindStats().StreamsAttached) }),
		prometheus.NewGaugeFunc(prometheus.GaugeOpts{
			Name: "tendril_server_tunnel_streams_active", Help: "Streams attached now, authenticated or not.",
		}, func() float64 { return float64(s.tun.BindStats().StreamsActive) }),
		prometheus.NewGaugeFunc(prometheus.GaugeOpts{
			Name: "tendril_server_relay_buffers",
			Help: "128 KiB copy buffers the CONNECT front-end's connections hold now: one per direction moving bytes or blocked writing them; an idle connection holds none.",
		}, func() float64 { return float64(pipe.BuffersHeld()) }),
		prometheus.NewGaugeFunc(prometheus.GaugeOpts{
			Name: "tendril_server_grpc_buffers",
			Help: "128 KiB buffers of the gRPC front-end's connections held now: bytes read from the shoot until gRPC has sent them, bytes from kube-apiserver until written into the tunnel; an idle connection holds none.",
		}, func() float64 { return float64(dataChunks.held.Load()) }),
	)
	// The tunnel's own packets (WireGuard, encrypted, on the agents' streams): bytes over
	// packets is the average packet size, which says whether bulk transfers fill the tunnel's
	// large MTU.
	tunnelStat := func(name, help, direction string, v func(bind.Stats) uint64) {
		reg.MustRegister(prometheus.NewCounterFunc(prometheus.CounterOpts{
			Name: name, Help: help, ConstLabels: prometheus.Labels{"direction": direction},
		}, func() float64 { return float64(v(s.tun.BindStats())) }))
	}
	const packetsHelp = "WireGuard packets on the agents' streams, by direction (in: from agents)."
	const bytesHelp = "WireGuard packet bytes on the agents' streams (framing excluded), by direction (in: from agents)."
	tunnelStat("tendril_server_tunnel_packets_total", packetsHelp, "in", func(st bind.Stats) uint64 { return st.PacketsIn })
	tunnelStat("tendril_server_tunnel_packets_total", packetsHelp, "out", func(st bind.Stats) uint64 { return st.PacketsOut })
	tunnelStat("tendril_server_tunnel_bytes_total", bytesHelp, "in", func(st bind.Stats) uint64 { return st.BytesIn })
	tunnelStat("tendril_server_tunnel_bytes_total", bytesHelp, "out", func(st bind.Stats) uint64 { return st.BytesOut })
	// The server's stack forwards nothing (the agent's does): only its drops.
	reg.MustRegister(wgmetrics.New("tendril_server_tunnel", false, s.tun.StackStats))
	for r := range bind.SendDropReason(len(bind.Stats{}.SendDropped)) {
		reg.MustRegister(prometheus.NewCounterFunc(prometheus.CounterOpts{
			Name:        "tendril_server_tunnel_send_dropped_total",
			Help:        "Packets for an agent not written to its stream, by reason (detached, write-error, refused).",
			ConstLabels: prometheus.Labels{"reason": r.String()},
		}, func() float64 { return float64(s.tun.BindStats().SendDropped[r]) }))
	}
	for r := range bind.DetachReason(len(bind.Stats{}.StreamsDetached)) {
		reg.MustRegister(prometheus.NewCounterFunc(prometheus.CounterOpts{
			Name: "tendril_server_tunnel_streams_detached_total",
			Help: "Streams ended, by reason (eof, read-error, bad-frame, write-error, closed; unauthenticated: no packet WireGuard accepted within the deadline; " +
				"evicted: unauthenticated and displaced by a newer stream with every slot taken; pruned: no agent's any more).",
			ConstLabels: prometheus.Labels{"reason": r.String()},
		}, func() float64 { return float64(s.tun.BindStats().StreamsDetached[r]) }))
	}
	for r := range bind.RefuseReason(len(bind.Stats{}.AttachRefused)) {
		reg.MustRegister(prometheus.NewCounterFunc(prometheus.CounterOpts{
			Name:        "tendril_server_tunnel_streams_refused_total",
			Help:        "Streams refused at attach, by reason (full: every slot holds an authenticated stream; closed: shutting down).",
			ConstLabels: prometheus.Labels{"reason": r.String()},
		}, func() float64 { return float64(s.tun.BindStats().AttachRefused[r]) }))
	}
	return m
}

// AgentState is one agent's state as tendril-server's metrics export it.
type AgentState struct{ Live, Active bool }

// AgentStates reads the agents' states from tendril-server's metrics in the Prometheus text format
// (tendril_server_agent_live and _active, by WireGuard public key), for the checks that watch a
// server from outside: tendril-local's, the end-to-end tests', the failover benchmark's.
func AgentStates(exposition string) map[string]AgentState {
	states := map[string]AgentState{}
	for l := range strings.SplitSeq(exposition, "\n") {
		for name, set := range map[string]func(*AgentState){
			"tendril_server_agent_live":   func(s *AgentState) { s.Live = true },
			"tendril_server_agent_active": func(s *AgentState) { s.Active = true },
		} {
			rest, ok := strings.CutPrefix(l, name+`{agent="`)
			if !ok {
				continue
			}
			key, value, ok := strings.Cut(rest, `"} `)
			if !ok {
				continue
			}
			st := states[key]
			if v, err := strconv.ParseFloat(value, 64); err == nil && v == 1 {
				set(&st)
			}
			states[key] = st
		}
	}
	return states
}

// ActiveAgent returns the index in keys of the active agent once every agent keys names is live
// in the exposition (AgentStates), and an error saying which is not yet.
func ActiveAgent(exposition string, keys []string) (int, error) {
	states := AgentStates(exposition)
	active := -1
	for i, key := range keys {
		if !states[key].Live {
			return -1, fmt.Errorf("agent %d not live", i)
		}
		if states[key].Active {
			active = i
		}
	}
	if active < 0 {
		return -1, errors.New("no active agent")
	}
	return active, nil
}
