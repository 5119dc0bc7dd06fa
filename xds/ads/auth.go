package ads

import (
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"net"
	"strings"

	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/peer"
	"google.golang.org/grpc/status"
)

// Who may connect (docs/design-notes/xds-mtls.md). Config.TLS makes the transport mutual TLS;
// Config.Authorize admits each stream by the node it names. Both refusals are logged and counted
// (tendril_xds_refused_total by reason).

// Refused reasons besides the TLS ones (a refusal error's RefusalReason, e.g. tlsreload's).
const (
	// ReasonNoNode: the stream's first request names no node.
	ReasonNoNode = "no_node"
	// ReasonNodeMismatch: the node ID is not one the client certificate may use.
	ReasonNodeMismatch = "node_mismatch"
	// ReasonNoClientCertificate: Authorize needs a client certificate and the connection has none.
	ReasonNoClientCertificate = "no_certificate"
)

// Refusal is an error of Authorize with the reason it is counted under.
type Refusal struct {
	Reason string
	Err    error
}

func (r *Refusal) Error() string {
	if r.Err == nil {
		return "refused: " + r.Reason
	}
	return r.Err.Error()
}

func (r *Refusal) Unwrap() error { return r.Err }

// RefusalReason is the label the refusal is counted under.
func (r *Refusal) RefusalReason() string { return r.Reason }

// refusalReason is the label of a refusal: the error's own, else fallback.
func refusalReason(err error, fallback string) string {
	var r interface{ RefusalReason() string }
	if errors.As(err, &r) {
		return r.RefusalReason()
	}
	return fallback
}

// NodeOfCertificate admits a node whose ID is the common name of the client's certificate, or
// starts with it and a dash: a Deployment's Pods, named <deployment>-<hash>-<suffix>, share the
// Deployment's certificate and each use their Pod name as node ID. It is a Config.Authorize.
func NodeOfCertificate(ctx context.Context, node *corev3.Node) error {
	p, _ := peer.FromContext(ctx)
	info, ok := p.AuthInfo.(credentials.TLSInfo)
	if !ok || len(info.State.PeerCertificates) == 0 {
		return &Refusal{Reason: ReasonNoClientCertificate, Err: errors.New("no client certificate")}
	}
	cn := info.State.PeerCertificates[0].Subject.CommonName
	id := node.GetId()
	if cn == "" || (id != cn && !strings.HasPrefix(id, cn+"-")) {
		return &Refusal{Reason: ReasonNodeMismatch, Err: fmt.Errorf("node ID %q is not allowed for the client certificate of %q (allowed: %q or %q-…)", id, cn, cn, cn)}
	}
	return nil
}

// authorizer checks the requests of one stream: the first must name a node, and every one that
// names a node must be admitted. It runs on the stream's reader only.
type authorizer struct {
	s     *Server
	ctx   context.Context
	first bool
}

func (s *Server) newAuthorizer(ctx context.Context) *authorizer {
	return &authorizer{s: s, ctx: ctx, first: true}
}

// check returns the status error that ends the stream, or nil.
func (a *authorizer) check(node *corev3.Node) error {
	if a.s.authorize == nil {
		return nil
	}
	first := a.first
	a.first = false
	if node.GetId() == "" && !first {
		return nil // Envoy names its node on the first request only
	}
	var err error
	if node.GetId() == "" {
		err = &Refusal{Reason: ReasonNoNode, Err: errors.New("the stream's first request names no node")}
	} else {
		err = a.s.authorize(a.ctx, node)
	}
	if err == nil {
		return nil
	}
	reason := refusalReason(err, ReasonNodeMismatch)
	a.s.metrics.refused.WithLabelValues(reason).Inc()
	var remote string
	if p, ok := peer.FromContext(a.ctx); ok {
		remote = p.Addr.String()
	}
	a.s.log.Info("Refused an xDS stream", "reason", reason, "node", node.GetId(), "remote", remote, "error", err.Error())
	return status.Error(codes.PermissionDenied, err.Error())
}

// serverOptions are the gRPC options of Config.TLS: a handshake that fails on the client's
// certificate is logged and counted by its reason (grpc-go logs handshake errors only through
// its own logger).
func (s *Server) serverOptions() []grpc.ServerOption {
	if s.tls == nil {
		return nil
	}
	base := s.tls
	cfg := &tls.Config{
		GetConfigForClient: func(hello *tls.ClientHelloInfo) (*tls.Config, error) {
			c := base.Clone()
			verify := c.VerifyConnection
			remote := hello.Conn.RemoteAddr()
			c.VerifyConnection = func(cs tls.ConnectionState) error {
				if verify == nil {
					return nil
				}
				err := verify(cs)
				if err != nil {
					s.refusedTLS(remote, err)
				}
				return err
			}
			return c, nil
		},
	}
	return []grpc.ServerOption{grpc.Creds(credentials.NewTLS(cfg))}
}

func (s *Server) refusedTLS(remote net.Addr, err error) {
	reason := refusalReason(err, "tls")
	s.metrics.refused.WithLabelValues(reason).Inc()
	s.log.Info("Refused an xDS client's TLS handshake", "reason", reason, "remote", remote.String(), "error", err.Error())
}

// TLS reports whether the server serves over TLS.
func (s *Server) TLS() bool { return s.tls != nil }
