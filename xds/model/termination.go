package model

import (
	"bytes"
	"crypto/tls"
	"crypto/x509"
	"encoding/pem"
	"errors"
	"fmt"
)

// Termination opts a shoot into the terminating mode of the SNI listener: the ingress ends the
// client's TLS with the shoot's serving certificate, authenticates client certificates against
// the shoot's client CA (and passes bearer tokens through), and sends each request on to one of
// the kube-apiserver replicas over TLS with the front-proxy client certificate, so that one
// client's requests spread over the replicas (docs/design-notes/l7-terminate.md). All material
// is PEM. A shoot without a Termination is passed through untouched.
type Termination struct {
	// ServingCert and ServingKey are kube-apiserver's serving certificate (chain) and key, which
	// the ingress now presents to the shoot's clients.
	ServingCert, ServingKey []byte
	// ClientCA is the bundle client certificates are verified against.
	ClientCA []byte
	// FrontProxyCert and FrontProxyKey are the client certificate the ingress presents to
	// kube-apiserver, whose --requestheader-client-ca-file trusts its issuer.
	FrontProxyCert, FrontProxyKey []byte
	// APIServerCA verifies kube-apiserver's serving certificate, for the name APIServerName.
	APIServerCA   []byte
	APIServerName string
}

// Equal reports whether two terminations are the same (nil equals only nil).
func (t *Termination) Equal(o *Termination) bool {
	if t == nil || o == nil {
		return t == o
	}
	return bytes.Equal(t.ServingCert, o.ServingCert) && bytes.Equal(t.ServingKey, o.ServingKey) &&
		bytes.Equal(t.ClientCA, o.ClientCA) &&
		bytes.Equal(t.FrontProxyCert, o.FrontProxyCert) && bytes.Equal(t.FrontProxyKey, o.FrontProxyKey) &&
		bytes.Equal(t.APIServerCA, o.APIServerCA) && t.APIServerName == o.APIServerName
}

// Validate parses every part, so that material the data plane could not load is refused where
// it comes in, not by every ingress replica NACKing it.
func (t *Termination) Validate() error {
	if _, err := tls.X509KeyPair(t.ServingCert, t.ServingKey); err != nil {
		return fmt.Errorf("serving certificate: %w", err)
	}
	if _, err := tls.X509KeyPair(t.FrontProxyCert, t.FrontProxyKey); err != nil {
		return fmt.Errorf("front-proxy certificate: %w", err)
	}
	if err := validateBundle(t.ClientCA); err != nil {
		return fmt.Errorf("client CA: %w", err)
	}
	if err := validateBundle(t.APIServerCA); err != nil {
		return fmt.Errorf("kube-apiserver CA: %w", err)
	}
	if err := ValidateHost(t.APIServerName); err != nil {
		return fmt.Errorf("kube-apiserver name %q: %w", t.APIServerName, err)
	}
	return nil
}

// validateBundle requires at least one certificate and nothing but certificates: a stray key or
// garbage in a CA bundle is a mistake that x509.CertPool.AppendCertsFromPEM would skip silently.
func validateBundle(b []byte) error {
	n := 0
	for rest := bytes.TrimSpace(b); len(rest) > 0; rest = bytes.TrimSpace(rest) {
		var blk *pem.Block
		blk, rest = pem.Decode(rest)
		if blk == nil {
			return errors.New("not PEM after the certificates")
		}
		if blk.Type != "CERTIFICATE" {
			return fmt.Errorf("a %q block in a certificate bundle", blk.Type)
		}
		if _, err := x509.ParseCertificate(blk.Bytes); err != nil {
			return fmt.Errorf("certificate %d: %w", n+1, err)
		}
		n++
	}
	if n == 0 {
		return errors.New("no certificate")
	}
	return nil
}

// String describes t without its keys, so that a log line or an error that prints a route never
// carries them: the sizes of its parts and the name.
func (t *Termination) String() string {
	if t == nil {
		return "<none>"
	}
	return fmt.Sprintf("{servingCert %d B, servingKey (redacted), clientCA %d B, frontProxyCert %d B, frontProxyKey (redacted), apiserverCA %d B, apiserverName %q}",
		len(t.ServingCert), len(t.ClientCA), len(t.FrontProxyCert), len(t.APIServerCA), t.APIServerName)
}
