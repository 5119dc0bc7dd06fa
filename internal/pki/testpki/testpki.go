// Package testpki makes certificate authorities and certificates for tests and local runs: an
// ECDSA P-256 CA and leaf certificates for DNS names and Kubernetes users, in memory or as PEM files. It is not a
// production PKI (no revocation, no rotation); the extension's secrets manager is that.
package testpki

import (
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"fmt"
	"math/big"
	"net"
	"os"
	"time"
)

// CA is a certificate authority that signs leaf certificates.
type CA struct {
	Cert *x509.Certificate
	key  *ecdsa.PrivateKey
	// Pool holds only this CA, for clients that verify against it.
	Pool *x509.CertPool
}

// NewCA returns a new self-signed CA named cn, valid for a day.
func NewCA(cn string) (*CA, error) {
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return nil, fmt.Errorf("CA key: %w", err)
	}
	tmpl := &x509.Certificate{
		SerialNumber:          serial(),
		Subject:               pkix.Name{CommonName: cn},
		NotBefore:             time.Now().Add(-time.Hour),
		NotAfter:              time.Now().Add(24 * time.Hour),
		KeyUsage:              x509.KeyUsageCertSign | x509.KeyUsageCRLSign,
		BasicConstraintsValid: true,
		IsCA:                  true,
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, &key.PublicKey, key)
	if err != nil {
		return nil, fmt.Errorf("CA certificate: %w", err)
	}
	cert, err := x509.ParseCertificate(der)
	if err != nil {
		return nil, err
	}
	pool := x509.NewCertPool()
	pool.AddCert(cert)
	return &CA{Cert: cert, key: key, Pool: pool}, nil
}

// Leaf issues a server and client certificate for names (DNS names or IP addresses), valid for a
// day.
func (ca *CA) Leaf(names ...string) (tls.Certificate, error) {
	tmpl := &x509.Certificate{
		Subject:     pkix.Name{CommonName: names[0]},
		NotBefore:   time.Now().Add(-time.Hour),
		NotAfter:    time.Now().Add(24 * time.Hour),
		ExtKeyUsage: []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth, x509.ExtKeyUsageClientAuth},
	}
	for _, n := range names {
		if ip := net.ParseIP(n); ip != nil {
			tmpl.IPAddresses = append(tmpl.IPAddresses, ip)
		} else {
			tmpl.DNSNames = append(tmpl.DNSNames, n)
		}
	}
	return ca.issue(tmpl)
}

// Client issues a client certificate for a Kubernetes user: the common name is the user, the
// organizations its groups (as kube-apiserver's x509 authenticator reads them). It is valid
// from notBefore to notAfter; a zero notAfter means a day from now.
func (ca *CA) Client(user string, groups []string, notBefore, notAfter time.Time) (tls.Certificate, error) {
	if notAfter.IsZero() {
		notBefore, notAfter = time.Now().Add(-time.Hour), time.Now().Add(24*time.Hour)
	}
	return ca.issue(&x509.Certificate{
		Subject:     pkix.Name{CommonName: user, Organization: groups},
		NotBefore:   notBefore,
		NotAfter:    notAfter,
		ExtKeyUsage: []x509.ExtKeyUsage{x509.ExtKeyUsageClientAuth},
	})
}

// issue signs tmpl (its serial number, key and key usage filled in) with a new key.
func (ca *CA) issue(tmpl *x509.Certificate) (tls.Certificate, error) {
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return tls.Certificate{}, fmt.Errorf("leaf key: %w", err)
	}
	tmpl.SerialNumber = serial()
	tmpl.KeyUsage = x509.KeyUsageDigitalSignature
	der, err := x509.CreateCertificate(rand.Reader, tmpl, ca.Cert, &key.PublicKey, ca.key)
	if err != nil {
		return tls.Certificate{}, fmt.Errorf("leaf certificate: %w", err)
	}
	leaf, err := x509.ParseCertificate(der)
	if err != nil {
		return tls.Certificate{}, err
	}
	return tls.Certificate{Certificate: [][]byte{der}, PrivateKey: key, Leaf: leaf}, nil
}

// PEM is the CA certificate as PEM.
func (ca *CA) PEM() []byte {
	return pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: ca.Cert.Raw})
}

// WriteCA writes the CA certificate as PEM to path.
func (ca *CA) WriteCA(path string) error {
	return os.WriteFile(path, ca.PEM(), 0o644)
}

// WriteFiles writes what a mutual-TLS peer reads: c's certificate and key, and the certificate
// of ca (the one its peer's certificates chain to, not necessarily c's issuer), as PEM files.
func WriteFiles(c tls.Certificate, ca *CA, certPath, keyPath, caPath string) error {
	if err := WritePair(c, certPath, keyPath); err != nil {
		return err
	}
	return ca.WriteCA(caPath)
}

// PEM encodes c's certificate and its key (PKCS #8).
func PEM(c tls.Certificate) (cert, key []byte, err error) {
	keyDER, err := x509.MarshalPKCS8PrivateKey(c.PrivateKey)
	if err != nil {
		return nil, nil, err
	}
	return pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: c.Certificate[0]}),
		pem.EncodeToMemory(&pem.Block{Type: "PRIVATE KEY", Bytes: keyDER}), nil
}

// WritePair writes c's certificate and key as PEM files.
func WritePair(c tls.Certificate, certPath, keyPath string) error {
	cert, key, err := PEM(c)
	if err != nil {
		return err
	}
	if err := os.WriteFile(certPath, cert, 0o644); err != nil {
		return err
	}
	return os.WriteFile(keyPath, key, 0o600)
}

func serial() *big.Int {
	n, err := rand.Int(rand.Reader, new(big.Int).Lsh(big.NewInt(1), 120))
	if err != nil {
		panic("testpki: no randomness: " + err.Error())
	}
	return n
}
