package charts

import (
	"slices"
	"strings"
	"testing"

	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
)

// TestUnifiedPortChoices: by default the legacy tunnel port is served, the unified port is
// CONNECT only, and Gardener's gateway is the relay for what only it serves; with
// ingress.removeHTTPProxyLegacyPort (Gardener's gate of that name) the ingress binds, exposes and
// opens no 8132, and ingress.proxyProtocol, an empty gardenerGateway and the seed's goAwayChance
// reach tendril-seed's flags.
func TestUnifiedPortChoices(t *testing.T) {
	type want struct {
		svcPorts  []int32
		fromWorld string
		tunnel    bool
		seedArgs  []string
		noArgs    []string
	}
	for name, tc := range map[string]struct {
		values map[string]any
		want   want
	}{
		"default": {nil, want{
			svcPorts: []int32{443, 8443, 8132}, fromWorld: `[{"protocol":"TCP","port":443},{"protocol":"TCP","port":8443},{"protocol":"TCP","port":8132}]`, tunnel: true,
			seedArgs: []string{"--gardener-gateway=istio-ingressgateway.istio-ingress.svc.cluster.local:8443"},
			noArgs:   []string{"--proxy-protocol", "--remove-http-proxy-legacy-port", "--goaway-chance="},
		}},
		"no legacy port, PROXY, no gateway": {map[string]any{
			"gardenerGateway": "",
			"goAwayChance":    "0.001",
			"ingress":         map[string]any{"removeHTTPProxyLegacyPort": true, "proxyProtocol": true},
		}, want{
			svcPorts: []int32{443, 8443}, fromWorld: `[{"protocol":"TCP","port":443},{"protocol":"TCP","port":8443}]`, tunnel: false,
			seedArgs: []string{"--proxy-protocol", "--remove-http-proxy-legacy-port", "--goaway-chance=0.001"},
			noArgs:   []string{"--gardener-gateway="},
		}},
	} {
		t.Run(name, func(t *testing.T) {
			objs := decode(t, render(t, tc.values))
			svc := find[*corev1.Service](t, objs, "tendril-ingress")
			var ports []int32
			for _, p := range svc.Spec.Ports {
				ports = append(ports, p.Port)
			}
			if !slices.Equal(ports, tc.want.svcPorts) {
				t.Errorf("Service ports %v, want %v", ports, tc.want.svcPorts)
			}
			if got := svc.Annotations["networking.resources.gardener.cloud/from-world-to-ports"]; got != tc.want.fromWorld {
				t.Errorf("from-world-to-ports %s, want %s", got, tc.want.fromWorld)
			}
			c := find[*appsv1.Deployment](t, objs, "tendril-ingress").Spec.Template.Spec.Containers[0]
			_, hasPort := containerPorts(c)["tunnel"]
			hasFlag := slices.ContainsFunc(c.Args, func(a string) bool { return strings.HasPrefix(a, "--tunnel-address=") })
			if hasPort != tc.want.tunnel || hasFlag != tc.want.tunnel {
				t.Errorf("tunnel container port %v, --tunnel-address %v; want both %v", hasPort, hasFlag, tc.want.tunnel)
			}
			args := find[*appsv1.Deployment](t, objs, "gardener-extension-tendril").Spec.Template.Spec.Containers[0].Args
			for _, a := range tc.want.seedArgs {
				if !slices.Contains(args, a) {
					t.Errorf("tendril-seed lacks %s: %v", a, args)
				}
			}
			for _, a := range tc.want.noArgs {
				if slices.ContainsFunc(args, func(x string) bool { return strings.HasPrefix(x, a) }) {
					t.Errorf("tendril-seed has %s: %v", a, args)
				}
			}
		})
	}
}
