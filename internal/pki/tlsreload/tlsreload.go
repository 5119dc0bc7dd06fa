// Package tlsreload provides mutual-TLS configurations whose certificate and trusted CAs can
// change under a running server or client: every handshake takes the current material, read
// from files that are re-read when they change (Files) or set by their owner (Store). It
// verifies peers itself against the current CAs, so a rotated CA bundle takes effect on the next
// handshake without a restart, and it reports why it refused a peer (Refusal).
package tlsreload

import (
	"crypto/tls"
	"crypto/x509"
	"errors"
	"fmt"
	"os"
	"sync"
	"sync/atomic"
	"time"

	"github.com/go-logr/logr"
)

// Material is what one side of a mutual-TLS connection needs: its own certificate and the CAs
// its peers' certificates must chain to.
type Material struct {
	Cert  tls.Certificate
	Roots *x509.CertPool
}

// Parse makes Material of PEM encodings: a certificate chain, its key and a CA bundle.
func Parse(certPEM, keyPEM, caPEM []byte) (*Material, error) {
	cert, err := tls.X509KeyPair(certPEM, keyPEM)
	if err != nil {
		return nil, fmt.Errorf("certificate and key: %w", err)
	}
	roots := x509.NewCertPool()
	if !roots.AppendCertsFromPEM(caPEM) {
		return nil, errors.New("CA bundle: no PEM certificate in it")
	}
	return &Material{Cert: cert, Roots: roots}, nil
}

// Source gives the current material. It is called on every handshake.
type Source interface {
	Material() (*Material, error)
}

// Store is a Source its owner sets (e.g. from Secrets it generates). The zero value holds
// nothing: handshakes fail until the first Set.
type Store struct{ p atomic.Pointer[Material] }

// Set makes m the material of the next handshakes.
func (s *Store) Set(m *Material) { s.p.Store(m) }

// Material returns the material last set.
func (s *Store) Material() (*Material, error) {
	if m := s.p.Load(); m != nil {
		return m, nil
	}
	return nil, errors.New("no certificate yet")
}

// Files is a Source read from PEM files: Cert (a chain), Key and CA (a bundle). Each call
// stats the three files (a handshake costs three stat calls; xDS connections are few and
// long-lived) and reads them again when one's size, modification time or inode changed; a
// Kubernetes Secret volume swaps all three at once through a symlink. A read that fails, or
// yields a certificate that does not match its key (a file half rewritten), keeps the last good
// material and is logged once; the files are read again when they change (or when one could not
// be stat'ed: it may appear). Material returns the same *Material until the files change, so
// that a caller can tell a new version by the pointer.
type Files struct {
	Cert, Key, CA string
	// Log receives reloads and failed reads. The zero value discards them.
	Log logr.Logger
	// Loaded, if set, is called after every read of the files with its error (nil: a new
	// version is in use), for a caller that counts them.
	Loaded func(err error)

	mu     sync.Mutex
	stamp  [3]stamp
	cur    *Material
	failed [3]stamp // of the version whose read failed last; not read again until they change
	err    error    // that read's error
}

// stamp identifies a version of a file.
type stamp struct {
	size  int64
	mtime time.Time
	ino   uint64
}

func statFile(path string) (stamp, error) {
	fi, err := os.Stat(path)
	if err != nil {
		return stamp{}, err
	}
	return stamp{size: fi.Size(), mtime: fi.ModTime(), ino: inode(fi)}, nil
}

// Material returns the files' current material, reading them again if they changed.
func (f *Files) Material() (*Material, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	var now [3]stamp
	var statErr error
	for i, p := range []string{f.Cert, f.Key, f.CA} {
		var err error
		if now[i], err = statFile(p); err != nil {
			statErr = err
		}
	}
	if statErr == nil && f.cur != nil && now == f.stamp {
		return f.cur, nil
	}
	if statErr == nil && f.err != nil && now == f.failed {
		return f.keep(fmt.Errorf("TLS files unchanged since they failed to load: %w", f.err))
	}
	m, err := f.read(statErr)
	if f.Loaded != nil {
		f.Loaded(err)
	}
	if err != nil {
		f.failed, f.err = now, err
		f.Log.Error(err, "Reading TLS files failed", "cert", f.Cert, "key", f.Key, "ca", f.CA, "keepingPrevious", f.cur != nil)
		return f.keep(err)
	}
	if f.cur != nil {
		f.Log.Info("TLS files changed: new handshakes use them", "cert", f.Cert, "notAfter", m.Cert.Leaf.NotAfter)
	}
	f.cur, f.stamp, f.err = m, now, nil
	return m, nil
}

// keep returns the material read before, or err when there is none. f.mu is held.
func (f *Files) keep(err error) (*Material, error) {
	if f.cur == nil {
		return nil, err
	}
	return f.cur, nil
}

func (f *Files) read(statErr error) (*Material, error) {
	if statErr != nil {
		return nil, fmt.Errorf("TLS files: %w", statErr)
	}
	var b [3][]byte
	for i, p := range []string{f.Cert, f.Key, f.CA} {
		var err error
		if b[i], err = os.ReadFile(p); err != nil {
			return nil, fmt.Errorf("TLS files: %w", err)
		}
	}
	m, err := Parse(b[0], b[1], b[2])
	if err != nil {
		return nil, fmt.Errorf("TLS files %s, %s, %s: %w", f.Cert, f.Key, f.CA, err)
	}
	return m, nil
}

// Refusal is the error a handshake fails with when the peer's certificate is refused; Reason is
// the label it is counted under.
type Refusal struct {
	Reason string
	Err    error
}

// Reasons of a Refusal.
const (
	// ReasonNoCertificate: the peer sent no certificate.
	ReasonNoCertificate = "no_certificate"
	// ReasonUntrusted: the peer's certificate does not chain to the current CAs, has expired, or
	// is not for the use or name asked.
	ReasonUntrusted = "untrusted_certificate"
)

func (r *Refusal) Error() string {
	if r.Err == nil {
		return "peer certificate refused: " + r.Reason
	}
	return fmt.Sprintf("peer certificate refused (%s): %v", r.Reason, r.Err)
}

func (r *Refusal) Unwrap() error { return r.Err }

// RefusalReason is the label the refusal is counted under.
func (r *Refusal) RefusalReason() string { return r.Reason }

// ServerConfig is a server's configuration that asks every client for a certificate chaining to
// src's current CAs for client use, and presents src's current certificate. A refused client
// fails the handshake with a *Refusal.
func ServerConfig(src Source) *tls.Config {
	return &tls.Config{
		// Envoy's upstream TLS goes up to 1.2 unless told otherwise.
		MinVersion: tls.VersionTLS12,
		// Verified in VerifyConnection against the CAs of the moment: tls.Config.ClientCAs would
		// pin the pool this config was made with.
		ClientAuth: tls.RequestClientCert,
		GetCertificate: func(*tls.ClientHelloInfo) (*tls.Certificate, error) {
			m, err := src.Material()
			if err != nil {
				return nil, fmt.Errorf("server certificate: %w", err)
			}
			return &m.Cert, nil
		},
		VerifyConnection: func(cs tls.ConnectionState) error {
			return verify(src, cs, x509.ExtKeyUsageClientAuth, "")
		},
	}
}

// ClientConfig is a client's configuration that presents src's current certificate and accepts
// a server whose certificate chains to src's current CAs and names serverName (a DNS name or an
// IP address). Empty: the server name sent in the handshake (gRPC sets it from the target's
// host); a connection without one (made to an IP address) is refused rather than accepted
// without a name check.
func ClientConfig(src Source, serverName string) *tls.Config {
	return &tls.Config{
		MinVersion: tls.VersionTLS12,
		ServerName: serverName,
		// Not skipped: VerifyConnection verifies the chain and the name against the CAs of the
		// moment (RootCAs would pin the pool this config was made with).
		InsecureSkipVerify: true,
		GetClientCertificate: func(*tls.CertificateRequestInfo) (*tls.Certificate, error) {
			m, err := src.Material()
			if err != nil {
				return nil, fmt.Errorf("client certificate: %w", err)
			}
			return &m.Cert, nil
		},
		VerifyConnection: func(cs tls.ConnectionState) error {
			name := serverName
			if name == "" {
				name = cs.ServerName
			}
			if name == "" {
				return errors.New("no server name to verify the server's certificate against (connected to an IP address: give the name)")
			}
			return verify(src, cs, x509.ExtKeyUsageServerAuth, name)
		},
	}
}

func verify(src Source, cs tls.ConnectionState, usage x509.ExtKeyUsage, name string) error {
	if len(cs.PeerCertificates) == 0 {
		return &Refusal{Reason: ReasonNoCertificate}
	}
	m, err := src.Material()
	if err != nil {
		return fmt.Errorf("verify peer: %w", err)
	}
	inter := x509.NewCertPool()
	for _, c := range cs.PeerCertificates[1:] {
		inter.AddCert(c)
	}
	_, err = cs.PeerCertificates[0].Verify(x509.VerifyOptions{
		Roots: m.Roots, Intermediates: inter, DNSName: name, KeyUsages: []x509.ExtKeyUsage{usage},
	})
	if err != nil {
		return &Refusal{Reason: ReasonUntrusted, Err: err}
	}
	return nil
}
