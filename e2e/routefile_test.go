package e2e

import (
	"fmt"
	"io"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/tendril-net/tendril/internal/pki/testpki"
)

// TestRouteFileRewrittenInPlace runs tendril-seed with a route file and tendril-ingress against
// it, and rewrites the file in place 20 times as "( sleep 0.3; cat good.yaml ) > routes.yaml"
// does (truncated at once, written 300 ms later), then leaves it empty. A client reaches the
// shoot by server name every 50 ms throughout: not one attempt may be refused, because an empty
// or partly written file must never withdraw the shoots.
func TestRouteFileRewrittenInPlace(t *testing.T) {
	ca, err := testpki.NewCA("e2e CA")
	if err != nil {
		t.Fatal(err)
	}
	const host = "api.alpha.e2e.test"
	good := fmt.Sprintf("shoots:\n- name: shoot--e2e--alpha\n  hosts: [%s]\n  apiserver: %s\n", host, upstream(t, ca, host))
	routeFile := filepath.Join(t.TempDir(), "routes.yaml")
	if err := os.WriteFile(routeFile, []byte(good), 0o644); err != nil {
		t.Fatal(err)
	}
	xdsAddr, seedMetrics, sniAddr, ingressMetrics := loopbackAddr(t), loopbackAddr(t), loopbackAddr(t), loopbackAddr(t)
	xdsSeed, xdsIngress := xdsTLS(t)
	start(t, "tendril-seed", []string{xdsAddr, seedMetrics}, append([]string{"--routes", routeFile, "--xds-address", xdsAddr, "--metrics-address", seedMetrics}, xdsSeed...)...)
	start(t, "tendril-ingress", []string{sniAddr, ingressMetrics}, append([]string{"--xds", xdsAddr, "--node-id", "e2e", "--sni-address", sniAddr, "--metrics-address", ingressMetrics}, xdsIngress...)...)
	reach := func() error { return reachSNI(sniAddr, host, ca) }
	eventually(t, "alpha", reach)

	stop := make(chan struct{})
	var wg sync.WaitGroup
	var probes int
	var failures []string
	every(&wg, stop, 50*time.Millisecond, func() {
		probes++
		if err := reach(); err != nil {
			failures = append(failures, fmt.Sprintf("%s: %v", time.Now().Format("15:04:05.000"), err))
		}
	})
	rewrite := func(content string, empty time.Duration) {
		fh, err := os.OpenFile(routeFile, os.O_WRONLY|os.O_TRUNC, 0)
		if err != nil {
			t.Error(err)
			return
		}
		defer fh.Close()
		time.Sleep(empty)
		if _, err := io.WriteString(fh, content); err != nil {
			t.Error(err)
		}
	}
	for range 20 {
		rewrite(good, 300*time.Millisecond)
		time.Sleep(100 * time.Millisecond)
	}
	rewrite("", 0) // a 0-byte file, left so
	time.Sleep(time.Second)
	close(stop)
	wg.Wait()
	t.Logf("%d probes during 20 in-place rewrites and a 0-byte file, %d refused", probes, len(failures))
	if len(failures) > 0 {
		t.Errorf("%d of %d probes refused:\n%s", len(failures), probes, strings.Join(failures, "\n"))
	}
	m, err := get("http://" + seedMetrics + "/metrics")
	if err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(m, `tendril_route_file_loads_total{outcome="no_shoots"}`) {
		t.Errorf("seed metrics lack the refused empty files:\n%s", m)
	}
}
