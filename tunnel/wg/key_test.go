package wg

import (
	"encoding/base64"
	"encoding/hex"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"
)

// RFC 7748 §6.1: Alice's private and public key.
const (
	rfcPrivateHex = "77076d0a7318a57d3c16c17251b26645df4c2f87ebc0992ab177fba51db92c2a"
	rfcPublicHex  = "8520f0098930a754748b7ddcb43ef75a0dbf3a0d26381af4eba4a98eaa9b4e6a"
)

func b64(t *testing.T, hexKey string) string {
	raw, err := hex.DecodeString(hexKey)
	if err != nil {
		t.Fatal(err)
	}
	return base64.StdEncoding.EncodeToString(raw)
}

func TestPublicKeyRFC7748(t *testing.T) {
	priv, err := ParseKey(b64(t, rfcPrivateHex))
	if err != nil {
		t.Fatal(err)
	}
	if got, want := priv.PublicKey().String(), b64(t, rfcPublicHex); got != want {
		t.Fatalf("PublicKey = %s, want %s", got, want)
	}
	if priv.hex() != rfcPrivateHex {
		t.Fatalf("hex = %s, want %s", priv.hex(), rfcPrivateHex)
	}
}

func TestGenerateKey(t *testing.T) {
	a, b := newKey(t), newKey(t)
	if a == b || a.IsZero() {
		t.Fatal("GenerateKey repeats or returns zero")
	}
	if a[0]&7 != 0 || a[31]&128 != 0 || a[31]&64 == 0 {
		t.Fatalf("key is not clamped as wg genkey's: %x … %x", a[0], a[31])
	}
	back, err := ParseKey(a.String())
	if err != nil || back != a {
		t.Fatalf("base64 round trip: %v, %v", back, err)
	}
}

func TestParseKeyErrors(t *testing.T) {
	for _, s := range []string{
		"",
		"not base64!",
		base64.StdEncoding.EncodeToString(make([]byte, 31)),
		base64.StdEncoding.EncodeToString(make([]byte, 33)),
		base64.URLEncoding.EncodeToString([]byte(strings.Repeat("\xff", 32))), // URL alphabet
	} {
		if _, err := ParseKey(s); err == nil {
			t.Errorf("ParseKey(%q) succeeded", s)
		}
	}
	var k Key
	if err := k.UnmarshalText([]byte("  " + b64(t, rfcPublicHex) + "\n")); err != nil {
		t.Fatalf("UnmarshalText with whitespace: %v", err)
	}
	if txt, _ := k.MarshalText(); string(txt) != b64(t, rfcPublicHex) {
		t.Fatalf("MarshalText = %s", txt)
	}
}

func TestLoadPrivateKey(t *testing.T) {
	dir := t.TempDir()
	write := func(name, content string) string {
		p := filepath.Join(dir, name)
		if err := os.WriteFile(p, []byte(content), 0o600); err != nil {
			t.Fatal(err)
		}
		return p
	}
	k, err := LoadPrivateKey(write("good", b64(t, rfcPrivateHex)+"\n"))
	if err != nil || k.hex() != rfcPrivateHex {
		t.Fatalf("LoadPrivateKey(good) = %v, %v", k, err)
	}
	for name, content := range map[string]string{
		"zero":      base64.StdEncoding.EncodeToString(make([]byte, 32)),
		"malformed": "definitely not a key",
		"large":     strings.Repeat(" ", 2000) + b64(t, rfcPrivateHex),
		"empty":     "",
	} {
		if _, err := LoadPrivateKey(write(name, content)); err == nil {
			t.Errorf("LoadPrivateKey(%s) succeeded", name)
		} else if !strings.Contains(err.Error(), name) {
			t.Errorf("LoadPrivateKey(%s): error %q does not name the file", name, err)
		}
	}
	if _, err := LoadPrivateKey(filepath.Join(dir, "missing")); err == nil {
		t.Error("LoadPrivateKey of a missing file succeeded")
	}
}

func TestParsePeers(t *testing.T) {
	pub := b64(t, rfcPublicHex)
	k, _ := ParseKey(pub)
	uapi := "private_key=" + rfcPrivateHex + "\n" +
		"public_key=" + rfcPublicHex + "\n" +
		"preshared_key=0000000000000000000000000000000000000000000000000000000000000000\n" +
		"protocol_version=1\nendpoint=stream/3\nlast_handshake_time_sec=1700000000\n" +
		"last_handshake_time_nsec=5\ntx_bytes=10\nrx_bytes=20\npersistent_keepalive_interval=25\n" +
		"allowed_ip=fd8f:6d53:b97a:1::2/128\n" +
		"public_key=" + strings.Repeat("ab", 32) + "\nprotocol_version=1\n" +
		"last_handshake_time_sec=0\nlast_handshake_time_nsec=0\ntx_bytes=0\nrx_bytes=0\n"
	peers := map[Key]PeerStatus{}
	if err := parsePeers([]byte(uapi), peers); err != nil {
		t.Fatal(err)
	}
	p := peers[k]
	if p.Endpoint != "stream/3" || !p.LastHandshake.Equal(time.Unix(1700000000, 5)) || p.TxBytes != 10 || p.RxBytes != 20 {
		t.Fatalf("peer: %+v", p)
	}
	var other Key
	for i := range other {
		other[i] = 0xab
	}
	if q, ok := peers[other]; !ok || !q.LastHandshake.IsZero() || q.Endpoint != "" {
		t.Fatalf("second peer: %+v, %v", q, ok)
	}
	for _, bad := range []string{"endpoint=stream/1\n", "public_key=zz\n", "public_key=" + rfcPublicHex + "\nrx_bytes=-1\n"} {
		if err := parsePeers([]byte(bad), peers); err == nil {
			t.Errorf("parsePeers(%q) succeeded", bad)
		}
	}
}

func TestLimiter(t *testing.T) {
	l := &limiter{burst: 3, every: time.Second}
	now := time.Unix(0, 0)
	for i := range 3 {
		if ok, _ := l.allow(now); !ok {
			t.Fatalf("line %d of the burst refused", i)
		}
	}
	for range 5 {
		if ok, _ := l.allow(now); ok {
			t.Fatal("line beyond the burst allowed")
		}
	}
	ok, suppressed := l.allow(now.Add(time.Second))
	if !ok || suppressed != 5 {
		t.Fatalf("after a second: allowed %v, suppressed %d; want true, 5", ok, suppressed)
	}
}

func TestParsePublicKeyArg(t *testing.T) {
	k, err := GenerateKey()
	if err != nil {
		t.Fatal(err)
	}
	pub := k.PublicKey()
	path := t.TempDir() + "/pub"
	if err := os.WriteFile(path, []byte(pub.String()+"\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	for _, arg := range []string{pub.String(), "@" + path} {
		if got, err := ParsePublicKeyArg(arg); err != nil || got != pub {
			t.Errorf("%q: %v, %v", arg, got, err)
		}
	}
	for _, bad := range []string{"", "@" + path + ".missing", "not-a-key"} {
		if _, err := ParsePublicKeyArg(bad); err == nil {
			t.Errorf("%q accepted", bad)
		}
	}
}
