package controlplane

import (
	"context"
	"crypto/x509"
	"encoding/pem"
	"maps"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/go-logr/logr/testr"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	testclock "k8s.io/utils/clock/testing"
	"sigs.k8s.io/controller-runtime/pkg/client"

	"github.com/tendril-net/tendril/internal/pki/tlsreload"
	"github.com/tendril-net/tendril/internal/testing/kubetest"
)

// TestXDSSecrets runs the xDS certificates' sync against a real API server: the secrets
// manager's CA, server and client certificates are created in tendril-seed's
// namespace, the ingress's Secret of a fixed name carries the client certificate and the CA
// bundle, the server holds its certificate in memory; a sync after the certificates' renewal
// point issues new ones and deletes the old; a new leader's sync serves the same ones.
func TestXDSSecrets(t *testing.T) {
	env := kubetest.Start(t)
	c := env.Client
	ctx := context.Background()
	for _, ns := range []string{"extension-tendril", "ingress"} {
		if err := c.Create(ctx, &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: ns}}); err != nil {
			t.Fatal(err)
		}
	}
	clk := testclock.NewFakeClock(time.Now())
	newCerts := func() *xdsCerts {
		return &xdsCerts{
			cfg:    XDSSecrets{}.withDefaults("extension-tendril", "ingress"),
			client: c, clock: clk, log: testr.New(t),
		}
	}
	x := newCerts()
	if err := x.sync(ctx); err != nil {
		t.Fatal(err)
	}
	managed := func() map[string]corev1.Secret {
		var l corev1.SecretList
		if err := c.List(ctx, &l, client.InNamespace("extension-tendril"), client.MatchingLabels{"managed-by": "secrets-manager", "manager-identity": XDSSecretsIdentity}); err != nil {
			t.Fatal(err)
		}
		m := map[string]corev1.Secret{}
		for _, s := range l.Items {
			m[s.Labels["name"]] = s
		}
		if len(m) != len(l.Items) {
			t.Errorf("more than one Secret of a name: %d Secrets, %d names", len(l.Items), len(m))
		}
		return m
	}
	first := managed()
	for _, name := range []string{XDSSecretCA, XDSSecretCA + "-bundle", XDSSecretServer, XDSSecretClient} {
		if _, ok := first[name]; !ok {
			t.Errorf("no secrets-manager Secret %s; have %v", name, first)
		}
	}

	pub := func() (*x509.Certificate, *tlsreload.Material) {
		s := &corev1.Secret{}
		if err := c.Get(ctx, client.ObjectKey{Namespace: "ingress", Name: "tendril-xds-client"}, s); err != nil {
			t.Fatal(err)
		}
		if s.Type != corev1.SecretTypeTLS {
			t.Errorf("client Secret type %s", s.Type)
		}
		m, err := tlsreload.Parse(s.Data[DataKeyCert], s.Data[DataKeyKey], s.Data[DataKeyCA])
		if err != nil {
			t.Fatal(err)
		}
		return m.Cert.Leaf, m
	}
	cli, cliMat := pub()
	srvMat, err := x.store.Material()
	if err != nil {
		t.Fatal(err)
	}
	srv := srvMat.Cert.Leaf
	if cli.Subject.CommonName != "tendril-ingress" {
		t.Errorf("client certificate CN %q, want tendril-ingress", cli.Subject.CommonName)
	}
	if _, err := cli.Verify(x509.VerifyOptions{Roots: srvMat.Roots, KeyUsages: []x509.ExtKeyUsage{x509.ExtKeyUsageClientAuth}}); err != nil {
		t.Errorf("the server does not trust the client certificate: %v", err)
	}
	if _, err := srv.Verify(x509.VerifyOptions{Roots: cliMat.Roots, DNSName: "tendril-xds.extension-tendril.svc", KeyUsages: []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth}}); err != nil {
		t.Errorf("the client does not trust the server certificate for the Service's name: %v", err)
	}
	if got := leaf(t, first[XDSSecretServer].Data[DataKeyCert]); !got.Equal(srv) {
		t.Error("the server serves another certificate than its secrets-manager Secret's")
	}

	// Another replica becomes leader: it serves the same certificates.
	y := newCerts()
	if err := y.sync(ctx); err != nil {
		t.Fatal(err)
	}
	if m, _ := y.store.Material(); !m.Cert.Leaf.Equal(srv) {
		t.Error("a new leader serves a new server certificate")
	}
	if again, _ := pub(); !again.Equal(cli) {
		t.Error("a new leader published a new client certificate")
	}

	// Past the leaves' renewal point (20 of 30 days): new leaves, the old ones deleted, the CA kept.
	clk.Step(21 * 24 * time.Hour)
	if err := x.sync(ctx); err != nil {
		t.Fatal(err)
	}
	renewed, _ := pub()
	m, _ := x.store.Material()
	if renewed.Equal(cli) || m.Cert.Leaf.Equal(srv) {
		t.Fatal("the certificates were not renewed past their renewal point")
	}
	if _, err := renewed.Verify(x509.VerifyOptions{Roots: m.Roots, KeyUsages: []x509.ExtKeyUsage{x509.ExtKeyUsageClientAuth}}); err != nil {
		t.Errorf("the server does not trust the renewed client certificate: %v", err)
	}
	second := managed()
	for _, name := range []string{XDSSecretServer, XDSSecretClient} {
		if second[name].Name == first[name].Name {
			t.Errorf("%s: still Secret %s", name, first[name].Name)
		}
	}
	if second[XDSSecretCA].Name != first[XDSSecretCA].Name {
		t.Errorf("the CA was renewed with its leaves: %s → %s", first[XDSSecretCA].Name, second[XDSSecretCA].Name)
	}
	names := slices.Sorted(maps.Keys(second))
	if len(names) != 4 || !strings.HasPrefix(names[0], XDSSecretCA) {
		t.Errorf("secrets-manager Secrets after renewal: %v, want the CA, its bundle and the two leaves", names)
	}
}

func leaf(t *testing.T, certPEM []byte) *x509.Certificate {
	t.Helper()
	b, _ := pem.Decode(certPEM)
	if b == nil {
		t.Fatal("no PEM certificate")
	}
	c, err := x509.ParseCertificate(b.Bytes)
	if err != nil {
		t.Fatal(err)
	}
	return c
}
