package wg

import (
	"crypto/ecdh"
	"crypto/rand"
	"encoding/base64"
	"errors"
	"fmt"
	"io"
	"os"
	"strings"
)

// KeySize is the size of a Curve25519 key.
const KeySize = 32

// maxKeyFile bounds what LoadPrivateKey reads: a key file is 44 base64 characters and a
// newline; 1 KiB leaves room for whitespace and refuses to slurp a wrong path's large file.
const maxKeyFile = 1 << 10

// Key is a WireGuard (Curve25519) private or public key. Its text form is standard base64, the
// format of `wg genkey` and `wg pubkey`. String prints the key itself, so keep private keys out
// of log lines.
type Key [KeySize]byte

// GenerateKey returns a new private key, clamped as `wg genkey` does.
func GenerateKey() (Key, error) {
	var k Key
	if _, err := rand.Read(k[:]); err != nil {
		return Key{}, fmt.Errorf("wg: generate key: %w", err)
	}
	// RFC 7748 clamping; Curve25519 applies it anyway, `wg genkey` stores it.
	k[0] &= 248
	k[31] = (k[31] & 127) | 64
	return k, nil
}

// ParseKey parses a key in standard base64 (surrounding whitespace is ignored).
func ParseKey(s string) (Key, error) {
	s = strings.TrimSpace(s)
	raw, err := base64.StdEncoding.DecodeString(s)
	if err != nil {
		return Key{}, fmt.Errorf("wg: parse key: not standard base64: %w", err)
	}
	if len(raw) != KeySize {
		return Key{}, fmt.Errorf("wg: parse key: %d bytes, want %d", len(raw), KeySize)
	}
	return Key(raw), nil
}

// LoadPrivateKey reads a private key file as `wg genkey` writes it (base64, whitespace
// ignored). It refuses a malformed key and the all-zero key. It does not check the file's
// permissions: tendril reads keys from Kubernetes Secret volumes, whose files are 0644 unless
// the pod sets defaultMode, and the container is the boundary there (a pod spec that wants
// more sets defaultMode 0400).
func LoadPrivateKey(path string) (Key, error) {
	f, err := os.Open(path)
	if err != nil {
		return Key{}, fmt.Errorf("wg: load private key: %w", err)
	}
	defer f.Close()
	data, err := io.ReadAll(io.LimitReader(f, maxKeyFile+1))
	if err != nil {
		return Key{}, fmt.Errorf("wg: load private key %s: %w", path, err)
	}
	if len(data) > maxKeyFile {
		return Key{}, fmt.Errorf("wg: load private key %s: file larger than %d bytes", path, maxKeyFile)
	}
	k, err := ParseKey(string(data))
	if err != nil {
		return Key{}, fmt.Errorf("wg: load private key %s: %w", path, err)
	}
	if k.IsZero() {
		return Key{}, fmt.Errorf("wg: load private key %s: %w", path, errZeroKey)
	}
	return k, nil
}

var errZeroKey = errors.New("all-zero key")

// PublicKey returns the public key of private key k (what `wg pubkey` prints).
func (k Key) PublicKey() Key {
	priv, err := ecdh.X25519().NewPrivateKey(k[:])
	if err != nil {
		// NewPrivateKey fails only for a length other than 32, which Key cannot have.
		panic(err)
	}
	return Key(priv.PublicKey().Bytes())
}

// IsZero reports whether k is all zeros (an unset key).
func (k Key) IsZero() bool { return k == Key{} }

// String returns k in standard base64.
func (k Key) String() string { return base64.StdEncoding.EncodeToString(k[:]) }

// MarshalText returns k in standard base64, so that keys read and write as text in
// configuration files.
func (k Key) MarshalText() ([]byte, error) { return []byte(k.String()), nil }

// UnmarshalText parses standard base64.
func (k *Key) UnmarshalText(text []byte) error {
	parsed, err := ParseKey(string(text))
	if err != nil {
		return err
	}
	*k = parsed
	return nil
}

// hex is the form of keys in WireGuard's configuration protocol (UAPI).
func (k Key) hex() string {
	const digits = "0123456789abcdef"
	var b [2 * KeySize]byte
	for i, c := range k {
		b[2*i], b[2*i+1] = digits[c>>4], digits[c&0xf]
	}
	return string(b[:])
}

// ParsePublicKeyArg parses a public key given on a command line: the key itself, or @FILE to read
// it from a file (a mounted Secret), surrounding whitespace ignored.
func ParsePublicKeyArg(v string) (Key, error) {
	if path, ok := strings.CutPrefix(v, "@"); ok {
		b, err := os.ReadFile(path)
		if err != nil {
			return Key{}, fmt.Errorf("wg: public key: %w", err)
		}
		v = string(b)
	}
	if strings.TrimSpace(v) == "" {
		return Key{}, errors.New("wg: public key: empty")
	}
	return ParseKey(strings.TrimSpace(v))
}
