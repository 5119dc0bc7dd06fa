// Package terminate measures the ingress's terminating mode (issue 42) against HAProxy doing the
// same in HTTP mode, in one run with one client: TLS ended with the shoot's serving certificate,
// client certificates verified against its client CA, forged X-Remote-* headers dropped and the
// certificate's identity set, each request balanced (least outstanding / leastconn) over HTTP/2
// to three kube-apiserver stand-ins that require the front-proxy client certificate. It reports
// requests per second and CPU per request of the data-plane process at each client count,
// memory per idle HTTP/2 client connection (settled, and 2 s after they opened), and memory per
// opted-in shoot. The stand-ins are
// Go HTTP/2 servers in this process, answering a small fixed body, so that the proxies' cost is
// what is measured; they are not kube-apiservers. It does not measure Envoy (no binary here).
package terminate

import (
	"context"
	"crypto/sha256"
	"crypto/tls"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"maps"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/tendril-net/tendril/bench/harness"
	"github.com/tendril-net/tendril/bench/machine"
	"github.com/tendril-net/tendril/bench/peers"
	"github.com/tendril-net/tendril/internal/pki/testpki"
	"github.com/tendril-net/tendril/wire"
)

// Config is one run. The zero value measures 1, 16 and 128 clients for 5 s each, 1,000 idle
// connections and 100 shoots, with the binaries in bin.
type Config struct {
	// BinDir holds tendril-seed and tendril-ingress; "" means "bin".
	BinDir string
	// Clients are the client counts, one HTTP/2 connection each, requests back to back.
	Clients []int
	// Duration is each cell's measuring time.
	Duration time.Duration
	// IdleConns is how many idle HTTP/2 client connections the memory figure holds.
	IdleConns int
	// Shoots is how many opted-in shoots the memory-per-shoot figure configures.
	Shoots int
	// Settle is how long the idle connections, and before them the process after its load,
	// are left alone before the settled readings (0 means DefaultSettle).
	Settle time.Duration
	// Dir holds the peers' files; "" means a temporary directory, removed at the end.
	Dir string
	// Progress receives a line per step; nil discards.
	Progress io.Writer
}

func (c Config) withDefaults() Config {
	if len(c.Clients) == 0 {
		c.Clients = []int{1, 16, 128}
	}
	if c.Duration <= 0 {
		c.Duration = 5 * time.Second
	}
	if c.IdleConns <= 0 {
		c.IdleConns = 1000
	}
	if c.Shoots <= 1 {
		c.Shoots = 100
	}
	if c.Settle <= 0 {
		c.Settle = DefaultSettle
	}
	if c.BinDir == "" {
		c.BinDir = "bin"
	}
	if c.Progress == nil {
		c.Progress = io.Discard
	}
	return c
}

// DefaultSettle is Config.Settle's default. tendril-ingress gives the free heap of a load back
// to the system in the first 10 s interval that allocated next to nothing after it, and once more
// an interval later (internal/host/idlemem): at most three intervals after the load began to
// end. HAProxy frees as it goes, so its readings do not move.
const DefaultSettle = 30 * time.Second

// Cell is one peer at one client count.
type Cell struct {
	Peer    string `json:"peer"`
	Clients int    `json:"clients"`
	// Requests answered 200 within the cell; Errors every other outcome.
	Requests int64   `json:"requests"`
	Errors   int64   `json:"errors"`
	RPS      float64 `json:"requests_per_second"`
	// CPUMicros is the data-plane process's CPU time per request.
	CPUMicros float64 `json:"cpu_us_per_request"`
	// PerReplica are the requests each stand-in answered: the balance.
	PerReplica []int64 `json:"per_replica"`
}

// PeerMemory is one peer's memory figures.
type PeerMemory struct {
	Peer string `json:"peer"`
	// IdleConnBytes is the data plane's resident set growth per idle HTTP/2 client connection,
	// settled: both readings Config.Settle after a load (a warm-up, then the opening of the
	// connections), so that neither holds garbage a runtime is about to give back.
	IdleConnBytes float64 `json:"idle_conn_bytes"`
	// BurstConnBytes is that growth 2 s after the last connection opened: what the opening's
	// garbage adds at its peak (a pod's memory limit must hold it).
	BurstConnBytes float64 `json:"burst_conn_bytes"`
	// ShootBytes is its growth per opted-in shoot beyond the first.
	ShootBytes float64 `json:"shoot_bytes"`
}

// Report is a run's result.
type Report struct {
	Versions map[string]string `json:"versions"`
	Cells    []Cell            `json:"cells"`
	Memory   []PeerMemory      `json:"memory"`
}

// pki is the run's certificates: one shoot CA (serving and kube-apiserver), the client CA, the
// front-proxy CA, and a serving certificate per shoot.
type pki struct {
	shootCA, clientCA, frontCA *testpki.CA
	apiserver, front, alice    tls.Certificate
	// aliceID is alice's credential id as kube-apiserver makes it.
	aliceID string
}

func newPKI() (*pki, error) {
	var p pki
	var err error
	for _, c := range []struct {
		ca **testpki.CA
		cn string
	}{{&p.shootCA, "bench shoot CA"}, {&p.clientCA, "bench client CA"}, {&p.frontCA, "bench front-proxy CA"}} {
		if *c.ca, err = testpki.NewCA(c.cn); err != nil {
			return nil, err
		}
	}
	if p.apiserver, err = p.shootCA.Leaf("kube-apiserver"); err != nil {
		return nil, err
	}
	if p.front, err = p.frontCA.Client("front-proxy", nil, time.Time{}, time.Time{}); err != nil {
		return nil, err
	}
	if p.alice, err = p.clientCA.Client("alice", []string{"devs"}, time.Time{}, time.Time{}); err != nil {
		return nil, err
	}
	sum := sha256.Sum256(p.alice.Leaf.Raw)
	p.aliceID = wire.CredentialIDPrefix + hex.EncodeToString(sum[:])
	return &p, nil
}

// host is shoot i's server name; shoot 0 is the one measured.
func host(i int) string { return fmt.Sprintf("api.s%d.bench.test", i) }

// replicas are the kube-apiserver stand-ins: HTTP/2 over TLS, the front-proxy certificate
// required, a fixed answer the size of a small kube-apiserver response.
type replicas struct {
	addrs  []string
	served []atomic.Int64
	srvs   []*http.Server
	wg     sync.WaitGroup
}

// body is about the size of kube-apiserver's answer to GET /api.
var body = []byte(`{"kind":"APIVersions","versions":["v1"],"serverAddressByClientCIDRs":[{"clientCIDR":"0.0.0.0/0","serverAddress":"10.250.0.10:443"}]}` + "\n")

func startReplicas(p *pki, n int) (*replicas, error) {
	r := &replicas{served: make([]atomic.Int64, n)}
	for i := range n {
		l, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			r.stop()
			return nil, err
		}
		srv := &http.Server{
			TLSConfig: &tls.Config{Certificates: []tls.Certificate{p.apiserver}, ClientAuth: tls.RequireAndVerifyClientCert,
				ClientCAs: p.frontCA.Pool, NextProtos: []string{"h2", "http/1.1"}},
			Handler: http.HandlerFunc(func(w http.ResponseWriter, req *http.Request) {
				// Both peers pass the user and the certificate's credential id (as
				// kube-apiserver's x509 authenticator makes it): the same work for each.
				if req.Header.Get("X-Remote-User") != "alice" || req.Header.Get(wire.CredentialIDHeader) != p.aliceID {
					w.WriteHeader(http.StatusForbidden)
					return
				}
				r.served[i].Add(1)
				w.Header().Set("Content-Type", "application/json")
				_, _ = w.Write(body)
			}),
		}
		r.srvs = append(r.srvs, srv)
		r.addrs = append(r.addrs, l.Addr().String())
		r.wg.Go(func() { _ = srv.ServeTLS(l, "", "") })
	}
	return r, nil
}

func (r *replicas) stop() {
	for _, s := range r.srvs {
		s.Close()
	}
	r.wg.Wait()
}

func (r *replicas) counts() []int64 {
	out := make([]int64, len(r.served))
	for i := range r.served {
		out[i] = r.served[i].Load()
	}
	return out
}

// Run measures both peers. The HAProxy side is skipped (and said so in the report's versions)
// when haproxy is not installed.
func Run(ctx context.Context, cfg Config) (*Report, error) {
	cfg = cfg.withDefaults()
	dir := cfg.Dir
	if dir == "" {
		d, err := os.MkdirTemp("", "tendril-bench-terminate-")
		if err != nil {
			return nil, err
		}
		defer os.RemoveAll(d)
		dir = d
	}
	p, err := newPKI()
	if err != nil {
		return nil, err
	}
	reps, err := startReplicas(p, 3)
	if err != nil {
		return nil, err
	}
	defer reps.stop()
	rep := &Report{Versions: map[string]string{}}
	for _, pr := range []proxy{tendrilProxy{bin: cfg.BinDir}, haproxyProxy{}} {
		if err := pr.check(); err != nil {
			rep.Versions[pr.name()] = "not measured: " + err.Error()
			continue
		}
		if err := measurePeer(ctx, cfg, dir, p, reps, pr, rep); err != nil {
			return rep, fmt.Errorf("%s: %w", pr.name(), err)
		}
	}
	return rep, nil
}

// running is a started proxy: its listener and its data-plane process.
type running struct {
	addr    string
	pid     int
	version string
	stop    func() error
}

// proxy is one peer of the comparison.
type proxy interface {
	name() string
	check() error
	start(ctx context.Context, dir string, p *pki, shoots int, replicas []string) (*running, error)
}

func measurePeer(ctx context.Context, cfg Config, dir string, p *pki, reps *replicas, pr proxy, rep *Report) error {
	pdir := filepath.Join(dir, pr.name())
	if err := os.MkdirAll(pdir, 0o755); err != nil {
		return err
	}
	fmt.Fprintf(cfg.Progress, "%s: 1 shoot\n", pr.name())
	run, err := pr.start(ctx, pdir, p, 1, reps.addrs)
	if err != nil {
		return err
	}
	defer run.stop()
	rep.Versions[pr.name()] = run.version
	if err := waitServing(ctx, run.addr, p, host(0)); err != nil {
		return err
	}
	oneShoot, _ := peers.ReadMemory(run.pid)
	// The idle connections first, after a warm-up at the most clients, both memory readings
	// settled: a reading right after a load would count the garbage that a runtime gives back
	// later (tendril-ingress: within Settle) as the connections' or, given back during them, as
	// negative growth; and a proxy's pools are as a load left them, as on a seed. The cells come
	// after, with the heap the connections grew, as an ingress holding connections has.
	warm := slices.Max(cfg.Clients)
	fmt.Fprintf(cfg.Progress, "%s: warm-up at %d clients; %d idle connections, readings %v apart\n", pr.name(), warm, cfg.IdleConns, cfg.Settle)
	if _, err := load(ctx, run, p, warm, 2*time.Second); err != nil {
		return err
	}
	idle, err := idleConnBytes(ctx, run, p, cfg.IdleConns, cfg.Settle)
	if err != nil {
		return err
	}
	for _, n := range cfg.Clients {
		before := reps.counts()
		c, err := load(ctx, run, p, n, cfg.Duration)
		if err != nil {
			return err
		}
		c.Peer = pr.name()
		after := reps.counts()
		for i := range after {
			c.PerReplica = append(c.PerReplica, after[i]-before[i])
		}
		fmt.Fprintf(cfg.Progress, "%s: %d clients: %.0f requests/s, %.1f µs CPU per request, %d errors\n", pr.name(), n, c.RPS, c.CPUMicros, c.Errors)
		rep.Cells = append(rep.Cells, c)
	}
	if err := run.stop(); err != nil {
		return err
	}
	fmt.Fprintf(cfg.Progress, "%s: %d shoots\n", pr.name(), cfg.Shoots)
	many, err := pr.start(ctx, filepath.Join(pdir, "many"), p, cfg.Shoots, reps.addrs)
	if err != nil {
		return err
	}
	defer many.stop()
	for i := range cfg.Shoots {
		if err := waitServing(ctx, many.addr, p, host(i)); err != nil {
			return err
		}
	}
	manyMem, _ := peers.ReadMemory(many.pid)
	rep.Memory = append(rep.Memory, PeerMemory{Peer: pr.name(), IdleConnBytes: idle.settled, BurstConnBytes: idle.burst,
		ShootBytes: float64(manyMem.RSS-oneShoot.RSS) / float64(cfg.Shoots-1)})
	return many.stop()
}

// client is one HTTP/2 client connection to shoot 0 through addr, with alice's certificate.
func client(addr string, p *pki, h string) *http.Client {
	var d net.Dialer
	return &http.Client{Timeout: 10 * time.Second, Transport: &http.Transport{
		TLSClientConfig:   &tls.Config{RootCAs: p.shootCA.Pool, ServerName: h, Certificates: []tls.Certificate{p.alice}},
		ForceAttemptHTTP2: true,
		MaxConnsPerHost:   1,
		DialContext:       func(ctx context.Context, _, _ string) (net.Conn, error) { return d.DialContext(ctx, "tcp", addr) },
	}}
}

func get(c *http.Client, h string) error {
	resp, err := c.Get("https://" + h + "/api")
	if err != nil {
		return err
	}
	defer resp.Body.Close()
	_, _ = io.Copy(io.Discard, resp.Body)
	if resp.StatusCode != http.StatusOK {
		return fmt.Errorf("status %d", resp.StatusCode)
	}
	if resp.ProtoMajor != 2 {
		return fmt.Errorf("protocol %s, want HTTP/2", resp.Proto)
	}
	return nil
}

// waitServing waits until a request to shoot h through addr succeeds (the routes arrive over
// xDS a moment after tendril-ingress is ready).
func waitServing(ctx context.Context, addr string, p *pki, h string) error {
	c := client(addr, p, h)
	defer c.CloseIdleConnections()
	deadline := time.Now().Add(30 * time.Second)
	for {
		err := get(c, h)
		if err == nil {
			return nil
		}
		if time.Now().After(deadline) || ctx.Err() != nil {
			return fmt.Errorf("shoot %s not served through %s: %w", h, addr, errors.Join(err, ctx.Err()))
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// load runs n clients for d and measures the data plane's CPU over them.
func load(ctx context.Context, run *running, p *pki, n int, d time.Duration) (Cell, error) {
	clients := make([]*http.Client, n)
	for i := range clients {
		clients[i] = client(run.addr, p, host(0))
		if err := get(clients[i], host(0)); err != nil { // connected before the clock starts
			return Cell{}, fmt.Errorf("client %d: %w", i, err)
		}
	}
	defer func() {
		for _, c := range clients {
			c.CloseIdleConnections()
		}
	}()
	var ok, bad atomic.Int64
	cpu0, _ := machine.ProcessCPU(run.pid)
	start := time.Now()
	stop := start.Add(d)
	var wg sync.WaitGroup
	for _, c := range clients {
		wg.Go(func() {
			for time.Now().Before(stop) && ctx.Err() == nil {
				if get(c, host(0)) == nil {
					ok.Add(1)
				} else {
					bad.Add(1)
				}
			}
		})
	}
	wg.Wait()
	elapsed := time.Since(start)
	cpu1, _ := machine.ProcessCPU(run.pid)
	c := Cell{Clients: n, Requests: ok.Load(), Errors: bad.Load(), RPS: float64(ok.Load()) / elapsed.Seconds()}
	if ok.Load() > 0 {
		c.CPUMicros = float64((cpu1 - cpu0).Microseconds()) / float64(ok.Load())
	}
	return c, ctx.Err()
}

// connBytes are the resident-set growth per idle connection: settled and at the opening's peak.
type connBytes struct{ settled, burst float64 }

// idleConnBytes waits settle, opens k client connections, one request each, and reports the data
// plane's resident-set growth per connection 2 s later and again settle after that.
func idleConnBytes(ctx context.Context, run *running, p *pki, k int, settle time.Duration) (connBytes, error) {
	if !harness.SleepCtx(ctx, settle) {
		return connBytes{}, ctx.Err()
	}
	before, _ := peers.ReadMemory(run.pid)
	clients := make([]*http.Client, 0, k)
	defer func() {
		for _, c := range clients {
			c.CloseIdleConnections()
		}
	}()
	for i := range k {
		if ctx.Err() != nil {
			return connBytes{}, ctx.Err()
		}
		c := client(run.addr, p, host(0))
		clients = append(clients, c)
		if err := get(c, host(0)); err != nil {
			return connBytes{}, fmt.Errorf("idle connection %d: %w", i, err)
		}
	}
	const burst = 2 * time.Second
	if !harness.SleepCtx(ctx, burst) {
		return connBytes{}, ctx.Err()
	}
	peak, _ := peers.ReadMemory(run.pid)
	if !harness.SleepCtx(ctx, settle-burst) {
		return connBytes{}, ctx.Err()
	}
	after, _ := peers.ReadMemory(run.pid)
	per := func(m peers.Memory) float64 { return (float64(m.RSS) - float64(before.RSS)) / float64(k) }
	return connBytes{settled: per(after), burst: per(peak)}, nil
}

// Write writes the report as JSON and as a table.
func (r *Report) Write(w io.Writer, jsonPath string) error {
	if jsonPath != "" {
		b, err := json.MarshalIndent(r, "", "  ")
		if err != nil {
			return err
		}
		if err := os.WriteFile(jsonPath, append(b, '\n'), 0o644); err != nil {
			return err
		}
	}
	for peer, v := range r.Versions {
		fmt.Fprintf(w, "%s: %s\n", peer, v)
	}
	fmt.Fprintf(w, "\n| peer | clients | requests/s | CPU µs/request | requests per CPU-second | errors | per replica |\n|---|---|---|---|---|---|---|\n")
	for _, c := range r.Cells {
		perCPU := 0.0
		if c.CPUMicros > 0 {
			perCPU = 1e6 / c.CPUMicros
		}
		fmt.Fprintf(w, "| %s | %d | %.0f | %.1f | %.0f | %d | %v |\n", c.Peer, c.Clients, c.RPS, c.CPUMicros, perCPU, c.Errors, c.PerReplica)
	}
	fmt.Fprintf(w, "\n| peer | bytes per idle HTTP/2 connection, settled | 2 s after opening | bytes per opted-in shoot |\n|---|---|---|---|\n")
	for _, m := range r.Memory {
		fmt.Fprintf(w, "| %s | %.0f | %.0f | %.0f |\n", m.Peer, m.IdleConnBytes, m.BurstConnBytes, m.ShootBytes)
	}
	if ratios := r.ratios(); ratios != "" {
		fmt.Fprintf(w, "\n%s", ratios)
	}
	return nil
}

// ratios are tendril's figures over HAProxy's, where both were measured.
func (r *Report) ratios() string {
	var b strings.Builder
	cells := map[string]map[int]Cell{}
	for _, c := range r.Cells {
		if cells[c.Peer] == nil {
			cells[c.Peer] = map[int]Cell{}
		}
		cells[c.Peer][c.Clients] = c
	}
	for _, n := range slices.Sorted(maps.Keys(cells["tendril"])) {
		t := cells["tendril"][n]
		if h, ok := cells["haproxy"][n]; ok && t.CPUMicros > 0 && h.RPS > 0 {
			fmt.Fprintf(&b, "%d clients: tendril/haproxy requests per CPU-second %.2f, requests/s %.2f\n", n, h.CPUMicros/t.CPUMicros, t.RPS/h.RPS)
		}
	}
	mem := map[string]PeerMemory{}
	for _, m := range r.Memory {
		mem[m.Peer] = m
	}
	if t, ok := mem["tendril"]; ok {
		if h, ok := mem["haproxy"]; ok && h.IdleConnBytes > 0 && h.ShootBytes > 0 {
			fmt.Fprintf(&b, "memory per idle connection tendril/haproxy %.2f settled, %.2f 2 s after opening; per shoot %.2f\n",
				t.IdleConnBytes/h.IdleConnBytes, t.BurstConnBytes/h.BurstConnBytes, t.ShootBytes/h.ShootBytes)
		}
	}
	return b.String()
}
