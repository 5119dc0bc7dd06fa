package extension

import (
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/tls"
	"crypto/x509"
	"encoding/pem"
	"io"
	"maps"
	"net"
	"slices"
	"syscall"
	"testing"
	"time"

	extensionssecretsmanager "github.com/gardener/gardener/extensions/pkg/util/secret/manager"
	secretsutils "github.com/gardener/gardener/pkg/utils/secrets"
	"github.com/mitchellh/hashstructure/v2"
)

// gardenerCA is a CA as the secrets manager makes it for caConfigs: Gardener's RSA-3072 CA.
func gardenerCA(t testing.TB) map[string][]byte {
	t.Helper()
	ca, err := (&secretsutils.CertificateSecretConfig{Name: SecretNameCA, CommonName: SecretNameCA, CertType: secretsutils.CACert}).Generate()
	if err != nil {
		t.Fatal(err)
	}
	return ca.SecretData()
}

// egressPair is tendril-server's serving certificate and kube-apiserver's client certificate
// from the leaf configs, and the CA pool both ends trust.
func egressPair(t testing.TB, caData map[string][]byte) (server, client tls.Certificate, pool *x509.CertPool) {
	t.Helper()
	cfgs, err := leafConfigs("shoot--local--a", 1, caData)
	if err != nil {
		t.Fatal(err)
	}
	certs := map[string]tls.Certificate{}
	for _, c := range cfgs {
		if _, ok := c.Config.(*ecdsaCertificateConfig); !ok {
			continue // a WireGuard key
		}
		d, err := c.Config.Generate()
		if err != nil {
			t.Fatal(err)
		}
		data := d.SecretData()
		if _, ok := data[secretsutils.DataKeyCertificateCA]; ok {
			t.Errorf("%s: ca.crt in the Secret: the peers trust the CA bundle", c.Config.GetName())
		}
		certs[c.Config.GetName()], err = tls.X509KeyPair(data[secretsutils.DataKeyCertificate], data[secretsutils.DataKeyPrivateKey])
		if err != nil {
			t.Fatalf("%s: %v", c.Config.GetName(), err)
		}
	}
	pool = x509.NewCertPool()
	if !pool.AppendCertsFromPEM(caData[secretsutils.DataKeyCertificateCA]) {
		t.Fatal("CA certificate does not parse")
	}
	if len(certs) != 2 {
		t.Fatalf("certificates %v, want %s and %s", slices.Collect(maps.Keys(certs)), SecretNameServerTLS, SecretNameAPIServerClient)
	}
	return certs[SecretNameServerTLS], certs[SecretNameAPIServerClient], pool
}

// TestEgressCertificates: the egress certificates are P-256 keys signed by Gardener's CA, for
// their one use each, and a mutual-TLS handshake with them succeeds as tendril-server and
// kube-apiserver configure it (cmd/tendril-server's mutualTLS, the EgressSelector's TLS config).
func TestEgressCertificates(t *testing.T) {
	caData := gardenerCA(t)
	server, client, pool := egressPair(t, caData)
	for name, c := range map[string]struct {
		cert  tls.Certificate
		usage x509.ExtKeyUsage
		dns   string
	}{
		"server": {server, x509.ExtKeyUsageServerAuth, "tendril-server.shoot--local--a.svc"},
		"client": {client, x509.ExtKeyUsageClientAuth, ""},
	} {
		leaf, err := x509.ParseCertificate(c.cert.Certificate[0])
		if err != nil {
			t.Fatal(err)
		}
		if k, ok := leaf.PublicKey.(*ecdsa.PublicKey); !ok || k.Curve != elliptic.P256() {
			t.Errorf("%s: public key %T, want ECDSA P-256", name, leaf.PublicKey)
		}
		if _, err := leaf.Verify(x509.VerifyOptions{Roots: pool, DNSName: c.dns, KeyUsages: []x509.ExtKeyUsage{c.usage}}); err != nil {
			t.Errorf("%s: %v", name, err)
		}
		other := x509.ExtKeyUsageClientAuth
		if c.usage == other {
			other = x509.ExtKeyUsageServerAuth
		}
		if _, err := leaf.Verify(x509.VerifyOptions{Roots: pool, KeyUsages: []x509.ExtKeyUsage{other}}); err == nil {
			t.Errorf("%s: valid for %v too", name, other)
		}
	}
	if err := handshake(server, client, pool); err != nil {
		t.Fatal(err)
	}

	// Another CA (a rotation) is another config, so another Secret; the same CA the same one.
	hash := func(caData map[string][]byte) uint64 {
		cfgs, err := leafConfigs("shoot--local--a", 1, caData)
		if err != nil {
			t.Fatal(err)
		}
		i := slices.IndexFunc(cfgs, func(c extensionssecretsmanager.SecretConfigWithOptions) bool {
			return c.Config.GetName() == SecretNameAPIServerClient
		})
		if i < 0 {
			t.Fatal("no client certificate config")
		}
		h, err := hashstructure.Hash(cfgs[i].Config, hashstructure.FormatV2, &hashstructure.HashOptions{IgnoreZeroValue: true})
		if err != nil {
			t.Fatal(err)
		}
		return h
	}
	if hash(caData) != hash(caData) {
		t.Error("the same CA gives another config hash")
	}
	if hash(caData) == hash(gardenerCA(t)) {
		t.Error("a new CA gives the same config hash: the certificate would not be renewed with it")
	}

	// Without a CA's key nothing is generated.
	noKey := map[string][]byte{secretsutils.DataKeyCertificateCA: caData[secretsutils.DataKeyCertificateCA]}
	if _, err := leafConfigs("shoot--local--a", 1, noKey); err == nil {
		t.Error("leaf configs from a CA without its key")
	}
}

// handshake makes one mutual-TLS connection over loopback TCP with server's and client's
// certificates, configured as tendril-server and kube-apiserver's EgressSelector do, and moves
// a byte through it.
func handshake(server, client tls.Certificate, pool *x509.CertPool) error {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return err
	}
	defer l.Close()
	done := make(chan error, 1)
	go func() {
		c, err := l.Accept()
		if err != nil {
			done <- err
			return
		}
		defer c.Close()
		s := tls.Server(c, &tls.Config{Certificates: []tls.Certificate{server}, ClientCAs: pool,
			ClientAuth: tls.RequireAndVerifyClientCert, MinVersion: tls.VersionTLS12, SessionTicketsDisabled: true})
		_, err = io.Copy(s, io.LimitReader(s, 1))
		done <- err
	}()
	c, err := tls.Dial("tcp", l.Addr().String(), &tls.Config{Certificates: []tls.Certificate{client}, RootCAs: pool,
		ServerName: "tendril-server.shoot--local--a"})
	if err != nil {
		<-done
		return err
	}
	defer c.Close()
	if _, err := c.Write([]byte{1}); err != nil {
		return err
	}
	if _, err := io.ReadFull(c, make([]byte, 1)); err != nil {
		return err
	}
	return <-done
}

// cpuTime is the CPU time this process used so far (user and system, all threads).
func cpuTime(b *testing.B) time.Duration {
	var ru syscall.Rusage
	if err := syscall.Getrusage(syscall.RUSAGE_SELF, &ru); err != nil {
		b.Fatal(err)
	}
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}

// BenchmarkEgressHandshake: the CPU of one dial of kube-apiserver's egress over mutual TLS,
// both ends in this process, one handshake at a time (cpu-ms/op: the CPU of both ends),
// with Gardener's RSA-3072 certificates (CertificateSecretConfig, what the egress used before)
// and with the P-256 ones the extension issues now.
//
//	go test -run=NONE -bench EgressHandshake ./extension/
func BenchmarkEgressHandshake(b *testing.B) {
	caData := gardenerCA(b)
	rsaCert := func(name string, usage secretsutils.CertType) tls.Certificate {
		ca, err := secretsutils.LoadCertificate(SecretNameCA, caData[secretsutils.DataKeyPrivateKeyCA], caData[secretsutils.DataKeyCertificateCA])
		if err != nil {
			b.Fatal(err)
		}
		d, err := (&secretsutils.CertificateSecretConfig{Name: name, CommonName: name, DNSNames: []string{"tendril-server.shoot--local--a"},
			CertType: usage, SigningCA: ca, SkipPublishingCACertificate: true}).Generate()
		if err != nil {
			b.Fatal(err)
		}
		data := d.SecretData()
		if blk, _ := pem.Decode(data[secretsutils.DataKeyPrivateKey]); blk == nil || blk.Type != "RSA PRIVATE KEY" {
			b.Fatalf("Gardener's certificate key is not RSA")
		}
		c, err := tls.X509KeyPair(data[secretsutils.DataKeyCertificate], data[secretsutils.DataKeyPrivateKey])
		if err != nil {
			b.Fatal(err)
		}
		return c
	}
	server, client, pool := egressPair(b, caData)
	for _, bc := range []struct {
		name           string
		server, client tls.Certificate
	}{
		{"gardener-rsa3072", rsaCert("server", secretsutils.ServerCert), rsaCert("client", secretsutils.ClientCert)},
		{"ecdsa-p256", server, client},
	} {
		b.Run(bc.name, func(b *testing.B) {
			start := cpuTime(b)
			for b.Loop() {
				if err := handshake(bc.server, bc.client, pool); err != nil {
					b.Fatal(err)
				}
			}
			b.ReportMetric(float64(cpuTime(b)-start)/float64(time.Millisecond)/float64(b.N), "cpu-ms/op")
		})
	}
}
