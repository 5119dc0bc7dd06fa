// Package source feeds route sets to the xDS server. This file is the static source: a YAML route
// file, re-read when it changes, so tendril runs without Kubernetes. It resolves host names in
// the file (EDS endpoints must be IPs) and validates the whole set; a bad file is refused and the
// last good set stays served. It does not translate or serve xDS.
package source

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/netip"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"time"

	"github.com/fsnotify/fsnotify"
	"github.com/go-logr/logr"
	"github.com/prometheus/client_golang/prometheus"
	"sigs.k8s.io/yaml"

	"github.com/tendril-net/tendril/xds/model"
)

// RouteFile is the route file's format.
type RouteFile struct {
	// Shoots must be present and a list: "shoots: []" serves no shoot. A file without it (empty,
	// only whitespace or comments, or "shoots:" alone) is refused with ErrNoShoots, because that
	// is what a file being rewritten in place looks like between its truncation and its write.
	Shoots []RouteEntry `json:"shoots"`
}

// ErrNoShoots refuses a route file without a "shoots" list.
var ErrNoShoots = errors.New(`no "shoots" list: an empty or partly written file is refused (write "shoots: []" to serve no shoot)`)

// RouteEntry is one shoot in the route file. Upstream addresses may name hosts; they are
// resolved when the file is loaded.
type RouteEntry struct {
	Name              string    `json:"name"`
	Hosts             []string  `json:"hosts"`
	APIServer         Addresses `json:"apiserver"`
	AdvertisedAddress string    `json:"advertisedAddress,omitempty"`
	VPNServer         Addresses `json:"vpnServer,omitempty"`
	// VPNReplicas are the tunnel server's replicas by hostname (tendril-server-0: "host:port"),
	// each a single endpoint, for agents that keep a tunnel to each.
	VPNReplicas map[string]string `json:"vpnReplicas,omitempty"`
	// Terminate opts the shoot into the terminating mode of the SNI listener (model.Termination);
	// it holds private keys, so a route file with one is as secret as they are.
	Terminate *TerminateEntry `json:"terminate,omitempty"`
}

// TerminateEntry is a shoot's terminating route in the route file, every part PEM.
type TerminateEntry struct {
	ServingCert    string `json:"servingCert"`
	ServingKey     string `json:"servingKey"`
	ClientCA       string `json:"clientCA"`
	FrontProxyCert string `json:"frontProxyCert"`
	FrontProxyKey  string `json:"frontProxyKey"`
	APIServerCA    string `json:"apiserverCA"`
	APIServerName  string `json:"apiserverName"`
}

// Addresses are an upstream's "host:port" endpoints. In the file they are one string (the
// original format, still accepted) or a list of strings.
type Addresses []string

// UnmarshalJSON accepts a string or a list of strings.
func (a *Addresses) UnmarshalJSON(b []byte) error {
	var one string
	if err := json.Unmarshal(b, &one); err == nil {
		*a = Addresses{one}
		return nil
	}
	var list []string
	if err := json.Unmarshal(b, &list); err != nil {
		return errors.New("want \"host:port\" or a list of them")
	}
	*a = list
	return nil
}

// MarshalJSON writes a single address as a string, so a file written by tendril stays readable
// by older versions.
func (a Addresses) MarshalJSON() ([]byte, error) {
	if len(a) == 1 {
		return json.Marshal(a[0])
	}
	return json.Marshal([]string(a))
}

// Resolver looks up the addresses of a host; *net.Resolver is one.
type Resolver interface {
	LookupNetIP(ctx context.Context, network, host string) ([]netip.Addr, error)
}

// ResolveTimeout bounds the name lookups of one load, so a dead DNS server delays a reload rather
// than hanging it.
const ResolveTimeout = 10 * time.Second

// MaxFileSize bounds the route file: 10,000 shoots at ~200 B each is 2 MB.
const MaxFileSize = 32 << 20

// ParseRoutes decodes a route file, resolves its addresses with r (net.DefaultResolver if nil) and
// validates the set. Unknown fields are errors, so a misspelt key is not silently ignored.
func ParseRoutes(ctx context.Context, data []byte, r Resolver) ([]model.Shoot, error) {
	if r == nil {
		r = net.DefaultResolver
	}
	var f RouteFile
	if err := yaml.UnmarshalStrict(data, &f); err != nil {
		return nil, fmt.Errorf("decode routes: %w", err)
	}
	if f.Shoots == nil {
		// Decoding leaves the slice nil when the key is missing or null; "shoots: []" makes it
		// empty and non-nil.
		return nil, ErrNoShoots
	}
	ctx, cancel := context.WithTimeout(ctx, ResolveTimeout)
	defer cancel()
	shoots := make([]model.Shoot, 0, len(f.Shoots))
	for i, e := range f.Shoots {
		s, err := e.model(ctx, r)
		if err != nil {
			return nil, fmt.Errorf("shoots[%d] (%s): %w", i, e.Name, err)
		}
		shoots = append(shoots, s)
	}
	if err := model.ValidateSet(shoots); err != nil {
		return nil, err
	}
	model.Sort(shoots)
	return shoots, nil
}

func (e RouteEntry) model(ctx context.Context, r Resolver) (model.Shoot, error) {
	s := model.Shoot{Name: e.Name, Hosts: e.Hosts}
	var err error
	if len(e.APIServer) == 0 {
		return s, errors.New("apiserver is required")
	}
	if s.APIServers, err = resolveAll(ctx, r, e.APIServer); err != nil {
		return s, fmt.Errorf("apiserver: %w", err)
	}
	if s.VPNServers, err = resolveAll(ctx, r, e.VPNServer); err != nil {
		return s, fmt.Errorf("vpnServer: %w", err)
	}
	for host, addr := range e.VPNReplicas {
		eps, err := resolveHostPort(ctx, r, addr)
		if err != nil {
			return s, fmt.Errorf("vpnReplicas[%s]: %w", host, err)
		}
		if len(eps) != 1 {
			return s, fmt.Errorf("vpnReplicas[%s]: %s has %d addresses, want one (a replica is one pod)", host, addr, len(eps))
		}
		s.VPNReplicas = append(s.VPNReplicas, model.VPNReplica{Hostname: host, Endpoint: eps[0]})
	}
	model.SortReplicas(s.VPNReplicas)
	if t := e.Terminate; t != nil {
		s.Termination = &model.Termination{
			ServingCert: []byte(t.ServingCert), ServingKey: []byte(t.ServingKey), ClientCA: []byte(t.ClientCA),
			FrontProxyCert: []byte(t.FrontProxyCert), FrontProxyKey: []byte(t.FrontProxyKey),
			APIServerCA: []byte(t.APIServerCA), APIServerName: t.APIServerName,
		}
	}
	if e.AdvertisedAddress != "" {
		// An advertised address is what clients dial, so it is an IP by definition.
		if s.AdvertisedAddress, err = netip.ParseAddr(e.AdvertisedAddress); err != nil {
			return s, fmt.Errorf("advertisedAddress: %w", err)
		}
	}
	return s, nil
}

// resolveAll resolves every "host:port" of an upstream into its endpoints, sorted and without
// duplicates, so that reloading an unchanged file never reorders them.
func resolveAll(ctx context.Context, r Resolver, addrs Addresses) ([]netip.AddrPort, error) {
	var out []netip.AddrPort
	for _, a := range addrs {
		eps, err := resolveHostPort(ctx, r, a)
		if err != nil {
			return nil, err
		}
		out = append(out, eps...)
	}
	slices.SortFunc(out, netip.AddrPort.Compare)
	return slices.Compact(out), nil
}

// resolveHostPort turns "host:port" into endpoints: the IP itself, or every address the host
// resolves to (a headless Service names all of its replicas).
func resolveHostPort(ctx context.Context, r Resolver, hostport string) ([]netip.AddrPort, error) {
	host, portStr, err := net.SplitHostPort(hostport)
	if err != nil {
		return nil, err
	}
	port, err := strconv.ParseUint(portStr, 10, 16)
	if err != nil || port == 0 {
		return nil, fmt.Errorf("invalid port %q", portStr)
	}
	if ip, err := netip.ParseAddr(host); err == nil {
		return []netip.AddrPort{netip.AddrPortFrom(ip.Unmap(), uint16(port))}, nil
	}
	ips, err := r.LookupNetIP(ctx, "ip", host)
	if err != nil {
		return nil, fmt.Errorf("resolve %s: %w", host, err)
	}
	if len(ips) == 0 {
		return nil, fmt.Errorf("resolve %s: no addresses", host)
	}
	out := make([]netip.AddrPort, len(ips))
	for i, ip := range ips {
		out[i] = netip.AddrPortFrom(ip.Unmap(), uint16(port))
	}
	return out, nil
}

// File watches a route file and publishes its route set: once at start and after every change.
type File struct {
	// Path is the route file.
	Path string
	// Resolver resolves host names in the file. If nil, net.DefaultResolver.
	Resolver Resolver
	// Log receives load errors and reloads. The zero value discards them.
	Log logr.Logger
	// Settle is the debounce: the file must be quiet for this long after an event before it is
	// read, and then read again this long later with the same content before it is parsed, so
	// that an editor's, a ConfigMap's or a shell redirection's multi-step write is read once,
	// complete. A reload thus comes 2 × Settle after the last write at the earliest. If zero,
	// 100 ms.
	Settle time.Duration
	// Registry receives the load counter. If nil, it is not registered.
	Registry prometheus.Registerer
}

// Publish receives each good route set; an error it returns is logged and the set counts as
// rejected.
type Publish func([]model.Shoot) error

// Run loads the file, publishes it, and republishes after each change until ctx ends. The first
// load must succeed: starting without routes because of a typo would look like a healthy ingress
// refusing every shoot. Later bad versions are logged, counted and skipped.
func (f *File) Run(ctx context.Context, publish Publish) error {
	loads := prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "tendril_route_file_loads_total",
		Help: "Route file loads, by outcome: applied, rejected (invalid), no_shoots (empty or without a shoots list), unsettled (changed between two reads a settle time apart; read again).",
	}, []string{"outcome"})
	if f.Registry != nil {
		if err := f.Registry.Register(loads); err != nil {
			return fmt.Errorf("register route file metrics: %w", err)
		}
	}
	w, err := fsnotify.NewWatcher()
	if err != nil {
		return fmt.Errorf("watch route file: %w", err)
	}
	defer w.Close()
	// The watch starts before the first load, so a change made while it loads is not missed.
	// Watch the directory, not the file: editors and ConfigMap volumes replace the file by rename,
	// which ends a watch on the file itself.
	if err := w.Add(filepath.Dir(f.Path)); err != nil {
		return fmt.Errorf("watch route file: %w", err)
	}
	settle := f.Settle
	if settle == 0 {
		settle = 100 * time.Millisecond
	}

	shoots, err := f.loadSettled(ctx, settle, loads)
	if err != nil {
		return err
	}
	if err := publish(shoots); err != nil {
		return fmt.Errorf("route file %s: %w", f.Path, err)
	}
	loads.WithLabelValues("applied").Inc()
	f.Log.Info("Routes loaded", "path", f.Path, "shoots", len(shoots))
	timer := time.NewTimer(0)
	<-timer.C
	// read is the content read when the timer last fired after quiet, waiting to be confirmed by
	// an identical second read; nil when the next firing is a first read.
	var read []byte
	for {
		select {
		case <-ctx.Done():
			timer.Stop()
			return nil
		case err := <-w.Errors:
			f.Log.Error(err, "Watching route file", "path", f.Path)
		case ev := <-w.Events:
			// Only the file itself and a ConfigMap volume's "..data" symlink swap concern us;
			// other files in the directory (logs, say) must not cause reloads. Reading an
			// unchanged file again resolves its host names again, which is wanted, and the xDS
			// server turns an unchanged set into no update at all.
			if filepath.Clean(ev.Name) == filepath.Clean(f.Path) || filepath.Base(ev.Name) == "..data" {
				read = nil
				timer.Reset(settle)
			}
		case <-timer.C:
			data, err := readBounded(f.Path)
			if err == nil && (read == nil || !bytes.Equal(data, read)) {
				// A first read, or the file changed since the last one without an event we
				// saw: read again after another settle time.
				if read != nil {
					loads.WithLabelValues("unsettled").Inc()
				}
				read = data
				timer.Reset(settle)
				continue
			}
			read = nil
			var shoots []model.Shoot
			if err == nil {
				shoots, err = f.parse(ctx, data)
			}
			if err == nil {
				err = publish(shoots)
			}
			if err != nil {
				outcome := "rejected"
				if errors.Is(err, ErrNoShoots) {
					outcome = "no_shoots"
				}
				loads.WithLabelValues(outcome).Inc()
				f.Log.Error(err, "Route file rejected, keeping the last good routes", "path", f.Path)
				continue
			}
			loads.WithLabelValues("applied").Inc()
			f.Log.Info("Routes reloaded", "path", f.Path, "shoots", len(shoots))
		}
	}
}

// loadSettled is the first load: the file is read until two reads settle apart agree, so a file
// being written as tendril-seed starts is read complete.
func (f *File) loadSettled(ctx context.Context, settle time.Duration, loads *prometheus.CounterVec) ([]model.Shoot, error) {
	data, err := readBounded(f.Path)
	if err != nil {
		return nil, err
	}
	for {
		select {
		case <-ctx.Done():
			return nil, ctx.Err()
		case <-time.After(settle):
		}
		again, err := readBounded(f.Path)
		if err != nil {
			return nil, err
		}
		if bytes.Equal(again, data) {
			return f.parse(ctx, data)
		}
		loads.WithLabelValues("unsettled").Inc()
		data = again
	}
}

func (f *File) parse(ctx context.Context, data []byte) ([]model.Shoot, error) {
	shoots, err := ParseRoutes(ctx, data, f.Resolver)
	if err != nil {
		return nil, fmt.Errorf("route file %s: %w", f.Path, err)
	}
	return shoots, nil
}

func readBounded(path string) ([]byte, error) {
	fh, err := os.Open(path)
	if err != nil {
		return nil, fmt.Errorf("read route file: %w", err)
	}
	defer fh.Close()
	var buf bytes.Buffer
	if _, err := buf.ReadFrom(io.LimitReader(fh, MaxFileSize+1)); err != nil {
		return nil, fmt.Errorf("read route file %s: %w", path, err)
	}
	if buf.Len() > MaxFileSize {
		return nil, fmt.Errorf("route file %s: larger than %d bytes", path, MaxFileSize)
	}
	return buf.Bytes(), nil
}
