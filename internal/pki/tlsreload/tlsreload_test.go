package tlsreload_test

import (
	"crypto/tls"
	"errors"
	"net"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/tendril-net/tendril/internal/pki/testpki"
	"github.com/tendril-net/tendril/internal/pki/tlsreload"
)

// writeFiles writes a CA and a leaf for names signed by it into dir as <prefix>.crt, .key and ca.crt.
func writeFiles(t *testing.T, dir string, ca *testpki.CA, names ...string) *tlsreload.Files {
	t.Helper()
	leaf, err := ca.Leaf(names...)
	if err != nil {
		t.Fatal(err)
	}
	f := &tlsreload.Files{Cert: filepath.Join(dir, "tls.crt"), Key: filepath.Join(dir, "tls.key"), CA: filepath.Join(dir, "ca.crt")}
	if err := testpki.WriteFiles(leaf, ca, f.Cert, f.Key, f.CA); err != nil {
		t.Fatal(err)
	}
	return f
}

func newCA(t *testing.T, name string) *testpki.CA {
	t.Helper()
	ca, err := testpki.NewCA(name)
	if err != nil {
		t.Fatal(err)
	}
	return ca
}

// handshake makes one TLS connection over loopback TCP and returns both sides' errors and the
// certificates each side saw.
func handshake(t *testing.T, server, client *tls.Config) (srvErr, cliErr error, srvSaw, cliSaw string) {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	type result struct {
		err error
		cn  string
	}
	done := make(chan result, 1)
	go func() {
		c, err := l.Accept()
		if err != nil {
			done <- result{err: err}
			return
		}
		defer c.Close()
		_ = c.SetDeadline(time.Now().Add(10 * time.Second))
		tc := tls.Server(c, server)
		if err := tc.Handshake(); err != nil {
			done <- result{err: err}
			return
		}
		// Wait for the client's byte: with TLS 1.3 the client finishes before the server has
		// checked its certificate.
		_, err = tc.Read(make([]byte, 1))
		if err == nil {
			_, err = tc.Write([]byte{1})
		}
		done <- result{err: err, cn: tc.ConnectionState().PeerCertificates[0].Subject.CommonName}
	}()
	c, err := net.Dial("tcp", l.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	_ = c.SetDeadline(time.Now().Add(10 * time.Second))
	tc := tls.Client(c, client)
	cliErr = tc.Handshake()
	if cliErr == nil {
		if _, cliErr = tc.Write([]byte{1}); cliErr == nil {
			_, cliErr = tc.Read(make([]byte, 1))
		}
		cliSaw = tc.ConnectionState().PeerCertificates[0].Subject.CommonName
	}
	r := <-done
	return r.err, cliErr, r.cn, cliSaw
}

func refusal(err error) string {
	var r *tlsreload.Refusal
	if errors.As(err, &r) {
		return r.Reason
	}
	return ""
}

func TestMutualTLS(t *testing.T) {
	ca := newCA(t, "ca")
	srvFiles := writeFiles(t, t.TempDir(), ca, "xds.example", "127.0.0.1")
	cliFiles := writeFiles(t, t.TempDir(), ca, "ingress")
	server := tlsreload.ServerConfig(srvFiles)

	t.Run("trusted", func(t *testing.T) {
		srvErr, cliErr, srvSaw, cliSaw := handshake(t, server, tlsreload.ClientConfig(cliFiles, "xds.example"))
		if srvErr != nil || cliErr != nil {
			t.Fatalf("server: %v, client: %v", srvErr, cliErr)
		}
		if srvSaw != "ingress" || cliSaw != "xds.example" {
			t.Fatalf("server saw %q, client saw %q", srvSaw, cliSaw)
		}
	})
	t.Run("no client certificate", func(t *testing.T) {
		plain := &tls.Config{RootCAs: ca.Pool, ServerName: "xds.example"}
		srvErr, cliErr, _, _ := handshake(t, server, plain)
		if refusal(srvErr) != tlsreload.ReasonNoCertificate || cliErr == nil {
			t.Fatalf("server: %v, client: %v; want refused for no certificate", srvErr, cliErr)
		}
	})
	t.Run("client certificate of another CA", func(t *testing.T) {
		other := writeFiles(t, t.TempDir(), newCA(t, "other"), "ingress")
		other.CA = cliFiles.CA // it trusts the server, but the server does not trust it
		srvErr, cliErr, _, _ := handshake(t, server, tlsreload.ClientConfig(other, "xds.example"))
		if refusal(srvErr) != tlsreload.ReasonUntrusted || cliErr == nil {
			t.Fatalf("server: %v, client: %v; want refused as untrusted", srvErr, cliErr)
		}
	})
	t.Run("server of another CA", func(t *testing.T) {
		other := writeFiles(t, t.TempDir(), newCA(t, "other"), "xds.example")
		other.CA = srvFiles.CA
		_, cliErr, _, _ := handshake(t, tlsreload.ServerConfig(other), tlsreload.ClientConfig(cliFiles, "xds.example"))
		if refusal(cliErr) != tlsreload.ReasonUntrusted {
			t.Fatalf("client: %v; want the server refused as untrusted", cliErr)
		}
	})
	t.Run("IP address without a name", func(t *testing.T) {
		// crypto/tls sends no server name for an IP address: with no name given the server
		// must be refused, not accepted unchecked.
		_, cliErr, _, _ := handshake(t, server, tlsreload.ClientConfig(cliFiles, ""))
		if cliErr == nil {
			t.Fatal("accepted the server without checking a name")
		}
	})
	t.Run("IP address", func(t *testing.T) {
		if _, cliErr, _, _ := handshake(t, server, tlsreload.ClientConfig(cliFiles, "127.0.0.1")); cliErr != nil {
			t.Fatalf("client: %v", cliErr)
		}
	})
	t.Run("server name", func(t *testing.T) {
		_, cliErr, _, _ := handshake(t, server, tlsreload.ClientConfig(cliFiles, "other.example"))
		if refusal(cliErr) != tlsreload.ReasonUntrusted {
			t.Fatalf("client: %v; want the server refused for its name", cliErr)
		}
	})
}

// TestRotation rewrites both sides' files with certificates of a new CA, as a Secret volume
// does: the next handshakes use and trust the new ones, without a new config.
func TestRotation(t *testing.T) {
	srvDir, cliDir := t.TempDir(), t.TempDir()
	ca := newCA(t, "ca-1")
	srvFiles := writeFiles(t, srvDir, ca, "xds-1")
	cliFiles := writeFiles(t, cliDir, ca, "ingress-1")
	server, client := tlsreload.ServerConfig(srvFiles), tlsreload.ClientConfig(cliFiles, "xds-1")
	if srvErr, cliErr, srvSaw, _ := handshake(t, server, client); srvErr != nil || cliErr != nil || srvSaw != "ingress-1" {
		t.Fatalf("before rotation: server %v, client %v, saw %q", srvErr, cliErr, srvSaw)
	}

	// A half-written file (certificate of the new pair, key of the old) keeps the old material.
	ca2 := newCA(t, "ca-2")
	next, err := ca2.Leaf("ingress-2")
	if err != nil {
		t.Fatal(err)
	}
	tmp := t.TempDir()
	if err := testpki.WritePair(next, filepath.Join(tmp, "c"), filepath.Join(tmp, "k")); err != nil {
		t.Fatal(err)
	}
	b, _ := os.ReadFile(filepath.Join(tmp, "c"))
	if err := os.WriteFile(cliFiles.Cert, b, 0o644); err != nil {
		t.Fatal(err)
	}
	if srvErr, cliErr, srvSaw, _ := handshake(t, server, client); srvErr != nil || cliErr != nil || srvSaw != "ingress-1" {
		t.Fatalf("half-written: server %v, client %v, saw %q; want the old certificate", srvErr, cliErr, srvSaw)
	}

	// Both sides rotated to the new CA.
	writeFiles(t, srvDir, ca2, "xds-1")
	writeFiles(t, cliDir, ca2, "ingress-2")
	srvErr, cliErr, srvSaw, _ := handshake(t, server, client)
	if srvErr != nil || cliErr != nil || srvSaw != "ingress-2" {
		t.Fatalf("after rotation: server %v, client %v, saw %q; want ingress-2", srvErr, cliErr, srvSaw)
	}
	// A client still holding the old CA's certificate is refused now.
	old := writeFiles(t, t.TempDir(), ca, "ingress-1")
	old.CA = srvFiles.CA
	if srvErr, _, _, _ := handshake(t, server, tlsreload.ClientConfig(old, "xds-1")); refusal(srvErr) != tlsreload.ReasonUntrusted {
		t.Fatalf("old CA's client after rotation: %v, want refused", srvErr)
	}
}

func TestStore(t *testing.T) {
	var s tlsreload.Store
	if _, err := s.Material(); err == nil {
		t.Fatal("empty store gave material")
	}
	ca := newCA(t, "ca")
	f := writeFiles(t, t.TempDir(), ca, "xds")
	m, err := f.Material()
	if err != nil {
		t.Fatal(err)
	}
	s.Set(m)
	cli := writeFiles(t, t.TempDir(), ca, "ingress")
	if srvErr, cliErr, _, _ := handshake(t, tlsreload.ServerConfig(&s), tlsreload.ClientConfig(cli, "xds")); srvErr != nil || cliErr != nil {
		t.Fatalf("server %v, client %v", srvErr, cliErr)
	}
}

func TestFilesMissing(t *testing.T) {
	f := &tlsreload.Files{Cert: "/nonexistent/tls.crt", Key: "/nonexistent/tls.key", CA: "/nonexistent/ca.crt"}
	if _, err := f.Material(); err == nil || !errors.Is(err, os.ErrNotExist) {
		t.Fatalf("missing files: %v, want not exist", err)
	}
}

// TestFilesFailedVersionReadOnce: a version of the files that fails to load is read (and
// reported to Loaded) once, not at every call, and the material read before stays in use; the
// next version is read as soon as it appears.
func TestFilesFailedVersionReadOnce(t *testing.T) {
	dir := t.TempDir()
	ca := newCA(t, "ca")
	f := writeFiles(t, dir, ca, "xds")
	var loads []error
	f.Loaded = func(err error) { loads = append(loads, err) }
	good, err := f.Material()
	if err != nil {
		t.Fatal(err)
	}
	// A half-written rotation: the CA bundle holds no certificate (new size, new mtime).
	if err := os.WriteFile(f.CA, []byte("not a certificate\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	for range 3 {
		if m, err := f.Material(); err != nil || m != good {
			t.Fatalf("with a broken CA file: %p, %v; want the material read before", m, err)
		}
	}
	if len(loads) != 2 || loads[0] != nil || loads[1] == nil {
		t.Fatalf("loads %v, want one good and one failed read", loads)
	}
	writeFiles(t, dir, ca, "xds")
	m, err := f.Material()
	if err != nil || m == good {
		t.Fatalf("after the rotation completed: %p, %v; want new material", m, err)
	}
	if len(loads) != 3 || loads[2] != nil {
		t.Fatalf("loads %v, want the new version read once", loads)
	}
}
