package egressrelay

import (
	"crypto/tls"
	"fmt"
	"sync"

	"github.com/tendril-net/tendril/internal/pki/tlsreload"
)

// clientTLS is the relay's client TLS configuration toward tendril-server, made from the
// certificate files (tlsreload.Files: read again when a mounted Secret swaps them, the last good
// version kept while a new one does not load). It is asked for every new tunnel, so that a
// rotation applies to the next one; a new version gives a new *tls.Config, by which the
// upstreams know to make a new connection and retire the old (upstream.go). The configuration is
// static per version, not tlsreload.ClientConfig's per-handshake lookup, for that reason.
type clientTLS struct {
	files      *tlsreload.Files
	serverName string

	mu  sync.Mutex
	m   *tlsreload.Material // the version cfg was made of
	cfg *tls.Config
}

// config returns the configuration for the files' current version.
func (c *clientTLS) config() (*tls.Config, error) {
	m, err := c.files.Material()
	if err != nil {
		return nil, fmt.Errorf("egressrelay: client certificate: %w", err)
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	if m != c.m {
		c.m, c.cfg = m, &tls.Config{
			Certificates: []tls.Certificate{m.Cert},
			RootCAs:      m.Roots,
			ServerName:   c.serverName,
			// gRPC over TLS: tendril-server's grpc-go refuses a handshake without h2.
			NextProtos: []string{"h2"},
			MinVersion: tls.VersionTLS12,
		}
	}
	return c.cfg, nil
}
