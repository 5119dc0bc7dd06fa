package extension

import (
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"errors"
	"fmt"
	"math/big"
	"time"

	"github.com/gardener/gardener/pkg/utils"
	secretsutils "github.com/gardener/gardener/pkg/utils/secrets"
)

// ecdsaCertificateConfig makes the secrets manager generate an ECDSA P-256 key and a
// certificate for it signed by the CA. Gardener's CertificateSecretConfig always makes a
// 3072-bit RSA key, and kube-apiserver's egress to tendril-server makes a mutual-TLS handshake
// per dial (its EgressSelector keeps no TLS session cache): both ends then sign with their
// RSA-3072 key on every dial, each signature tens of times the CPU of a P-256 one
// (BenchmarkEgressHandshake; docs/performance.md, "The egress certificates' keys"). The CA
// stays Gardener's (RSA): it signs once per certificate, and verifying its signature is cheap.
//
// The certificate is renewed with the CA: CAChecksum is part of the config's hash, which names
// the Secret (what SignedByCA's checksum label does for CertificateSecretConfig); and before it
// expires, with secretsmanager.Validity(certificateValidity) among its options.
type ecdsaCertificateConfig struct {
	Name       string
	CommonName string
	DNSNames   []string
	CertType   secretsutils.CertType // ServerCert or ClientCert
	// CAChecksum is the checksum of the signing CA's Secret data.
	CAChecksum string

	ca *secretsutils.Certificate // unexported: not in the hash
}

// certificateValidity is what Gardener's CertificateSecretConfig gives a certificate without a
// Validity, 10 years; the secrets manager renews it after 8 (80 %), or with the CA.
const certificateValidity = 10 * 365 * 24 * time.Hour

// signingCA is the CA in caData (the CA Secret's ca.crt and ca.key) and the checksum of that data,
// loaded once for all the certificates it signs.
type signingCA struct {
	ca       *secretsutils.Certificate
	checksum string
}

func loadSigningCA(caData map[string][]byte) (signingCA, error) {
	ca, err := secretsutils.LoadCertificate(SecretNameCA, caData[secretsutils.DataKeyPrivateKeyCA], caData[secretsutils.DataKeyCertificateCA])
	if err != nil {
		return signingCA{}, fmt.Errorf("load CA: %w", err)
	}
	if ca.PrivateKey == nil {
		return signingCA{}, errors.New("the CA has no private key")
	}
	return signingCA{ca: ca, checksum: utils.ComputeSecretChecksum(caData)}, nil
}

// certificate is the config of a certificate signed by the CA.
func (s signingCA) certificate(name, commonName string, dnsNames []string, certType secretsutils.CertType) *ecdsaCertificateConfig {
	return &ecdsaCertificateConfig{Name: name, CommonName: commonName, DNSNames: dnsNames, CertType: certType,
		CAChecksum: s.checksum, ca: s.ca}
}

func (c *ecdsaCertificateConfig) GetName() string { return c.Name }

func (c *ecdsaCertificateConfig) Generate() (secretsutils.DataInterface, error) {
	if c.ca == nil {
		return nil, errors.New("no signing CA")
	}
	var usage x509.ExtKeyUsage
	switch c.CertType {
	case secretsutils.ServerCert:
		usage = x509.ExtKeyUsageServerAuth
	case secretsutils.ClientCert:
		usage = x509.ExtKeyUsageClientAuth
	default:
		return nil, fmt.Errorf("certificate type %q: want server or client", c.CertType)
	}
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return nil, fmt.Errorf("generate key: %w", err)
	}
	serial, err := rand.Int(rand.Reader, new(big.Int).Lsh(big.NewInt(1), 128))
	if err != nil {
		return nil, fmt.Errorf("serial number: %w", err)
	}
	now := secretsutils.Clock.Now()
	template := &x509.Certificate{
		SerialNumber:          serial,
		Subject:               pkix.Name{CommonName: c.CommonName},
		DNSNames:              c.DNSNames,
		NotBefore:             secretsutils.AdjustToClockSkew(now),
		NotAfter:              now.Add(certificateValidity),
		KeyUsage:              x509.KeyUsageDigitalSignature,
		ExtKeyUsage:           []x509.ExtKeyUsage{usage},
		BasicConstraintsValid: true,
	}
	der, err := x509.CreateCertificate(rand.Reader, template, c.ca.Certificate, &key.PublicKey, c.ca.PrivateKey)
	if err != nil {
		return nil, fmt.Errorf("sign certificate: %w", err)
	}
	keyDER, err := x509.MarshalPKCS8PrivateKey(key)
	if err != nil {
		return nil, fmt.Errorf("encode key: %w", err)
	}
	return certificateData{
		secretsutils.DataKeyCertificate: pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der}),
		secretsutils.DataKeyPrivateKey:  pem.EncodeToMemory(&pem.Block{Type: "PRIVATE KEY", Bytes: keyDER}),
	}, nil
}

// certificateData is a certificate Secret's data: tls.crt and tls.key, as the CertificateSecretConfig
// it replaces writes with SkipPublishingCACertificate (the peers trust the CA bundle).
type certificateData map[string][]byte

func (d certificateData) SecretData() map[string][]byte { return d }
