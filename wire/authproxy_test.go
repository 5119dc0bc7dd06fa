package wire_test

import (
	"bytes"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/sha256"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/hex"
	"encoding/json"
	"encoding/pem"
	"fmt"
	"math/big"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/tendril-net/tendril/wire"
)

// harness runs AuthProxyLua's envoy_on_request under LuaJIT (the Lua Envoy embeds) against a
// stand-in for Envoy's request handle: its headers are a table (name → list of values) whose
// methods live in the metatable, and its connection reports what the case says. It prints the
// outcome as JSON: the headers after the filter, or the response it sent.
const harness = `
local case = assert(loadstring("return " .. io.read("*a")))()
local methods = {}
function methods:remove(name) rawset(self, name, nil) end
function methods:replace(name, value) rawset(self, name, {value}) end
function methods:add(name, value)
  local list = rawget(self, name) or {}
  list[#list + 1] = value
  rawset(self, name, list)
end
local headers = setmetatable({}, {__index = methods})
for name, values in pairs(case.headers) do rawset(headers, name, values) end
local ssl = nil
if case.presented ~= nil then
  ssl = {
    peerCertificatePresented = function() return case.presented end,
    peerCertificateValidated = function() return case.validated end,
    subjectPeerCertificate = function() return case.subject end,
    sha256PeerCertificateDigest = function() return case.digest end,
  }
end
local responded = nil
local handle = {
  headers = function() return headers end,
  streamInfo = function() return {downstreamSslConnection = function() return ssl end} end,
  respond = function(_, h, body) responded = h[":status"] end,
}
dofile(arg[1])
envoy_on_request(handle)
local function quote(s) return '"' .. s:gsub('[%c"\\]', function(c) return string.format("\\u%04x", c:byte()) end) .. '"' end
local parts = {}
for name, values in pairs(headers) do
  local vs = {}
  for _, v in ipairs(values) do vs[#vs + 1] = quote(v) end
  parts[#parts + 1] = quote(name) .. ":[" .. table.concat(vs, ",") .. "]"
end
io.write('{"status":' .. quote(responded or "") .. ',"headers":{' .. table.concat(parts, ",") .. "}}")
`

// outcome is what the harness prints.
type outcome struct {
	Status  string              `json:"status"`
	Headers map[string][]string `json:"headers"`
}

func runFilter(t *testing.T, dir, luaCase string) outcome {
	t.Helper()
	cmd := exec.Command("luajit", filepath.Join(dir, "harness.lua"), filepath.Join(dir, "authproxy.lua"))
	cmd.Stdin = strings.NewReader(luaCase)
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	out, err := cmd.Output()
	if err != nil {
		t.Fatalf("luajit: %v: %s", err, stderr.Bytes())
	}
	var o outcome
	if err := json.Unmarshal(out, &o); err != nil {
		t.Fatalf("harness output %q: %v", out, err)
	}
	return o
}

// rfc2253 is the subject of a certificate as Envoy renders it, OpenSSL's RFC 2253 form, taken
// from openssl itself for a certificate with that subject; Go reads the certificate back as
// kube-apiserver's x509 authenticator does.
func rfc2253(t *testing.T, dir string, subject pkix.Name) (string, *x509.Certificate) {
	t.Helper()
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	tmpl := &x509.Certificate{SerialNumber: big.NewInt(1), Subject: subject, NotBefore: time.Now(), NotAfter: time.Now().Add(time.Hour)}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, &key.PublicKey, key)
	if err != nil {
		t.Fatal(err)
	}
	cert, err := x509.ParseCertificate(der)
	if err != nil {
		t.Fatal(err)
	}
	path := filepath.Join(dir, "cert.pem")
	if err := os.WriteFile(path, pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der}), 0o644); err != nil {
		t.Fatal(err)
	}
	out, err := exec.Command("openssl", "x509", "-in", path, "-noout", "-subject", "-nameopt", "RFC2253").Output()
	if err != nil {
		t.Fatalf("openssl: %v", err)
	}
	s, ok := strings.CutPrefix(strings.TrimSpace(string(out)), "subject=")
	if !ok {
		t.Fatalf("openssl printed %q", out)
	}
	return s, cert
}

// luaString quotes s for Lua.
func luaString(s string) string {
	var b strings.Builder
	b.WriteByte('"')
	for i := 0; i < len(s); i++ {
		fmt.Fprintf(&b, "\\%d", s[i])
	}
	b.WriteByte('"')
	return b.String()
}

// TestAuthProxyLua runs the filter Envoy is given: forged X-Remote-* headers never pass; a
// verified certificate's user and groups are set as Go's x509 reads them from the certificate,
// for subjects with several organizations and with characters RFC 2253 escapes; an unverified
// certificate or one without a user gets 401.
func TestAuthProxyLua(t *testing.T) {
	for _, bin := range []string{"luajit", "openssl"} {
		if _, err := exec.LookPath(bin); err != nil {
			t.Fatalf("%s is not on PATH; install it (Debian package %s, see .ci/run)", bin, bin)
		}
	}
	dir := t.TempDir()
	if err := os.WriteFile(filepath.Join(dir, "harness.lua"), []byte(harness), 0o644); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(dir, "authproxy.lua"), []byte(wire.AuthProxyLua), 0o644); err != nil {
		t.Fatal(err)
	}
	forged := `["X-Remote-User"]={"admin"},["x-remote-group"]={"system:masters"},["X-REMOTE-EXTRA-scopes"]={"all"},["accept"]={"application/json"}`
	t.Run("no certificate", func(t *testing.T) {
		o := runFilter(t, dir, "{headers={"+forged+"}}")
		if o.Status != "" || len(o.Headers) != 1 || o.Headers["accept"] == nil {
			t.Errorf("got %+v, want only accept left and no response", o)
		}
	})
	for _, subject := range []pkix.Name{
		{CommonName: "alice", Organization: []string{"team-a", "team-b", "system:authenticated"}},
		{CommonName: `a,b+c"d\e`, Organization: []string{"x;y", " lead", "=eq", "#hash"}},
		{CommonName: "system:node:worker-1", Organization: []string{"system:nodes"}, Country: []string{"DE"}, OrganizationalUnit: []string{"ou"}},
	} {
		s, cert := rfc2253(t, dir, subject)
		parsed := cert.Subject
		t.Run(s, func(t *testing.T) {
			// Envoy's digest is the hex SHA-256 of the certificate's DER, as kube-apiserver's.
			digest := sha256.Sum256(cert.Raw)
			o := runFilter(t, dir, fmt.Sprintf("{headers={%s},presented=true,validated=true,subject=%s,digest=%q}", forged, luaString(s), hex.EncodeToString(digest[:])))
			want := map[string][]string{"accept": {"application/json"}, "x-remote-user": {parsed.CommonName},
				wire.CredentialIDHeader: {wire.CredentialIDPrefix + hex.EncodeToString(digest[:])}}
			if len(parsed.Organization) > 0 {
				want["x-remote-group"] = parsed.Organization
			}
			if o.Status != "" || len(o.Headers) != len(want) {
				t.Fatalf("got %+v, want headers %v", o, want)
			}
			for k, v := range want {
				if !slices.Equal(o.Headers[k], v) {
					t.Errorf("%s: %q, want %q (as Go's x509 reads the certificate)", k, o.Headers[k], v)
				}
			}
		})
	}
	for name, c := range map[string]string{
		"unverified": "presented=true,validated=false,subject=\"CN=alice\"",
		"no user":    "presented=true,validated=true,subject=\"O=team-a\"",
		"empty user": "presented=true,validated=true,subject=\"CN=,O=team-a\"",
	} {
		t.Run(name, func(t *testing.T) {
			if o := runFilter(t, dir, "{headers={"+forged+"},"+c+"}"); o.Status != "401" {
				t.Errorf("got %+v, want 401", o)
			}
		})
	}
}
