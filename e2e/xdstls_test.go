package e2e

import (
	"context"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/tendril-net/tendril/internal/pki/testpki"
)

// xdsNode is the common name of the ingress's xDS client certificate in these tests: node IDs
// are xdsNode or start with "e2e-" (server.NodeOfCertificate).
const xdsNode = "e2e"

// xdsTLS writes an xDS CA, tendril-seed's server certificate for 127.0.0.1 and an ingress client
// certificate named xdsNode, and returns tendril-seed's and tendril-ingress's flags for them:
// xDS between the binaries runs over mutual TLS, as on a seed.
func xdsTLS(t *testing.T) (seed, ingress []string) {
	t.Helper()
	ca, err := testpki.NewCA("e2e-xds-ca")
	if err != nil {
		t.Fatal(err)
	}
	dir := t.TempDir()
	caFile := filepath.Join(dir, "ca.crt")
	if err := ca.WriteCA(caFile); err != nil {
		t.Fatal(err)
	}
	pair := func(name, cn string) (string, string) {
		c, err := ca.Leaf(cn)
		if err != nil {
			t.Fatal(err)
		}
		cert, key := filepath.Join(dir, name+".crt"), filepath.Join(dir, name+".key")
		if err := testpki.WritePair(c, cert, key); err != nil {
			t.Fatal(err)
		}
		return cert, key
	}
	sc, sk := pair("server", "127.0.0.1")
	cc, ck := pair("client", xdsNode)
	return []string{"--xds-cert-file", sc, "--xds-key-file", sk, "--xds-ca-file", caFile},
		[]string{"--xds-cert-file", cc, "--xds-key-file", ck, "--xds-ca-file", caFile}
}

// TestXDSPlaintextOnlyByFlag: tendril-seed and tendril-ingress refuse to start without xDS
// certificates unless told --xds-insecure, and then they work in plaintext.
func TestXDSPlaintextOnlyByFlag(t *testing.T) {
	routeFile := filepath.Join(t.TempDir(), "routes.yaml")
	if err := os.WriteFile(routeFile, []byte("shoots: []\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	xdsAddr, sniAddr, metrics := loopbackAddr(t), loopbackAddr(t), loopbackAddr(t)
	for name, args := range map[string][]string{
		"tendril-seed":    {"--routes", routeFile, "--xds-address", xdsAddr, "--metrics-address", ""},
		"tendril-ingress": {"--xds", xdsAddr, "--sni-address", sniAddr, "--metrics-address", ""},
	} {
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		out, err := exec.CommandContext(ctx, filepath.Join(binDir, name), args...).CombinedOutput()
		cancel()
		if err == nil || !strings.Contains(string(out), "--xds-insecure for local use") {
			t.Errorf("%s without xDS certificates: %v, output:\n%s\nwant a refusal naming --xds-insecure", name, err, out)
		}
	}
	start(t, "tendril-seed", []string{xdsAddr}, "--routes", routeFile, "--xds-address", xdsAddr, "--metrics-address", "", "--xds-insecure")
	start(t, "tendril-ingress", []string{sniAddr, metrics}, "--xds", xdsAddr, "--node-id", "any", "--sni-address", sniAddr, "--metrics-address", metrics, "--xds-insecure")
	eventually(t, "tendril-ingress configured in plaintext", func() error { _, err := get("http://" + metrics + "/readyz"); return err })
}
