package tunnel

import (
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"net"
	"sync"

	"github.com/tendril-net/tendril/bench/internal/inflight"
	"github.com/tendril-net/tendril/edge/pipe"
)

// The encrypted baseline (issue 22): the cheapest encrypted path between the client and the pod,
// a pair of relays with kernel TCP on both ends and one TLS connection between them per TCP
// connection (what two `socat openssl` hops do). The seed-side relay accepts the client's TCP
// connection and opens a new TLS connection to the shoot-side relay, which dials the pod over
// the direct veth. Both relays run in this process (their CPU is the client's, so the target has
// no CPU figures); TLS 1.3 with Go's defaults (AES-GCM with AES-NI, X25519MLKEM768), the
// front-ends' certificates, no client certificate and no session resumption.

// certTLSRelay names the shoot-side relay's certificate.
const certTLSRelay = "tls-relay"

// tlsRelayPair is the two relays; close stops both and waits for every connection they carry.
type tlsRelayPair struct {
	lns   []net.Listener
	wg    sync.WaitGroup
	conns inflight.Set
}

// startTLSRelay listens on 127.0.0.1 for the client (seed side) and for the seed side's TLS
// connections (shoot side), and returns the client's address.
func startTLSRelay(serverTLS, clientTLS *tls.Config, pod string) (*tlsRelayPair, string, error) {
	p := &tlsRelayPair{}
	shoot, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return nil, "", err
	}
	seed, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		shoot.Close()
		return nil, "", err
	}
	p.lns = []net.Listener{shoot, seed}
	var d net.Dialer
	// Shoot side: TLS in, kernel TCP to the pod.
	p.serve(shoot, func(c net.Conn) (net.Conn, net.Conn, error) {
		tc := tls.Server(c, serverTLS)
		if err := tc.Handshake(); err != nil {
			return nil, nil, fmt.Errorf("TLS handshake: %w", err)
		}
		up, err := d.Dial("tcp", pod)
		return tc, up, err
	})
	// Seed side: kernel TCP in, a new TLS connection to the shoot side.
	shootAddr := shoot.Addr().String()
	p.serve(seed, func(c net.Conn) (net.Conn, net.Conn, error) {
		up, err := tls.DialWithDialer(&d, "tcp", shootAddr, clientTLS)
		return c, up, err
	})
	return p, seed.Addr().String(), nil
}

// serve accepts on ln and relays each connection to what open returns.
func (p *tlsRelayPair) serve(ln net.Listener, open func(net.Conn) (net.Conn, net.Conn, error)) {
	p.wg.Go(func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			if !p.conns.Add(c) {
				c.Close()
				return
			}
			p.wg.Go(func() {
				defer p.conns.Done(c)
				in, up, err := open(c)
				if err != nil {
					if up != nil {
						up.Close()
					}
					return
				}
				if !p.conns.Add(up) {
					up.Close()
					return
				}
				defer p.conns.Done(up)
				pipe.Pipe(in, up, 0)
			})
		}
	})
}

// Close stops both relays and waits for every connection they carried.
func (p *tlsRelayPair) Close() error {
	var errs []error
	for _, ln := range p.lns {
		errs = append(errs, ln.Close())
	}
	p.conns.Close()
	p.wg.Wait()
	return errors.Join(errs...)
}

func (r *runner) tlsRelayStack() *stack {
	s := &stack{name: TargetTLSRelay, path: "client → relay (kernel TCP) ⇄ one TLS connection per TCP connection ⇄ relay (kernel TCP) → pod over the direct veth; both relays in the benchmark's process"}
	s.check = func(context.Context) error { return nil }
	s.version = func(context.Context) string { return "Go crypto/tls relays (bench/tunnel), TLS 1.3, Go's defaults" }
	s.startServer = func(_ context.Context, dir string) error {
		cert, key, err := r.pki.pair(dir, certTLSRelay, certTLSRelay)
		if err != nil {
			return err
		}
		kp, err := tls.LoadX509KeyPair(cert, key)
		if err != nil {
			return err
		}
		serverTLS := &tls.Config{Certificates: []tls.Certificate{kp}, MinVersion: tls.VersionTLS13, SessionTicketsDisabled: true}
		clientTLS := &tls.Config{RootCAs: r.pki.ca.Pool, ServerName: certTLSRelay, MinVersion: tls.VersionTLS13}
		// The pod over the direct veth, as direct dials it.
		pair, listen, err := startTLSRelay(serverTLS, clientTLS, addr(r.topo.directIP, r.pod.port()))
		if err != nil {
			return err
		}
		s.closers = append(s.closers, pair)
		s.dial = map[string]dialFunc{TargetTLSRelay: tcpDialer(listen)}
		return nil
	}
	return s
}
