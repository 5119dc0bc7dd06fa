package realseed

import (
	"context"
	"fmt"
	"net"
	"net/netip"
	"strconv"
	"time"

	v1beta1constants "github.com/gardener/gardener/pkg/apis/core/v1beta1/constants"
	corednsconstants "github.com/gardener/gardener/pkg/component/networking/coredns/constants"
	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	networkingv1 "k8s.io/api/networking/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/utils/ptr"
	"sigs.k8s.io/controller-runtime/pkg/client"

	"github.com/tendril-net/tendril/extension/manifest"
	"github.com/tendril-net/tendril/extension/networkpaths"
	"github.com/tendril-net/tendril/internal/kube/netpoleval"
)

// The shoot side's actors: probe pods in the shoot's kube-system on its node, each with the
// labels the policies select (the agent's from its Deployment's template).
const (
	shootAgent    = "tendril-agent"
	shootFromSeed = "metrics-server (from-seed)"
	shootCoreDNS  = "coredns"
	shootPlain    = "kube-system pod without policy labels"
	fromSeedPort  = 10250
)

// shootPaths are the rows of the shoot side of docs/network-paths.md that a shoot without
// Gardener's VPN has, and what Gardener's deny-all in kube-system (shoot system component,
// Kubernetes ≥ 1.33) means for a pod no other policy selects.
func shootPaths() []networkpaths.Path {
	return []networkpaths.Path{
		{From: shootAgent, To: shootFromSeed, Port: fromSeedPort, Want: true, Why: "kubectl top, HPA: the seed through the tunnel"},
		{From: shootAgent, To: networkpaths.Internet, Port: manifest.PortIngressProxy, Want: true, Why: "the agent dials the seed ingress"},
		{From: shootCoreDNS, To: shootFromSeed, Port: fromSeedPort, Want: false, Why: "from-seed is the seed's only"},
		{From: shootPlain, To: shootFromSeed, Port: fromSeedPort, Want: false, Why: "Gardener's deny-all in kube-system"},
		{From: shootPlain, To: networkpaths.Internet, Port: manifest.PortIngressProxy, Want: false, Why: "Gardener's deny-all in kube-system"},
	}
}

// shootPathSettle is how long a path's connection may take to come out as the policies say
// after its probe pods run: kube-router puts a new pod into its chains at its next sync.
const shootPathSettle = 15 * time.Second

// MeasureShootPaths builds the shoot side's actors in shoot s as probe pods on its node, judges
// each path with the evaluator from the policies in the shoot (Gardener's shoot system
// component's, tendril's ManagedResource's), and opens a connection along it from the source's
// probe pod (kubectl exec through the shoot's API server, so through the tunnel); kube-router on
// the shoot's node enforces the policies. A connection that disagrees with the verdict is tried
// again for shootPathSettle (kube-router's sync) before it counts.
func (c *Cluster) MeasureShootPaths(ctx context.Context, s *Shoot, lb string) ([]PathRow, error) {
	var agent appsv1.Deployment
	if err := s.Client.Get(ctx, client.ObjectKey{Namespace: manifest.ShootNamespace, Name: manifest.AgentObjectName(0)}, &agent); err != nil {
		return nil, fmt.Errorf("shoot %s: the agent's Deployment: %w", s.cfg.Name, err)
	}
	labels := map[string]map[string]string{
		shootAgent:    agent.Spec.Template.Labels,
		shootFromSeed: {"k8s-app": "metrics-server", v1beta1constants.LabelNetworkPolicyShootFromSeed: v1beta1constants.LabelNetworkPolicyAllowed},
		shootCoreDNS:  {corednsconstants.LabelKey: corednsconstants.LabelValue},
		shootPlain:    {"app": "plain"},
	}
	var ns corev1.Namespace
	if err := s.Client.Get(ctx, client.ObjectKey{Name: manifest.ShootNamespace}, &ns); err != nil {
		return nil, err
	}
	// The agent's probe carries the labels the agent's ReplicaSet selects: owned by a ConfigMap
	// as its controller, the ReplicaSet cannot adopt it (and then scale the real agent down).
	owner := &corev1.ConfigMap{ObjectMeta: metav1.ObjectMeta{Name: "path-probes", Namespace: manifest.ShootNamespace}}
	if err := s.Client.Create(ctx, owner); err != nil {
		return nil, fmt.Errorf("shoot %s: %w", s.cfg.Name, err)
	}
	// Deleting the owner takes the probes with it (the shoot's garbage collector); each is
	// deleted at once as well, and waited for, so that nothing selects them afterwards.
	defer func() { _ = s.Client.Delete(context.Background(), owner) }()
	pods := map[string]*corev1.Pod{}
	defer c.deleteProbes(ctx, s, pods)
	actors := map[string]netpoleval.Endpoint{}
	for _, actor := range []string{shootAgent, shootFromSeed, shootCoreDNS, shootPlain} {
		name := "path-" + strconv.Itoa(len(pods))
		spec := probePodSpec(manifest.ShootNamespace, name, s.Node.cfg.Name, c.probeImage, labels[actor], nil,
			[]corev1.ContainerPort{{ContainerPort: fromSeedPort}}, []int32{fromSeedPort})
		spec.OwnerReferences = []metav1.OwnerReference{{APIVersion: "v1", Kind: "ConfigMap", Name: owner.Name, UID: owner.UID, Controller: ptr.To(true)}}
		p, err := c.runInShoot(ctx, s, spec)
		if err != nil {
			return nil, err
		}
		pods[actor] = p
		actors[actor] = netpoleval.Pod(p, &ns)
	}
	addr, err := netip.ParseAddr(lb)
	if err != nil {
		return nil, fmt.Errorf("load balancer %q: %w", lb, err)
	}
	actors[networkpaths.Internet] = netpoleval.Endpoint{Name: networkpaths.Internet, IP: addr}
	var policies networkingv1.NetworkPolicyList
	if err := s.Client.List(ctx, &policies); err != nil {
		return nil, err
	}
	var rows []PathRow
	for _, p := range shootPaths() {
		v, err := netpoleval.Evaluate(policies.Items, actors[p.From], actors[p.To], corev1.ProtocolTCP, p.Port)
		if err != nil {
			return nil, err
		}
		dst := lb
		if pod, ok := pods[p.To]; ok {
			dst = pod.Status.PodIP
		}
		row := PathRow{Path: p, Evaluated: v.Allowed}
		deadline := time.Now().Add(shootPathSettle)
		for {
			if row.Measured, row.Detail, err = dialIn(ctx, s.REST, s.kube, manifest.ShootNamespace, pods[p.From].Name,
				net.JoinHostPort(dst, strconv.Itoa(int(p.Port))), pathTimeout); err != nil {
				return nil, fmt.Errorf("shoot %s: %w", s.cfg.Name, err)
			}
			if row.Measured == row.Evaluated || time.Now().After(deadline) {
				break
			}
			time.Sleep(time.Second)
		}
		rows = append(rows, row)
	}
	return rows, nil
}

// deleteProbes deletes the probe pods and waits until they are gone.
func (c *Cluster) deleteProbes(ctx context.Context, s *Shoot, pods map[string]*corev1.Pod) {
	for _, p := range pods {
		_ = s.Client.Delete(ctx, p, client.GracePeriodSeconds(0))
	}
	_ = c.waitFor(ctx, "kubelet "+s.Node.cfg.Name, "the path probes gone", time.Minute, func(ctx context.Context) error {
		for _, p := range pods {
			if err := s.Client.Get(ctx, client.ObjectKeyFromObject(p), &corev1.Pod{}); !apierrors.IsNotFound(err) {
				return fmt.Errorf("pod %s still there (%v)", p.Name, err)
			}
		}
		return nil
	})
}
