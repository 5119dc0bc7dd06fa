// Package sni is the "sni" mode of tendril-bench: SNI passthrough, the seed's
// public entry point. A client opens a TLS connection whose ClientHello names
// a shoot's host, and the data plane forwards it, without terminating TLS, to
// that shoot's kube-apiserver. Targets: direct (the client dials the upstream
// itself), HAProxy (req_ssl_sni), nginx (stream, ssl_preread) and tendril
// (tendril-seed + tendril-ingress's SNI listener).
//
// The measurements, the upstreams, the client and the report are package
// harness's; this package only says which data planes do the job.
package sni

import (
	"context"

	"github.com/tendril-net/tendril/bench/harness"
	"github.com/tendril-net/tendril/bench/peers"
)

// Mode is the sni mode.
var Mode = harness.Mode{
	Name:    "sni",
	Targets: []string{harness.TargetDirect, harness.TargetHAProxy, harness.TargetNginx, harness.TargetTendril},
	Peer:    peer,
}

func peer(name string, cfg harness.Config) harness.Peer {
	switch name {
	case harness.TargetHAProxy:
		return harness.Peer{Peer: peers.HAProxy{Job: peers.JobSNI}, Static: true}
	case harness.TargetNginx:
		return harness.Peer{Peer: peers.Nginx{}, Static: true}
	default:
		return harness.Peer{Peer: peers.Tendril{BinDir: cfg.BinDir, Job: peers.JobSNI}}
	}
}

// Run runs the sni benchmark; see harness.Run.
func Run(ctx context.Context, cfg harness.Config) (*harness.Report, error) {
	return harness.Run(ctx, Mode, cfg)
}
