package v1alpha1

import (
	"strings"
	"testing"
)

func TestDecodeProviderConfig(t *testing.T) {
	for _, tc := range []struct {
		name, raw  string
		wantErr    string
		wantEgress EgressMode
		wantProxy  bool
		wantAgents int // AgentsOr(7): 7 means "not configured"
		wantStack  TunnelStack
		wantGoAway string
		wantPerReq bool
	}{
		{name: "empty is the default", raw: "", wantEgress: EgressHTTPConnect},
		{name: "full", raw: `{"apiVersion":"tendril.extensions.gardener.cloud/v1alpha1","kind":"ProviderConfig","apiserverProxy":{"enabled":true},"egress":"httpConnect"}`, wantEgress: EgressHTTPConnect, wantProxy: true},
		{name: "grpc", raw: `{"egress":"grpc"}`, wantEgress: EgressGRPC},
		{name: "httpConnect through the relay", raw: `{"egress":"httpConnectRelay"}`, wantEgress: EgressHTTPConnectRelay},
		{name: "without type meta", raw: `{"egress":"httpConnect"}`, wantEgress: EgressHTTPConnect},
		{name: "two agents", raw: `{"highAvailability":{"agents":2}}`, wantEgress: EgressHTTPConnect, wantAgents: 2},
		{name: "one agent", raw: `{"highAvailability":{"agents":1}}`, wantEgress: EgressHTTPConnect, wantAgents: 1},
		{name: "zero agents", raw: `{"highAvailability":{"agents":0}}`, wantErr: "spec.providerConfig.highAvailability.agents: Invalid value: 0: must be between 1 and 2"},
		{name: "three agents", raw: `{"highAvailability":{"agents":3}}`, wantErr: "spec.providerConfig.highAvailability.agents: Invalid value: 3"},
		{name: "kernel tunnel", raw: `{"tunnel":{"stack":"kernel"}}`, wantEgress: EgressHTTPConnect, wantStack: TunnelStackKernel},
		{name: "userspace tunnel", raw: `{"tunnel":{"stack":"userspace"}}`, wantEgress: EgressHTTPConnect},
		{name: "tunnel without a stack", raw: `{"tunnel":{}}`, wantEgress: EgressHTTPConnect},
		{name: "bad tunnel stack", raw: `{"tunnel":{"stack":"tun"}}`, wantErr: `spec.providerConfig.tunnel.stack: Unsupported value: "tun"`},
		{name: "goaway chance", raw: `{"kubeAPIServer":{"goAwayChance":"0.001"}}`, wantEgress: EgressHTTPConnect, wantGoAway: "0.001"},
		{name: "goaway chance at the bound", raw: `{"kubeAPIServer":{"goAwayChance":"2e-2"}}`, wantEgress: EgressHTTPConnect, wantGoAway: "0.02"},
		{name: "kubeAPIServer without a goaway chance", raw: `{"kubeAPIServer":{}}`, wantEgress: EgressHTTPConnect},
		{name: "goaway chance above the bound", raw: `{"kubeAPIServer":{"goAwayChance":"0.03"}}`, wantErr: `spec.providerConfig.kubeAPIServer.goAwayChance: Invalid value: "0.03": must be a decimal above 0 and at most 0.02, or "0" for none`},
		{name: "zero goaway chance: none", raw: `{"kubeAPIServer":{"goAwayChance":"0"}}`, wantEgress: EgressHTTPConnect, wantGoAway: ""},
		{name: "zero goaway chance as a decimal", raw: `{"kubeAPIServer":{"goAwayChance":"0.0"}}`, wantErr: "spec.providerConfig.kubeAPIServer.goAwayChance"},
		{name: "negative goaway chance", raw: `{"kubeAPIServer":{"goAwayChance":"-0.01"}}`, wantErr: "spec.providerConfig.kubeAPIServer.goAwayChance"},
		{name: "NaN goaway chance", raw: `{"kubeAPIServer":{"goAwayChance":"NaN"}}`, wantErr: "spec.providerConfig.kubeAPIServer.goAwayChance"},
		{name: "goaway chance in per cent", raw: `{"kubeAPIServer":{"goAwayChance":"1%"}}`, wantErr: "spec.providerConfig.kubeAPIServer.goAwayChance"},
		{name: "goaway chance as a number", raw: `{"kubeAPIServer":{"goAwayChance":0.01}}`, wantErr: "cannot decode"},
		{name: "per-request balancing", raw: `{"kubeAPIServer":{"balancing":"PerRequest"}}`, wantEgress: EgressHTTPConnect, wantPerReq: true},
		{name: "per-connection balancing", raw: `{"kubeAPIServer":{"balancing":"PerConnection"}}`, wantEgress: EgressHTTPConnect},
		{name: "bad balancing", raw: `{"kubeAPIServer":{"balancing":"perRequest"}}`, wantErr: `spec.providerConfig.kubeAPIServer.balancing: Unsupported value: "perRequest"`},
		{name: "unknown field", raw: `{"egres":"grpc"}`, wantErr: `unknown field "egres"`},
		{name: "bad egress", raw: `{"egress":"socks"}`, wantErr: `spec.providerConfig.egress: Unsupported value: "socks"`},
		{name: "wrong kind", raw: `{"kind":"Other"}`, wantErr: "spec.providerConfig.kind"},
		{name: "wrong version", raw: `{"apiVersion":"tendril.extensions.gardener.cloud/v9"}`, wantErr: "spec.providerConfig.apiVersion"},
		{name: "garbage", raw: "\x00\xff", wantErr: "cannot decode"},
		{name: "two objects", raw: `{} {}`, wantErr: "trailing data"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			cfg, errs := DecodeProviderConfig([]byte(tc.raw))
			if tc.wantErr != "" {
				if len(errs) == 0 || !strings.Contains(errs.ToAggregate().Error(), tc.wantErr) {
					t.Fatalf("errors %v, want one containing %q", errs, tc.wantErr)
				}
				return
			}
			if len(errs) != 0 {
				t.Fatalf("unexpected errors: %v", errs)
			}
			if cfg.EgressOrDefault() != tc.wantEgress || cfg.APIServerProxyEnabled() != tc.wantProxy {
				t.Fatalf("got egress %q proxy %v", cfg.EgressOrDefault(), cfg.APIServerProxyEnabled())
			}
			want := tc.wantAgents
			if want == 0 {
				want = 7
			}
			if got := cfg.AgentsOr(7); got != want {
				t.Fatalf("agents %d, want %d", got, want)
			}
			wantStack := tc.wantStack
			if wantStack == "" {
				wantStack = TunnelStackUserspace
			}
			if got := cfg.TunnelStackOrDefault(); got != wantStack {
				t.Fatalf("tunnel stack %q, want %q", got, wantStack)
			}
			if got := cfg.GoAwayChance(); got != tc.wantGoAway {
				t.Fatalf("goaway chance %q, want %q", got, tc.wantGoAway)
			}
			if got := cfg.PerRequest(); got != tc.wantPerReq {
				t.Fatalf("per-request balancing %v, want %v", got, tc.wantPerReq)
			}
		})
	}
}

// TestEgressFor: an unset mode is httpConnectRelay with several servers and httpConnect with one;
// a configured mode is kept either way.
func TestEgressFor(t *testing.T) {
	for _, tc := range []struct {
		cfg     *ProviderConfig
		several bool
		want    EgressMode
	}{
		{nil, false, EgressHTTPConnect},
		{nil, true, EgressHTTPConnectRelay},
		{&ProviderConfig{}, true, EgressHTTPConnectRelay},
		{&ProviderConfig{Egress: EgressHTTPConnect}, true, EgressHTTPConnect},
		{&ProviderConfig{Egress: EgressGRPC}, false, EgressGRPC},
	} {
		if got := tc.cfg.EgressFor(tc.several); got != tc.want {
			t.Errorf("%+v, several servers %v: %q, want %q", tc.cfg, tc.several, got, tc.want)
		}
	}
}

// TestGoAwayChanceWith: the seed's default applies to a shoot balanced per connection that sets
// no chance of its own; its own chance wins; "0" is none; a shoot balanced per request gets the
// default not (its own, if it sets one, it does).
func TestGoAwayChanceWith(t *testing.T) {
	for _, tc := range []struct {
		raw, seed, want string
	}{
		{`{}`, "", ""},
		{`{}`, "0.002", "0.002"},
		{`{"kubeAPIServer":{"goAwayChance":"0.001"}}`, "0.002", "0.001"},
		{`{"kubeAPIServer":{"goAwayChance":"0"}}`, "0.002", ""},
		{`{"kubeAPIServer":{"balancing":"PerConnection"}}`, "0.002", "0.002"},
		{`{"kubeAPIServer":{"balancing":"PerRequest"}}`, "0.002", ""},
		{`{"kubeAPIServer":{"balancing":"PerRequest","goAwayChance":"0.001"}}`, "0.002", "0.001"},
	} {
		cfg, errs := DecodeProviderConfig([]byte(tc.raw))
		if len(errs) > 0 {
			t.Fatalf("%s: %v", tc.raw, errs)
		}
		if got := cfg.GoAwayChanceWith(tc.seed); got != tc.want {
			t.Errorf("%s with the seed's %q: %q, want %q", tc.raw, tc.seed, got, tc.want)
		}
	}
	var none *ProviderConfig
	if got := none.GoAwayChanceWith("0.002"); got != "0.002" {
		t.Errorf("no providerConfig with the seed's 0.002: %q", got)
	}
	for s, want := range map[string]bool{"0.001": true, "0.02": true, "0": false, "0.03": false, "NaN": false, "x": false, "": false} {
		if ValidGoAwayChance(s) != want {
			t.Errorf("ValidGoAwayChance(%q) = %v", s, !want)
		}
	}
}
