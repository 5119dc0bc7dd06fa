package realseed

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"net/netip"
	"path/filepath"
	"slices"
	"strings"
	"time"

	gardencorev1 "github.com/gardener/gardener/pkg/apis/core/v1"
	gardencorev1beta1 "github.com/gardener/gardener/pkg/apis/core/v1beta1"
	v1beta1constants "github.com/gardener/gardener/pkg/apis/core/v1beta1/constants"
	resourcesv1alpha1 "github.com/gardener/gardener/pkg/apis/resources/v1alpha1"
	"github.com/gardener/gardener/pkg/chartrenderer"
	seedsystem "github.com/gardener/gardener/pkg/component/seed/system"
	gardenletnetworkpolicy "github.com/gardener/gardener/pkg/controller/networkpolicy"
	gardenerutils "github.com/gardener/gardener/pkg/utils/gardener"
	kubernetesutils "github.com/gardener/gardener/pkg/utils/kubernetes"
	"github.com/gardener/gardener/pkg/utils/managedresources"
	"github.com/gardener/gardener/pkg/utils/oci"
	"github.com/go-logr/logr"
	"github.com/google/go-containerregistry/pkg/name"
	v1 "github.com/google/go-containerregistry/pkg/v1"
	"github.com/google/go-containerregistry/pkg/v1/layout"
	"github.com/google/go-containerregistry/pkg/v1/remote"
	"github.com/google/go-containerregistry/pkg/v1/static"
	"github.com/google/go-containerregistry/pkg/v1/types"
	appsv1 "k8s.io/api/apps/v1"
	batchv1 "k8s.io/api/batch/v1"
	corev1 "k8s.io/api/core/v1"
	schedulingv1 "k8s.io/api/scheduling/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/version"
	podsecurityadmissionapi "k8s.io/pod-security-admission/api"
	"sigs.k8s.io/controller-runtime/pkg/client"

	"github.com/tendril-net/tendril/charts"
	"github.com/tendril-net/tendril/extension/networkpaths"
	"github.com/tendril-net/tendril/internal/host/procgroup"
	"github.com/tendril-net/tendril/internal/kube/kubeenv"
	"github.com/tendril-net/tendril/internal/kube/shootgrm"
)

// SeedName is the Seed the real seed is, in the values gardenlet mixes in.
const SeedName = "local"

// ControllerInstallation is the name gardener-controller-manager would give tendril's
// installation on this seed; gardenlet derives the extension's namespace and ManagedResource
// names from it (extension-<name>).
const ControllerInstallation = "tendril-local"

// Release is what InstallTendril installs.
type Release struct {
	// ImageLayout is make image's OCI image layout (image/oci beside the binaries, which make
	// image writes to bin/image/oci, when empty).
	ImageLayout string
	// Values are chart values on top of the chart's own; the image and its digest are set to
	// what was pushed.
	Values map[string]any
}

// Installation is tendril as installed.
type Installation struct {
	// Image and Chart are the references by digest pulled from the local registry.
	Image, Chart string
	// Namespace is the extension's namespace.
	Namespace string
}

// gardenerSeed prepares the cluster as gardenlet prepares a seed before any extension is
// installed: namespace garden, Gardener's CRDs, the seed's resource manager (Gardener's own
// controllers, in this process, class seed) and the seed system component with Gardener's
// PriorityClasses (applied through that resource manager).
func (c *Cluster) gardenerSeed(ctx context.Context) error {
	garden := &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: v1beta1constants.GardenNamespace,
		Labels: map[string]string{v1beta1constants.GardenRole: v1beta1constants.GardenRoleGarden}}}
	if err := c.Client.Create(ctx, garden); err != nil {
		return fmt.Errorf("namespace garden: %w", err)
	}
	// gardenlet's Helm chart brings gardener-system-critical (its own and the seed resource
	// manager's class; tendril-ingress runs with it); value and text as gardenadm deploys it
	// where there is no gardenlet chart (pkg/gardenadm/botanist/system.go).
	critical := &schedulingv1.PriorityClass{ObjectMeta: metav1.ObjectMeta{Name: v1beta1constants.PriorityClassNameSeedSystemCritical},
		Value:       999998950,
		Description: "This class is used to ensure that the gardener-resource-manager has a high priority and is not preempted in favor of other pods."}
	if err := c.Client.Create(ctx, critical); err != nil {
		return fmt.Errorf("PriorityClass %s: %w", critical.Name, err)
	}
	if err := kubeenv.InstallGardenerCRDs(ctx, c.Client); err != nil {
		return fmt.Errorf("Gardener's CRDs: %w", err)
	}
	mgr, err := shootgrm.New(c.grmCtx, shootgrm.Config{Seed: c.REST, Shoot: c.REST, Namespace: v1beta1constants.GardenNamespace,
		Class: v1beta1constants.SeedResourceManagerClass, ClusterID: SeedName, SyncPeriod: 10 * time.Second})
	if err != nil {
		return err
	}
	c.background("seed resource manager", mgr)
	// gardenlet's seed NetworkPolicy controller and the seed resource manager's NetworkPolicy
	// controller, Gardener's own code in this process, for this seed's networks: kube-router
	// enforces what they write.
	np, err := networkpaths.NewSeedControllers(c.grmCtx, c.REST, c.runtimeNetworks(), logr.Discard())
	if err != nil {
		return err
	}
	c.background("seed NetworkPolicy controllers", np)
	// The seed's DNS provider, and gardenlet's copy of its credentials (Secret seed-ingress),
	// which the chart's DNSRecord names.
	if err := c.startDNSProvider(ctx); err != nil {
		return err
	}
	creds := &corev1.Secret{ObjectMeta: metav1.ObjectMeta{Name: "seed-ingress", Namespace: v1beta1constants.GardenNamespace}}
	if err := c.Client.Create(ctx, creds); err != nil {
		return fmt.Errorf("secret garden/seed-ingress: %w", err)
	}
	sys := seedsystem.New(c.Client, v1beta1constants.GardenNamespace, seedsystem.Values{ManagePriorityClasses: true})
	if err := sys.Deploy(ctx); err != nil {
		return fmt.Errorf("seed system component: %w", err)
	}
	if err := sys.Wait(ctx); err != nil {
		return fmt.Errorf("seed system component (Gardener's PriorityClasses): %w", err)
	}
	return nil
}

// InstallTendril installs tendril as a release, the way gardenlet installs an extension: the
// image make image built is pushed to the local registry, the seed chart is pushed there as a
// Helm OCI artifact, pulled back by digest with Gardener's HelmRegistry, rendered with
// Gardener's chart renderer and the values gardenlet mixes in, and handed to the seed's
// resource manager as ControllerInstallation's ManagedResource in namespace garden. The
// extension's namespace gets the labels gardenlet gives it, restricted Pod Security among them
// (the ControllerRegistration asks for it). It returns once tendril-seed and tendril-ingress
// run, pulled by digest, Ready by their probes.
func (c *Cluster) InstallTendril(ctx context.Context, rel Release) (*Installation, error) {
	if rel.ImageLayout == "" {
		rel.ImageLayout = filepath.Join(c.cfg.BinDir, "image", "oci")
	}
	img, err := layoutImage(rel.ImageLayout)
	if err != nil {
		return nil, err
	}
	inst := &Installation{}
	if inst.Image, err = c.Push(img, "tendril", "latest"); err != nil {
		return nil, err
	}
	if inst.Chart, err = c.pushChart(); err != nil {
		return nil, err
	}
	// What gardenlet does with a ControllerDeployment whose helm.ociRepository names the chart.
	pulled, err := oci.NewHelmRegistry(c.Client).Pull(ctx, &gardencorev1.OCIRepository{Ref: &inst.Chart})
	if err != nil {
		return nil, fmt.Errorf("pull the chart %s as gardenlet does: %w", inst.Chart, err)
	}
	ci := &gardencorev1beta1.ControllerInstallation{ObjectMeta: metav1.ObjectMeta{Name: ControllerInstallation}}
	inst.Namespace = gardenerutils.NamespaceNameForControllerInstallation(ci)
	ns := &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: inst.Namespace, Labels: map[string]string{
		v1beta1constants.GardenRole:                      v1beta1constants.GardenRoleExtension,
		v1beta1constants.LabelControllerRegistrationName: "tendril",
		resourcesv1alpha1.HighAvailabilityConfigConsider: "true",
		podsecurityadmissionapi.EnforceLevelLabel:        string(podsecurityadmissionapi.LevelRestricted),
	}}}
	if err := c.Client.Create(ctx, ns); err != nil {
		return nil, fmt.Errorf("namespace %s: %w", inst.Namespace, err)
	}
	repo, digest, _ := strings.Cut(inst.Image, "@")
	values := map[string]any{"image": repo, "imageDigest": digest}
	for k, v := range rel.Values {
		values[k] = v
	}
	values["gardener"] = gardenerValues()
	renderer := chartrenderer.NewWithServerVersion(&version.Info{GitVersion: "v1.37.1", Major: "1", Minor: "37"})
	release, err := renderer.RenderArchive(pulled, "tendril", inst.Namespace, values)
	if err != nil {
		return nil, fmt.Errorf("render the chart: %w", err)
	}
	data := release.AsSecretData()
	// gardenlet tells every container its seed.
	if err := gardenerutils.MutateObjectsInSecretData(data, inst.Namespace, []string{appsv1.GroupName, batchv1.GroupName}, func(obj runtime.Object) error {
		return kubernetesutils.VisitPodSpec(obj, func(ps *corev1.PodSpec) {
			kubernetesutils.VisitContainers(ps, func(ct *corev1.Container) {
				kubernetesutils.AddEnvVar(ct, corev1.EnvVar{Name: v1beta1constants.EnvSeedName, Value: SeedName}, true)
			})
		})
	}); err != nil {
		return nil, err
	}
	mrName := gardenerutils.ManagedResourceNameForControllerInstallation(ci)
	if err := managedresources.Create(ctx, c.Client, v1beta1constants.GardenNamespace, mrName, nil, false,
		v1beta1constants.SeedResourceManagerClass, data, nil, nil, nil); err != nil {
		return nil, fmt.Errorf("ManagedResource %s: %w", mrName, err)
	}
	if err := c.waitFor(ctx, "kubelet", "tendril-seed and tendril-ingress Ready", 3*time.Minute, func(ctx context.Context) error {
		for _, d := range []string{"gardener-extension-tendril", "tendril-ingress"} {
			if err := c.deploymentReady(ctx, inst.Namespace, d, inst.Image); err != nil {
				return fmt.Errorf("%w (ManagedResource %s: %s)", err, mrName, c.mrState(ctx, mrName))
			}
		}
		return nil
	}); err != nil {
		return nil, err
	}
	return inst, nil
}

// background runs a manager of Gardener's controllers until Stop; Stop waits for it.
func (c *Cluster) background(name string, mgr interface{ Start(context.Context) error }) {
	c.bg.Add(1)
	go func() {
		defer c.bg.Done()
		if err := mgr.Start(c.grmCtx); err != nil && c.grmCtx.Err() == nil {
			fmt.Fprintf(c.cfg.Out, "%s: %v\n", name, err)
		}
	}()
}

// runtimeNetworks are the seed's networks as the Seed's spec.networks gives them to gardenlet.
func (c *Cluster) runtimeNetworks() gardenletnetworkpolicy.RuntimeNetworkConfig {
	return gardenletnetworkpolicy.RuntimeNetworkConfig{
		IPFamilies: []gardencorev1beta1.IPFamily{gardencorev1beta1.IPFamilyIPv4},
		Nodes:      []string{netip.PrefixFrom(c.NodeIP, 32).String()},
		Pods:       []string{PodCIDR},
		Services:   []string{ServiceCIDR},
	}
}

// gardenerValues are the values gardenlet mixes in under gardener: for this seed.
func gardenerValues() map[string]any {
	return map[string]any{
		"version":   "v1.150.0",
		"garden":    map[string]any{"clusterIdentity": "local-garden"},
		"gardenlet": map[string]any{"featureGates": map[string]any{}},
		"seed": map[string]any{
			"name": SeedName, "clusterIdentity": SeedName, "provider": "local", "region": "local",
			"ingressDomain": "ingress.local.seed.local.tendril.dev",
			"labels":        map[string]any{}, "annotations": map[string]any{}, "protected": false, "visible": true,
			"spec": map[string]any{
				"ingress": map[string]any{"domain": "ingress.local.seed.local.tendril.dev", "controller": map[string]any{"kind": "nginx"}},
				"dns":     map[string]any{"provider": map[string]any{"type": DNSProviderType}},
			},
		},
	}
}

// layoutImage reads the one image of an OCI layout.
func layoutImage(dir string) (v1.Image, error) {
	idx, err := layout.ImageIndexFromPath(dir)
	if err != nil {
		return nil, fmt.Errorf("tendril's image: %w (run `make image`)", err)
	}
	m, err := idx.IndexManifest()
	if err != nil {
		return nil, err
	}
	if len(m.Manifests) != 1 {
		return nil, fmt.Errorf("tendril's image: %s holds %d images, want 1", dir, len(m.Manifests))
	}
	return idx.Image(m.Manifests[0].Digest)
}

// pushChart pushes the seed chart as its Helm OCI artifact (charts.OCIArtifact: the blobs and
// manifest bytes make chart writes) and returns its reference by digest.
func (c *Cluster) pushChart() (string, error) {
	a, err := charts.OCIArtifact(charts.SeedChart)
	if err != nil {
		return "", err
	}
	repo, err := name.NewRepository(c.Registry+"/charts/"+a.Name, name.Insecure)
	if err != nil {
		return "", err
	}
	for _, l := range []v1.Layer{static.NewLayer(a.Config, charts.HelmConfigMediaType), static.NewLayer(a.Chart, charts.HelmChartMediaType)} {
		if err := remote.WriteLayer(repo, l); err != nil {
			return "", fmt.Errorf("push the chart to the local registry: %w", err)
		}
	}
	if err := remote.Put(repo.Tag(a.Version), rawManifest(a.Manifest)); err != nil {
		return "", fmt.Errorf("push the chart's manifest: %w", err)
	}
	return repo.Name() + "@" + a.Digest, nil
}

// rawManifest is a manifest pushed as its bytes.
type rawManifest []byte

func (m rawManifest) RawManifest() ([]byte, error) { return m, nil }
func (m rawManifest) MediaType() (types.MediaType, error) {
	return types.OCIManifestSchema1, nil
}

// deploymentReady checks that Deployment name has all its replicas Ready, each running image.
func (c *Cluster) deploymentReady(ctx context.Context, ns, name, image string) error {
	err := c.deploymentReadyIn(ctx, c.Client, ns, name, image)
	var short *notReady
	if errors.As(err, &short) {
		return fmt.Errorf("%w (%s)", err, c.podState(ctx, ns, short.selector))
	}
	return err
}

// deploymentPods is Deployment ns/name and the pods its selector selects.
func deploymentPods(ctx context.Context, cl client.Client, ns, name string) (*appsv1.Deployment, *corev1.PodList, error) {
	var d appsv1.Deployment
	if err := cl.Get(ctx, client.ObjectKey{Namespace: ns, Name: name}, &d); err != nil {
		return nil, nil, fmt.Errorf("deployment %s/%s: %w", ns, name, err)
	}
	var pods corev1.PodList
	if err := cl.List(ctx, &pods, client.InNamespace(ns), client.MatchingLabels(d.Spec.Selector.MatchLabels)); err != nil {
		return nil, nil, err
	}
	return &d, &pods, nil
}

// notReady is a Deployment with fewer Ready pods than replicas.
type notReady struct {
	deployment  string
	ready, want int32
	selector    map[string]string
}

func (e *notReady) Error() string {
	return fmt.Sprintf("deployment %s: %d of %d pods Ready", e.deployment, e.ready, e.want)
}

// deploymentReadyIn checks that Deployment ns/name of the cluster cl reaches (the seed, a shoot)
// has all its replicas Ready, each container running image.
func (c *Cluster) deploymentReadyIn(ctx context.Context, cl client.Client, ns, name, image string) error {
	d, pods, err := deploymentPods(ctx, cl, ns, name)
	if err != nil {
		return err
	}
	want := int32(1)
	if d.Spec.Replicas != nil {
		want = *d.Spec.Replicas
	}
	ready := int32(0)
	for _, p := range pods.Items {
		if err := c.podStuck(&p); err != nil {
			return &fatalError{fmt.Errorf("deployment %s/%s: %w", ns, name, err)}
		}
		ok := p.DeletionTimestamp == nil
		for _, cs := range p.Status.ContainerStatuses {
			ok = ok && cs.Ready
		}
		for _, ct := range p.Spec.Containers {
			if ct.Image != image {
				return fmt.Errorf("pod %s runs %s, want %s", p.Name, ct.Image, image)
			}
		}
		if ok && len(p.Status.ContainerStatuses) > 0 {
			ready++
		}
	}
	if ready < want {
		return &notReady{deployment: ns + "/" + name, ready: ready, want: want, selector: d.Spec.Selector.MatchLabels}
	}
	return nil
}

// pullFailed tells why a container of the pod cannot start because its image cannot be pulled
// (a wrong digest, a registry that is not there), or nil. kubelet goes on retrying with back-off;
// the reason is already final.
func pullFailed(p *corev1.Pod) error {
	for _, cs := range append(p.Status.InitContainerStatuses, p.Status.ContainerStatuses...) {
		if w := cs.State.Waiting; w != nil {
			switch w.Reason {
			case "ErrImagePull", "ImagePullBackOff", "InvalidImageName", "ErrImageNeverPull":
				return fmt.Errorf("pod %s, container %s: image %s: %s: %s", p.Name, cs.Name, cs.Image, w.Reason, w.Message)
			}
		}
	}
	return nil
}

// podStuck tells why the pod cannot come up (an image it cannot pull, a container that keeps
// crashing), or nil: what ends a wait for it at once.
func (c *Cluster) podStuck(p *corev1.Pod) error {
	return errors.Join(pullFailed(p), c.crashLooping(p))
}

// crashRestarts is how many restarts of a crash-looping container make it final: a container
// may fail once or twice while what it needs comes up.
const crashRestarts = 3

// crashLooping tells why a container of the pod keeps ending, with the end of its log, once it
// has restarted crashRestarts times, or nil.
func (c *Cluster) crashLooping(p *corev1.Pod) error {
	for _, cs := range append(p.Status.InitContainerStatuses, p.Status.ContainerStatuses...) {
		w, t := cs.State.Waiting, cs.LastTerminationState.Terminated
		if w == nil || w.Reason != "CrashLoopBackOff" || cs.RestartCount < crashRestarts || t == nil {
			continue
		}
		return fmt.Errorf("pod %s, container %s: CrashLoopBackOff after %d restarts, last exit code %d (%s); its log ends:\n%s",
			p.Name, cs.Name, cs.RestartCount, t.ExitCode, t.Reason, c.containerLogTail(p, cs.Name))
	}
	return nil
}

// containerLogTail is the end of the newest log kubelet keeps of the pod's container, on the
// seed's node or an extra node (read from the machine: a shoot's kubelet is reached only
// through the tunnel, which may be what fails).
func (c *Cluster) containerLogTail(p *corev1.Pod, container string) string {
	dirs := []string{c.path("var", "log", "pods")}
	for _, n := range c.nodes {
		dirs = append(dirs, n.path("var", "log", "pods"))
	}
	for _, d := range dirs {
		logs, _ := filepath.Glob(filepath.Join(d, fmt.Sprintf("%s_%s_%s", p.Namespace, p.Name, p.UID), container, "*.log"))
		if len(logs) > 0 {
			slices.Sort(logs)
			return procgroup.LogTail(logs[len(logs)-1])
		}
	}
	return "(no log found)"
}

// mrState says in a few words where ManagedResource name in garden stands.
func (c *Cluster) mrState(ctx context.Context, name string) string {
	var mr resourcesv1alpha1.ManagedResource
	if err := c.Client.Get(ctx, client.ObjectKey{Namespace: v1beta1constants.GardenNamespace, Name: name}, &mr); err != nil {
		return err.Error()
	}
	var b bytes.Buffer
	for _, cond := range mr.Status.Conditions {
		fmt.Fprintf(&b, "%s=%s %s; ", cond.Type, cond.Status, cond.Message)
	}
	if b.Len() == 0 {
		return "no conditions yet"
	}
	return strings.TrimSuffix(b.String(), "; ")
}
