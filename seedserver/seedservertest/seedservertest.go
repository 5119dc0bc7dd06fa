// Package seedservertest starts a real tendril-server for tests: its egress (CONNECT) and
// konnectivity (gRPC) front-ends on mutual TLS, and an agent end of the tunnel attached to it
// over a loopback TCP stream, as it would be through the ingress. The agent's inner address is
// the only shoot network the server allows. Like package server it imports no Kubernetes code.
package seedservertest

import (
	"context"
	"crypto/tls"
	"io"
	"net"
	"net/netip"
	"sync"
	"testing"
	"time"

	"github.com/go-logr/logr/testr"
	"github.com/prometheus/client_golang/prometheus"
	"google.golang.org/grpc/credentials"

	"github.com/tendril-net/tendril/internal/pki/testpki"
	"github.com/tendril-net/tendril/seedserver"
	"github.com/tendril-net/tendril/tunnel/wg"
)

// The tunnel's inner addresses: the server's and the agent's.
var (
	ServerAddr = netip.MustParseAddr("fd8f:6d53:b97a:1::1")
	AgentAddr  = netip.MustParseAddr("fd8f:6d53:b97a:1::2")
)

// Options configures Start. The zero value is a working backend.
type Options struct {
	// AgentKey is the agent's WireGuard key. If zero, the key the server has as its peer; any
	// other key never brings the tunnel up.
	AgentKey wg.Key
	// ServerName is the name on tendril-server's certificate and the client's expected name. If
	// empty, "tendril-server".
	ServerName string
	// DialTimeout and RequestTimeout are the server's (seedserver.Config); zero: its defaults.
	DialTimeout, RequestTimeout time.Duration
	// Registry receives the server's metrics; nil: not registered.
	Registry prometheus.Registerer
}

// Backend is a running tendril-server with an agent attached. Everything stops when the test
// ends.
type Backend struct {
	Server *seedserver.Server
	// Agent is the agent's end of the tunnel; it listens on AgentAddr.
	Agent *wg.Tunnel
	// CA signed the server's certificate and is the only CA the server trusts for clients.
	CA *testpki.CA
	// Connect is the egress CONNECT front-end and GRPC the konnectivity front-end, host:port;
	// both want a client certificate from CA.
	Connect, GRPC string
	// ClientTLS holds a client certificate the server trusts ("kube-apiserver") and verifies the
	// server's certificate against CA and ServerName.
	ClientTLS *tls.Config

	mu        sync.Mutex
	listeners []net.Listener // ServeEcho's
	wg        sync.WaitGroup
}

// Start starts tendril-server and attaches an agent to it. It does not wait for the tunnel:
// WaitReady does.
func Start(t *testing.T, o Options) *Backend {
	t.Helper()
	if o.ServerName == "" {
		o.ServerName = "tendril-server"
	}
	serverKey, err := wg.GenerateKey()
	if err != nil {
		t.Fatal(err)
	}
	realAgent, err := wg.GenerateKey()
	if err != nil {
		t.Fatal(err)
	}
	agentKey := o.AgentKey
	if agentKey.IsZero() {
		agentKey = realAgent
	}
	srv, err := seedserver.New(seedserver.Config{
		Tunnel: wg.Config{
			PrivateKey:     serverKey,
			LocalAddresses: []netip.Addr{ServerAddr},
			Peers:          []wg.Peer{{PublicKey: realAgent.PublicKey(), AllowedIPs: []netip.Prefix{netip.PrefixFrom(AgentAddr, 128)}}},
		},
		ShootCIDRs:     []netip.Prefix{netip.PrefixFrom(AgentAddr, 128)},
		DialTimeout:    o.DialTimeout,
		RequestTimeout: o.RequestTimeout,
		Registry:       o.Registry,
		Log:            testr.New(t).WithName("server"),
	})
	if err != nil {
		t.Fatal(err)
	}
	agent, err := wg.New(wg.Config{
		PrivateKey:     agentKey,
		LocalAddresses: []netip.Addr{AgentAddr},
		Peers: []wg.Peer{{PublicKey: serverKey.PublicKey(), AllowedIPs: []netip.Prefix{netip.PrefixFrom(ServerAddr, 128)},
			PersistentKeepalive: 25 * time.Second}},
		Logger: testr.New(t).WithName("agent"),
	})
	if err != nil {
		t.Fatal(err)
	}

	ca, err := testpki.NewCA("shoot CA")
	if err != nil {
		t.Fatal(err)
	}
	serverCert, err := ca.Leaf(o.ServerName)
	if err != nil {
		t.Fatal(err)
	}
	clientCert, err := ca.Leaf("kube-apiserver")
	if err != nil {
		t.Fatal(err)
	}
	serverTLS := func() *tls.Config {
		return &tls.Config{Certificates: []tls.Certificate{serverCert}, ClientCAs: ca.Pool, ClientAuth: tls.RequireAndVerifyClientCert}
	}
	tunnelL := listen(t)
	rawConnect := listen(t)
	grpcL := listen(t)
	b := &Backend{Server: srv, Agent: agent, CA: ca, Connect: rawConnect.Addr().String(), GRPC: grpcL.Addr().String(),
		ClientTLS: &tls.Config{Certificates: []tls.Certificate{clientCert}, RootCAs: ca.Pool, ServerName: o.ServerName}}
	ctx, cancel := context.WithCancel(context.Background())
	b.wg.Add(3)
	go func() { defer b.wg.Done(); _ = srv.ServeTunnel(ctx, tunnelL) }()
	go func() { defer b.wg.Done(); _ = srv.ServeConnect(ctx, rawConnect, serverTLS()) }()
	go func() { defer b.wg.Done(); _ = srv.ServeGRPC(ctx, grpcL, credentials.NewTLS(serverTLS())) }()
	t.Cleanup(func() {
		cancel()
		b.mu.Lock()
		for _, l := range b.listeners {
			l.Close()
		}
		b.mu.Unlock()
		agent.Close()
		srv.Close()
		b.wg.Wait()
	})

	// The agent dials the server's tunnel port, as it would through the ingress.
	stream, err := net.Dial("tcp", tunnelL.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	if _, err := agent.AttachPeer(stream, serverKey.PublicKey()); err != nil {
		t.Fatal(err)
	}
	return b
}

func listen(t *testing.T) net.Listener {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	return l
}

// WaitReady waits up to 10 s for the server to be ready (the tunnel up).
func (b *Backend) WaitReady(t *testing.T) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for {
		ok, why := b.Server.Ready()
		if ok {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("tunnel not up: %s", why)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// ServeEcho serves an echo on the agent's inner address at port until the test ends: each
// connection is greeted with greeting (none if empty) and then gets back what it sends. It
// returns the address, the target to dial through the server.
func (b *Backend) ServeEcho(t *testing.T, port uint16, greeting string) string {
	t.Helper()
	addr := netip.AddrPortFrom(AgentAddr, port)
	l, err := b.Agent.ListenTCP(addr)
	if err != nil {
		t.Fatal(err)
	}
	b.mu.Lock()
	b.listeners = append(b.listeners, l)
	b.mu.Unlock()
	b.wg.Add(1)
	go func() {
		defer b.wg.Done()
		var conns sync.WaitGroup
		defer conns.Wait()
		for {
			c, err := l.Accept()
			if err != nil {
				return
			}
			conns.Add(1)
			go func() {
				defer conns.Done()
				defer c.Close()
				if greeting != "" {
					_, _ = io.WriteString(c, greeting)
				}
				_, _ = io.Copy(c, c)
			}()
		}
	}()
	return addr.String()
}
