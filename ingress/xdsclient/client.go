// Package xdsclient is a delta ADS client: it subscribes to resource types on one aggregated
// stream, hands every response to a handler that applies it, and ACKs or NACKs the response by
// what the handler returned. It reconnects with backoff and tells the server which resource
// versions it already holds, so a reconnect sends only what changed. It does not interpret
// resources.
package xdsclient

import (
	"cmp"
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"math/rand/v2"
	"time"

	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	discoveryv3 "github.com/envoyproxy/go-control-plane/envoy/service/discovery/v3"
	"github.com/go-logr/logr"
	rpcstatus "google.golang.org/genproto/googleapis/rpc/status"
	"google.golang.org/grpc"
	"google.golang.org/grpc/backoff"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/keepalive"
	"google.golang.org/grpc/status"
)

// MaxRecvMsgSize is the largest response accepted. The first cluster response at 10,000 shoots
// is about 5.6 MiB (design.md), over grpc-go's 4 MiB default; 64 MiB leaves room for 100,000.
const MaxRecvMsgSize = 64 << 20

// Update is one response from the server.
type Update struct {
	TypeURL string
	// Version is the server's version of the type after this response (system_version_info),
	// for display: delta xDS versions resources one by one.
	Version string
	// Resources were added or changed; Removed names the resources that are gone.
	Resources []*discoveryv3.Resource
	Removed   []string
}

// Handler applies one update. A nil error ACKs it; an error NACKs it with the error's text as
// detail, and the handler must have kept its previous state for the type. Handlers run one at a
// time.
type Handler func(Update) error

// Config configures a client. Address, NodeID and Types are required.
type Config struct {
	// Address of the xDS server, host:port.
	Address string
	// NodeID identifies this data plane to the server.
	NodeID string
	// Cluster is the node's cluster, for the server's bookkeeping. Optional.
	Cluster string
	// Types are the type URLs to subscribe to (wildcard), in the order to subscribe them.
	Types []string
	// Log receives connection state changes and NACKs. The zero value discards them.
	Log logr.Logger
	// MinBackoff and MaxBackoff bound the wait between reconnects. If zero, 100 ms and 10 s.
	MinBackoff, MaxBackoff time.Duration
	// TLS, when set, secures the connection (tlsreload.ClientConfig: mutual TLS with
	// certificates re-read on every handshake). Nil: plaintext, unless DialOptions set
	// credentials.
	TLS *tls.Config
	// DialOptions are added to the gRPC dial.
	DialOptions []grpc.DialOption
}

// Run keeps a stream to the server until ctx ends, reconnecting after errors.
func Run(ctx context.Context, cfg Config, h Handler) error {
	if cfg.Address == "" || cfg.NodeID == "" || len(cfg.Types) == 0 {
		return errors.New("xdsclient: address, node ID and types are required")
	}
	minB, maxB := cfg.MinBackoff, cfg.MaxBackoff
	minB = cmp.Or(minB, 100*time.Millisecond)
	maxB = cmp.Or(maxB, 10*time.Second)
	creds := insecure.NewCredentials()
	if cfg.TLS != nil {
		creds = credentials.NewTLS(cfg.TLS)
	}
	opts := append([]grpc.DialOption{
		grpc.WithTransportCredentials(creds),
		grpc.WithDefaultCallOptions(grpc.MaxCallRecvMsgSize(MaxRecvMsgSize)),
		grpc.WithKeepaliveParams(keepalive.ClientParameters{Time: 30 * time.Second, Timeout: 5 * time.Second}),
		// gRPC's own connection backoff (1 s growing to 120 s) would override the client's: a
		// stream cannot open while the connection backs off, so after a control-plane failover
		// a replica could wait minutes for the new leader. Bound it by the client's.
		grpc.WithConnectParams(grpc.ConnectParams{
			Backoff:           backoff.Config{BaseDelay: minB, Multiplier: 1.6, Jitter: 0.2, MaxDelay: maxB},
			MinConnectTimeout: 20 * time.Second, // gRPC's default
		}),
	}, cfg.DialOptions...)
	conn, err := grpc.NewClient(cfg.Address, opts...)
	if err != nil {
		return fmt.Errorf("xdsclient: %w", err)
	}
	defer func() { conn.Close() }()
	ads := discoveryv3.NewAggregatedDiscoveryServiceClient(conn)

	// known holds the version of every resource applied, per type, across reconnects.
	known := make(map[string]map[string]string, len(cfg.Types))
	for _, t := range cfg.Types {
		known[t] = make(map[string]string)
	}
	backoff := minB
	for {
		start := time.Now()
		received, err := stream(ctx, ads, cfg, known, h)
		if ctx.Err() != nil {
			return nil
		}
		// A stream that got a response, or lived a while, was healthy: start the backoff over.
		// Otherwise control-plane restarts a few seconds apart (a rollout, two leader changes)
		// would find the client waiting up to MaxBackoff.
		if received || time.Since(start) > maxB {
			backoff = minB
		}
		wait := backoff/2 + rand.N(backoff/2+1) // jitter, so replicas do not reconnect in step
		cfg.Log.Info("xDS stream ended, reconnecting", "address", cfg.Address, "error", err.Error(), "after", wait.String())
		select {
		case <-ctx.Done():
			return nil
		case <-time.After(wait):
		}
		if c := status.Code(err); c == codes.PermissionDenied || c == codes.Unauthenticated {
			// The server refused this client's identity: a new stream on the same connection
			// would present the same certificate. A new connection handshakes again, with the
			// certificate files as they are now (rotated, or fixed by the operator).
			conn.Close()
			if conn, err = grpc.NewClient(cfg.Address, opts...); err != nil {
				return fmt.Errorf("xdsclient: %w", err)
			}
			ads = discoveryv3.NewAggregatedDiscoveryServiceClient(conn)
		}
		backoff = min(2*backoff, maxB)
	}
}

// stream subscribes and applies responses until the stream fails; received reports whether a
// response arrived.
func stream(ctx context.Context, ads discoveryv3.AggregatedDiscoveryServiceClient, cfg Config, known map[string]map[string]string, h Handler) (received bool, err error) {
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	st, err := ads.DeltaAggregatedResources(ctx)
	if err != nil {
		return false, fmt.Errorf("open stream: %w", err)
	}
	node := &corev3.Node{Id: cfg.NodeID, Cluster: cfg.Cluster, UserAgentName: "tendril-ingress"}
	for _, t := range cfg.Types {
		req := &discoveryv3.DeltaDiscoveryRequest{Node: node, TypeUrl: t, InitialResourceVersions: known[t]}
		if err := st.Send(req); err != nil {
			return received, fmt.Errorf("subscribe %s: %w", t, err)
		}
	}
	cfg.Log.Info("xDS stream open", "address", cfg.Address, "node", cfg.NodeID)
	for {
		resp, err := st.Recv()
		if err != nil {
			return received, fmt.Errorf("receive: %w", err)
		}
		received = true
		t := resp.GetTypeUrl()
		versions, ok := known[t]
		if !ok {
			// The server answered a type this client never asked for: refuse, keep going.
			if err := st.Send(nack(resp, fmt.Errorf("type %s not subscribed", t))); err != nil {
				return received, fmt.Errorf("send NACK: %w", err)
			}
			continue
		}
		u := Update{TypeURL: t, Version: resp.GetSystemVersionInfo(), Resources: resp.GetResources(), Removed: resp.GetRemovedResources()}
		if err := h(u); err != nil {
			cfg.Log.Info("Rejecting xDS response", "type", t, "nonce", resp.GetNonce(), "error", err.Error())
			if err := st.Send(nack(resp, err)); err != nil {
				return received, fmt.Errorf("send NACK: %w", err)
			}
			continue
		}
		for _, r := range resp.GetResources() {
			versions[r.GetName()] = r.GetVersion()
		}
		for _, n := range resp.GetRemovedResources() {
			delete(versions, n)
		}
		if err := st.Send(&discoveryv3.DeltaDiscoveryRequest{TypeUrl: t, ResponseNonce: resp.GetNonce()}); err != nil {
			return received, fmt.Errorf("send ACK: %w", err)
		}
	}
}

func nack(resp *discoveryv3.DeltaDiscoveryResponse, err error) *discoveryv3.DeltaDiscoveryRequest {
	return &discoveryv3.DeltaDiscoveryRequest{
		TypeUrl:       resp.GetTypeUrl(),
		ResponseNonce: resp.GetNonce(),
		ErrorDetail:   &rpcstatus.Status{Code: int32(codes.InvalidArgument), Message: err.Error()},
	}
}
