// Package peers starts, configures and stops the data planes that tendril is
// benchmarked against (HAProxy and nginx from the distribution) and tendril's
// own seed + ingress binaries, all for the same routes and the same Job: SNI
// passthrough, PROXY-protocol routing by destination, or CONNECT routing by
// the X-Gardener-Destination header.
//
// Each data plane runs as a child process on free loopback ports, with its
// configuration rendered from the templates embedded in this package into a
// directory the caller owns. The package does not generate load, measure, or
// install anything: a missing binary or module is reported by Check so that a
// benchmark can skip that peer and go on with the others.
package peers

import (
	"bytes"
	"context"
	_ "embed"
	"errors"
	"fmt"
	"net"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"runtime"
	"strings"
	"syscall"
	"text/template"
	"time"

	"github.com/tendril-net/tendril/internal/host/inherit"
	"github.com/tendril-net/tendril/internal/host/reserve"
)

// Route is one shoot's route: connections whose ClientHello names Host, whose
// PROXY header's destination is Advertised:443, or whose CONNECT names the
// shoot (GardenerDestination(Name)) go to Upstream.
type Route struct {
	// Name identifies the route in generated configurations (backend and
	// upstream names) and in tendril's route file (the shoot name).
	Name string
	// Host is the TLS server name, lower case.
	Host string
	// Upstream is the upstream's IP:port (an address, not a host name, so
	// that no peer resolves anything on the hot path).
	Upstream string
	// Advertised is the shoot's advertised address, the destination of
	// the PROXY headers for it; the zero value means none (JobSNI and
	// JobConnect do without).
	Advertised netip.Addr
}

// Job is what a data plane routes by.
type Job string

const (
	// JobSNI routes TLS connections by the ClientHello's server name.
	JobSNI Job = "sni"
	// JobProxy reads a PROXY header (v1 or v2) first and routes by its
	// destination: Route.Advertised, port APIServerPort (GEP-8).
	JobProxy Job = "proxy"
	// JobConnect answers an HTTP/1.1 CONNECT whose X-Gardener-Destination
	// header names a shoot's kube-apiserver, once that shoot's upstream is
	// connected, and then tunnels (the current Gardener generation).
	JobConnect Job = "connect"
)

// APIServerPort is the destination port of the PROXY headers for an
// advertised address: kube-apiserver's port in the shoot.
const APIServerPort = 443

// GardenerDestinationHeader is the CONNECT request header that names the
// destination cluster, in Gardener's wire form (GardenerDestination).
const GardenerDestinationHeader = "X-Gardener-Destination"

// GardenerDestination is the X-Gardener-Destination value that reaches the
// kube-apiserver of the shoot named name (its namespace in the seed).
func GardenerDestination(name string) string {
	return "outbound|443||kube-apiserver." + name + ".svc.cluster.local"
}

var (
	nameRE = regexp.MustCompile(`^[A-Za-z0-9][A-Za-z0-9_.-]*$`)
	hostRE = regexp.MustCompile(`^[a-z0-9]([a-z0-9-]*[a-z0-9])?(\.[a-z0-9]([a-z0-9-]*[a-z0-9])?)*$`)
)

// Validate checks that the route can be written into every peer's
// configuration as is: names and hosts are plain tokens, so a route can never
// inject configuration.
func (r Route) Validate() error {
	if !nameRE.MatchString(r.Name) {
		return fmt.Errorf("route name %q: want letters, digits, '_', '.', '-'", r.Name)
	}
	if !hostRE.MatchString(r.Host) {
		return fmt.Errorf("route %s: host %q is not a lower-case DNS name", r.Name, r.Host)
	}
	if _, err := netip.ParseAddrPort(r.Upstream); err != nil {
		return fmt.Errorf("route %s: upstream: %w", r.Name, err)
	}
	if r.Advertised.IsValid() && (r.Advertised.Zone() != "" || r.Advertised.Is4In6()) {
		return fmt.Errorf("route %s: advertised address %s: want a plain IPv4 or IPv6 address", r.Name, r.Advertised)
	}
	return nil
}

func validateRoutes(routes []Route) error {
	if len(routes) == 0 {
		return errors.New("no routes")
	}
	seen := map[string]bool{}
	for _, r := range routes {
		if err := r.Validate(); err != nil {
			return err
		}
		if seen[r.Name] || seen["host:"+r.Host] {
			return fmt.Errorf("route %s: duplicate name or host %s", r.Name, r.Host)
		}
		seen[r.Name], seen["host:"+r.Host] = true, true
		if a := r.Advertised; a.IsValid() {
			if seen["advertised:"+a.String()] {
				return fmt.Errorf("route %s: duplicate advertised address %s", r.Name, a)
			}
			seen["advertised:"+a.String()] = true
		}
	}
	return nil
}

// Timeouts are the same for every peer, so that no peer wins by giving up
// earlier or waiting longer than another.
type Timeouts struct {
	// Hello bounds the wait for the ClientHello (design.md: 10 s).
	Hello time.Duration
	// Connect bounds the upstream dial.
	Connect time.Duration
	// Idle closes a connection without traffic in either direction.
	Idle time.Duration
}

// DefaultTimeouts mirror what tendril-ingress uses for its SNI listener where
// a benchmark can tell the difference (ClientHello 10 s); the idle timeout is
// shorter than tendril's 1 h because a benchmark connection is never idle for
// long, and a stuck one should not outlive the run.
var DefaultTimeouts = Timeouts{Hello: 10 * time.Second, Connect: 5 * time.Second, Idle: 60 * time.Second}

// orDefault is t, or DefaultTimeouts for the zero value: what every peer's
// "zero means DefaultTimeouts" field resolves to.
func (t Timeouts) orDefault() Timeouts {
	if t == (Timeouts{}) {
		return DefaultTimeouts
	}
	return t
}

// maxConn is the default connection limit written into the peers'
// configurations: far above the rate benchmark's concurrency, so that no peer
// queues connections, and below the 20,000 open files a process gets here
// (each proxied connection holds two sockets, nginx counts both against
// worker_connections). The idle benchmark sets its own (HAProxy.MaxConn,
// Nginx.MaxConn).
const maxConn = 8192

// Peer is a data plane doing one Job.
type Peer interface {
	// Name is the target's name in reports ("haproxy", "nginx", "tendril").
	Name() string
	// Check reports why the peer cannot run here (binary or module
	// missing), or nil.
	Check(ctx context.Context) error
	// Start runs the peer for routes, with its files in dir (which the
	// caller creates and removes after Stop), and returns once the peer
	// accepts TCP connections on Instance.Addr. It does not check that
	// routes work end to end: that takes a TLS client.
	Start(ctx context.Context, dir string, routes []Route) (*Instance, error)
}

// Instance is a running peer.
type Instance struct {
	// Addr is the address clients connect to (127.0.0.1:port).
	Addr string
	// Version describes the binary, e.g. "HAProxy version 2.6.12-1+deb12u4".
	Version string
	// Config is the rendered configuration (for reports and debugging).
	Config string

	// Metrics is the data plane's Prometheus endpoint (http://…/metrics),
	// "" when it has none (HAProxy and nginx as configured here).
	Metrics string

	procs []*Process // stopped in reverse order
	// reserved are the ports held for a peer that binds them itself, given up after Stop.
	reserved []*reserve.Port
	// dataPlane are the processes that carry the connections; nil means
	// all of procs.
	dataPlane []*Process
}

// Groups returns the process group IDs of the peer's processes: each
// process leads its own group, which holds its workers too (nginx).
func (in *Instance) Groups() []int {
	var gs []int
	for _, p := range in.procs {
		gs = append(gs, p.cmd.Process.Pid)
	}
	return gs
}

// DataPlaneGroups returns the process groups of the processes that carry
// connections, whose CPU, memory and descriptors are the data plane's cost:
// HAProxy's process, nginx's master with its workers (in the master's group),
// tendril-ingress without tendril-seed (which only serves routes over xDS).
func (in *Instance) DataPlaneGroups() []int {
	ps := in.dataPlane
	if ps == nil {
		ps = in.procs
	}
	var gs []int
	for _, p := range ps {
		gs = append(gs, p.cmd.Process.Pid)
	}
	return gs
}

// Stop stops the peer's processes (last started first) and waits for them.
// It is safe to call more than once.
func (in *Instance) Stop() error {
	var errs []error
	for i := len(in.procs) - 1; i >= 0; i-- {
		errs = append(errs, in.procs[i].Stop())
	}
	for _, p := range in.reserved {
		p.Close()
	}
	return errors.Join(errs...)
}

// onReservedPort calls start with a loopback address reserved for a peer that binds it itself
// (internal/host/reserve: no bind of port 0 elsewhere gets it meanwhile); the reservation is the
// Instance's until Stop.
func onReservedPort(start func(addr string) (*Instance, error)) (*Instance, error) {
	p, err := reserve.TCP("127.0.0.1")
	if err != nil {
		return nil, err
	}
	in, err := start(p.Addr)
	if err != nil {
		p.Close()
		return nil, err
	}
	in.reserved = append(in.reserved, p)
	return in, nil
}

// startAttempts is how often a peer start is tried with fresh ports: a peer that
// cannot inherit a socket (HAProxy, nginx, squid) binds a port reserved for it
// (onReservedPort), which no bind of port 0 gets; should one bind it anyway
// (an explicit bind of that port), the peer fails with EADDRINUSE and starts
// again on another.
const startAttempts = 3

// startRetry calls start up to startAttempts times while it fails because a
// port was taken (AddrInUse), until it succeeds or ctx ends, and returns the
// last error.
func startRetry(ctx context.Context, start func() (*Instance, error)) (*Instance, error) {
	var err error
	for range startAttempts {
		var in *Instance
		if in, err = start(); err == nil {
			return in, nil
		}
		if ctx.Err() != nil || !AddrInUse(err) {
			break
		}
	}
	return nil, err
}

// fileStart is how a peer that reads one configuration file and binds its
// port itself (HAProxy, nginx, squid) is started: on a reserved loopback port,
// again on another while the port turns out taken.
type fileStart struct {
	name    string // the peer's name: its log is dir/name.log, its errors say it
	bin     string
	version string // Instance.Version
	dir     string
	file    string        // the configuration's name in dir
	ready   time.Duration // how long the peer may take to accept
	// config renders the configuration for the peer's address; args are
	// the command-line arguments for that address and the configuration
	// file's path, asked for just before each start, so that they may also
	// clear what a failed attempt left behind.
	config func(addr string) (string, error)
	args   func(addr, path string) []string
}

// start writes the configuration, starts the peer and waits until it accepts.
func (f fileStart) start(ctx context.Context) (*Instance, error) {
	return startRetry(ctx, func() (*Instance, error) {
		return onReservedPort(func(addr string) (*Instance, error) {
			cfg, err := f.config(addr)
			if err != nil {
				return nil, err
			}
			path := filepath.Join(f.dir, f.file)
			if err := writeFile(path, cfg); err != nil {
				return nil, err
			}
			p, err := StartProcess(f.name, filepath.Join(f.dir, f.name+".log"), f.bin, f.args(addr, path)...)
			if err != nil {
				return nil, err
			}
			if err := waitAccept(ctx, addr, f.ready, p); err != nil {
				return nil, errors.Join(fmt.Errorf("%s: %w", f.name, err), p.Stop())
			}
			return &Instance{Addr: addr, Version: f.version, Config: cfg, procs: []*Process{p}}, nil
		})
	})
}

// AddrInUse tells whether err is a bind's EADDRINUSE, of this process or in the
// log tail of a peer that exited (each peer prints strerror's text: HAProxy
// "cannot bind socket (Address already in use)", nginx "bind() … failed (98:
// Address already in use)", OpenVPN "… Address already in use (errno=98)").
func AddrInUse(err error) bool {
	return errors.Is(err, syscall.EADDRINUSE) || strings.Contains(strings.ToLower(err.Error()), "address already in use")
}

// Bind binds n listening sockets on 127.0.0.1, each on a port the kernel picks,
// for a tendril binary to inherit (StartWithSockets).
func Bind(n int) ([]*inherit.Socket, error) {
	var socks []*inherit.Socket
	for range n {
		s, err := inherit.Bind("127.0.0.1:0")
		if err != nil {
			inherit.Close(socks...)
			return nil, err
		}
		socks = append(socks, s)
	}
	return socks, nil
}

func loopback(port int) string { return fmt.Sprintf("127.0.0.1:%d", port) }

// cores is the worker/thread count given to every multi-threaded peer: one
// per CPU, each peer's recommended setting (HAProxy nbthread, nginx
// worker_processes auto would do the same).
func cores() int { return runtime.NumCPU() }

var (
	//go:embed haproxy.cfg.tmpl
	haproxyTmplText string
	//go:embed nginx.conf.tmpl
	nginxTmplText string
	//go:embed squid.conf.tmpl
	squidTmplText string

	funcs = template.FuncMap{
		// ms renders a duration in milliseconds, a unit both HAProxy
		// and nginx accept.
		"ms": func(d time.Duration) string { return fmt.Sprintf("%dms", d.Milliseconds()) },
		// destination is a route's X-Gardener-Destination value.
		"destination": GardenerDestination,
		// secs renders a duration in whole seconds, at least 1, for
		// squid's time units.
		"secs": func(d time.Duration) string {
			return fmt.Sprintf("%d seconds", max(1, int64((d+time.Second-1)/time.Second)))
		},
		// regex quotes a string for a POSIX extended regular expression.
		"regex": regexp.QuoteMeta,
		// host and port split a route's validated IP:port upstream.
		"host": func(hostport string) string { return netip.MustParseAddrPort(hostport).Addr().String() },
		"port": func(hostport string) uint16 { return netip.MustParseAddrPort(hostport).Port() },
	}
	haproxyTmpl = template.Must(template.New("haproxy.cfg").Funcs(funcs).Parse(haproxyTmplText))
	nginxTmpl   = template.Must(template.New("nginx.conf").Funcs(funcs).Parse(nginxTmplText))
	squidTmpl   = template.Must(template.New("squid.conf").Funcs(funcs).Parse(squidTmplText))
)

func render(t *template.Template, data any) (string, error) {
	var b bytes.Buffer
	if err := t.Execute(&b, data); err != nil {
		return "", fmt.Errorf("render %s: %w", t.Name(), err)
	}
	return b.String(), nil
}

// waitAccept waits until addr accepts a TCP connection, one of procs exits,
// timeout passes or ctx ends.
func waitAccept(ctx context.Context, addr string, timeout time.Duration, procs ...*Process) error {
	ctx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	var d net.Dialer
	tick := time.NewTicker(20 * time.Millisecond)
	defer tick.Stop()
	for {
		for _, p := range procs {
			if err := p.Exited(); err != nil {
				return err
			}
		}
		dctx, dcancel := context.WithTimeout(ctx, time.Second)
		c, err := d.DialContext(dctx, "tcp", addr)
		dcancel()
		if err == nil {
			c.Close()
			return nil
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("%s does not accept connections: %w (last: %w)", addr, ctx.Err(), err)
		case <-tick.C:
		}
	}
}

// firstLine returns the first non-empty line of s, trimmed.
// versionOf returns the first line a peer's binary prints for args (its version flag), or
// "unknown" when the binary is missing or prints nothing.
func versionOf(ctx context.Context, bin func() (string, error), args ...string) string {
	path, err := bin()
	if err != nil {
		return "unknown"
	}
	out, _ := exec.CommandContext(ctx, path, args...).CombinedOutput()
	if l := firstLine(string(out)); l != "" {
		return l
	}
	return "unknown"
}

func firstLine(s string) string {
	for l := range strings.Lines(s) {
		if l = strings.TrimSpace(l); l != "" {
			return l
		}
	}
	return ""
}

// writeFile writes a configuration file readable by the peer's workers,
// which may drop privileges (nginx workers run as nobody when started by
// root; the master reads the configuration, but keep it readable anyway).
func writeFile(path, content string) error {
	if err := os.WriteFile(path, []byte(content), 0o644); err != nil {
		return fmt.Errorf("write %s: %w", path, err)
	}
	return nil
}

// lookBin finds a peer's binary: bin if set (a name or a path), else def, on PATH. The error
// names the Debian packages that provide it.
func lookBin(bin, def, debianPackages string) (string, error) {
	name := bin
	if name == "" {
		name = def
	}
	p, err := exec.LookPath(name)
	if err != nil {
		return "", fmt.Errorf("%s not found (Debian: apt-get install --no-install-recommends %s): %w", name, debianPackages, err)
	}
	return p, nil
}
