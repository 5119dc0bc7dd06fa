// Package model is tendril's routing model: one Route per shoot, naming the server names that reach
// its kube-apiserver, the advertised address the PROXY listener routes by, and the upstream
// endpoints behind them (kube-apiserver runs several replicas, so an upstream is a list). It validates routes but knows nothing about Envoy, xDS or Kubernetes; the
// sources (route file, Kubernetes objects) fill it and xds/translate turns it into resources.
package model

import (
	"cmp"
	"errors"
	"fmt"
	"net/netip"
	"slices"
	"strings"
)

// Shoot is the route of one shoot: everything the ingress needs to reach its control plane.
type Shoot struct {
	// Name is the shoot namespace in the seed, e.g. "shoot--dev--alpha". It names the shoot's
	// resources, so it must be a DNS label.
	Name string
	// Hosts are the TLS server names (SNI) that reach the shoot's kube-apiserver, lower-case.
	Hosts []string
	// APIServers are the kube-apiserver's endpoints, one per ready replica. EDS endpoints must be
	// IP addresses, so a source resolves host names before it builds the model. Empty means the
	// shoot is routed but has no ready endpoint: its clusters exist (its server names stay
	// claimed) and connections to it are refused until endpoints appear.
	APIServers []netip.AddrPort
	// AdvertisedAddress is kube-apiserver's advertised address, which in-cluster clients reach
	// through the PROXY listener; the zero value means the shoot has none.
	AdvertisedAddress netip.Addr
	// VPNServers are the shoot's tunnel endpoints (tendril-server), reached through the CONNECT
	// listeners; empty means the shoot has no tunnel route.
	VPNServers []netip.AddrPort
	// VPNReplicas are the tunnel server's replicas by their own names (an HA shoot's
	// tendril-server StatefulSet: each replica's hostname and endpoint), so that an agent can keep
	// a tunnel to each one; sorted by hostname. Empty: the shoot's server is reached only as a
	// whole (VPNServers).
	VPNReplicas []VPNReplica
	// Termination, when set, has the SNI listener terminate TLS for Hosts and balance each
	// request over APIServers; nil passes connections through to them.
	Termination *Termination

	// APIServer and VPNServer are single-endpoint shorthands, merged into the lists by
	// APIServerEndpoints and VPNServerEndpoints.
	//
	// Deprecated: use APIServers and VPNServers; kept until the remaining callers move.
	APIServer, VPNServer netip.AddrPort
}

// Validate reports the first thing wrong with one shoot's route.
func (s Shoot) Validate() error {
	if err := validateLabel(s.Name); err != nil {
		return fmt.Errorf("shoot name %q: %w", s.Name, err)
	}
	if err := validateEndpoints(s.APIServers, s.APIServer); err != nil {
		return fmt.Errorf("shoot %s: apiserver: %w", s.Name, err)
	}
	if err := validateEndpoints(s.VPNServers, s.VPNServer); err != nil {
		return fmt.Errorf("shoot %s: vpnServer: %w", s.Name, err)
	}
	if err := validateReplicas(s.VPNReplicas); err != nil {
		return fmt.Errorf("shoot %s: vpnReplicas: %w", s.Name, err)
	}
	if len(s.Hosts) == 0 {
		return fmt.Errorf("shoot %s: at least one host is required", s.Name)
	}
	if s.Termination != nil {
		if err := s.Termination.Validate(); err != nil {
			return fmt.Errorf("shoot %s: termination: %w", s.Name, err)
		}
	}
	seen := make(map[string]bool, len(s.Hosts))
	for _, h := range s.Hosts {
		if err := ValidateHost(h); err != nil {
			return fmt.Errorf("shoot %s: host %q: %w", s.Name, h, err)
		}
		if seen[h] {
			return fmt.Errorf("shoot %s: host %q listed twice", s.Name, h)
		}
		seen[h] = true
	}
	return nil
}

// APIServerEndpoints returns the kube-apiserver endpoints (APIServers and the deprecated
// APIServer), unmapped, sorted and without duplicates, so that the order a source lists them in
// never changes the resources.
func (s Shoot) APIServerEndpoints() []netip.AddrPort { return endpoints(s.APIServers, s.APIServer) }

// VPNServerEndpoints returns the tunnel endpoints like APIServerEndpoints.
func (s Shoot) VPNServerEndpoints() []netip.AddrPort { return endpoints(s.VPNServers, s.VPNServer) }

// VPNReplica is one replica of a shoot's tunnel server.
type VPNReplica struct {
	// Hostname is the replica's name in its Service's DNS (tendril-server-0): a DNS label.
	Hostname string
	// Endpoint is its tunnel endpoint.
	Endpoint netip.AddrPort
}

func validateReplicas(list []VPNReplica) error {
	seen := make(map[string]bool, len(list))
	for _, r := range list {
		if err := validateLabel(r.Hostname); err != nil {
			return fmt.Errorf("hostname %q: %w", r.Hostname, err)
		}
		if seen[r.Hostname] {
			return fmt.Errorf("hostname %q listed twice", r.Hostname)
		}
		seen[r.Hostname] = true
		if !r.Endpoint.IsValid() || r.Endpoint.Port() == 0 {
			return fmt.Errorf("%s: endpoint %q must be IP:port with a non-zero port", r.Hostname, r.Endpoint)
		}
	}
	return nil
}

// SortReplicas sorts replicas by hostname, then endpoint, so that the order a source lists them
// in never changes the resources.
func SortReplicas(list []VPNReplica) {
	slices.SortFunc(list, func(a, b VPNReplica) int {
		return cmp.Or(strings.Compare(a.Hostname, b.Hostname), a.Endpoint.Compare(b.Endpoint))
	})
}

func validateEndpoints(list []netip.AddrPort, single netip.AddrPort) error {
	if single.IsValid() {
		list = append(slices.Clip(list), single)
	}
	for _, e := range list {
		if !e.IsValid() || e.Port() == 0 {
			return fmt.Errorf("endpoint %q must be IP:port with a non-zero port", e)
		}
	}
	return nil
}

func endpoints(list []netip.AddrPort, single netip.AddrPort) []netip.AddrPort {
	out := make([]netip.AddrPort, 0, len(list)+1)
	for _, e := range list {
		out = append(out, netip.AddrPortFrom(e.Addr().Unmap(), e.Port()))
	}
	if single.IsValid() {
		out = append(out, netip.AddrPortFrom(single.Addr().Unmap(), single.Port()))
	}
	slices.SortFunc(out, netip.AddrPort.Compare)
	return slices.Compact(out)
}

// ValidateHost checks that h is a lower-case DNS name as a TLS client sends it in SNI: labels of
// letters, digits, '-' and '_' (a few real names carry it), separated by dots, at most 253 bytes.
// Upper case is refused rather than folded so that the route file and the generated cluster
// names agree byte for byte.
func ValidateHost(h string) error {
	if h == "" {
		return errors.New("empty")
	}
	// 253 = 255 octets of wire format minus the length byte of the first label and the root.
	if len(h) > 253 {
		return errors.New("longer than 253 bytes")
	}
	for _, label := range strings.Split(h, ".") {
		if label == "" {
			return errors.New("empty label")
		}
		if len(label) > 63 {
			return fmt.Errorf("label %q longer than 63 bytes", label)
		}
		for i := 0; i < len(label); i++ {
			c := label[i]
			switch {
			case c >= 'a' && c <= 'z', c >= '0' && c <= '9', c == '-', c == '_':
			case c >= 'A' && c <= 'Z':
				return errors.New("must be lower-case")
			default:
				return fmt.Errorf("invalid character %q", c)
			}
		}
	}
	return nil
}

func validateLabel(s string) error {
	if s == "" {
		return errors.New("empty")
	}
	if len(s) > 63 {
		return errors.New("longer than 63 bytes")
	}
	for i := 0; i < len(s); i++ {
		c := s[i]
		if !(c >= 'a' && c <= 'z' || c >= '0' && c <= '9' || c == '-') {
			return fmt.Errorf("invalid character %q (a DNS label is [a-z0-9-])", c)
		}
	}
	if s[0] == '-' || s[len(s)-1] == '-' {
		return errors.New("must start and end with a letter or digit")
	}
	return nil
}

// ValidateSet validates every shoot and the set as a whole: names are unique, and no server name
// or advertised address belongs to two shoots (either would route one shoot's clients to another;
// Claims.Admit). A shoot that conflicts is reported against the earlier one that holds the claim.
func ValidateSet(shoots []Shoot) error {
	names := make(map[string]bool, len(shoots))
	var claims Claims
	var errs []error
	for _, s := range shoots {
		if err := s.Validate(); err != nil {
			errs = append(errs, err)
			continue
		}
		if names[s.Name] {
			errs = append(errs, fmt.Errorf("shoot %s listed twice", s.Name))
			continue
		}
		names[s.Name] = true
		if err := claims.Admit(s); err != nil {
			errs = append(errs, err)
		}
	}
	return errors.Join(errs...)
}

// Sort orders shoots by name, the order every consumer of a set relies on for determinism.
func Sort(shoots []Shoot) {
	slices.SortFunc(shoots, func(a, b Shoot) int { return cmp.Compare(a.Name, b.Name) })
}

// Equal reports whether two routes are the same, field by field (lists in the same order).
// Written out rather than reflect.DeepEqual: the control plane compares every shoot of a set with
// the one it holds on each change, and at 10,000 shoots reflection was a fifth of its CPU.
func (s Shoot) Equal(o Shoot) bool {
	return s.Name == o.Name &&
		slices.Equal(s.Hosts, o.Hosts) &&
		slices.Equal(s.APIServers, o.APIServers) &&
		s.AdvertisedAddress == o.AdvertisedAddress &&
		slices.Equal(s.VPNServers, o.VPNServers) &&
		slices.Equal(s.VPNReplicas, o.VPNReplicas) &&
		s.Termination.Equal(o.Termination) &&
		s.APIServer == o.APIServer &&
		s.VPNServer == o.VPNServer
}
