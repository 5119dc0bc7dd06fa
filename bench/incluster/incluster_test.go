package incluster

import (
	"testing"

	"github.com/tendril-net/tendril/bench/harness"
	"github.com/tendril-net/tendril/bench/internal/runtest"
)

// TestProxyMini is an end-to-end run of the proxy mode against direct,
// HAProxy and tendril (when installed): each shoot's PROXY header reaches
// that shoot's upstream only.
func TestProxyMini(t *testing.T) {
	runtest.Mini(t, Proxy, nil)
}

// TestConnectMini is an end-to-end run of the connect mode against direct
// and tendril (when installed). HAProxy is started with its CONNECT-routing
// configuration and must be skipped with what it answered: it forwards the
// CONNECT to the upstream instead of answering it, and the upstream, a TLS
// server, cannot answer, so HAProxy says 502. Should a later HAProxy tunnel
// by itself, this test fails, and HAProxyConnectNote needs another look.
func TestConnectMini(t *testing.T) {
	runtest.Mini(t, Connect, map[string]string{harness.TargetHAProxy: `CONNECT answered "HTTP/1.1 502 Bad Gateway"`})
}
