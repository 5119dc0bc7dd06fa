package extension_test

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"maps"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	v1beta1helper "github.com/gardener/gardener/pkg/api/core/v1beta1/helper"
	gardencorev1beta1 "github.com/gardener/gardener/pkg/apis/core/v1beta1"
	v1beta1constants "github.com/gardener/gardener/pkg/apis/core/v1beta1/constants"
	extensionsv1alpha1 "github.com/gardener/gardener/pkg/apis/extensions/v1alpha1"
	resourcesv1alpha1 "github.com/gardener/gardener/pkg/apis/resources/v1alpha1"
	gardenerextension "github.com/gardener/gardener/pkg/component/extensions/extension"
	"github.com/gardener/gardener/pkg/utils/managedresources"
	secretsmanager "github.com/gardener/gardener/pkg/utils/secrets/manager"
	"github.com/go-logr/logr/testr"
	monitoringv1 "github.com/prometheus-operator/prometheus-operator/pkg/apis/monitoring/v1"
	monitoringv1alpha1 "github.com/prometheus-operator/prometheus-operator/pkg/apis/monitoring/v1alpha1"
	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	networkingv1 "k8s.io/api/networking/v1"
	policyv1 "k8s.io/api/policy/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/client-go/util/retry"
	"k8s.io/utils/clock"
	"k8s.io/utils/ptr"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/config"
	"sigs.k8s.io/controller-runtime/pkg/log"
	"sigs.k8s.io/controller-runtime/pkg/manager"
	metricsserver "sigs.k8s.io/controller-runtime/pkg/metrics/server"
	"sigs.k8s.io/yaml"

	tendrilv1alpha1 "github.com/tendril-net/tendril/apis/tendril/v1alpha1"
	"github.com/tendril-net/tendril/extension"
	"github.com/tendril-net/tendril/extension/manifest"
	"github.com/tendril-net/tendril/internal/testing/kubetest"
	"github.com/tendril-net/tendril/internal/testing/testwait"
	"github.com/tendril-net/tendril/wire"
)

// healthGrace is the tests' RolloutGrace: long enough to see Progressing on a loaded
// machine (one sync per second), short enough to wait for False.
const healthGrace = 8 * time.Second

// startController runs the Extension controller against a real API server until the test ends;
// its secrets manager runs on clk (nil: the real clock).
func startController(t *testing.T, env *kubetest.Env, clk clock.Clock) {
	t.Helper()
	log.SetLogger(testr.New(t))
	mgr, err := manager.New(env.Config, manager.Options{
		Scheme:  env.Scheme,
		Metrics: metricsserver.Options{BindAddress: "0"},
		// Two "seeds" in one test process run the same controllers twice.
		Controller: config.Controller{SkipNameValidation: ptr.To(true)},
	})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	if err := extension.Add(ctx, mgr, extension.AddOptions{Config: extension.Config{
		Image: "example.org/tendril:test", Ingress: "ingress.seed.example.org", Clock: clk,
	}}); err != nil {
		t.Fatal(err)
	}
	if err := extension.AddHealthCheck(mgr, extension.HealthOptions{SyncPeriod: time.Second, RolloutGrace: healthGrace}); err != nil {
		t.Fatal(err)
	}
	done := make(chan error, 1)
	go func() { done <- mgr.Start(ctx) }()
	controllerCaches.Store(env.Client, mgr.GetCache())
	t.Cleanup(func() {
		controllerCaches.Delete(env.Client)
		cancel()
		if err := <-done; err != nil {
			t.Errorf("manager: %v", err)
		}
	})
}

// controllerCaches maps an API server's client (kubetest.Env.Client) to the cache of the
// controller startController runs against it. Gardener's ShootNotFailedPredicate reads the
// shoot's Cluster from that cache when an Extension event arrives and drops the event if the
// Cluster is not there yet; gardenlet creates the Cluster long before a shoot's Extensions, a
// test a moment before, so shoot waits until the controller's cache has it.
var controllerCaches sync.Map // client.Client → client.Reader

// shoot creates what gardenlet would have in a shoot namespace before the Extension:
// the namespace, the Cluster, and kube-apiserver's Deployment and Service.
// shoot creates the shoot namespace, its Cluster and kube-apiserver; mutate edits the Shoot
// before it goes into the Cluster.
func shoot(t *testing.T, c client.Client, ns string, hibernated bool, mutate ...func(*gardencorev1beta1.Shoot)) {
	t.Helper()
	ctx := context.Background()
	// gardener.cloud/role=shoot: the generic reconciler reads the Cluster only in shoot namespaces.
	must(t, c.Create(ctx, &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: ns, Labels: map[string]string{v1beta1constants.GardenRole: v1beta1constants.GardenRoleShoot}}}))
	name := strings.TrimPrefix(ns, "shoot--local--")
	sh := &gardencorev1beta1.Shoot{
		TypeMeta:   metav1.TypeMeta{APIVersion: "core.gardener.cloud/v1beta1", Kind: "Shoot"},
		ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: "garden-local"},
		Spec: gardencorev1beta1.ShootSpec{
			DNS: &gardencorev1beta1.DNS{Domain: ptr.To(name + ".local.example.org")},
			Networking: &gardencorev1beta1.Networking{
				Nodes: ptr.To("10.250.0.0/16"), Pods: ptr.To("100.64.0.0/12"), Services: ptr.To("100.104.0.0/13"),
			},
			Hibernation: &gardencorev1beta1.Hibernation{Enabled: ptr.To(hibernated)},
		},
		Status: gardencorev1beta1.ShootStatus{
			IsHibernated: hibernated,
			AdvertisedAddresses: []gardencorev1beta1.ShootAdvertisedAddress{
				{Name: "external", URL: "https://api." + name + ".local.example.org"},
				{Name: "internal", URL: "https://api." + name + ".local.internal.example.org"},
				{Name: "service-account-issuer", URL: "https://issuer.example.org/" + name},
			},
		},
	}
	for _, m := range mutate {
		m(sh)
	}
	raw, err := json.Marshal(sh)
	must(t, err)
	must(t, c.Create(ctx, &extensionsv1alpha1.Cluster{
		ObjectMeta: metav1.ObjectMeta{Name: ns},
		Spec: extensionsv1alpha1.ClusterSpec{
			CloudProfile: runtime.RawExtension{Raw: []byte(`{"apiVersion":"core.gardener.cloud/v1beta1","kind":"CloudProfile"}`)},
			Seed:         &runtime.RawExtension{Raw: []byte(`{"apiVersion":"core.gardener.cloud/v1beta1","kind":"Seed"}`)},
			Shoot:        runtime.RawExtension{Raw: raw},
		},
	}))
	if cache, ok := controllerCaches.Load(c); ok {
		testwait.For(t, "the controller's cache has Cluster "+ns, func() error {
			return cache.(client.Reader).Get(ctx, client.ObjectKey{Name: ns}, &extensionsv1alpha1.Cluster{})
		})
	}
	labels := map[string]string{"app": "kubernetes", "role": "apiserver"}
	must(t, c.Create(ctx, &appsv1.Deployment{
		ObjectMeta: metav1.ObjectMeta{Name: "kube-apiserver", Namespace: ns, Labels: labels},
		Spec: appsv1.DeploymentSpec{
			Selector: &metav1.LabelSelector{MatchLabels: labels},
			Template: corev1.PodTemplateSpec{
				ObjectMeta: metav1.ObjectMeta{Labels: labels},
				Spec: corev1.PodSpec{Containers: []corev1.Container{{
					Name: "kube-apiserver", Image: "registry.k8s.io/kube-apiserver:v1.37.1",
					Args: []string{"--advertise-address=240.0.0.10", "--secure-port=443"},
				}}},
			},
		},
	}))
	must(t, c.Create(ctx, &corev1.Service{
		ObjectMeta: metav1.ObjectMeta{Name: "kube-apiserver", Namespace: ns},
		Spec:       corev1.ServiceSpec{Selector: labels, Ports: []corev1.ServicePort{{Name: "kube-apiserver", Port: 443}}},
	}))
}

func newExtension(ns, providerConfig string) *extensionsv1alpha1.Extension {
	e := &extensionsv1alpha1.Extension{
		ObjectMeta: metav1.ObjectMeta{Name: "tendril", Namespace: ns},
		Spec:       extensionsv1alpha1.ExtensionSpec{DefaultSpec: extensionsv1alpha1.DefaultSpec{Type: extension.Type}},
	}
	if providerConfig != "" {
		e.Spec.ProviderConfig = &runtime.RawExtension{Raw: []byte(providerConfig)}
	}
	return e
}

func must(t *testing.T, err error) {
	t.Helper()
	if err != nil {
		t.Fatal(err)
	}
}

func lastOp(c client.Client, key client.ObjectKey) (*gardencorev1beta1.LastOperation, *extensionsv1alpha1.Extension, error) {
	e := &extensionsv1alpha1.Extension{}
	if err := c.Get(context.Background(), key, e); err != nil {
		return nil, nil, err
	}
	if e.Status.LastOperation == nil {
		return nil, e, fmt.Errorf("no lastOperation yet")
	}
	return e.Status.LastOperation, e, nil
}

// migrate asks for a migration as gardenlet does (the operation annotation) and waits until
// lastOperation says Migrate Succeeded and the annotation is gone; it returns the Extension then.
func migrate(t *testing.T, c client.Client, ext *extensionsv1alpha1.Extension) *extensionsv1alpha1.Extension {
	t.Helper()
	patch := client.MergeFrom(ext.DeepCopy())
	metav1.SetMetaDataAnnotation(&ext.ObjectMeta, v1beta1constants.GardenerOperation, v1beta1constants.GardenerOperationMigrate)
	must(t, c.Patch(context.Background(), ext, patch))
	testwait.For(t, "migrate succeeded", func() error {
		op, e, err := lastOp(c, client.ObjectKeyFromObject(ext))
		if err != nil {
			return err
		}
		if op.Type != gardencorev1beta1.LastOperationTypeMigrate || op.State != gardencorev1beta1.LastOperationStateSucceeded {
			return fmt.Errorf("lastOperation %s %s: %s", op.Type, op.State, op.Description)
		}
		if e.Annotations[v1beta1constants.GardenerOperation] != "" {
			return fmt.Errorf("operation annotation still set")
		}
		ext = e
		return nil
	})
	return ext
}

// createExtension creates the Extension of the shoot in ns with providerConfig and waits until
// it has succeeded.
func createExtension(t *testing.T, c client.Client, ns, providerConfig string) *extensionsv1alpha1.Extension {
	t.Helper()
	start := time.Now().Add(-time.Second)
	ext := newExtension(ns, providerConfig)
	must(t, c.Create(context.Background(), ext))
	return waitSucceeded(t, c, client.ObjectKeyFromObject(ext), start)
}

func waitSucceeded(t *testing.T, c client.Client, key client.ObjectKey, after time.Time) *extensionsv1alpha1.Extension {
	t.Helper()
	var ext *extensionsv1alpha1.Extension
	testwait.For(t, "extension "+key.String()+" succeeded", func() error {
		op, e, err := lastOp(c, key)
		if err != nil {
			return err
		}
		if op.State != gardencorev1beta1.LastOperationStateSucceeded || op.LastUpdateTime.Time.Before(after) || e.Status.ObservedGeneration != e.Generation {
			return fmt.Errorf("lastOperation %s %s at %s: %s", op.Type, op.State, op.LastUpdateTime, op.Description)
		}
		ext = e
		return nil
	})
	return ext
}

// testReconcile provisions two shoots through the generic Extension reconciler with a real
// API server and checks every object, then that a second reconcile changes nothing, that a
// hibernated shoot has no route and no server replica, and that delete removes everything.
func TestExtension(t *testing.T) {
	env := kubetest.Start(t)
	startController(t, env, nil)
	t.Run("reconcile", func(t *testing.T) { testReconcile(t, env.Client) })
	t.Run("invalid provider config", func(t *testing.T) { testInvalidProviderConfig(t, env.Client) })
	t.Run("health", func(t *testing.T) { testHealth(t, env.Client) })
	t.Run("hibernation", func(t *testing.T) { testHibernation(t, env.Client) })
	t.Run("force delete", func(t *testing.T) { testForceDelete(t, env.Client) })
	t.Run("high availability", func(t *testing.T) { testHighAvailability(t, env.Client) })
	t.Run("kernel tunnel", func(t *testing.T) { testKernelTunnel(t, env.Client) })
}

// testKernelTunnel: providerConfig tunnel.stack kernel puts tendril-server and the agent on TUN
// devices (--tun, NET_ADMIN, the node's /dev/net/tun, root) and gives the agent's pod the
// init container that turns on forwarding; a stack it does not know is a configuration problem.
func testKernelTunnel(t *testing.T, c client.Client) {
	ctx := context.Background()
	ns := "shoot--local--lambda"
	shoot(t, c, ns, false)
	createExtension(t, c, ns, `{"tunnel":{"stack":"kernel"}}`)

	d := &appsv1.Deployment{}
	must(t, c.Get(ctx, client.ObjectKey{Namespace: ns, Name: manifest.ServerName}, d))
	ctr := d.Spec.Template.Spec.Containers[0]
	if !slices.Contains(ctr.Args, "--tun="+manifest.TUNDevice) || ctr.SecurityContext.Capabilities == nil ||
		!slices.Contains(ctr.SecurityContext.Capabilities.Add, "NET_ADMIN") {
		t.Errorf("tendril-server: args %v, security context %+v; want --tun and NET_ADMIN", ctr.Args, ctr.SecurityContext)
	}
	mr := &resourcesv1alpha1.ManagedResource{}
	must(t, c.Get(ctx, client.ObjectKey{Namespace: ns, Name: manifest.ManagedResourceName}, mr))
	data := managedResourceData(t, c, mr)
	for _, want := range []string{"--tun=" + manifest.TUNDevice, "name: " + manifest.AgentName + "-sysctl", "net.ipv4.ip_forward=1", "path: /dev/net/tun"} {
		if !strings.Contains(data, want) {
			t.Errorf("the shoot's objects lack %q", want)
		}
	}

	bad := "shoot--local--mu"
	shoot(t, c, bad, false)
	must(t, c.Create(ctx, newExtension(bad, `{"tunnel":{"stack":"tun"}}`)))
	testwait.For(t, "configuration problem", func() error {
		_, e, err := lastOp(c, client.ObjectKey{Namespace: bad, Name: "tendril"})
		if err != nil {
			return err
		}
		if e.Status.LastError == nil || !slices.Contains(e.Status.LastError.Codes, gardencorev1beta1.ErrorConfigurationProblem) ||
			!strings.Contains(e.Status.LastError.Description, "tunnel.stack") {
			return fmt.Errorf("lastError %+v", e.Status.LastError)
		}
		return nil
	})
}

// haControlPlane makes the shoot's control plane highly available (zone failure tolerance).
func haControlPlane(sh *gardencorev1beta1.Shoot) {
	sh.Spec.ControlPlane = &gardencorev1beta1.ControlPlane{HighAvailability: &gardencorev1beta1.HighAvailability{
		FailureTolerance: gardencorev1beta1.FailureTolerance{Type: gardencorev1beta1.FailureToleranceTypeZone},
	}}
}

// agentKeys are the persisted agent WireGuard key Secrets in ns by agent index.
func agentKeys(t *testing.T, c client.Client, ns string) map[int]corev1.Secret {
	t.Helper()
	secrets := &corev1.SecretList{}
	must(t, c.List(context.Background(), secrets, client.InNamespace(ns), client.MatchingLabels{secretsmanager.LabelKeyManagerIdentity: extension.SecretsManagerIdentity}))
	keys := map[int]corev1.Secret{}
	for _, s := range secrets.Items {
		for i := range 3 {
			if s.Labels[secretsmanager.LabelKeyName] == extension.AgentWireGuardSecretName(i) {
				if s.Labels[secretsmanager.LabelKeyPersist] != "true" {
					t.Errorf("agent key %s not persisted", s.Name)
				}
				keys[i] = s
			}
		}
	}
	return keys
}

// wantAgents checks that ns runs exactly the agents with these addresses, each with its own key
// from keys, on both sides: tendril-server's peers, the shoot's Deployments and Secrets, and
// status.state.
func wantAgents(t *testing.T, c client.Client, ns string, ks map[int]corev1.Secret, addrs ...string) {
	t.Helper()
	testwait.For(t, fmt.Sprintf("%d agents", len(addrs)), func() error {
		var pubs []string
		for i := range addrs {
			pubs = append(pubs, string(ks[i].Data[extension.DataKeyPublicKey]))
		}
		args := serverArgs(t, c, ns)
		for _, want := range []string{"--agent-public-key=" + strings.Join(pubs, ",") + " ", "--agent-address=" + strings.Join(addrs, ",") + " "} {
			if !strings.Contains(args, want) {
				return fmt.Errorf("tendril-server args %q lack %q", args, want)
			}
		}
		objs, err := managedresources.GetObjects(context.Background(), c, ns, manifest.ManagedResourceName)
		if err != nil {
			return err
		}
		deps, secrets, pdbs := map[string]*appsv1.Deployment{}, map[string]*corev1.Secret{}, 0
		for _, o := range objs {
			switch x := o.(type) {
			case *appsv1.Deployment:
				deps[x.Name] = x
			case *corev1.Secret:
				secrets[x.Name] = x
			case *policyv1.PodDisruptionBudget:
				pdbs++
			}
		}
		if len(deps) != len(addrs) {
			return fmt.Errorf("shoot Deployments %v, want %d agents", keys(deps), len(addrs))
		}
		for i, addr := range addrs {
			d := deps[manifest.AgentObjectName(i)]
			if d == nil {
				return fmt.Errorf("no Deployment %s", manifest.AgentObjectName(i))
			}
			spec := d.Spec.Template.Spec
			if a := strings.Join(spec.Containers[0].Args, " "); !strings.Contains(a, "--address="+addr+" ") {
				return fmt.Errorf("%s args %q: want address %s", d.Name, a, addr)
			}
			sec := secrets[spec.Volumes[0].Secret.SecretName]
			if sec == nil || !bytes.Equal(sec.Data["private-key"], ks[i].Data[extension.DataKeyPrivateKey]) {
				return fmt.Errorf("%s mounts %s, which lacks agent %d's private key", d.Name, spec.Volumes[0].Secret.SecretName, i)
			}
			if (len(addrs) > 1) != (spec.Affinity != nil) {
				return fmt.Errorf("%s affinity %+v with %d agents", d.Name, spec.Affinity, len(addrs))
			}
		}
		if wantPDB := min(len(addrs)-1, 1); pdbs != wantPDB {
			return fmt.Errorf("%d PodDisruptionBudgets, want %d", pdbs, wantPDB)
		}
		ext := &extensionsv1alpha1.Extension{}
		if err := c.Get(context.Background(), client.ObjectKey{Namespace: ns, Name: "tendril"}, ext); err != nil {
			return err
		}
		var st extension.State
		if err := json.Unmarshal(ext.Status.State.Raw, &st); err != nil {
			return err
		}
		for i, addr := range addrs {
			if i >= len(st.AgentAddresses) || st.AgentAddresses[i].String() != addr {
				return fmt.Errorf("status.state agent addresses %v, want %v first", st.AgentAddresses, addrs)
			}
		}
		return nil
	})
}

// wantServers checks the shape of ns's tendril-server for n replicas: a StatefulSet of n under
// the tendril-server Service, spread, with a PodDisruptionBudget and no Deployment for n > 1,
// each agent dialling every replica by name; a Deployment and nothing else for one.
func wantServers(t *testing.T, c client.Client, ns string, n int) {
	t.Helper()
	ctx := context.Background()
	key := client.ObjectKey{Namespace: ns, Name: manifest.ServerName}
	testwait.For(t, fmt.Sprintf("%s: %d tendril-server replicas", ns, n), func() error {
		sts, dep, pdb := &appsv1.StatefulSet{}, &appsv1.Deployment{}, &policyv1.PodDisruptionBudget{}
		stsErr, depErr, pdbErr := c.Get(ctx, key, sts), c.Get(ctx, key, dep), c.Get(ctx, key, pdb)
		if n == 1 {
			if depErr != nil || !apierrors.IsNotFound(stsErr) || !apierrors.IsNotFound(pdbErr) {
				return fmt.Errorf("deployment %v, statefulset %v, budget %v; want the Deployment alone", depErr, stsErr, pdbErr)
			}
			return nil
		}
		switch {
		case stsErr != nil || pdbErr != nil || !apierrors.IsNotFound(depErr):
			return fmt.Errorf("statefulset %v, budget %v, deployment %v; want the StatefulSet and its budget alone", stsErr, pdbErr, depErr)
		case ptr.Deref(sts.Spec.Replicas, 0) != int32(n) || sts.Spec.ServiceName != manifest.ServerName || sts.Spec.PodManagementPolicy != appsv1.ParallelPodManagement:
			return fmt.Errorf("statefulset replicas %v, serviceName %q, policy %q", sts.Spec.Replicas, sts.Spec.ServiceName, sts.Spec.PodManagementPolicy)
		case sts.Spec.Template.Spec.Affinity == nil || sts.Spec.Template.Spec.Affinity.PodAntiAffinity == nil:
			return errors.New("the replicas are not spread")
		case pdb.Spec.MaxUnavailable == nil || pdb.Spec.MaxUnavailable.IntValue() != 1:
			return fmt.Errorf("budget maxUnavailable %v", pdb.Spec.MaxUnavailable)
		}
		objs, err := managedresources.GetObjects(ctx, c, ns, manifest.ManagedResourceName)
		if err != nil {
			return err
		}
		var dests []string
		for i := range n {
			dests = append(dests, wire.TendrilServerReplicaWireName(ns, fmt.Sprintf("tendril-server-%d", i)))
		}
		want := "--destination=" + strings.Join(dests, ",")
		for _, o := range objs {
			if d, ok := o.(*appsv1.Deployment); ok && !slices.Contains(d.Spec.Template.Spec.Containers[0].Args, want) {
				return fmt.Errorf("agent %s args %q lack %q", d.Name, d.Spec.Template.Spec.Containers[0].Args, want)
			}
		}
		return nil
	})
}

// testHighAvailability: a shoot with an HA control plane gets two agents, each with its own
// persisted key and address; the providerConfig overrides the count both ways; going down to
// one agent and back up gives agent 1 its recorded address again and never touches agent 0's
// key; an agent count out of range is a configuration problem.
func testHighAvailability(t *testing.T, c client.Client) {
	ctx := context.Background()
	ha, plain := "shoot--local--iota", "shoot--local--kappa"
	shoot(t, c, ha, false, haControlPlane)
	shoot(t, c, plain, false)
	start := time.Now().Add(-time.Second)
	must(t, c.Create(ctx, newExtension(ha, "")))
	must(t, c.Create(ctx, newExtension(plain, `{"highAvailability":{"agents":2}}`)))
	ext := waitSucceeded(t, c, client.ObjectKey{Namespace: ha, Name: "tendril"}, start)
	waitSucceeded(t, c, client.ObjectKey{Namespace: plain, Name: "tendril"}, start)

	keys := agentKeys(t, c, ha)
	if len(keys) != 2 || bytes.Equal(keys[0].Data[extension.DataKeyPrivateKey], keys[1].Data[extension.DataKeyPrivateKey]) {
		t.Fatalf("agent keys %d, want two different ones", len(keys))
	}
	wantAgents(t, c, ha, keys, "fd8f:6d53:b97a:1::2", "fd8f:6d53:b97a:1::3")
	wantAgents(t, c, plain, agentKeys(t, c, plain), "fd8f:6d53:b97a:1::2", "fd8f:6d53:b97a:1::3")
	// The HA control plane gets two servers, each agent a tunnel to both; the plain one with
	// two agents keeps its one server.
	wantServers(t, c, ha, manifest.HAServers)
	wantServers(t, c, plain, 1)

	setConfig := func(raw string) {
		t.Helper()
		e := &extensionsv1alpha1.Extension{}
		// The last change's reconciliation must be over: ending, it removes the operation
		// annotation from the live object, and would take this change's with it (gardenlet
		// sets it once per change, too).
		testwait.For(t, "the previous reconciliation's end", func() error {
			must(t, c.Get(ctx, client.ObjectKeyFromObject(ext), e))
			if op, ok := e.Annotations[v1beta1constants.GardenerOperation]; ok {
				return fmt.Errorf("operation annotation %q still set", op)
			}
			return nil
		})
		patch := client.MergeFrom(e.DeepCopy())
		e.Spec.ProviderConfig = &runtime.RawExtension{Raw: []byte(raw)}
		// gardenlet asks for the reconciliation along with the change.
		metav1.SetMetaDataAnnotation(&e.ObjectMeta, v1beta1constants.GardenerOperation, v1beta1constants.GardenerOperationReconcile)
		must(t, c.Patch(ctx, e, patch))
	}
	setConfig(`{"highAvailability":{"agents":1}}`)
	one := agentKeys(t, c, ha)
	wantAgents(t, c, ha, map[int]corev1.Secret{0: keys[0]}, "fd8f:6d53:b97a:1::2")
	if !bytes.Equal(one[0].Data[extension.DataKeyPrivateKey], keys[0].Data[extension.DataKeyPrivateKey]) {
		t.Error("agent 0's key changed when agent 1 went")
	}
	setConfig(`{"highAvailability":{"agents":2}}`)
	again := agentKeys(t, c, ha)
	testwait.For(t, "agent 1's key back", func() error {
		again = agentKeys(t, c, ha)
		if len(again) != 2 {
			return fmt.Errorf("%d agent keys", len(again))
		}
		return nil
	})
	if !bytes.Equal(again[0].Data[extension.DataKeyPrivateKey], keys[0].Data[extension.DataKeyPrivateKey]) {
		t.Error("agent 0's key changed when agent 1 came back")
	}
	wantAgents(t, c, ha, again, "fd8f:6d53:b97a:1::2", "fd8f:6d53:b97a:1::3")

	setConfig(`{"highAvailability":{"agents":3}}`)
	testwait.For(t, "configuration problem", func() error {
		_, e, err := lastOp(c, client.ObjectKeyFromObject(ext))
		if err != nil {
			return err
		}
		if e.Status.LastError == nil || !slices.Contains(e.Status.LastError.Codes, gardencorev1beta1.ErrorConfigurationProblem) ||
			!strings.Contains(e.Status.LastError.Description, "highAvailability.agents") {
			return fmt.Errorf("lastError %+v", e.Status.LastError)
		}
		return nil
	})
	wantAgents(t, c, ha, again, "fd8f:6d53:b97a:1::2", "fd8f:6d53:b97a:1::3")
}

func testReconcile(t *testing.T, c client.Client) {
	ctx := context.Background()

	alpha, beta := "shoot--local--alpha", "shoot--local--beta"
	shoot(t, c, alpha, false)
	shoot(t, c, beta, true)
	// A seed upgraded from a version whose extension wrote tendril-server's NetworkPolicy by
	// hand still has it (alpha); a policy of that name not tendril's stays (beta).
	legacy := func(ns string, labels map[string]string) *networkingv1.NetworkPolicy {
		return &networkingv1.NetworkPolicy{
			ObjectMeta: metav1.ObjectMeta{Name: manifest.ServerName, Namespace: ns, Labels: labels},
			Spec: networkingv1.NetworkPolicySpec{
				PodSelector: metav1.LabelSelector{MatchLabels: map[string]string{v1beta1constants.LabelApp: manifest.ServerName}},
				PolicyTypes: []networkingv1.PolicyType{networkingv1.PolicyTypeIngress},
			},
		}
	}
	must(t, c.Create(ctx, legacy(alpha, map[string]string{v1beta1constants.LabelApp: manifest.ServerName})))
	must(t, c.Create(ctx, legacy(beta, map[string]string{"owner": "someone-else"})))
	start := time.Now().Add(-time.Second)
	must(t, c.Create(ctx, newExtension(alpha, `{"apiVersion":"tendril.extensions.gardener.cloud/v1alpha1","kind":"ProviderConfig","apiserverProxy":{"enabled":true}}`)))
	must(t, c.Create(ctx, newExtension(beta, "")))
	extAlpha := waitSucceeded(t, c, client.ObjectKey{Namespace: alpha, Name: "tendril"}, start)
	waitSucceeded(t, c, client.ObjectKey{Namespace: beta, Name: "tendril"}, start)

	// Secrets: WireGuard keys and the CA persisted; private keys never in status.
	secrets := &corev1.SecretList{}
	must(t, c.List(ctx, secrets, client.InNamespace(alpha), client.MatchingLabels{secretsmanager.LabelKeyManagerIdentity: extension.SecretsManagerIdentity}))
	byName := map[string]corev1.Secret{}
	for _, s := range secrets.Items {
		byName[s.Labels[secretsmanager.LabelKeyName]] = s
	}
	for _, n := range []string{extension.SecretNameCA, extension.SecretNameServerTLS, extension.SecretNameAPIServerClient, extension.SecretNameServerWireGuard, extension.SecretNameAgentWireGuard} {
		if _, ok := byName[n]; !ok {
			t.Errorf("secret %s missing (have %v)", n, keys(byName))
		}
	}
	for _, n := range []string{extension.SecretNameCA, extension.SecretNameServerWireGuard, extension.SecretNameAgentWireGuard} {
		if byName[n].Labels[secretsmanager.LabelKeyPersist] != "true" {
			t.Errorf("secret %s not persisted: labels %v", n, byName[n].Labels)
		}
	}
	serverKey, agentKey := byName[extension.SecretNameServerWireGuard], byName[extension.SecretNameAgentWireGuard]
	if len(serverKey.Data[extension.DataKeyPrivateKey]) != 44 || len(agentKey.Data[extension.DataKeyPublicKey]) != 44 {
		t.Errorf("WireGuard keys are not 32-byte base64: %q %q", serverKey.Data[extension.DataKeyPrivateKey], agentKey.Data[extension.DataKeyPublicKey])
	}
	if extAlpha.Status.State == nil || strings.Contains(string(extAlpha.Status.State.Raw), string(agentKey.Data[extension.DataKeyPrivateKey])) {
		t.Errorf("status.state %v: want tunnel addresses and no private key", extAlpha.Status.State)
	}

	// Seed side.
	dep := &appsv1.Deployment{}
	must(t, c.Get(ctx, client.ObjectKey{Namespace: alpha, Name: manifest.ServerName}, dep))
	args := strings.Join(dep.Spec.Template.Spec.Containers[0].Args, " ")
	for _, want := range []string{
		"--agent-public-key=" + string(agentKey.Data[extension.DataKeyPublicKey]),
		"--shoot-cidrs=10.250.0.0/16,100.64.0.0/12,100.104.0.0/13",
		"--tunnel-address=:1194", "--connect-address=:9443", "--grpc-address=:8090", "--metrics-address=:9090",
	} {
		if !strings.Contains(args, want) {
			t.Errorf("tendril-server args %q lack %q", args, want)
		}
	}
	if *dep.Spec.Replicas != 1 || dep.Spec.Template.Spec.PriorityClassName != v1beta1constants.PriorityClassNameShootControlPlane500 {
		t.Errorf("tendril-server replicas %d priority %q", *dep.Spec.Replicas, dep.Spec.Template.Spec.PriorityClassName)
	}
	vols := map[string]string{}
	for _, v := range dep.Spec.Template.Spec.Volumes {
		vols[v.Name] = v.Secret.SecretName
	}
	if vols["wireguard"] != serverKey.Name || vols["tls"] != byName[extension.SecretNameServerTLS].Name || vols["ca"] != byName[extension.SecretNameCA+"-bundle"].Name {
		t.Errorf("tendril-server volumes %v do not mount the generated secrets", vols)
	}
	svc := &corev1.Service{}
	must(t, c.Get(ctx, client.ObjectKey{Namespace: alpha, Name: manifest.ServerName}, svc))
	var ports []int32
	for _, p := range svc.Spec.Ports {
		ports = append(ports, p.Port)
	}
	if !slices.Equal(ports, []int32{1194, 9443, 8090, 9090}) {
		t.Errorf("tendril-server service ports %v", ports)
	}
	// No hand-written NetworkPolicy: Gardener's resource manager derives tendril-server's from
	// the Service (extension/networkpaths proves the paths); the old one is deleted.
	if err := c.Get(ctx, client.ObjectKey{Namespace: alpha, Name: manifest.ServerName}, &networkingv1.NetworkPolicy{}); !apierrors.IsNotFound(err) {
		t.Errorf("NetworkPolicy %s: %v, want none (the old one deleted)", manifest.ServerName, err)
	}
	if err := c.Get(ctx, client.ObjectKey{Namespace: beta, Name: manifest.ServerName}, &networkingv1.NetworkPolicy{}); err != nil {
		t.Errorf("NetworkPolicy %s not tendril's: %v, want it left alone", manifest.ServerName, err)
	}

	// Monitoring: the shoot's Prometheus (prometheus=shoot) scrapes tendril-server through its
	// Service and the agent through the shoot's kube-apiserver pod proxy, and loads the rules.
	scrapes := &monitoringv1alpha1.ScrapeConfigList{}
	must(t, c.List(ctx, scrapes, client.InNamespace(alpha), client.MatchingLabels{"prometheus": "shoot"}))
	jobs := map[string]string{}
	for _, sc := range scrapes.Items {
		for _, r := range sc.Spec.RelabelConfigs {
			if r.TargetLabel == "job" && r.Replacement != nil {
				jobs[sc.Name] = *r.Replacement
			}
		}
		if sc.Name == "shoot-"+manifest.AgentName {
			if len(sc.Spec.KubernetesSDConfigs) != 1 || ptr.Deref(sc.Spec.KubernetesSDConfigs[0].APIServer, "") != "https://kube-apiserver" {
				t.Errorf("agent scrape config does not discover through the shoot's kube-apiserver: %+v", sc.Spec.KubernetesSDConfigs)
			}
			if !slices.ContainsFunc(sc.Spec.RelabelConfigs, func(r monitoringv1.RelabelConfig) bool {
				return r.TargetLabel == "__metrics_path__" && ptr.Deref(r.Replacement, "") == "/api/v1/namespaces/kube-system/pods/${1}:${2}/proxy/metrics"
			}) {
				t.Errorf("agent scrape config does not go through the pod proxy: %+v", sc.Spec.RelabelConfigs)
			}
		}
	}
	if want := map[string]string{"shoot-" + manifest.ServerName: manifest.JobServer, "shoot-" + manifest.AgentName: manifest.JobAgent}; !maps.Equal(jobs, want) {
		t.Errorf("scrape configs (name: job) %v, want %v", jobs, want)
	}
	rule := &monitoringv1.PrometheusRule{}
	must(t, c.Get(ctx, client.ObjectKey{Namespace: alpha, Name: "shoot-tendril"}, rule))
	var alerts []string
	for _, g := range rule.Spec.Groups {
		for _, r := range g.Rules {
			alerts = append(alerts, r.Alert)
		}
	}
	if rule.Labels["prometheus"] != "shoot" || !slices.Contains(alerts, "TendrilTunnelDown") || !slices.Contains(alerts, "TendrilEgressDialsFailing") {
		t.Errorf("PrometheusRule labels %v alerts %v", rule.Labels, alerts)
	}

	// Route.
	route := &tendrilv1alpha1.Route{}
	must(t, c.Get(ctx, client.ObjectKey{Namespace: alpha, Name: manifest.RouteName}, route))
	if want := []string{"api.alpha.local.example.org", "api.alpha.local.internal.example.org"}; !slices.Equal(route.Spec.Hostnames, want) {
		t.Errorf("route hostnames %v, want %v", route.Spec.Hostnames, want)
	}
	if route.Spec.AdvertisedAddress != "240.0.0.10" || route.Spec.TunnelServer == nil || route.Spec.TunnelServer.Name != manifest.ServerName {
		t.Errorf("route spec %+v", route.Spec)
	}

	// Shoot side: the ManagedResource's objects.
	mr := &resourcesv1alpha1.ManagedResource{}
	must(t, c.Get(ctx, client.ObjectKey{Namespace: alpha, Name: manifest.ManagedResourceName}, mr))
	if mr.Spec.Class != nil || mr.Labels["origin"] == "gardener" || ptr.Deref(mr.Spec.KeepObjects, false) {
		t.Errorf("managed resource class %v labels %v keepObjects %v", mr.Spec.Class, mr.Labels, mr.Spec.KeepObjects)
	}
	shootYAML := managedResourceData(t, c, mr)
	for _, want := range []string{
		"kind: Deployment", "name: tendril-agent", "kind: DaemonSet", "name: tendril-apiserver-proxy",
		"kind: NetworkPolicy", "name: " + manifest.AgentFromSeedPolicyName, "name: " + manifest.AgentPolicyName,
		"--advertised-address=240.0.0.10", "--seed=ingress.seed.example.org:8443",
		"--destination=outbound|1194||tendril-server." + alpha + ".svc.cluster.local",
		"--server-public-key=" + string(serverKey.Data[extension.DataKeyPublicKey]),
	} {
		if !strings.Contains(shootYAML, want) {
			t.Errorf("shoot objects lack %q", want)
		}
	}
	mrBeta := &resourcesv1alpha1.ManagedResource{}
	must(t, c.Get(ctx, client.ObjectKey{Namespace: beta, Name: manifest.ManagedResourceName}, mrBeta))
	if y := managedResourceData(t, c, mrBeta); strings.Contains(y, "DaemonSet") {
		t.Error("apiserver-proxy deployed although not enabled for beta")
	}

	// Hibernated beta: no route, no server replica.
	if err := c.Get(ctx, client.ObjectKey{Namespace: beta, Name: manifest.RouteName}, &tendrilv1alpha1.Route{}); !apierrors.IsNotFound(err) {
		t.Errorf("hibernated shoot has a route: %v", err)
	}
	depBeta := &appsv1.Deployment{}
	must(t, c.Get(ctx, client.ObjectKey{Namespace: beta, Name: manifest.ServerName}, depBeta))
	if *depBeta.Spec.Replicas != 0 {
		t.Errorf("hibernated shoot's tendril-server has %d replicas", *depBeta.Spec.Replicas)
	}

	// A second reconcile (gardenlet's operation annotation) changes no object.
	before := versions(t, c, alpha)
	// lastUpdateTime has one-second resolution: step past the first reconcile's second.
	time.Sleep(1100 * time.Millisecond)
	again := time.Now().Truncate(time.Second)
	patch := client.MergeFrom(extAlpha.DeepCopy())
	metav1.SetMetaDataAnnotation(&extAlpha.ObjectMeta, v1beta1constants.GardenerOperation, v1beta1constants.GardenerOperationReconcile)
	must(t, c.Patch(ctx, extAlpha, patch))
	waitSucceeded(t, c, client.ObjectKeyFromObject(extAlpha), again)
	if after := versions(t, c, alpha); !mapsEqual(before, after) {
		t.Errorf("second reconcile changed objects:\nbefore %v\nafter  %v", before, after)
	}

	// Drift: someone scales tendril-server; the extension puts it back without being asked.
	drifted := &appsv1.Deployment{}
	must(t, c.Get(ctx, client.ObjectKey{Namespace: alpha, Name: manifest.ServerName}, drifted))
	dpatch := client.MergeFrom(drifted.DeepCopy())
	drifted.Spec.Replicas = ptr.To[int32](3)
	must(t, c.Patch(ctx, drifted, dpatch))
	testwait.For(t, "drift reverted", func() error {
		d := &appsv1.Deployment{}
		if err := c.Get(ctx, client.ObjectKeyFromObject(drifted), d); err != nil {
			return err
		}
		if *d.Spec.Replicas != 1 {
			return fmt.Errorf("replicas %d", *d.Spec.Replicas)
		}
		return nil
	})

	// Delete removes everything tendril made.
	must(t, c.Delete(ctx, extAlpha))
	testwait.For(t, "extension deleted", func() error {
		if err := c.Get(ctx, client.ObjectKeyFromObject(extAlpha), &extensionsv1alpha1.Extension{}); !apierrors.IsNotFound(err) {
			return fmt.Errorf("still there: %v", err)
		}
		return nil
	})
	if left := versions(t, c, alpha); len(left) != 0 {
		t.Errorf("left after delete: %v", left)
	}
}

// testInvalidProviderConfig: a bad providerConfig ends in Error with ERR_CONFIGURATION_PROBLEM
// and creates nothing.
func testInvalidProviderConfig(t *testing.T, c client.Client) {
	ns := "shoot--local--gamma"
	shoot(t, c, ns, false)
	must(t, c.Create(context.Background(), newExtension(ns, `{"egress":"socks5"}`)))
	testwait.For(t, "extension error", func() error {
		op, e, err := lastOp(c, client.ObjectKey{Namespace: ns, Name: "tendril"})
		if err != nil {
			return err
		}
		if op.State != gardencorev1beta1.LastOperationStateError || e.Status.LastError == nil ||
			!slices.Contains(e.Status.LastError.Codes, gardencorev1beta1.ErrorConfigurationProblem) {
			return fmt.Errorf("lastOperation %s %s, lastError %+v", op.Type, op.State, e.Status.LastError)
		}
		if !strings.Contains(e.Status.LastError.Description, "egress") {
			return fmt.Errorf("lastError does not name the field: %s", e.Status.LastError.Description)
		}
		return nil
	})
	if left := versions(t, c, ns); len(left) != 0 {
		t.Errorf("objects created despite invalid config: %v", left)
	}
}

func managedResourceData(t *testing.T, c client.Client, mr *resourcesv1alpha1.ManagedResource) string {
	t.Helper()
	objs, err := managedresources.GetObjects(context.Background(), c, mr.Namespace, mr.Name)
	must(t, err)
	var b strings.Builder
	for _, o := range objs {
		y, err := yaml.Marshal(o)
		must(t, err)
		b.Write(y)
		b.WriteString("---\n")
	}
	return b.String()
}

// versions maps every tendril object in ns to its resourceVersion.
func versions(t *testing.T, c client.Client, ns string) map[string]string {
	t.Helper()
	ctx := context.Background()
	out := map[string]string{}
	add := func(kind string, l client.ObjectList, opts ...client.ListOption) {
		must(t, c.List(ctx, l, append(opts, client.InNamespace(ns))...))
		items, err := meta.ExtractList(l)
		must(t, err)
		for _, item := range items {
			o, err := meta.Accessor(item)
			must(t, err)
			out[kind+"/"+o.GetName()] = o.GetResourceVersion()
		}
	}
	byApp := client.MatchingLabels{"app": manifest.ServerName}
	add("Deployment", &appsv1.DeploymentList{}, byApp)
	add("Service", &corev1.ServiceList{}, byApp)
	add("NetworkPolicy", &networkingv1.NetworkPolicyList{}, byApp)
	add("Route", &tendrilv1alpha1.RouteList{})
	byPrometheus := client.MatchingLabels{"prometheus": "shoot"}
	add("ScrapeConfig", &monitoringv1alpha1.ScrapeConfigList{}, byPrometheus)
	add("PrometheusRule", &monitoringv1.PrometheusRuleList{}, byPrometheus)
	add("ManagedResource", &resourcesv1alpha1.ManagedResourceList{})
	add("Secret", &corev1.SecretList{}, client.MatchingLabels{secretsmanager.LabelKeyManagerIdentity: extension.SecretsManagerIdentity})
	add("Secret", &corev1.SecretList{}, client.MatchingLabels{"resources.gardener.cloud/garbage-collectable-reference": "true"})
	return out
}

func keys[V any](m map[string]V) []string { return slices.Sorted(mapKeys(m)) }

func mapKeys[V any](m map[string]V) func(func(string) bool) {
	return func(yield func(string) bool) {
		for k := range m {
			if !yield(k) {
				return
			}
		}
	}
}

func mapsEqual(a, b map[string]string) bool {
	if len(a) != len(b) {
		return false
	}
	for k, v := range a {
		if b[k] != v {
			return false
		}
	}
	return true
}

// testHealth: ControlPlaneHealthy follows tendril-server's Ready pods — Ready means a live
// tunnel, since the readiness probe is /readyz — and SystemComponentsHealthy the shoot
// ManagedResource. Tunnel down: Progressing, False once the grace has passed, True again
// when it is back; a deleted Deployment comes back through the drift watch and is not
// healthy until its pod is Ready (a Deployment missing or scaled to zero, False at once,
// is in health_test.go: the drift watch undoes both too fast to watch here). The Deployment's and ManagedResource's status are written here as
// kube-controller-manager (from kubelet's probe results) and the resource manager would.
func testHealth(t *testing.T, c client.Client) {
	ctx := context.Background()
	ns := "shoot--local--delta"
	shoot(t, c, ns, false)
	ext := createExtension(t, c, ns, "")
	setServerReady(t, c, ns, 1)
	markManagedResourceHealthy(t, c, ns)
	waitCondition(t, c, ext, gardencorev1beta1.ShootControlPlaneHealthy, gardencorev1beta1.ConditionTrue)
	waitCondition(t, c, ext, gardencorev1beta1.ShootSystemComponentsHealthy, gardencorev1beta1.ConditionTrue)

	// The agent's tunnel drops: /readyz fails, the pod is not Ready.
	down := time.Now()
	setServerReady(t, c, ns, 0)
	waitCondition(t, c, ext, gardencorev1beta1.ShootControlPlaneHealthy, gardencorev1beta1.ConditionProgressing)
	waitCondition(t, c, ext, gardencorev1beta1.ShootControlPlaneHealthy, gardencorev1beta1.ConditionFalse)
	if since := time.Since(down); since < healthGrace {
		t.Errorf("ControlPlaneHealthy False %v after the tunnel dropped, before the grace of %v", since, healthGrace)
	}
	setServerReady(t, c, ns, 1)
	waitCondition(t, c, ext, gardencorev1beta1.ShootControlPlaneHealthy, gardencorev1beta1.ConditionTrue)

	// Deleted: the drift watch puts a new Deployment back at once, whose pod has no tunnel yet.
	old := &appsv1.Deployment{}
	must(t, c.Get(ctx, client.ObjectKey{Namespace: ns, Name: manifest.ServerName}, old))
	must(t, c.Delete(ctx, old))
	testwait.For(t, "tendril-server re-created", func() error {
		d := &appsv1.Deployment{}
		if err := c.Get(ctx, client.ObjectKeyFromObject(old), d); err != nil {
			return err
		}
		if d.UID == old.UID {
			return fmt.Errorf("still the deleted one")
		}
		return nil
	})
	// Progressing, or False if a check ran while it was gone (False stays until True).
	waitConditionNot(t, c, ext, gardencorev1beta1.ShootControlPlaneHealthy, gardencorev1beta1.ConditionTrue)
	setServerReady(t, c, ns, 1)
	waitCondition(t, c, ext, gardencorev1beta1.ShootControlPlaneHealthy, gardencorev1beta1.ConditionTrue)
}

// setServerReady writes the tendril-server Deployment's status as kube-controller-manager
// would with ready of its one pod Ready. The strategy is Recreate, so a not-ready pod makes
// the Deployment unavailable.
func setServerReady(t *testing.T, c client.Client, ns string, ready int32) {
	t.Helper()
	d := &appsv1.Deployment{}
	must(t, c.Get(context.Background(), client.ObjectKey{Namespace: ns, Name: manifest.ServerName}, d))
	avail := appsv1.DeploymentCondition{Type: appsv1.DeploymentAvailable, Status: corev1.ConditionTrue, Reason: "MinimumReplicasAvailable"}
	if ready == 0 {
		avail.Status, avail.Reason = corev1.ConditionFalse, "MinimumReplicasUnavailable"
	}
	d.Status = appsv1.DeploymentStatus{
		ObservedGeneration: d.Generation, Replicas: 1, UpdatedReplicas: 1, ReadyReplicas: ready, AvailableReplicas: ready, UnavailableReplicas: 1 - ready,
		Conditions: []appsv1.DeploymentCondition{avail},
	}
	must(t, c.Status().Update(context.Background(), d))
}

func markManagedResourceHealthy(t *testing.T, c client.Client, ns string) {
	t.Helper()
	mr := &resourcesv1alpha1.ManagedResource{}
	must(t, c.Get(context.Background(), client.ObjectKey{Namespace: ns, Name: manifest.ManagedResourceName}, mr))
	now := metav1.Now()
	mr.Status.ObservedGeneration = mr.Generation
	mr.Status.Conditions = []gardencorev1beta1.Condition{
		{Type: resourcesv1alpha1.ResourcesApplied, Status: gardencorev1beta1.ConditionTrue, LastTransitionTime: now, LastUpdateTime: now, Reason: "ApplySucceeded"},
		{Type: resourcesv1alpha1.ResourcesHealthy, Status: gardencorev1beta1.ConditionTrue, LastTransitionTime: now, LastUpdateTime: now, Reason: "ResourcesHealthy"},
		{Type: resourcesv1alpha1.ResourcesProgressing, Status: gardencorev1beta1.ConditionFalse, LastTransitionTime: now, LastUpdateTime: now, Reason: "ResourcesRolledOut"},
	}
	must(t, c.Status().Update(context.Background(), mr))
}

func waitCondition(t *testing.T, c client.Client, ext *extensionsv1alpha1.Extension, typ gardencorev1beta1.ConditionType, want gardencorev1beta1.ConditionStatus) {
	t.Helper()
	testwait.For(t, fmt.Sprintf("%s=%s", typ, want), func() error {
		e := &extensionsv1alpha1.Extension{}
		if err := c.Get(context.Background(), client.ObjectKeyFromObject(ext), e); err != nil {
			return err
		}
		for _, cond := range e.Status.Conditions {
			if cond.Type == typ {
				if cond.Status != want {
					return fmt.Errorf("%s is %s: %s", typ, cond.Status, cond.Message)
				}
				return nil
			}
		}
		return fmt.Errorf("no %s condition in %v", typ, e.Status.Conditions)
	})
}

// waitConditionNot waits until the Extension has the condition with any status but unwanted.
func waitConditionNot(t *testing.T, c client.Client, ext client.Object, typ gardencorev1beta1.ConditionType, unwanted gardencorev1beta1.ConditionStatus) {
	t.Helper()
	testwait.For(t, fmt.Sprintf("%s not %s", typ, unwanted), func() error {
		_, e, err := lastOp(c, client.ObjectKeyFromObject(ext))
		if e == nil {
			return err
		}
		cond := v1beta1helper.GetCondition(e.Status.Conditions, typ)
		if cond == nil || cond.Status == unwanted {
			return fmt.Errorf("%s: %v", typ, cond)
		}
		return nil
	})
}

// TestMigrateRestore moves a shoot between two seeds (two API servers) as gardenlet does:
// migrate in the source (shoot objects kept, seed objects removed, persisted secrets and
// status.state kept), copy the persisted secrets, Cluster and Extension (with its state) to the
// destination, restore there. The WireGuard keys and CA come out byte-identical, so the
// shoot's running agent reconnects without any change in the shoot.
// A shoot with an HA control plane does the same with both agents' keys and addresses.
func TestMigrateRestore(t *testing.T) {
	src, dst := kubetest.Start(t), kubetest.Start(t)
	startController(t, src, nil)
	startController(t, dst, nil)
	t.Run("one agent", func(t *testing.T) { testMigrateRestore(t, src, dst, "shoot--local--epsilon") })
	t.Run("two agents", func(t *testing.T) { testMigrateRestore(t, src, dst, "shoot--local--lambda", haControlPlane) })
}

func testMigrateRestore(t *testing.T, src, dst *kubetest.Env, ns string, mutate ...func(*gardencorev1beta1.Shoot)) {
	ctx := context.Background()
	shoot(t, src.Client, ns, false, mutate...)
	ext := createExtension(t, src.Client, ns, "")
	srcArgs := serverArgs(t, src.Client, ns)
	srcShoot := managedResourceData(t, src.Client, managedResource(t, src.Client, ns))

	ext = migrate(t, src.Client, ext)
	left := versions(t, src.Client, ns)
	for k := range left {
		if !strings.HasPrefix(k, "Secret/") {
			t.Errorf("after migrate, %s is still in the source seed", k)
		}
	}
	persisted := &corev1.SecretList{}
	must(t, src.Client.List(ctx, persisted, client.InNamespace(ns), client.MatchingLabels{secretsmanager.LabelKeyPersist: "true"}))
	srcKeys := agentKeys(t, src.Client, ns)
	if len(persisted.Items) != 2+len(srcKeys) {
		t.Fatalf("persisted secrets after migrate: %d, want the CA, the server's and %d agents' WireGuard keys", len(persisted.Items), len(srcKeys))
	}
	if ext.Status.State == nil {
		t.Fatal("no status.state after migrate")
	}

	// Restore in the destination seed, from what gardenlet carries over.
	shoot(t, dst.Client, ns, false, mutate...)
	for _, s := range persisted.Items {
		cp := &corev1.Secret{ObjectMeta: metav1.ObjectMeta{Name: s.Name, Namespace: ns, Labels: s.Labels}, Type: s.Type, Data: s.Data}
		must(t, dst.Client.Create(ctx, cp))
	}
	// gardenlet's order: create waiting for state, write the state, then ask for restore.
	restored := newExtension(ns, "")
	restored.Annotations = map[string]string{v1beta1constants.GardenerOperation: v1beta1constants.GardenerOperationWaitForState}
	must(t, dst.Client.Create(ctx, restored))
	// The health check may write the new Extension's status meanwhile: retry on conflict.
	must(t, retry.RetryOnConflict(retry.DefaultRetry, func() error {
		if err := dst.Client.Get(ctx, client.ObjectKeyFromObject(restored), restored); err != nil {
			return err
		}
		restored.Status.State = ext.Status.State
		return dst.Client.Status().Update(ctx, restored)
	}))
	rpatch := client.MergeFrom(restored.DeepCopy())
	metav1.SetMetaDataAnnotation(&restored.ObjectMeta, v1beta1constants.GardenerOperation, v1beta1constants.GardenerOperationRestore)
	must(t, dst.Client.Patch(ctx, restored, rpatch))
	// Restore ends Succeeded; a later drift or health round may already have turned the type
	// into Reconcile, so the state and the objects are what the test holds on to.
	testwait.For(t, "restore succeeded", func() error {
		op, e, err := lastOp(dst.Client, client.ObjectKeyFromObject(restored))
		if err != nil {
			return err
		}
		if op.State != gardencorev1beta1.LastOperationStateSucceeded || e.Annotations[v1beta1constants.GardenerOperation] != "" {
			return fmt.Errorf("lastOperation %s %s: %s", op.Type, op.State, op.Description)
		}
		return nil
	})
	if got := serverArgs(t, dst.Client, ns); got != srcArgs {
		t.Errorf("tendril-server args changed across migration:\nsource %s\nrestored %s", srcArgs, got)
	}
	if got := managedResourceData(t, dst.Client, managedResource(t, dst.Client, ns)); got != srcShoot {
		t.Errorf("shoot objects changed across migration:\nsource\n%s\nrestored\n%s", srcShoot, got)
	}
	for _, s := range persisted.Items {
		got := &corev1.Secret{}
		must(t, dst.Client.Get(ctx, client.ObjectKeyFromObject(&s), got))
		if !mapsEqualBytes(got.Data, s.Data) {
			t.Errorf("persisted secret %s changed after restore", s.Name)
		}
	}
	addrs := []string{"fd8f:6d53:b97a:1::2", "fd8f:6d53:b97a:1::3"}[:len(srcKeys)]
	wantAgents(t, dst.Client, ns, srcKeys, addrs...)
}

// testForceDelete: with the Shoot marked for force deletion, deleting the Extension finishes
// even though the ManagedResource can never go (its finalizer stands for a shoot API server
// that is gone).
func testForceDelete(t *testing.T, c client.Client) {
	ctx := context.Background()
	ns := "shoot--local--zeta"
	shoot(t, c, ns, false)
	ext := createExtension(t, c, ns, "")
	mr := managedResource(t, c, ns)
	patch := client.MergeFrom(mr.DeepCopy())
	mr.Finalizers = append(mr.Finalizers, "resources.gardener.cloud/gardener-resource-manager")
	must(t, c.Patch(ctx, mr, patch))
	t.Cleanup(func() { // release the stand-in finalizer so the namespace can go
		mr := &resourcesv1alpha1.ManagedResource{}
		if c.Get(ctx, client.ObjectKey{Namespace: ns, Name: manifest.ManagedResourceName}, mr) == nil {
			p := client.MergeFrom(mr.DeepCopy())
			mr.Finalizers = nil
			_ = c.Patch(ctx, mr, p)
		}
	})

	cluster := &extensionsv1alpha1.Cluster{}
	must(t, c.Get(ctx, client.ObjectKey{Name: ns}, cluster))
	var sh gardencorev1beta1.Shoot
	must(t, json.Unmarshal(cluster.Spec.Shoot.Raw, &sh))
	metav1.SetMetaDataAnnotation(&sh.ObjectMeta, "confirmation.gardener.cloud/force-deletion", "true")
	now := metav1.Now()
	sh.DeletionTimestamp = &now
	raw, err := json.Marshal(&sh)
	must(t, err)
	cpatch := client.MergeFrom(cluster.DeepCopy())
	cluster.Spec.Shoot.Raw = raw
	must(t, c.Patch(ctx, cluster, cpatch))

	must(t, c.Delete(ctx, ext))
	testwait.For(t, "force-deleted extension gone", func() error {
		if err := c.Get(ctx, client.ObjectKeyFromObject(ext), &extensionsv1alpha1.Extension{}); !apierrors.IsNotFound(err) {
			return fmt.Errorf("still there: %v", err)
		}
		return nil
	})
	for k := range versions(t, c, ns) {
		if k != "ManagedResource/"+manifest.ManagedResourceName && !strings.HasPrefix(k, "Secret/managedresource-") {
			t.Errorf("left after force delete: %s", k)
		}
	}
}

func serverArgs(t *testing.T, c client.Client, ns string) string {
	t.Helper()
	spec := serverPod(t, c, ns).Spec
	return strings.Join(spec.Containers[0].Args, " ") + fmt.Sprint(spec.Volumes)
}

// serverPod is tendril-server's pod template: the StatefulSet's of an HA shoot, else the
// Deployment's.
func serverPod(t *testing.T, c client.Client, ns string) corev1.PodTemplateSpec {
	t.Helper()
	key := client.ObjectKey{Namespace: ns, Name: manifest.ServerName}
	sts := &appsv1.StatefulSet{}
	if err := c.Get(context.Background(), key, sts); err == nil {
		return sts.Spec.Template
	} else if !apierrors.IsNotFound(err) {
		t.Fatal(err)
	}
	d := &appsv1.Deployment{}
	must(t, c.Get(context.Background(), key, d))
	return d.Spec.Template
}

func managedResource(t *testing.T, c client.Client, ns string) *resourcesv1alpha1.ManagedResource {
	t.Helper()
	mr := &resourcesv1alpha1.ManagedResource{}
	must(t, c.Get(context.Background(), client.ObjectKey{Namespace: ns, Name: manifest.ManagedResourceName}, mr))
	return mr
}

func mapsEqualBytes(a, b map[string][]byte) bool {
	if len(a) != len(b) {
		return false
	}
	for k, v := range a {
		if string(b[k]) != string(v) {
			return false
		}
	}
	return true
}

// testHibernation takes an awake shoot through hibernation and back in the order gardenlet
// v1.150 does (pkg/gardenlet/controller/shoot/shoot/reconciler.go, reconciler_reconcile.go),
// with Gardener's extension component doing gardenlet's steps (deploy with the reconcile
// operation, then wait until it has been handled). Going to sleep, the Cluster says
// spec.hibernation.enabled from the start of the flow (reconciler.go l.346), and once
// kube-apiserver is down "Hibernating extension resources after kube-apiserver hibernation"
// (reconciler_reconcile.go l.899–902) reconciles tendril while status.isHibernated is still
// false: the workers may still be draining and kube-apiserver's next start needs the tunnel, so
// tendril-server, the Route and the agent must stay (a tendril that scaled down on
// spec.hibernation.enabled alone fails here). isHibernated reaches the Cluster after the flow
// (reconciler.go l.821, l.137); then the seed side goes. Waking, the Cluster says
// enabled=false before the flow, and tendril must be back when "Deploying extension resources
// before kube-apiserver" (reconciler_reconcile.go l.389–391) has been handled.
func testHibernation(t *testing.T, c client.Client) {
	ctx := context.Background()
	ns := "shoot--local--eta"
	shoot(t, c, ns, false)
	createExtension(t, c, ns, "")
	waitSeedSide(t, c, ns, 1, true)
	shootSide := managedResourceData(t, c, managedResource(t, c, ns))
	agentsAwake := agentReplicas(t, c, ns)
	if len(agentsAwake) == 0 {
		t.Fatalf("no %s Deployment in the shoot's ManagedResource", manifest.AgentName)
	}

	// Going to sleep, in the flow: workers draining, kube-apiserver scaled down.
	setHibernation(t, c, ns, true, false)
	gardenletStep(t, c, ns, "hibernating extension resources after kube-apiserver hibernation")
	// No wait: the reconcile gardenlet waited for has run, and what it left is what counts.
	if err := seedSide(ctx, c, ns, 1, true); err != nil {
		t.Fatalf("after gardenlet's reconcile while the shoot goes to sleep (workers may still run): %v", err)
	}
	if got := agentReplicas(t, c, ns); !maps.Equal(got, agentsAwake) {
		t.Fatalf("after gardenlet's reconcile while the shoot goes to sleep: agents %v, want %v", got, agentsAwake)
	}
	if got := managedResourceData(t, c, managedResource(t, c, ns)); got != shootSide {
		t.Fatalf("after gardenlet's reconcile while the shoot goes to sleep the shoot's ManagedResource changed:\n%s\nwant:\n%s", got, shootSide)
	}
	// After the flow: the Cluster says isHibernated, and nothing but the Cluster watch follows.
	setHibernation(t, c, ns, true, true)
	waitSeedSide(t, c, ns, 0, false)

	// Wake-up: the Cluster first, then gardenlet's step before kube-apiserver.
	setHibernation(t, c, ns, false, true)
	gardenletStep(t, c, ns, "deploying extension resources before kube-apiserver")
	if err := seedSide(ctx, c, ns, 1, true); err != nil {
		t.Fatalf("waking up, when gardenlet would deploy kube-apiserver: %v", err)
	}
	setHibernation(t, c, ns, false, false)
	waitSeedSide(t, c, ns, 1, true)
}

// gardenletStep does what gardenlet's DeployExtensionsBeforeKubeAPIServer task and the wait
// after it do for tendril: it asks for a reconcile (operation and timestamp annotations) and
// waits until the Extension has handled it (Gardener's CheckExtensionObject: annotation gone,
// observed generation current, lastOperation Succeeded no earlier than the timestamp), then
// checks that itself, so what the caller asserts next is what that reconcile left.
func gardenletStep(t *testing.T, c client.Client, ns, step string) {
	t.Helper()
	ctx := context.Background()
	ext := gardenerextension.New(testr.New(t), c, &gardenerextension.Values{
		Namespace: ns,
		Extensions: map[string]gardenerextension.Extension{extension.Type: {
			Extension: *newExtension(ns, ""),
			Timeout:   time.Minute,
			Lifecycle: &gardencorev1beta1.ControllerResourceLifecycle{Reconcile: ptr.To(gardencorev1beta1.BeforeKubeAPIServer)},
		}},
	}, 100*time.Millisecond, 30*time.Second, time.Minute)
	afterLastOperation(t, c, client.ObjectKey{Namespace: ns, Name: "tendril"})
	must(t, ext.DeployBeforeKubeAPIServer(ctx))
	must(t, ext.WaitBeforeKubeAPIServer(ctx))

	op, e, err := lastOp(c, client.ObjectKey{Namespace: ns, Name: "tendril"})
	must(t, err)
	asked, err := time.Parse(time.RFC3339Nano, e.Annotations[v1beta1constants.GardenerTimestamp])
	if err != nil {
		t.Fatalf("%s: %s annotation: %v", step, v1beta1constants.GardenerTimestamp, err)
	}
	if pending := e.Annotations[v1beta1constants.GardenerOperation]; pending != "" {
		t.Fatalf("%s: operation %q not handled", step, pending)
	}
	if op.Type != gardencorev1beta1.LastOperationTypeReconcile || op.State != gardencorev1beta1.LastOperationStateSucceeded ||
		op.LastUpdateTime.Time.Before(asked.Truncate(time.Second)) || e.Status.ObservedGeneration != e.Generation {
		t.Fatalf("%s: lastOperation %s %s at %s (asked at %s), observed generation %d/%d",
			step, op.Type, op.State, op.LastUpdateTime, asked, e.Status.ObservedGeneration, e.Generation)
	}
}

// afterLastOperation waits until the second after the Extension's last lastOperation update
// and returns it. lastOperation and gardener.cloud/timestamp are compared in whole seconds, so
// only a reconcile that ends after what the caller does next can then look newer than that.
func afterLastOperation(t *testing.T, c client.Client, key client.ObjectKey) time.Time {
	t.Helper()
	op, _, err := lastOp(c, key)
	must(t, err)
	next := op.LastUpdateTime.Truncate(time.Second).Add(time.Second)
	time.Sleep(time.Until(next))
	return next
}

// agentReplicas maps each tendril-agent Deployment in the shoot's ManagedResource to its replicas.
func agentReplicas(t *testing.T, c client.Client, ns string) map[string]int32 {
	t.Helper()
	objs, err := managedresources.GetObjects(context.Background(), c, ns, manifest.ManagedResourceName)
	must(t, err)
	agents := map[string]int32{}
	for _, o := range objs {
		if d, ok := o.(*appsv1.Deployment); ok && strings.HasPrefix(d.Name, manifest.AgentName) {
			agents[d.Name] = ptr.Deref(d.Spec.Replicas, 1)
		}
	}
	return agents
}

// setHibernation writes the shoot's spec.hibernation.enabled and status.isHibernated into
// its Cluster, as gardenlet's Cluster sync does, and waits until the reconcile tendril's Cluster
// watch starts for it has succeeded, so that no reconcile is still running when the test goes
// on (a gardenletStep after it then sees its own reconcile's end, not that one's).
func setHibernation(t *testing.T, c client.Client, ns string, enabled, hibernated bool) {
	t.Helper()
	ctx := context.Background()
	key := client.ObjectKey{Namespace: ns, Name: "tendril"}
	changed := afterLastOperation(t, c, key)
	cluster := &extensionsv1alpha1.Cluster{}
	must(t, c.Get(ctx, client.ObjectKey{Name: ns}, cluster))
	var sh gardencorev1beta1.Shoot
	must(t, json.Unmarshal(cluster.Spec.Shoot.Raw, &sh))
	sh.Spec.Hibernation = &gardencorev1beta1.Hibernation{Enabled: ptr.To(enabled)}
	sh.Status.IsHibernated = hibernated
	raw, err := json.Marshal(&sh)
	must(t, err)
	patch := client.MergeFrom(cluster.DeepCopy())
	cluster.Spec.Shoot.Raw = raw
	must(t, c.Patch(ctx, cluster, patch))
	waitSucceeded(t, c, key, changed)
}

// waitSeedSide waits until tendril-server has replicas and the Route exists or not.
func waitSeedSide(t *testing.T, c client.Client, ns string, replicas int32, route bool) {
	t.Helper()
	testwait.For(t, fmt.Sprintf("%s: tendril-server replicas %d, route %v", ns, replicas, route), func() error {
		return seedSide(context.Background(), c, ns, replicas, route)
	})
}

// seedSide checks that tendril-server has replicas and the Route exists or not.
func seedSide(ctx context.Context, c client.Client, ns string, replicas int32, route bool) error {
	d := &appsv1.Deployment{}
	if err := c.Get(ctx, client.ObjectKey{Namespace: ns, Name: manifest.ServerName}, d); err != nil {
		return err
	}
	if got := ptr.Deref(d.Spec.Replicas, 1); got != replicas {
		return fmt.Errorf("tendril-server replicas %d, want %d", got, replicas)
	}
	err := c.Get(ctx, client.ObjectKey{Namespace: ns, Name: manifest.RouteName}, &tendrilv1alpha1.Route{})
	switch {
	case route && err != nil:
		return fmt.Errorf("route: %w", err)
	case !route && !apierrors.IsNotFound(err):
		return fmt.Errorf("route still there (%v)", err)
	}
	return nil
}
