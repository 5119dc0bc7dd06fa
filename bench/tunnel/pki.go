package tunnel

import (
	"crypto/tls"
	"fmt"
	"path/filepath"

	"github.com/tendril-net/tendril/internal/pki/testpki"
)

// pki is the run's certificates, made at run time from one CA (ECDSA P-256)
// and written as PEM files into dir.
type pki struct {
	dir    string
	ca     *testpki.CA
	caFile string
	// client is kube-apiserver's client certificate toward the egress
	// front-ends (tendril-server's and proxy-server's).
	client tls.Certificate
}

// Certificate names: a leaf's common name is the first name.
const (
	certTendrilServer = "tendril-server"
	certKonnServer    = "konnectivity-server"
	certKonnAgent     = "konnectivity-agent"
	certOpenVPNServer = "openvpn-server"
	certOpenVPNClient = "openvpn-client"
	certAPIServer     = "kube-apiserver"
)

func newPKI(dir string) (*pki, error) {
	ca, err := testpki.NewCA("tendril-bench tunnel CA")
	if err != nil {
		return nil, err
	}
	p := &pki{dir: dir, ca: ca, caFile: filepath.Join(dir, "ca.pem")}
	if err := ca.WriteCA(p.caFile); err != nil {
		return nil, err
	}
	if p.client, err = ca.Leaf(certAPIServer); err != nil {
		return nil, err
	}
	return p, nil
}

// pair issues a certificate for names and writes it to dir/<file>.pem and
// dir/<file>-key.pem, returning the two paths.
func (p *pki) pair(dir, file string, names ...string) (cert, key string, err error) {
	c, err := p.ca.Leaf(names...)
	if err != nil {
		return "", "", err
	}
	cert, key = filepath.Join(dir, file+".pem"), filepath.Join(dir, file+"-key.pem")
	if err := testpki.WritePair(c, cert, key); err != nil {
		return "", "", fmt.Errorf("write %s: %w", file, err)
	}
	return cert, key, nil
}

// clientTLS is kube-apiserver's TLS toward a front-end whose certificate
// names serverName: mutual TLS, no session cache, so every connection makes
// a full handshake as the EgressSelector's do.
func (p *pki) clientTLS(serverName string) *tls.Config {
	return &tls.Config{Certificates: []tls.Certificate{p.client}, RootCAs: p.ca.Pool, ServerName: serverName,
		MinVersion: tls.VersionTLS12}
}
