package server_test

import (
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	discoveryv3 "github.com/envoyproxy/go-control-plane/envoy/service/discovery/v3"
	resourcev3 "github.com/envoyproxy/go-control-plane/pkg/resource/v3"
	"github.com/go-logr/logr/testr"
	"github.com/prometheus/client_golang/prometheus"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/status"

	"github.com/tendril-net/tendril/ingress/xdsclient"
	"github.com/tendril-net/tendril/internal/pki/testpki"
	"github.com/tendril-net/tendril/internal/pki/tlsreload"
	"github.com/tendril-net/tendril/internal/testing/metrictest"
	"github.com/tendril-net/tendril/internal/testing/testwait"
	"github.com/tendril-net/tendril/xds/ads"
	"github.com/tendril-net/tendril/xds/model"
	"github.com/tendril-net/tendril/xds/model/modeltest"
	"github.com/tendril-net/tendril/xds/server"
	"github.com/tendril-net/tendril/xds/store"
)

// pki writes a leaf of ca for names into a new directory and returns its files.
func pki(t *testing.T, ca *testpki.CA, names ...string) *tlsreload.Files {
	t.Helper()
	leaf, err := ca.Leaf(names...)
	if err != nil {
		t.Fatal(err)
	}
	dir := t.TempDir()
	f := &tlsreload.Files{Cert: filepath.Join(dir, "tls.crt"), Key: filepath.Join(dir, "tls.key"), CA: filepath.Join(dir, "ca.crt")}
	if err := testpki.WriteFiles(leaf, ca, f.Cert, f.Key, f.CA); err != nil {
		t.Fatal(err)
	}
	return f
}

// mtlsServer is an xDS server over mutual TLS with node IDs bound to certificates, serving one
// shoot.
type mtlsServer struct {
	addr string
	ca   *testpki.CA
	reg  *prometheus.Registry
}

func startMTLS(t *testing.T) *mtlsServer {
	t.Helper()
	ca, err := testpki.NewCA("xds-ca")
	if err != nil {
		t.Fatal(err)
	}
	reg := prometheus.NewRegistry()
	s := server.New(server.Config{
		Log: testr.New(t), Registry: reg,
		TLS: tlsreload.ServerConfig(pki(t, ca, "xds.test", "127.0.0.1")), Authorize: server.NodeOfCertificate,
	})
	if _, err := s.Apply([]model.Shoot{modeltest.Shoot(1)}); err != nil {
		t.Fatal(err)
	}
	return &mtlsServer{addr: startServer(t, s), ca: ca, reg: reg}
}

func (m *mtlsServer) refused(t *testing.T, reason string) float64 {
	return metrictest.Sum(t, m.reg, "tendril_xds_refused_total", map[string]string{"reason": reason})
}

// fetch runs xdsclient with tlsCfg as node until it applied the clusters, or until the server
// counted a refusal of reason (then it fails if anything was applied).
func (m *mtlsServer) fetch(t *testing.T, tlsCfg *tls.Config, node, reason string) {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	var mu sync.Mutex
	var got []string
	done := make(chan error, 1)
	go func() {
		done <- xdsclient.Run(ctx, xdsclient.Config{
			Address: m.addr, NodeID: node, Types: store.Types, TLS: tlsCfg, Log: testr.New(t), MinBackoff: 10 * time.Millisecond,
		}, func(u xdsclient.Update) error {
			mu.Lock()
			defer mu.Unlock()
			for _, r := range u.Resources {
				got = append(got, r.GetName())
			}
			return nil
		})
	}()
	defer func() {
		cancel()
		if err := <-done; err != nil {
			t.Error(err)
		}
	}()
	before := 0.0
	if reason != "" {
		before = m.refused(t, reason)
	}
	testwait.For(t, "xDS client "+node, func() error {
		mu.Lock()
		defer mu.Unlock()
		if reason == "" {
			if len(got) == 0 {
				return errors.New("no resources applied")
			}
			return nil
		}
		if len(got) > 0 {
			t.Fatalf("a refused client (%s) was served %v", reason, got)
		}
		if n := m.refused(t, reason); n <= before {
			return fmt.Errorf("refusals %s: %v", reason, n)
		}
		return nil
	})
}

func TestMutualTLSNodes(t *testing.T) {
	m := startMTLS(t)
	ingress := pki(t, m.ca, "tendril-ingress")
	client := tlsreload.ClientConfig(ingress, "xds.test")

	t.Run("the certificate's name", func(t *testing.T) { m.fetch(t, client, "tendril-ingress", "") })
	t.Run("a pod of the certificate's deployment", func(t *testing.T) { m.fetch(t, client, "tendril-ingress-7d9c5b8f6-x2x4q", "") })
	t.Run("another node ID", func(t *testing.T) { m.fetch(t, client, "tendril-egress-0", ads.ReasonNodeMismatch) })
	t.Run("a name that extends the certificate's", func(t *testing.T) { m.fetch(t, client, "tendril-ingressx", ads.ReasonNodeMismatch) })
	t.Run("no client certificate", func(t *testing.T) {
		m.fetch(t, &tls.Config{RootCAs: m.ca.Pool, ServerName: "xds.test"}, "tendril-ingress", tlsreload.ReasonNoCertificate)
	})
	t.Run("a certificate of another CA", func(t *testing.T) {
		other, err := testpki.NewCA("other")
		if err != nil {
			t.Fatal(err)
		}
		f := pki(t, other, "tendril-ingress")
		f.CA = ingress.CA
		m.fetch(t, tlsreload.ClientConfig(f, "xds.test"), "tendril-ingress", tlsreload.ReasonUntrusted)
	})
	t.Run("plaintext", func(t *testing.T) {
		ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
		defer cancel()
		st, err := dialADS(t, m.addr).DeltaAggregatedResources(ctx)
		if err == nil {
			_ = st.Send(&discoveryv3.DeltaDiscoveryRequest{Node: &corev3.Node{Id: "tendril-ingress"}, TypeUrl: resourcev3.ClusterType})
			_, err = st.Recv()
		}
		if status.Code(err) != codes.Unavailable {
			t.Fatalf("plaintext stream: %v, want Unavailable", err)
		}
	})
}

// TestNodeRefusedStatus checks what a refused stream is told, on both protocols: PermissionDenied
// naming the node and the certificate, for the first request's node and for a later one's.
func TestNodeRefusedStatus(t *testing.T) {
	m := startMTLS(t)
	ingress := pki(t, m.ca, "tendril-ingress")
	conn, err := grpc.NewClient(m.addr, grpc.WithTransportCredentials(credentials.NewTLS(tlsreload.ClientConfig(ingress, "xds.test"))))
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	adsClient := discoveryv3.NewAggregatedDiscoveryServiceClient(conn)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()

	check := func(t *testing.T, err error, want string) {
		t.Helper()
		if status.Code(err) != codes.PermissionDenied || !strings.Contains(err.Error(), want) {
			t.Fatalf("stream ended with %v, want PermissionDenied naming %q", err, want)
		}
	}
	t.Run("delta", func(t *testing.T) {
		st, err := adsClient.DeltaAggregatedResources(ctx)
		if err != nil {
			t.Fatal(err)
		}
		_ = st.Send(&discoveryv3.DeltaDiscoveryRequest{Node: &corev3.Node{Id: "shoot-0"}, TypeUrl: resourcev3.ClusterType})
		_, err = st.Recv()
		check(t, err, `node ID "shoot-0" is not allowed for the client certificate of "tendril-ingress"`)
	})
	t.Run("delta, no node", func(t *testing.T) {
		st, err := adsClient.DeltaAggregatedResources(ctx)
		if err != nil {
			t.Fatal(err)
		}
		_ = st.Send(&discoveryv3.DeltaDiscoveryRequest{TypeUrl: resourcev3.ClusterType})
		_, err = st.Recv()
		check(t, err, "names no node")
	})
	t.Run("delta, a later request changes the node", func(t *testing.T) {
		st, err := adsClient.DeltaAggregatedResources(ctx)
		if err != nil {
			t.Fatal(err)
		}
		_ = st.Send(&discoveryv3.DeltaDiscoveryRequest{Node: &corev3.Node{Id: "tendril-ingress-0"}, TypeUrl: resourcev3.ClusterType})
		if _, err := st.Recv(); err != nil {
			t.Fatal(err)
		}
		_ = st.Send(&discoveryv3.DeltaDiscoveryRequest{Node: &corev3.Node{Id: "shoot-0"}, TypeUrl: resourcev3.EndpointType})
		for err == nil {
			_, err = st.Recv()
		}
		check(t, err, `"shoot-0"`)
	})
	t.Run("state of the world", func(t *testing.T) {
		st, err := adsClient.StreamAggregatedResources(ctx)
		if err != nil {
			t.Fatal(err)
		}
		_ = st.Send(&discoveryv3.DiscoveryRequest{Node: &corev3.Node{Id: "shoot-0"}, TypeUrl: resourcev3.ClusterType})
		_, err = st.Recv()
		check(t, err, `"shoot-0"`)
	})
	if n := m.refused(t, ads.ReasonNodeMismatch); n != 3 {
		t.Errorf("node_mismatch refusals: %v, want 3", n)
	}
	if n := m.refused(t, ads.ReasonNoNode); n != 1 {
		t.Errorf("no_node refusals: %v, want 1", n)
	}
}

// TestCertificateRotation: neither side restarts while its files change. A client whose
// certificate may not use its node ID is refused and keeps retrying; once its files hold a
// certificate for the node, its next handshake uses it and it is served. Likewise the server
// refuses a client of a CA its bundle lacks until the bundle file holds that CA.
func TestCertificateRotation(t *testing.T) {
	ca, err := testpki.NewCA("xds-ca")
	if err != nil {
		t.Fatal(err)
	}
	other, err := testpki.NewCA("other-ca")
	if err != nil {
		t.Fatal(err)
	}
	srvFiles := pki(t, ca, "xds.test")
	reg := prometheus.NewRegistry()
	s := server.New(server.Config{Log: testr.New(t), Registry: reg, TLS: tlsreload.ServerConfig(srvFiles), Authorize: server.NodeOfCertificate})
	if _, err := s.Apply([]model.Shoot{modeltest.Shoot(1)}); err != nil {
		t.Fatal(err)
	}
	m := &mtlsServer{addr: startServer(t, s), ca: ca, reg: reg}

	// The client's files: first a certificate named for another node, then the right one.
	cli := pki(t, ca, "tendril-egress")
	rotate := func(c *testpki.CA, cn string) {
		leaf, err := c.Leaf(cn)
		if err != nil {
			t.Fatal(err)
		}
		if err := testpki.WritePair(leaf, cli.Cert, cli.Key); err != nil {
			t.Fatal(err)
		}
	}
	ctx, cancel := context.WithCancel(context.Background())
	applied := make(chan struct{}, 1)
	done := make(chan error, 1)
	go func() {
		done <- xdsclient.Run(ctx, xdsclient.Config{
			Address: m.addr, NodeID: "tendril-ingress-0", Types: store.Types, TLS: tlsreload.ClientConfig(cli, "xds.test"),
			Log: testr.New(t), MinBackoff: 10 * time.Millisecond, MaxBackoff: 100 * time.Millisecond,
		}, func(u xdsclient.Update) error {
			if len(u.Resources) > 0 {
				select {
				case applied <- struct{}{}:
				default:
				}
			}
			return nil
		})
	}()
	defer func() {
		cancel()
		if err := <-done; err != nil {
			t.Error(err)
		}
	}()
	served := func() bool {
		select {
		case <-applied:
			return true
		default:
			return false
		}
	}
	testwait.For(t, "the client refused for its node", func() error {
		if served() {
			t.Fatal("served with a certificate for another node")
		}
		if m.refused(t, ads.ReasonNodeMismatch) == 0 {
			return errors.New("no node_mismatch refusal yet")
		}
		return nil
	})

	// A certificate for the node, but of a CA the server does not trust yet.
	rotate(other, "tendril-ingress")
	testwait.For(t, "the client refused for its CA", func() error {
		if served() {
			t.Fatal("served with a certificate of an untrusted CA")
		}
		if m.refused(t, tlsreload.ReasonUntrusted) == 0 {
			return errors.New("no untrusted_certificate refusal yet")
		}
		return nil
	})

	// The server's bundle gains that CA: the client's next handshake is accepted.
	bundle, err := os.ReadFile(srvFiles.CA)
	if err != nil {
		t.Fatal(err)
	}
	otherPEM := filepath.Join(t.TempDir(), "other.crt")
	if err := other.WriteCA(otherPEM); err != nil {
		t.Fatal(err)
	}
	b, err := os.ReadFile(otherPEM)
	if err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(srvFiles.CA, append(bundle, b...), 0o644); err != nil {
		t.Fatal(err)
	}
	testwait.For(t, "the rotated client served", func() error {
		if !served() {
			return errors.New("nothing applied yet")
		}
		return nil
	})
}
