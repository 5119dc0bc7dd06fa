// Package incluster holds the "proxy" and "connect" modes of tendril-bench:
// the entry points through which clients inside a shoot reach the shoot's own
// kube-apiserver in the seed. Both arrive on tendril-ingress's proxy
// listener, one port for the two generations of the apiserver-proxy agent:
//
//   - proxy (GEP-8): the agent writes a PROXY v2 header whose destination is
//     the shoot's advertised address, port 443, then the client's TLS follows;
//     the data plane routes by the header's destination.
//   - connect (the current Gardener generation): the agent sends an HTTP/1.1
//     CONNECT with X-Gardener-Destination naming the shoot's kube-apiserver,
//     waits for "200 Connection established", then speaks TLS through the
//     tunnel.
//
// In both the TLS goes end to end to the shoot's upstream, verified for its
// host, exactly as in the sni mode; direct (the client dials the upstream
// itself, sending nothing before TLS) is the physical limit. Peers: HAProxy
// and nginx for proxy; squid for connect, which HAProxy and nginx cannot do
// (HAProxyConnectNote). The measurements, upstreams, client and report are
// package harness's; this package only says which data planes do each job.
package incluster

import (
	"context"

	"github.com/tendril-net/tendril/bench/harness"
	"github.com/tendril-net/tendril/bench/peers"
)

// Proxy is the proxy mode: direct, HAProxy (accept-proxy, use_backend by
// dst), nginx (stream, listen … proxy_protocol, map on the header's
// destination) and tendril.
var Proxy = harness.Mode{
	Name:    "proxy",
	Targets: []string{harness.TargetDirect, harness.TargetHAProxy, harness.TargetNginx, harness.TargetTendril},
	Path: "PROXY v2 header with the shoot's advertised address:443 as destination " +
		"(direct: none, the client dials the shoot's upstream itself)",
	Peer: func(name string, cfg harness.Config) harness.Peer {
		switch name {
		case harness.TargetHAProxy:
			return harness.Peer{Peer: peers.HAProxy{Job: peers.JobProxy}, Preamble: harness.PreambleProxyV2, Static: true}
		case harness.TargetNginx:
			return harness.Peer{Peer: peers.Nginx{Job: peers.JobProxy}, Preamble: harness.PreambleProxyV2, Static: true}
		}
		return harness.Peer{Peer: peers.Tendril{BinDir: cfg.BinDir, Job: peers.JobProxy}, Preamble: harness.PreambleProxyV2}
	},
}

// HAProxyConnectNote says why HAProxy is no CONNECT peer. The connect mode
// still starts it with the routing configuration and probes it, so a report
// shows what it answers rather than relying on this text.
const HAProxyConnectNote = "HAProxy 2.6 cannot do the connect job: it is a reverse proxy, not a CONNECT endpoint. " +
	"In mode http it picks the backend by X-Gardener-Destination as asked, but forwards the CONNECT request " +
	"itself to that backend's server and starts a tunnel only once the server answers 2xx; it never answers " +
	"\"200 Connection established\" on its own, and option http_proxy (destination from the request) is refused " +
	"since 2.5. The upstream, a TLS server like kube-apiserver, cannot parse the request, HAProxy answers 502, " +
	"and the run skips it after one probe. nginx 1.22 cannot either: it answers 400 to a CONNECT request line, " +
	"and its stream module cannot answer one."

// SquidConnectNote says how squid does the job, and where it differs.
const SquidConnectNote = "squid (Debian package squid, when installed) is the CONNECT peer: an ACL on " +
	"X-Gardener-Destination admits the request and selects the shoot's upstream as an originserver cache_peer; " +
	"squid connects, answers 200 and tunnels, as tendril does, with one worker process per CPU (SMP; its version " +
	"line says when it had to run one). One difference: squid tunnels to such a peer only on the port the CONNECT " +
	"names, so its requests name the upstream's port instead of 443 (in a seed both are 443; tendril ignores the port)."

// Connect is the connect mode: direct, squid (the ratio baseline) and
// tendril; HAProxy is started and probed, and skipped with what it answered
// (HAProxyConnectNote).
var Connect = harness.Mode{
	Name:    "connect",
	Targets: []string{harness.TargetDirect, harness.TargetHAProxy, harness.TargetSquid, harness.TargetTendril},
	Path: "CONNECT <host>:443 with X-Gardener-Destination: outbound|443||kube-apiserver.<shoot>.svc.cluster.local, " +
		"\"200 Connection established\" awaited (squid: the upstream's port instead of 443; direct: none, " +
		"the client dials the shoot's upstream itself)",
	Notes:    []string{HAProxyConnectNote, SquidConnectNote},
	Baseline: harness.TargetSquid,
	Peer: func(name string, cfg harness.Config) harness.Peer {
		switch name {
		case harness.TargetHAProxy:
			return harness.Peer{Peer: peers.HAProxy{Job: peers.JobConnect}, Preamble: harness.PreambleConnect, Static: true}
		case harness.TargetSquid:
			return harness.Peer{Peer: peers.Squid{}, Preamble: harness.PreambleConnectUpstreamPort, Static: true}
		}
		return harness.Peer{Peer: peers.Tendril{BinDir: cfg.BinDir, Job: peers.JobConnect}, Preamble: harness.PreambleConnect}
	},
}

// RunProxy runs the proxy benchmark; see harness.Run.
func RunProxy(ctx context.Context, cfg harness.Config) (*harness.Report, error) {
	return harness.Run(ctx, Proxy, cfg)
}

// RunConnect runs the connect benchmark; see harness.Run.
func RunConnect(ctx context.Context, cfg harness.Config) (*harness.Report, error) {
	return harness.Run(ctx, Connect, cfg)
}
