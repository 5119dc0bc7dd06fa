package harness

import (
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"fmt"
	"math/big"
	"time"
)

// pki is the run's test CA and one server certificate per shoot host, made
// at run time so no key material is ever stored.
type pki struct {
	pool  *x509.CertPool    // the CA, the only root clients trust
	certs []tls.Certificate // certs[i] names hosts[i] only
}

// newPKI makes an ECDSA P-256 CA and a leaf for each host. P-256 is what a
// kube-apiserver serving certificate made by Gardener's secrets manager uses
// too, so the handshake cost is the realistic one.
func newPKI(hosts []string) (*pki, error) {
	now := time.Now()
	caKey, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return nil, fmt.Errorf("CA key: %w", err)
	}
	caTmpl := &x509.Certificate{
		SerialNumber:          serial(),
		Subject:               pkix.Name{CommonName: "tendril-bench CA"},
		NotBefore:             now.Add(-time.Hour),
		NotAfter:              now.Add(48 * time.Hour),
		IsCA:                  true,
		BasicConstraintsValid: true,
		KeyUsage:              x509.KeyUsageCertSign | x509.KeyUsageDigitalSignature,
	}
	caDER, err := x509.CreateCertificate(rand.Reader, caTmpl, caTmpl, &caKey.PublicKey, caKey)
	if err != nil {
		return nil, fmt.Errorf("CA certificate: %w", err)
	}
	ca, err := x509.ParseCertificate(caDER)
	if err != nil {
		return nil, fmt.Errorf("parse CA certificate: %w", err)
	}
	p := &pki{pool: x509.NewCertPool()}
	p.pool.AddCert(ca)
	for _, host := range hosts {
		key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
		if err != nil {
			return nil, fmt.Errorf("key for %s: %w", host, err)
		}
		tmpl := &x509.Certificate{
			SerialNumber: serial(),
			Subject:      pkix.Name{CommonName: host},
			DNSNames:     []string{host},
			NotBefore:    now.Add(-time.Hour),
			NotAfter:     now.Add(48 * time.Hour),
			KeyUsage:     x509.KeyUsageDigitalSignature,
			ExtKeyUsage:  []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth},
		}
		der, err := x509.CreateCertificate(rand.Reader, tmpl, ca, &key.PublicKey, caKey)
		if err != nil {
			return nil, fmt.Errorf("certificate for %s: %w", host, err)
		}
		leaf, err := x509.ParseCertificate(der)
		if err != nil {
			return nil, fmt.Errorf("parse certificate for %s: %w", host, err)
		}
		// Only the leaf goes on the wire: the client has the CA as its root.
		p.certs = append(p.certs, tls.Certificate{Certificate: [][]byte{der}, PrivateKey: key, Leaf: leaf})
	}
	return p, nil
}

func serial() *big.Int {
	n, err := rand.Int(rand.Reader, new(big.Int).Lsh(big.NewInt(1), 120))
	if err != nil {
		// crypto/rand.Reader does not fail on supported platforms (it
		// panics itself if the kernel source is gone).
		panic(err)
	}
	return n
}
