package peers

import (
	"context"
	"debug/buildinfo"
	"errors"
	"fmt"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"time"

	"github.com/tendril-net/tendril/internal/host/inherit"
)

// Tendril runs tendril's own data plane as two processes: tendril-seed serves
// the routes from a route file over xDS, tendril-ingress receives them and
// forwards connections on the listener for its Job: the SNI listener for
// JobSNI, the proxy listener (PROXY header or X-Gardener-Destination CONNECT,
// one port for both) for JobProxy and JobConnect. The zero value does JobSNI
// with the binaries in "bin".
type Tendril struct {
	// BinDir holds tendril-seed and tendril-ingress; "" means "bin".
	BinDir string
	// Job selects the listener; "" means JobSNI.
	Job Job
	// ReadyTimeout bounds the wait for the ingress's /readyz; 0 means 30 s.
	ReadyTimeout time.Duration
	// Routes, if set, is tendril-seed's route file as it is, in place of RouteFile(routes):
	// for routes RouteFile cannot express (the terminating mode's certificates). The routes
	// Start is given are then only validated.
	Routes string
}

var _ Peer = Tendril{}

// Name implements Peer.
func (Tendril) Name() string { return "tendril" }

func (t Tendril) bins() (seed, ingress string) {
	dir := t.BinDir
	if dir == "" {
		dir = "bin"
	}
	return filepath.Join(dir, "tendril-seed"), filepath.Join(dir, "tendril-ingress")
}

// Check implements Peer: both binaries must exist.
func (t Tendril) Check(context.Context) error {
	seed, ingress := t.bins()
	for _, b := range []string{ingress, seed} {
		if _, err := os.Stat(b); err != nil {
			return fmt.Errorf("%s not found", b)
		}
	}
	return nil
}

// RouteFile renders tendril-seed's static route file: one shoot per route,
// with one host each and its advertised address if it has one.
// Route.Validate guarantees that every value is a plain token, so no value
// needs escaping beyond the quotes.
func RouteFile(routes []Route) (string, error) {
	if err := validateRoutes(routes); err != nil {
		return "", err
	}
	var b strings.Builder
	b.WriteString("shoots:\n")
	for _, r := range routes {
		fmt.Fprintf(&b, "- name: %s\n  hosts: [%q]\n  apiserver: %q\n", r.Name, r.Host, r.Upstream)
		if r.Advertised.IsValid() {
			fmt.Fprintf(&b, "  advertisedAddress: %q\n", r.Advertised.String())
		}
	}
	return b.String(), nil
}

// Version describes tendril-ingress from its embedded build information:
// module version, VCS revision (+dirty when built from a modified tree), Go
// version, and the binary's modification time (a build without VCS
// information is "(devel)" only, and the time still tells builds apart).
func (t Tendril) Version() string {
	_, ingress := t.bins()
	bi, err := buildinfo.ReadFile(ingress)
	if err != nil {
		return "unknown"
	}
	built := ""
	if st, err := os.Stat(ingress); err == nil {
		built = ", built " + st.ModTime().UTC().Format("2006-01-02 15:04 UTC")
	}
	v := "tendril-ingress " + bi.Main.Version
	settings := map[string]string{}
	for _, s := range bi.Settings {
		settings[s.Key] = s.Value
	}
	if rev := settings["vcs.revision"]; rev != "" {
		v += " " + rev[:min(12, len(rev))]
		if settings["vcs.modified"] == "true" {
			v += "+dirty"
		}
	}
	return v + " " + bi.GoVersion + built
}

// Start implements Peer:
//
//	tendril-seed --routes FILE --xds-address 127.0.0.1:P1 --xds-insecure --metrics-address 127.0.0.1:P2 --proxy-protocol
//	tendril-ingress --xds 127.0.0.1:P1 --xds-insecure --node-id bench --sni-address 127.0.0.1:P3 --metrics-address 127.0.0.1:P4 --profiling
//
// with --proxy-address instead of --sni-address for JobProxy and JobConnect.
// It returns once the ingress's /readyz answers 200 and its listener accepts.
// The routes may still arrive a moment later over xDS: the caller probes a
// route end to end before it measures.
func (t Tendril) Start(ctx context.Context, dir string, routes []Route) (*Instance, error) {
	if err := t.Check(ctx); err != nil {
		return nil, err
	}
	listenFlag := "--sni-address"
	switch t.Job {
	case "", JobSNI:
	case JobProxy, JobConnect:
		listenFlag = "--proxy-address"
	default:
		return nil, fmt.Errorf("tendril: unknown job %q", t.Job)
	}
	seedBin, ingressBin := t.bins()
	// The binaries get absolute paths: exec would otherwise look a bare
	// relative name up in PATH.
	seedBin, _ = filepath.Abs(seedBin)
	ingressBin, _ = filepath.Abs(ingressBin)
	routeFile, err := RouteFile(routes)
	if err != nil {
		return nil, err
	}
	if t.Routes != "" {
		routeFile = t.Routes
	}
	path := filepath.Join(dir, "routes.yaml")
	if err := writeFile(path, routeFile); err != nil {
		return nil, err
	}
	readyTimeout := t.ReadyTimeout
	if readyTimeout <= 0 {
		readyTimeout = 30 * time.Second
	}
	version := t.Version()
	// The processes inherit their sockets: no port to lose to another process, no retry.
	socks, err := Bind(4)
	if err != nil {
		return nil, err
	}
	xds, seedMetrics, listen, ingressMetrics := socks[0].Addr, socks[1].Addr, socks[2].Addr, socks[3].Addr
	seed, err := StartWithSockets("tendril-seed", filepath.Join(dir, "tendril-seed.log"), socks[:2], seedBin,
		"--routes", path, "--xds-address", xds, "--xds-insecure", "--metrics-address", seedMetrics, "--proxy-protocol")
	if err != nil {
		inherit.Close(socks[2:]...)
		return nil, err
	}
	if err := waitAccept(ctx, xds, readyTimeout, seed); err != nil {
		inherit.Close(socks[2:]...)
		return nil, errors.Join(fmt.Errorf("tendril-seed: %w", err), seed.Stop())
	}
	ingress, err := StartWithSockets("tendril-ingress", filepath.Join(dir, "tendril-ingress.log"), socks[2:], ingressBin,
		"--xds", xds, "--xds-insecure", "--node-id", "bench", listenFlag, listen, "--metrics-address", ingressMetrics, "--profiling")
	if err != nil {
		return nil, errors.Join(err, seed.Stop())
	}
	in := &Instance{Addr: listen, Version: version, Config: routeFile, Metrics: "http://" + ingressMetrics + "/metrics",
		procs: []*Process{seed, ingress}, dataPlane: []*Process{ingress}}
	if err := waitReady(ctx, "http://"+ingressMetrics+"/readyz", readyTimeout, seed, ingress); err != nil {
		return nil, errors.Join(fmt.Errorf("tendril-ingress: %w", err), in.Stop())
	}
	if err := waitAccept(ctx, listen, readyTimeout, seed, ingress); err != nil {
		return nil, errors.Join(fmt.Errorf("tendril-ingress: %w", err), in.Stop())
	}
	return in, nil
}

// waitReady polls url until it answers 200, one of procs exits, timeout
// passes or ctx ends.
func waitReady(ctx context.Context, url string, timeout time.Duration, procs ...*Process) error {
	ctx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	// No keep-alive: a poller that stops must not leave an idle
	// connection (and its goroutines) behind.
	client := &http.Client{Timeout: time.Second, Transport: &http.Transport{DisableKeepAlives: true}}
	tick := time.NewTicker(50 * time.Millisecond)
	defer tick.Stop()
	last := errors.New("not polled yet")
	for {
		for _, p := range procs {
			if err := p.Exited(); err != nil {
				return err
			}
		}
		req, err := http.NewRequestWithContext(ctx, http.MethodGet, url, nil)
		if err != nil {
			return fmt.Errorf("readiness request: %w", err)
		}
		if resp, err := client.Do(req); err != nil {
			last = err
		} else {
			resp.Body.Close()
			if resp.StatusCode == http.StatusOK {
				return nil
			}
			last = fmt.Errorf("GET %s: %s", url, resp.Status)
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("not ready: %w (last: %w)", ctx.Err(), last)
		case <-tick.C:
		}
	}
}
