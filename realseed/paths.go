package realseed

import (
	"context"
	"fmt"
	"net"
	"slices"
	"strconv"
	"strings"
	"time"

	tendrilv1alpha1 "github.com/tendril-net/tendril/apis/tendril/v1alpha1"
	corev1 "k8s.io/api/core/v1"
	"sigs.k8s.io/controller-runtime/pkg/client"

	"github.com/tendril-net/tendril/extension/networkpaths"
	"github.com/tendril-net/tendril/internal/kube/kubescheme"
)

// The paths' world lives in namespaces of its own, beside tendril's real installation: the
// policies Gardener's controllers derive for it are the same, and its probe pods answer for the
// actors without standing in for a real pod behind a real Service.
const (
	pathsExtNS = "extension-tendril-paths"
	pathsA     = "shoot--paths--a"
	pathsB     = "shoot--paths--b"
)

// PathsShoots are the two shoots of the measured table, named and configured as in
// docs/network-paths.md (A: httpConnect, B: grpc and Gardener's VPN as the HA pair).
var PathsShoots = [2]networkpaths.Shoot{
	{Name: "A", Namespace: pathsA, Egress: tendrilv1alpha1.EgressHTTPConnect},
	{Name: "B", Namespace: pathsB, Egress: tendrilv1alpha1.EgressGRPC, VPNHighAvailability: true},
}

// PathRow is one network path: what tendril wants, what internal/kube/netpoleval judged from the
// policies Gardener's controllers wrote, and what kube-router did with a connection along it.
type PathRow struct {
	networkpaths.Path
	Evaluated bool
	// Measured is whether the connection opened; Detail says how (the probe's words).
	Measured bool
	Detail   string
}

// pathTimeout is how long a connection along a path may take to open: kube-router drops or
// rejects a denied one, and an allowed one opens in a millisecond on one node.
const pathTimeout = 2 * time.Second

// MeasurePaths builds extension/networkpaths' World in the cluster with a probe pod for every
// actor (its Deployment template's labels, annotations and ports), lets Gardener's NetworkPolicy
// controllers write their policies, judges every path with the evaluator and then opens a TCP
// connection along it: from the source's probe pod (kubectl exec); for the load balancer from a
// network namespace standing for the internet (makeWorld); for the seed API server, a process
// of the node, from the node.
func (c *Cluster) MeasurePaths(ctx context.Context) ([]PathRow, error) {
	paths := networkpaths.SeedPaths(PathsShoots[0], PathsShoots[1])
	ports := map[int32]bool{}
	for _, p := range paths {
		ports[p.Port] = true
	}
	w := networkpaths.NewWorldWith(c.Client, networkpaths.WorldOptions{
		SeedAPIServer: c.NodeIP,
		MakePod: func(ctx context.Context, ns, name string, tmpl corev1.PodTemplateSpec) (*corev1.Pod, error) {
			return c.probeFor(ctx, ns, name, tmpl, ports)
		},
		// Not Gardener's default namespace: the installed chart's gateway address names it.
		IstioNamespace: "istio-ingress-paths",
		// A second LoadBalancer Service on the node's one address would take the real
		// ingress's ports; the policies do not depend on the type.
		Mutate: func(o client.Object) {
			if s, ok := o.(*corev1.Service); ok && s.Spec.Type == corev1.ServiceTypeLoadBalancer {
				s.Spec.Type = corev1.ServiceTypeClusterIP
				s.Spec.ExternalTrafficPolicy = ""
				for i := range s.Spec.Ports {
					s.Spec.Ports[i].NodePort = 0
				}
			}
		},
	})
	if err := w.Seed(ctx, kubescheme.New(), pathsExtNS); err != nil {
		return nil, fmt.Errorf("paths world, seed side: %w", err)
	}
	for _, s := range PathsShoots {
		if err := w.ShootControlPlane(ctx, s, pathsExtNS); err != nil {
			return nil, fmt.Errorf("paths world, shoot %s: %w", s.Name, err)
		}
	}
	res, err := networkpaths.Settle(ctx, c.Client, w.Actors(), paths, 2*time.Minute)
	if err != nil {
		return nil, err
	}
	if len(res.Problems) > 0 {
		return nil, fmt.Errorf("Gardener's policies did not settle as wanted:\n%s", strings.Join(res.Problems, "\n"))
	}
	// Settle waited for the policies to stop changing; kube-router applies a change within
	// its sync (under 0.2 s measured): give it a second more.
	time.Sleep(time.Second)
	if err := makeWorld(ctx); err != nil {
		return nil, err
	}
	defer removeWorld()
	pods := w.Pods()
	var rows []PathRow
	for _, p := range paths {
		dst, ok := pods[p.To]
		if !ok {
			return nil, fmt.Errorf("path %s → %s: no pod for the destination", p.From, p.To)
		}
		addr := net.JoinHostPort(dst.Status.PodIP, strconv.Itoa(int(p.Port)))
		row := PathRow{Path: p, Evaluated: p.Want} // Settle returned only with every verdict as wanted
		if src, ok := pods[p.From]; ok {
			row.Measured, row.Detail, err = c.Dial(ctx, src.Namespace, src.Name, addr, pathTimeout)
			if err != nil {
				return nil, err
			}
		} else if p.From == networkpaths.Internet {
			if row.Measured, row.Detail, err = c.dialFromWorld(ctx, addr, pathTimeout); err != nil {
				return nil, err
			}
		} else {
			// The seed API server is a process of the node: its connections come from the node.
			conn, err := net.DialTimeout("tcp", addr, pathTimeout)
			row.Measured = err == nil
			if err == nil {
				conn.Close()
				row.Detail = "open (from the node)"
			} else {
				row.Detail = "closed (from the node): " + err.Error()
			}
		}
		rows = append(rows, row)
	}
	return rows, nil
}

// probeFor makes the probe pod that stands in for a Deployment's pod: its template's labels
// and annotations (what the policies select), every container's ports in one container (what
// named ports resolve against), listening on those and on every path's port.
func (c *Cluster) probeFor(ctx context.Context, ns, name string, tmpl corev1.PodTemplateSpec, pathPorts map[int32]bool) (*corev1.Pod, error) {
	listen := map[int32]bool{}
	for p := range pathPorts {
		listen[p] = true
	}
	var cports []corev1.ContainerPort
	seen := map[string]bool{}
	for _, ct := range append(tmpl.Spec.InitContainers, tmpl.Spec.Containers...) {
		for _, p := range ct.Ports {
			key := p.Name + "/" + strconv.Itoa(int(p.ContainerPort))
			if seen[key] || (p.Name != "" && seen[p.Name]) {
				continue
			}
			seen[key], seen[p.Name] = true, true
			cports = append(cports, corev1.ContainerPort{Name: p.Name, ContainerPort: p.ContainerPort, Protocol: p.Protocol})
			if p.Protocol == "" || p.Protocol == corev1.ProtocolTCP {
				listen[p.ContainerPort] = true
			}
		}
	}
	var serve []int32
	for p := range listen {
		serve = append(serve, p)
	}
	slices.Sort(serve)
	return c.probePod(ctx, ns, name, "", tmpl.Labels, tmpl.Annotations, cports, serve)
}

// PathsDocument is docs/network-paths-measured.md for the seed's rows and a shoot's.
func PathsDocument(rows, shootRows []PathRow) string {
	word := map[bool]string{true: "allowed", false: "denied"}
	conn := map[bool]string{true: "open", false: "closed"}
	var b strings.Builder
	b.WriteString(`# Network paths on a real seed, measured

Generated by ` + "`go test ./realseed -run TestRealSeed -update`" + ` as root (make test runs it and fails
when this file is stale or a row's connection disagrees with the policies' verdict, marked ✗).

The real seed of ` + "`make seed`" + ` (package realseed): one node with kube-router enforcing
NetworkPolicies. The paths of [docs/network-paths.md](network-paths.md) are built again there, in
namespaces of their own beside tendril's installation, labelled as gardenlet labels them: the
tendril-seed chart's Services, extension/manifest's tendril-server Service and Gardener's
kube-apiserver Service per shoot, Gardener's istio ingress gateway and each shoot's vpn-seed-server
as Gardener's components make them, and for every actor a probe pod (` + "`tendril-probe`" + `) with its
Deployment template's labels, annotations and ports. Gardener's own NetworkPolicy controllers
(gardenlet's seed controller, the resource manager's) write the policies; internal/kube/netpoleval
judges each path from them, and a TCP connection along it is then opened from the source's probe
pod (kubectl exec); from a network namespace joined to the node by a veth pair (198.51.100.2, neither
a pod's nor the node's address: kube-router admits the node's own traffic to its pods whatever the
policies say) for the load balancer; from the node for the seed API server, a process of the node.
Every probe pod listens on every port of the table, so a closed connection is one kube-router
dropped or rejected, not a port nobody listens on.

| from | to | port | why | wanted | policies (netpoleval) | connection (kube-router) |
|---|---|---|---|---|---|---|
`)
	table := func(rows []PathRow) {
		for _, r := range rows {
			mark := ""
			if r.Measured != r.Evaluated {
				mark = " ✗"
			}
			fmt.Fprintf(&b, "| %s | %s | %d | %s | %s | %s | %s%s |\n", r.From, r.To, r.Port, r.Why, word[r.Want], word[r.Evaluated], conn[r.Measured], mark)
		}
	}
	table(rows)
	b.WriteString(`
## Shoot side

In make seed's shoot ` + "`a`" + ` (package realseed, StartShoot): kube-system of the shoot as Gardener's
resource manager applies it (Gardener's shoot system component: ` + "`gardener.cloud--deny-all`" + ` and
the allow-to-* policies; tendril's ManagedResource: the agent's policies), kube-router enforcing
them on the shoot's node. A probe pod on that node for each actor with the labels the policies
select (the agent's from its Deployment's template), each connection opened from the source's
probe pod by an exec through the shoot's API server (so through the tunnel), retried for up to
15 s while kube-router's next sync puts a new pod into its chains. The load balancer is the
ingress's address. Gardener's vpn-shoot is not deployed in these shoots: its rows stay in the
evaluator's table.

| from | to | port | why | wanted | policies (netpoleval) | connection (kube-router) |
|---|---|---|---|---|---|---|
`)
	table(shootRows)
	return b.String()
}
