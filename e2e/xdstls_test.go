package e2e

import (
	"path/filepath"
	"testing"

	"github.com/tendril-net/tendril/internal/testpki"
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
