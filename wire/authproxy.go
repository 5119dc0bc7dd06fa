package wire

// The authenticating-proxy headers kube-apiserver reads from a front proxy it trusts (its
// --requestheader-username-headers, --requestheader-group-headers and
// --requestheader-extra-headers-prefix; Gardener sets these three for its own front proxy).
// The ingress's terminating mode sets the first two from a verified client certificate and drops
// whatever a client sent under RemoteHeaderPrefix.
const (
	RemoteUserHeader        = "X-Remote-User"
	RemoteGroupHeader       = "X-Remote-Group"
	RemoteExtraHeaderPrefix = "X-Remote-Extra-"
	// RemoteHeaderPrefix covers all three.
	RemoteHeaderPrefix = "X-Remote-"
	// CredentialIDHeader is the extra authentication.kubernetes.io/credential-id (its slash
	// percent-encoded: kube-apiserver lower-cases and path-unescapes an extra's key). kube-apiserver's
	// own x509 authenticator sets that extra to CredentialIDPrefix and the certificate's hex
	// SHA-256, and its audit log records it for each request; the terminating mode passes the
	// same, so a certificate client's audit entries are those of a direct connection.
	// (Gardener's istio filter sets no extra.)
	CredentialIDHeader = "x-remote-extra-authentication.kubernetes.io%2fcredential-id"
	CredentialIDPrefix = "X509SHA256="
)

// AuthProxyLua is the authenticating proxy as Envoy runs it (an HTTP Lua filter on a terminating
// route, which has Envoy accept any client certificate and leave its verdict to this code):
// every X-Remote-* header the client sent is dropped; a client certificate that did not verify
// against the shoot's client CA, or names no user, gets kube-apiserver's 401; a verified one's
// common name and organizations become X-Remote-User and X-Remote-Group, and its SHA-256 (Envoy's
// hex digest of the DER) the credential id (CredentialIDHeader). Envoy has no other way
// to split a certificate's organizations into headers. tendril-ingress accepts a Lua filter only
// with exactly this code, and does the same natively (ingress/terminate). Envoy renders the
// subject as RFC 2253 (most significant attribute last, "\," and "\2C" escapes), so the first
// CN in that string is the certificate's last, the one Go's x509 (kube-apiserver's
// authenticator) reads.
const AuthProxyLua = `-- tendril's authenticating proxy (wire.AuthProxyLua).
local unauthorized = '{"kind":"Status","apiVersion":"v1","metadata":{},"status":"Failure","message":"Unauthorized","reason":"Unauthorized","code":401}\n'

-- attributes splits an RFC 2253 subject into {type, value} pairs, values unescaped.
local function attributes(subject)
  local out, i, n = {}, 1, #subject
  while i <= n do
    local eq = subject:find("=", i, true)
    if eq == nil then break end
    local typ, value, j = subject:sub(i, eq - 1), {}, eq + 1
    while j <= n do
      local c = subject:sub(j, j)
      if c == "\\" then
        local hex = subject:sub(j + 1, j + 2)
        if hex:match("^%x%x$") then
          value[#value + 1] = string.char(tonumber(hex, 16))
          j = j + 3
        else
          value[#value + 1] = subject:sub(j + 1, j + 1)
          j = j + 2
        end
      elseif c == "," or c == "+" then
        break
      else
        value[#value + 1] = c
        j = j + 1
      end
    end
    out[#out + 1] = {typ, table.concat(value)}
    i = j + 1
  end
  return out
end

function envoy_on_request(handle)
  local headers = handle:headers()
  local forged = {}
  for name, _ in pairs(headers) do
    if name:lower():sub(1, 9) == "x-remote-" then forged[#forged + 1] = name end
  end
  for _, name in ipairs(forged) do headers:remove(name) end
  local ssl = handle:streamInfo():downstreamSslConnection()
  if ssl == nil or not ssl:peerCertificatePresented() then return end
  local user, groups = nil, {}
  if ssl:peerCertificateValidated() then
    for _, a in ipairs(attributes(ssl:subjectPeerCertificate())) do
      if a[1] == "CN" and user == nil then
        user = a[2]
      elseif a[1] == "O" then
        groups[#groups + 1] = a[2]
      end
    end
  end
  if user == nil or user == "" then
    handle:respond({[":status"] = "401", ["content-type"] = "application/json"}, unauthorized)
    return
  end
  headers:replace("x-remote-user", user)
  for g = #groups, 1, -1 do headers:add("x-remote-group", groups[g]) end
  headers:replace("x-remote-extra-authentication.kubernetes.io%2fcredential-id", "X509SHA256=" .. ssl:sha256PeerCertificateDigest())
end
`
