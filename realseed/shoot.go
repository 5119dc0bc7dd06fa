package realseed

import (
	"context"
	"debug/elf"
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"net/netip"
	"os"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"time"

	"github.com/Masterminds/semver/v3"
	gardencorev1beta1 "github.com/gardener/gardener/pkg/apis/core/v1beta1"
	v1beta1constants "github.com/gardener/gardener/pkg/apis/core/v1beta1/constants"
	extensionsv1alpha1 "github.com/gardener/gardener/pkg/apis/extensions/v1alpha1"
	shootsystem "github.com/gardener/gardener/pkg/component/shoot/system"
	gardenerutils "github.com/gardener/gardener/pkg/utils/gardener"
	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/apimachinery/pkg/util/intstr"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"
	"k8s.io/utils/ptr"
	"sigs.k8s.io/controller-runtime/pkg/client"

	tendrilv1alpha1 "github.com/tendril-net/tendril/apis/tendril/v1alpha1"
	"github.com/tendril-net/tendril/extension"
	"github.com/tendril-net/tendril/extension/egresswebhook"
	"github.com/tendril-net/tendril/extension/manifest"
	"github.com/tendril-net/tendril/extension/networkpaths"
	"github.com/tendril-net/tendril/internal/kube/kubeenv"
	"github.com/tendril-net/tendril/internal/kube/shootgrm"
)

// ShootDomain is the parent DNS domain of the real seed's shoots (make run's too): shoot a's
// API server is api.a.<ShootDomain>.
const ShootDomain = "local.tendril.dev"

// ShootNetworks holds the shoots' pod and Service ranges (shoot i: pods 10.199.i.0/24, Services
// 10.199.(128+i).0/24); the guard keeps it on the machine. A shoot's node is extra node
// shootNodeBase+i, its link 10.198.(100+i).0/30 the shoot's node network.
const (
	ShootNetworks = "10.199.0.0/16"
	shootNodeBase = 100
	// maxShoots keeps 128+i below 256 and 100+i within StartNode's 250.
	maxShoots = 100
)

// The shoot's control-plane ports on the machine (kube-controller-manager and kube-scheduler
// run there, one pair per shoot): shoot i's are these + i, below the ephemeral range.
const (
	shootKCMPortBase       = 10300
	shootSchedulerPortBase = 10400
)

// Gardener's names for the shoot's etcd (pkg/component/etcd/etcd: the druid-managed Etcd
// etcd-main and its client Service) and its client port.
const (
	etcdMainName   = "etcd-main"
	etcdMainClient = "etcd-main-client"
	etcdClientPort = 2379
)

// ShootConfig is one shoot of the real seed, in project local.
type ShootConfig struct {
	// Name is the shoot's name (a DNS label): namespace shoot--local--<name>, API server
	// api.<name>.<ShootDomain>.
	Name string
	// Index (1–100) numbers its networks and node.
	Index int
	// Egress is its kube-apiserver's egress mode (when empty: httpConnect, or for a highly
	// available shoot none, so that the extension picks its default for one).
	Egress tendrilv1alpha1.EgressMode
	// PerRequest opts the shoot into the ingress's terminating mode (providerConfig
	// kubeAPIServer.balancing PerRequest): the ingress terminates its API traffic with
	// gardenlet's serving certificate and balances each request.
	PerRequest bool
	// HighAvailability gives the shoot a highly available control plane (failure tolerance
	// node): the extension runs two tendril-server replicas and two agents for it.
	HighAvailability bool
}

// Shoot is a running shoot: its control plane as pods in its seed namespace, its node an extra
// node registered with its API server.
type Shoot struct {
	cfg ShootConfig
	// Namespace is the shoot's control-plane namespace in the seed; Host its API server's name.
	Namespace, Host string
	// Kubeconfig is an admin kubeconfig that reaches the shoot's kube-apiserver through
	// tendril-ingress's SNI listener (the load balancer's address, Host as TLS server name);
	// REST and Client the same as client configurations.
	Kubeconfig string
	// UserKubeconfig is the same by the API server's name (https://Host), which the cluster's
	// DNS answers once the shoot's external DNSRecord is in place; kubectl uses it.
	UserKubeconfig string
	REST           *rest.Config
	Client         client.Client
	kube           kubernetes.Interface
	// Node is the shoot's node.
	Node *Node
	// Nodes, Pods and Services are its networks.
	Nodes, Pods, Services netip.Prefix
	// Created is when its Extension was created; FirstLogs when kubectl logs first read a pod's
	// log through the tunnel (the agent's), AgentStarted when the agent's container started.
	Created, FirstLogs, AgentStarted time.Time
	dir                              string
	token                            string
	// servingRotations counts RotateServingCertificate's new serving certificates.
	servingRotations int
	// webhookCA is the CA of the shoot's webhook, once CallWebhook started it.
	webhookCA []byte
}

var dnsLabel = regexp.MustCompile(`^[a-z]([a-z0-9-]{0,18}[a-z0-9])?$`)

// StartShoot makes shoot cfg as Gardener would on this seed and returns once tendril's agent
// runs on its node:
//   - its namespace as gardenlet labels it, the Cluster (with the Shoot) and the Extension of
//     type tendril with its egress mode;
//   - its control plane as pods of images by digest from the local registry: etcd (Gardener's
//     names, plain HTTP, no backup) and kube-apiserver, the Deployment carrying Gardener's pod
//     labels and gardenlet's label for control-plane webhooks, so that tendril's egress webhook
//     (served by tendril-seed from the installed chart) mutates it for real, retried as gardenlet
//     retries while the webhook refuses it for secrets that do not exist yet; Gardener's
//     kube-apiserver Service (apiserverexposure);
//   - kube-controller-manager and kube-scheduler as processes of the machine (on a seed they are
//     pods too; here they only have to make the shoot's Deployments run);
//   - the shoot's resource manager (Gardener's, in this process) and Gardener's shoot system
//     component through it (PriorityClasses, kube-system's policies);
//   - a node: an extra node registered with the shoot's API server through the ingress, its pods'
//     DNS the seed's CoreDNS (which answers the ingress's name the agent dials), with a
//     kube-proxy for the shoot's Services (a webhook's ClusterIP, which the agent dials for
//     kube-apiserver) and a kube-router enforcing the shoot's NetworkPolicies (Gardener's
//     kube-system deny-all among them, from the shoot system component).
func (c *Cluster) StartShoot(ctx context.Context, inst *Installation, cfg ShootConfig) (*Shoot, error) {
	if !dnsLabel.MatchString(cfg.Name) || cfg.Index < 1 || cfg.Index > maxShoots {
		return nil, fmt.Errorf("shoot %q: a name of up to 20 lower-case letters, digits and dashes and an index 1–%d are required", cfg.Name, maxShoots)
	}
	if cfg.Egress == "" && !cfg.HighAvailability {
		cfg.Egress = tendrilv1alpha1.EgressHTTPConnect
	}
	s := &Shoot{cfg: cfg, Namespace: "shoot--local--" + cfg.Name, Host: "api." + cfg.Name + "." + ShootDomain, dir: c.path("shoots", cfg.Name),
		Nodes:    netip.PrefixFrom(netip.AddrFrom4([4]byte{10, 198, byte(shootNodeBase + cfg.Index), 0}), 30),
		Pods:     netip.PrefixFrom(netip.AddrFrom4([4]byte{10, 199, byte(cfg.Index), 0}), 24),
		Services: netip.PrefixFrom(netip.AddrFrom4([4]byte{10, 199, byte(128 + cfg.Index), 0}), 24),
	}
	if err := os.MkdirAll(s.dir, 0o700); err != nil {
		return nil, err
	}
	c.shoots = append(c.shoots, s)
	images, err := c.controlPlaneImages()
	if err != nil {
		return nil, err
	}
	step := func(what string, f func() error) error {
		t0 := time.Now()
		if err := f(); err != nil {
			return fmt.Errorf("shoot %s: %s: %w", cfg.Name, what, err)
		}
		fmt.Fprintf(c.cfg.Out, "[%5.1fs] shoot %s: %s (%.1f s)\n", time.Since(c.started).Seconds(), cfg.Name, what, time.Since(t0).Seconds())
		return nil
	}
	if err := step("namespace, Cluster, Extension, etcd, kube-apiserver Deployment admitted by tendril's webhook", func() error {
		return c.createShoot(ctx, s, inst, images)
	}); err != nil {
		return nil, err
	}
	if err := step("kube-apiserver Ready, reached through tendril-ingress by SNI", func() error {
		return c.shootAPIServerReady(ctx, s, inst)
	}); err != nil {
		return nil, err
	}
	if err := step("controller manager, scheduler, resource manager, Gardener's shoot system", func() error {
		return c.startShootControllers(ctx, s)
	}); err != nil {
		return nil, err
	}
	if err := step("node Ready, tendril-agent Ready on it", func() error {
		n, err := c.StartNode(ctx, NodeConfig{Name: "shoot-" + cfg.Name + "-node", Index: shootNodeBase + cfg.Index,
			Kubeconfig: s.Kubeconfig, PodCIDR: s.Pods.String(), ClusterDNS: DNSServiceIP, KubeProxy: true,
			NetworkPolicy: true, ServiceCIDR: s.Services.String()})
		if err != nil {
			return err
		}
		s.Node = n
		if err := c.firstLogs(ctx, s); err != nil {
			return err
		}
		// Both tunnel ends are Ready only once the tunnel is up (tendril-server's /readyz is a
		// live agent): the agent is waited for, tendril-server's pods only checked for crashes.
		return c.waitFor(ctx, "kubelet "+n.cfg.Name, "tendril-agent Ready in the shoot", 3*time.Minute, func(ctx context.Context) error {
			if err := c.podsCrashing(ctx, s.Namespace, map[string]string{v1beta1constants.LabelApp: manifest.ServerName}); err != nil {
				return err
			}
			return c.deploymentReadyIn(ctx, s.Client, manifest.ShootNamespace, manifest.AgentObjectName(0), inst.Image)
		})
	}); err != nil {
		return nil, err
	}
	if err := step("api."+cfg.Name+" DNSRecord pointed at the ingress by tendril's webhook, resolved by CoreDNS", func() error {
		return c.externalDNSRecord(ctx, s, inst)
	}); err != nil {
		return nil, err
	}
	return s, nil
}

// controlPlaneImages pushes make testbin's etcd and kube-apiserver as images of one file each
// (once per cluster) and returns their references by digest.
func (c *Cluster) controlPlaneImages() (map[string]string, error) {
	c.cpOnce.Do(func() {
		c.cpImages = map[string]string{}
		for _, b := range []string{"etcd", "kube-apiserver"} {
			path := c.testbin(b)
			if err := staticBinary(path); err != nil {
				c.cpErr = err
				return
			}
			ref, err := c.pushBinary(path, "tendril/"+b, kubeenv.KubernetesVersion)
			if err != nil {
				c.cpErr = err
				return
			}
			c.cpImages[b] = ref
		}
	})
	return c.cpImages, c.cpErr
}

// staticBinary fails for an ELF file that needs a dynamic loader: an image of one file has
// none, and the container would fail with a bare "no such file or directory".
func staticBinary(path string) error {
	f, err := elf.Open(path)
	if err != nil {
		return fmt.Errorf("%s: %w", path, err)
	}
	defer f.Close()
	for _, p := range f.Progs {
		if p.Type == elf.PT_INTERP {
			return fmt.Errorf("%s is linked dynamically and cannot run in an image of its own: build it again with make testbin (static since its directory ends in -static)", path)
		}
	}
	return nil
}

// shootObject is the Shoot as gardenlet hands it to extensions in the Cluster.
func (s *Shoot) shootObject() *gardencorev1beta1.Shoot {
	return &gardencorev1beta1.Shoot{
		TypeMeta: metav1.TypeMeta{APIVersion: gardencorev1beta1.SchemeGroupVersion.String(), Kind: "Shoot"},
		// A tendril shoot keeps its kube-apiserver traffic passthrough at Gardener's gateway
		// (docs/design-notes/gardener-coexistence.md).
		ObjectMeta: metav1.ObjectMeta{Name: s.cfg.Name, Namespace: "garden-local", UID: types.UID("shoot-" + s.cfg.Name),
			Annotations: map[string]string{extension.DisableIstioTLSTermination: "true"}},
		Spec: gardencorev1beta1.ShootSpec{
			DNS:        &gardencorev1beta1.DNS{Domain: ptr.To(s.cfg.Name + "." + ShootDomain)},
			Kubernetes: gardencorev1beta1.Kubernetes{Version: strings.TrimPrefix(kubeenv.KubernetesVersion, "v")},
			Networking: &gardencorev1beta1.Networking{Type: ptr.To("calico"),
				Nodes: ptr.To(s.Nodes.String()), Pods: ptr.To(s.Pods.String()), Services: ptr.To(s.Services.String())},
			Provider:     gardencorev1beta1.Provider{Type: "local"},
			Region:       "local",
			Maintenance:  &gardencorev1beta1.Maintenance{TimeWindow: &gardencorev1beta1.MaintenanceTimeWindow{Begin: "220000+0000", End: "230000+0000"}},
			ControlPlane: s.controlPlane(),
		},
		Status: gardencorev1beta1.ShootStatus{TechnicalID: s.Namespace, UID: types.UID("shoot-" + s.cfg.Name)},
	}
}

// controlPlane is the Shoot's spec.controlPlane: failure tolerance node for a highly available
// shoot (this seed has no zones), none otherwise.
func (s *Shoot) controlPlane() *gardencorev1beta1.ControlPlane {
	if !s.cfg.HighAvailability {
		return nil
	}
	return &gardencorev1beta1.ControlPlane{HighAvailability: &gardencorev1beta1.HighAvailability{
		FailureTolerance: gardencorev1beta1.FailureTolerance{Type: gardencorev1beta1.FailureToleranceTypeNode}}}
}

// createShoot creates the shoot's seed objects: what gardenlet writes before the control plane
// (namespace, Cluster, Extension), then etcd and kube-apiserver.
func (c *Cluster) createShoot(ctx context.Context, s *Shoot, inst *Installation, images map[string]string) error {
	ns := &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: s.Namespace, Labels: networkpaths.ShootNamespaceLabels()}}
	if err := c.Client.Create(ctx, ns); err != nil {
		return fmt.Errorf("namespace: %w", err)
	}
	if err := c.shootPKI(ctx, s, c.NodeIP); err != nil {
		return err
	}
	shootJSON, err := json.Marshal(s.shootObject())
	if err != nil {
		return err
	}
	pcfg := tendrilv1alpha1.ProviderConfig{
		TypeMeta: metav1.TypeMeta{APIVersion: tendrilv1alpha1.SchemeGroupVersion.String(), Kind: "ProviderConfig"},
		Egress:   s.cfg.Egress,
	}
	if s.cfg.PerRequest {
		pcfg.KubeAPIServer = &tendrilv1alpha1.KubeAPIServer{Balancing: tendrilv1alpha1.BalancingPerRequest}
	}
	pc, err := json.Marshal(pcfg)
	if err != nil {
		return err
	}
	files := map[string][]byte{}
	for _, f := range shootPKIFiles {
		if files[f], err = os.ReadFile(filepath.Join(s.dir, f)); err != nil {
			return err
		}
	}
	objs := []client.Object{
		&extensionsv1alpha1.Cluster{
			ObjectMeta: metav1.ObjectMeta{Name: s.Namespace},
			Spec: extensionsv1alpha1.ClusterSpec{
				CloudProfile: runtime.RawExtension{Raw: []byte(`{"apiVersion":"core.gardener.cloud/v1beta1","kind":"CloudProfile"}`)},
				Seed:         &runtime.RawExtension{Raw: []byte(`{"apiVersion":"core.gardener.cloud/v1beta1","kind":"Seed","metadata":{"name":"` + SeedName + `"}}`)},
				Shoot:        runtime.RawExtension{Raw: shootJSON},
			},
		},
		// As gardenlet's extension deployer writes it: with the operation annotation, which the
		// extension's predicates reconcile on.
		&extensionsv1alpha1.Extension{
			ObjectMeta: metav1.ObjectMeta{Name: extension.Type, Namespace: s.Namespace, Annotations: map[string]string{
				v1beta1constants.GardenerOperation: v1beta1constants.GardenerOperationReconcile,
				v1beta1constants.GardenerTimestamp: time.Now().UTC().Format(time.RFC3339Nano),
			}},
			Spec: extensionsv1alpha1.ExtensionSpec{DefaultSpec: extensionsv1alpha1.DefaultSpec{Type: extension.Type, ProviderConfig: &runtime.RawExtension{Raw: pc}}},
		},
		&corev1.Secret{ObjectMeta: metav1.ObjectMeta{Name: "kube-apiserver-local", Namespace: s.Namespace}, Data: files},
	}
	objs = append(objs, etcdObjects(s.Namespace, images["etcd"])...)
	s.Created = time.Now()
	for _, o := range objs {
		if err := c.Client.Create(ctx, o); err != nil {
			return fmt.Errorf("create %T %s: %w", o, o.GetName(), err)
		}
	}
	if err := networkpaths.DeployKubeAPIServerService(ctx, c.Client, s.Namespace); err != nil {
		return err
	}
	// tendril's webhook refuses the Deployment until the extension has made the secrets it
	// mounts; gardenlet retries, and so does this.
	dep := s.kubeAPIServerDeployment(images["kube-apiserver"])
	err = c.waitFor(ctx, "kube-apiserver", "kube-apiserver Deployment of "+s.Namespace+" admitted", 2*time.Minute, func(ctx context.Context) error {
		return c.Client.Create(ctx, dep.DeepCopy())
	})
	if err != nil {
		return fmt.Errorf("%w\n%s", err, c.extensionState(ctx, s, inst))
	}
	return nil
}

// extensionState says where the shoot's Extension stands and how tendril-seed's log ends: what
// an operator looks at when a shoot's control plane does not come.
func (c *Cluster) extensionState(ctx context.Context, s *Shoot, inst *Installation) string {
	var ext extensionsv1alpha1.Extension
	state := "Extension: "
	if err := c.Client.Get(ctx, client.ObjectKey{Namespace: s.Namespace, Name: extension.Type}, &ext); err != nil {
		state += err.Error()
	} else if op := ext.Status.LastOperation; op == nil {
		state += "no lastOperation"
	} else {
		state += fmt.Sprintf("lastOperation %s %s: %s", op.Type, op.State, op.Description)
	}
	if e := ext.Status.LastError; e != nil {
		state += "; lastError: " + e.Description
	}
	logs, err := c.PodLogs(ctx, inst.Namespace, map[string]string{"app.kubernetes.io/name": "tendril-seed"})
	if err != nil {
		return state + "; tendril-seed's log: " + err.Error()
	}
	lines := strings.Split(strings.TrimSpace(logs), "\n")
	return state + "; tendril-seed's log ends:\n" + strings.Join(lines[max(0, len(lines)-15):], "\n")
}

// etcdObjects are the shoot's etcd: a Deployment of one pod named and labelled as Gardener's
// etcd-main, its data in an emptyDir, and the client Service kube-apiserver reaches it by.
// Plain HTTP and no backup: a shortcut of a one-machine seed (Gardener's druid runs it with
// TLS, peers and backups).
func etcdObjects(ns, image string) []client.Object {
	labels := map[string]string{
		v1beta1constants.LabelApp: "etcd-statefulset", v1beta1constants.LabelRole: v1beta1constants.ETCDRoleMain,
		v1beta1constants.GardenRole: v1beta1constants.GardenRoleControlPlane, "instance": etcdMainName, "name": "etcd",
	}
	url := fmt.Sprintf("http://%s:%d", etcdMainClient, etcdClientPort)
	pod := corev1.PodSpec{
		AutomountServiceAccountToken: ptr.To(false),
		SecurityContext:              nonRootPod(),
		Containers: []corev1.Container{{
			Name: "etcd", Image: image,
			Args: []string{"--name=" + etcdMainName, "--data-dir=/var/etcd/data",
				fmt.Sprintf("--listen-client-urls=http://0.0.0.0:%d", etcdClientPort), "--advertise-client-urls=" + url,
				"--listen-peer-urls=http://127.0.0.1:2380", "--initial-advertise-peer-urls=http://127.0.0.1:2380",
				"--initial-cluster=" + etcdMainName + "=http://127.0.0.1:2380", "--unsafe-no-fsync"},
			Ports:           []corev1.ContainerPort{{Name: "client", ContainerPort: etcdClientPort, Protocol: corev1.ProtocolTCP}},
			ReadinessProbe:  &corev1.Probe{ProbeHandler: corev1.ProbeHandler{HTTPGet: &corev1.HTTPGetAction{Path: "/health", Port: intstr.FromInt32(etcdClientPort)}}, PeriodSeconds: 1},
			SecurityContext: restrictedContainer(),
			VolumeMounts:    []corev1.VolumeMount{{Name: "data", MountPath: "/var/etcd"}},
		}},
		Volumes: []corev1.Volume{{Name: "data", VolumeSource: corev1.VolumeSource{EmptyDir: &corev1.EmptyDirVolumeSource{}}}},
	}
	return []client.Object{
		&corev1.Service{
			ObjectMeta: metav1.ObjectMeta{Name: etcdMainClient, Namespace: ns, Labels: labels},
			Spec: corev1.ServiceSpec{Selector: labels, Ports: []corev1.ServicePort{{Name: "client", Port: etcdClientPort,
				TargetPort: intstr.FromInt32(etcdClientPort), Protocol: corev1.ProtocolTCP}}},
		},
		&appsv1.Deployment{
			ObjectMeta: metav1.ObjectMeta{Name: etcdMainName, Namespace: ns, Labels: labels},
			Spec: appsv1.DeploymentSpec{Replicas: ptr.To[int32](1), Strategy: appsv1.DeploymentStrategy{Type: appsv1.RecreateDeploymentStrategyType},
				Selector: &metav1.LabelSelector{MatchLabels: labels},
				Template: corev1.PodTemplateSpec{ObjectMeta: metav1.ObjectMeta{Labels: labels}, Spec: pod}},
		},
	}
}

// kubeAPIServerDeployment is the shoot's kube-apiserver as gardenlet would deploy it, as far as
// tendril's webhook and Gardener's NetworkPolicies see it: the Deployment's name and labels,
// the pod labels of pkg/component/kubernetes/apiserver (deployment.go), gardenlet's label for
// control-plane webhooks, port 443. Its flags are a one-machine cluster's: the admin token, no
// audit, no admission webhooks of Gardener's.
func (s *Shoot) kubeAPIServerDeployment(image string) *appsv1.Deployment {
	labels := networkpaths.KubeAPIServerPodLabels()
	labels[gardenerutils.NetworkPolicyLabel(etcdMainClient, etcdClientPort)] = v1beta1constants.LabelNetworkPolicyAllowed
	const dir = "/srv/kubernetes/local"
	f := func(name string) string { return dir + "/" + name }
	args := []string{
		fmt.Sprintf("--etcd-servers=http://%s:%d", etcdMainClient, etcdClientPort),
		fmt.Sprintf("--secure-port=%d", manifest.PortKubeAPIServer),
		"--tls-cert-file=" + f("tls.crt"), "--tls-private-key-file=" + f("tls.key"), "--client-ca-file=" + f(shootPKIClientCA),
		// The authenticating proxy's headers, trusted from the front-proxy CA's certificates
		// only, as Gardener's kube-apiserver has them (pkg/component/kubernetes/apiserver).
		"--requestheader-client-ca-file=" + f(shootPKIFrontProxyCA), "--requestheader-extra-headers-prefix=X-Remote-Extra-",
		"--requestheader-group-headers=X-Remote-Group", "--requestheader-username-headers=X-Remote-User",
		"--token-auth-file=" + f("tokens.csv"), "--authorization-mode=Node,RBAC", "--allow-privileged=true",
		"--service-account-issuer=https://" + s.Host, "--service-account-key-file=" + f("sa.pub"),
		"--service-account-signing-key-file=" + f("sa.key"), "--service-cluster-ip-range=" + s.Services.String(),
		// The shoot's kubelets by their node addresses, which the tunnel's agent reaches.
		"--kubelet-preferred-address-types=InternalIP",
		"--profiling=false",
	}
	https := &corev1.HTTPGetAction{Path: "/readyz", Port: intstr.FromInt32(manifest.PortKubeAPIServer), Scheme: corev1.URISchemeHTTPS}
	objLabels := map[string]string{
		v1beta1constants.LabelApp: v1beta1constants.LabelKubernetes, v1beta1constants.LabelRole: v1beta1constants.LabelAPIServer,
		v1beta1constants.LabelExtensionProviderMutatedByControlplaneWebhook: "true",
	}
	return &appsv1.Deployment{
		ObjectMeta: metav1.ObjectMeta{Name: manifest.KubeAPIServerName, Namespace: s.Namespace, Labels: objLabels},
		Spec: appsv1.DeploymentSpec{
			Replicas: ptr.To[int32](1),
			Selector: &metav1.LabelSelector{MatchLabels: map[string]string{v1beta1constants.LabelApp: v1beta1constants.LabelKubernetes, v1beta1constants.LabelRole: v1beta1constants.LabelAPIServer}},
			Template: corev1.PodTemplateSpec{
				ObjectMeta: metav1.ObjectMeta{Labels: labels},
				Spec: corev1.PodSpec{
					AutomountServiceAccountToken: ptr.To(false),
					SecurityContext:              nonRootPod(),
					Containers: []corev1.Container{{
						Name: "kube-apiserver", Image: image, Args: args,
						Ports:           []corev1.ContainerPort{{Name: "https", ContainerPort: manifest.PortKubeAPIServer, Protocol: corev1.ProtocolTCP}},
						ReadinessProbe:  &corev1.Probe{ProbeHandler: corev1.ProbeHandler{HTTPGet: https}, PeriodSeconds: 1},
						SecurityContext: restrictedContainer(),
						VolumeMounts:    []corev1.VolumeMount{{Name: "local", MountPath: dir, ReadOnly: true}},
					}},
					Volumes: []corev1.Volume{{Name: "local", VolumeSource: corev1.VolumeSource{Secret: &corev1.SecretVolumeSource{
						SecretName: "kube-apiserver-local", DefaultMode: ptr.To[int32](0o440)}}}},
				},
			},
		},
	}
}

// nonRootPod runs a pod as Gardener's distroless non-root user, its volumes readable by its
// group, and lets it bind 443 without a capability (a safe sysctl).
func nonRootPod() *corev1.PodSecurityContext {
	return &corev1.PodSecurityContext{
		RunAsNonRoot: ptr.To(true), RunAsUser: ptr.To[int64](65532), RunAsGroup: ptr.To[int64](65532), FSGroup: ptr.To[int64](65532),
		SeccompProfile: &corev1.SeccompProfile{Type: corev1.SeccompProfileTypeRuntimeDefault},
		Sysctls:        []corev1.Sysctl{{Name: "net.ipv4.ip_unprivileged_port_start", Value: "0"}},
	}
}

func restrictedContainer() *corev1.SecurityContext {
	return &corev1.SecurityContext{AllowPrivilegeEscalation: ptr.To(false), ReadOnlyRootFilesystem: ptr.To(true),
		Capabilities: &corev1.Capabilities{Drop: []corev1.Capability{"ALL"}}}
}

// shootAPIServerReady waits for etcd, for kube-apiserver's pods as the webhook mutated them
// (its egress selector configuration in the flags, the image by digest) Ready, and for the
// shoot's API to answer through the ingress, whose route for Host the extension made.
func (c *Cluster) shootAPIServerReady(ctx context.Context, s *Shoot, inst *Installation) error {
	images, _ := c.controlPlaneImages()
	if err := c.waitFor(ctx, "kubelet", "etcd of "+s.Namespace+" Ready", 2*time.Minute, func(ctx context.Context) error {
		return c.deploymentReady(ctx, s.Namespace, etcdMainName, images["etcd"])
	}); err != nil {
		return err
	}
	var dep appsv1.Deployment
	if err := c.Client.Get(ctx, client.ObjectKey{Namespace: s.Namespace, Name: manifest.KubeAPIServerName}, &dep); err != nil {
		return err
	}
	if !hasArg(dep.Spec.Template.Spec.Containers, "kube-apiserver", egresswebhook.FlagEgressSelectorConfigFile+"="+egresswebhook.ConfigFile) {
		return fmt.Errorf("the kube-apiserver Deployment was admitted without tendril's egress selector configuration (%s=%s): is tendril's webhook registered?",
			egresswebhook.FlagEgressSelectorConfigFile, egresswebhook.ConfigFile)
	}
	if err := c.waitFor(ctx, "kubelet", "kube-apiserver of "+s.Namespace+" Ready", 3*time.Minute, func(ctx context.Context) error {
		return c.deploymentReady(ctx, s.Namespace, manifest.KubeAPIServerName, images["kube-apiserver"])
	}); err != nil {
		return err
	}
	return c.waitFor(ctx, "kube-apiserver", s.Host+" answering /readyz through tendril-ingress", 2*time.Minute, func(ctx context.Context) error {
		return s.kube.Discovery().RESTClient().Get().AbsPath("/readyz").Do(ctx).Error()
	})
}

func hasArg(cs []corev1.Container, container, arg string) bool {
	for _, ct := range cs {
		if ct.Name != container {
			continue
		}
		for _, a := range append(append([]string{}, ct.Command...), ct.Args...) {
			if a == arg {
				return true
			}
		}
	}
	return false
}

// startShootControllers runs the shoot's kube-controller-manager and kube-scheduler on the
// machine (through kube-apiserver's Service), the shoot's resource manager in this
// process, and deploys Gardener's shoot system component through it.
func (c *Cluster) startShootControllers(ctx context.Context, s *Shoot) error {
	// As on a seed, the controllers reach kube-apiserver by its Service in the namespace, not
	// through the load balancer (kube-proxy carries the machine's connections to its ClusterIP).
	var svc corev1.Service
	if err := c.Client.Get(ctx, client.ObjectKey{Namespace: s.Namespace, Name: manifest.KubeAPIServerName}, &svc); err != nil {
		return err
	}
	kc, i := filepath.Join(s.dir, "controllers.kubeconfig"), s.cfg.Index
	if _, _, _, err := adminKubeconfig(kc, s.Namespace, net.JoinHostPort(svc.Spec.ClusterIP, strconv.Itoa(manifest.PortKubeAPIServer)),
		manifest.KubeAPIServerName+"."+s.Namespace+".svc", filepath.Join(s.dir, "ca.crt"), s.token, 50); err != nil {
		return err
	}
	kcm, sched := "kube-controller-manager "+s.cfg.Name, "kube-scheduler "+s.cfg.Name
	if err := c.start(kcm, c.seedbin("kube-controller-manager"), "--kubeconfig", kc,
		"--authentication-kubeconfig", kc, "--authorization-kubeconfig", kc,
		"--service-account-private-key-file", filepath.Join(s.dir, "sa.key"), "--root-ca-file", filepath.Join(s.dir, "ca.crt"),
		"--service-cluster-ip-range", s.Services.String(), "--controllers=*,-nodeipam",
		"--leader-elect=false", "--bind-address", "127.0.0.1", "--secure-port", strconv.Itoa(shootKCMPortBase+i),
		"--use-service-account-credentials=false"); err != nil {
		return err
	}
	if err := c.start(sched, c.seedbin("kube-scheduler"), "--kubeconfig", kc,
		"--authentication-kubeconfig", kc, "--authorization-kubeconfig", kc,
		"--leader-elect=false", "--bind-address", "127.0.0.1", "--secure-port", strconv.Itoa(shootSchedulerPortBase+i)); err != nil {
		return err
	}
	if err := c.waitFor(ctx, kcm, "default ServiceAccount in the shoot", time.Minute, func(ctx context.Context) error {
		return s.kube.Discovery().RESTClient().Get().AbsPath("/api/v1/namespaces/default/serviceaccounts/default").Do(ctx).Error()
	}); err != nil {
		return err
	}
	mgr, err := shootgrm.New(c.grmCtx, shootgrm.Config{Seed: c.REST, Shoot: s.REST, Namespace: s.Namespace, ClusterID: SeedName, SyncPeriod: 10 * time.Second})
	if err != nil {
		return err
	}
	c.background("resource manager of "+s.Namespace, mgr)
	var nets [3][]net.IPNet
	for i, p := range []netip.Prefix{s.Pods, s.Services, s.Nodes} {
		nets[i] = []net.IPNet{{IP: p.Addr().AsSlice(), Mask: net.CIDRMask(p.Bits(), 32)}}
	}
	sys := shootsystem.New(c.Client, s.Namespace, shootsystem.Values{
		Extensions: []string{extension.Type}, ExternalClusterDomain: ptr.To(s.cfg.Name + "." + ShootDomain),
		KubernetesVersion: semver.MustParse(kubeenv.KubernetesVersion), Object: s.shootObject(), ProjectName: "local",
		PodNetworkCIDRs: nets[0], ServiceNetworkCIDRs: nets[1], NodeNetworkCIDRs: nets[2],
	})
	if err := sys.Deploy(ctx); err != nil {
		return fmt.Errorf("Gardener's shoot system component: %w", err)
	}
	wctx, cancel := context.WithTimeout(ctx, 2*time.Minute)
	defer cancel()
	if err := sys.Wait(wctx); err != nil {
		return fmt.Errorf("Gardener's shoot system component (applied by the shoot's resource manager): %w", err)
	}
	return nil
}

// podsCrashing fails finally when a seed pod in ns labelled labels cannot pull its image or
// crash-loops.
func (c *Cluster) podsCrashing(ctx context.Context, ns string, labels map[string]string) error {
	var pods corev1.PodList
	if err := c.Client.List(ctx, &pods, client.InNamespace(ns), client.MatchingLabels(labels)); err != nil {
		return err
	}
	for _, p := range pods.Items {
		if err := c.podStuck(&p); err != nil {
			return &fatalError{err}
		}
	}
	return nil
}

// firstLogs waits for the first read of the agent pod's log through the shoot's API server,
// which kube-apiserver carries through the tunnel the agent makes, and records when it passed.
func (c *Cluster) firstLogs(ctx context.Context, s *Shoot) error {
	return c.waitFor(ctx, "kubelet "+s.Node.cfg.Name, "first kubectl logs through the tunnel", 3*time.Minute, func(ctx context.Context) error {
		if err := c.podsCrashing(ctx, s.Namespace, map[string]string{v1beta1constants.LabelApp: manifest.ServerName}); err != nil {
			return err
		}
		var pods corev1.PodList
		if err := s.Client.List(ctx, &pods, client.InNamespace(manifest.ShootNamespace), client.MatchingLabels{v1beta1constants.LabelApp: manifest.AgentName}); err != nil {
			return err
		}
		for _, p := range pods.Items {
			if err := c.podStuck(&p); err != nil {
				return &fatalError{err}
			}
			for _, cs := range p.Status.ContainerStatuses {
				if cs.State.Running == nil {
					continue
				}
				if err := s.kube.CoreV1().Pods(p.Namespace).GetLogs(p.Name, &corev1.PodLogOptions{Container: cs.Name, TailLines: ptr.To[int64](1)}).Do(ctx).Error(); err != nil {
					return fmt.Errorf("logs of %s: %w", p.Name, err)
				}
				s.FirstLogs, s.AgentStarted = time.Now(), cs.State.Running.StartedAt.Time
				return nil
			}
		}
		return errors.New("no running agent pod yet")
	})
}
