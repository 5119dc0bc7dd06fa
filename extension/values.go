package extension

import (
	"context"
	"fmt"
	"net/netip"
	"net/url"
	"slices"
	"strings"

	extensionscontroller "github.com/gardener/gardener/extensions/pkg/controller"
	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"sigs.k8s.io/controller-runtime/pkg/client"

	"github.com/tendril-net/tendril/extension/manifest"
)

// hostnames are the shoot's kube-apiserver names: api.<spec.dns.domain> and every host in
// status.advertisedAddresses (external, internal, …), lower-cased and without duplicates.
func hostnames(cluster *extensionscontroller.Cluster) []string {
	var hs []string
	add := func(h string) {
		h = strings.ToLower(strings.TrimSuffix(h, "."))
		if h != "" && !slices.Contains(hs, h) {
			hs = append(hs, h)
		}
	}
	shoot := cluster.Shoot
	if shoot.Spec.DNS != nil && shoot.Spec.DNS.Domain != nil {
		add("api." + *shoot.Spec.DNS.Domain)
	}
	for _, a := range shoot.Status.AdvertisedAddresses {
		if a.Name == "service-account-issuer" {
			continue // not an API server address
		}
		if u, err := url.Parse(a.URL); err == nil && u.Hostname() != "" {
			if _, err := netip.ParseAddr(u.Hostname()); err != nil { // SNI carries names only
				add(u.Hostname())
			}
		}
	}
	slices.Sort(hs)
	return hs
}

// shootCIDRs are the shoot's node, pod and service networks, from status.networking when
// Gardener reports it (dual stack lists every family) and from the spec otherwise.
func shootCIDRs(cluster *extensionscontroller.Cluster) ([]netip.Prefix, error) {
	var raw []string
	if st := cluster.Shoot.Status.Networking; st != nil {
		raw = append(append(append(raw, st.Nodes...), st.Pods...), st.Services...)
	}
	if len(raw) == 0 && cluster.Shoot.Spec.Networking != nil {
		n := cluster.Shoot.Spec.Networking
		for _, s := range []*string{n.Nodes, n.Pods, n.Services} {
			if s != nil {
				raw = append(raw, strings.Split(*s, ",")...)
			}
		}
	}
	var ps []netip.Prefix
	for _, s := range raw {
		p, err := netip.ParsePrefix(strings.TrimSpace(s))
		if err != nil {
			return nil, fmt.Errorf("shoot network %q: %w", s, err)
		}
		ps = append(ps, p.Masked())
	}
	return ps, nil
}

// advertisedAddress reads kube-apiserver's --advertise-address from its Deployment (read
// only: Gardener owns it) and falls back to the Service's ClusterIP when the flag is absent.
// The zero Addr means neither exists yet.
func advertisedAddress(ctx context.Context, c client.Reader, namespace string) (netip.Addr, error) {
	dep := &appsv1.Deployment{}
	err := c.Get(ctx, client.ObjectKey{Namespace: namespace, Name: manifest.KubeAPIServerName}, dep)
	if err != nil && !apierrors.IsNotFound(err) {
		return netip.Addr{}, fmt.Errorf("read kube-apiserver deployment: %w", err)
	}
	if err == nil {
		for _, ctr := range dep.Spec.Template.Spec.Containers {
			if ctr.Name != manifest.KubeAPIServerName {
				continue
			}
			args := append(append([]string{}, ctr.Command...), ctr.Args...)
			for i, a := range args {
				v, ok := strings.CutPrefix(a, "--advertise-address=")
				if !ok && a == "--advertise-address" && i+1 < len(args) {
					v, ok = args[i+1], true
				}
				if ok {
					addr, err := netip.ParseAddr(v)
					if err != nil {
						return netip.Addr{}, fmt.Errorf("kube-apiserver --advertise-address %q: %w", v, err)
					}
					return addr, nil
				}
			}
		}
	}
	svc := &corev1.Service{}
	if err := c.Get(ctx, client.ObjectKey{Namespace: namespace, Name: manifest.KubeAPIServerName}, svc); err != nil {
		if apierrors.IsNotFound(err) {
			return netip.Addr{}, nil
		}
		return netip.Addr{}, fmt.Errorf("read kube-apiserver service: %w", err)
	}
	if addr, err := netip.ParseAddr(svc.Spec.ClusterIP); err == nil {
		return addr, nil
	}
	return netip.Addr{}, nil
}
