package extension_test

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"testing"
	"time"

	v1beta1constants "github.com/gardener/gardener/pkg/apis/core/v1beta1/constants"
	resourcesv1alpha1 "github.com/gardener/gardener/pkg/apis/resources/v1alpha1"
	"github.com/gardener/gardener/pkg/component/gardener/resourcemanager"
	"github.com/gardener/gardener/pkg/resourcemanager/webhook/highavailabilityconfig"
	"github.com/go-logr/logr/testr"
	admissionregistrationv1 "k8s.io/api/admissionregistration/v1"
	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/utils/ptr"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/manager"
	metricsserver "sigs.k8s.io/controller-runtime/pkg/metrics/server"
	"sigs.k8s.io/controller-runtime/pkg/webhook"
	"sigs.k8s.io/controller-runtime/pkg/webhook/admission"

	"github.com/tendril-net/tendril/extension/manifest"
	"github.com/tendril-net/tendril/internal/pki/testpki"
	"github.com/tendril-net/tendril/internal/testing/kubetest"
	"github.com/tendril-net/tendril/internal/testing/testnet"
	"github.com/tendril-net/tendril/internal/testing/testwait"
)

// TestServersUnderGRMHighAvailability puts Gardener's resource manager's high-availability-config
// webhook in front of a real kube-apiserver, as the seed's resource manager serves it for every
// namespace gardenlet labels "consider" (Gardener's handler, pkg/resourcemanager/webhook/
// highavailabilityconfig, registered by Gardener's own webhook configuration,
// resourcemanager.NewHighAvailabilityConfigMutatingWebhook), on a seed of two nodes in two
// zones, and reconciles an HA shoot under it. GRM does not change the two replicas (the
// StatefulSet carries no high-availability-config type label, so GetReplicaCount leaves them),
// and adds its own topology spread: required over hosts (failure tolerance set, more than one
// node) and over the namespace's zones, each with minDomains 2, beside the extension's preferred
// anti-affinity; another reconcile leaves the StatefulSet as GRM and the extension made it
// together (the same generation).
func TestServersUnderGRMHighAvailability(t *testing.T) {
	env := kubetest.Start(t)
	ctx := context.Background()
	for i, zone := range []string{"zone-a", "zone-b"} {
		must(t, env.Client.Create(ctx, &corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: fmt.Sprintf("seed-node-%d", i),
			Labels: map[string]string{corev1.LabelTopologyZone: zone}}}))
	}
	startGRMHighAvailabilityWebhook(t, env)
	startController(t, env, nil)

	ns := "shoot--local--xi"
	shoot(t, env.Client, ns, false, haControlPlane)
	// gardenlet's labels and annotations on the control-plane namespace of a shoot with zone
	// failure tolerance on a seed of zones a and b (v1.150 pkg/gardenlet/operation/botanist/
	// namespaces.go l.81, l.89, l.119).
	var namespace corev1.Namespace
	must(t, env.Client.Get(ctx, client.ObjectKey{Name: ns}, &namespace))
	patch := client.MergeFrom(namespace.DeepCopy())
	metav1.SetMetaDataLabel(&namespace.ObjectMeta, resourcesv1alpha1.HighAvailabilityConfigConsider, "true")
	metav1.SetMetaDataAnnotation(&namespace.ObjectMeta, resourcesv1alpha1.HighAvailabilityConfigFailureToleranceType, "zone")
	metav1.SetMetaDataAnnotation(&namespace.ObjectMeta, resourcesv1alpha1.HighAvailabilityConfigZones, "zone-a,zone-b")
	must(t, env.Client.Patch(ctx, &namespace, patch))

	start := time.Now().Add(-time.Second)
	ext := newExtension(ns, "")
	must(t, env.Client.Create(ctx, ext))
	ext = waitSucceeded(t, env.Client, client.ObjectKeyFromObject(ext), start)
	wantServers(t, env.Client, ns, manifest.HAServers)

	sts := &appsv1.StatefulSet{}
	must(t, env.Client.Get(ctx, client.ObjectKey{Namespace: ns, Name: manifest.ServerName}, sts))
	if got := ptr.Deref(sts.Spec.Replicas, 0); got != manifest.HAServers {
		t.Errorf("replicas %d under GRM's webhook, want the extension's %d", got, manifest.HAServers)
	}
	spread := map[string]corev1.TopologySpreadConstraint{}
	for _, c := range sts.Spec.Template.Spec.TopologySpreadConstraints {
		spread[c.TopologyKey] = c
	}
	for _, key := range []string{corev1.LabelHostname, corev1.LabelTopologyZone} {
		c, ok := spread[key]
		if !ok || c.WhenUnsatisfiable != corev1.DoNotSchedule || ptr.Deref(c.MinDomains, 0) != 2 ||
			c.LabelSelector == nil || c.LabelSelector.MatchLabels[v1beta1constants.LabelApp] != manifest.ServerName {
			t.Errorf("GRM's spread over %s: %+v (present %v), want DoNotSchedule, minDomains 2, the servers' pods", key, c, ok)
		}
	}
	if a := sts.Spec.Template.Spec.Affinity; a == nil || a.PodAntiAffinity == nil {
		t.Error("the extension's anti-affinity is gone")
	}

	// Another reconcile: the extension writes its StatefulSet again, GRM mutates it as before,
	// and nothing changes.
	generation := sts.Generation
	start = time.Now().Add(-time.Second)
	patch = client.MergeFrom(ext.DeepCopy())
	metav1.SetMetaDataAnnotation(&ext.ObjectMeta, v1beta1constants.GardenerOperation, v1beta1constants.GardenerOperationReconcile)
	must(t, env.Client.Patch(ctx, ext, patch))
	waitSucceeded(t, env.Client, client.ObjectKeyFromObject(ext), start)
	must(t, env.Client.Get(ctx, client.ObjectKey{Namespace: ns, Name: manifest.ServerName}, sts))
	if sts.Generation != generation {
		t.Errorf("a reconcile moved the StatefulSet from generation %d to %d: the extension and GRM's webhook disagree", generation, sts.Generation)
	}
}

// startGRMHighAvailabilityWebhook serves Gardener's high-availability-config handler over TLS
// on loopback and registers it with Gardener's webhook configuration for it.
func startGRMHighAvailabilityWebhook(t *testing.T, env *kubetest.Env) {
	t.Helper()
	ca, err := testpki.NewCA("GRM webhook CA")
	must(t, err)
	pair, err := ca.Leaf("127.0.0.1")
	must(t, err)
	dir := t.TempDir()
	must(t, testpki.WritePair(pair, filepath.Join(dir, "tls.crt"), filepath.Join(dir, "tls.key")))
	port := testnet.ReservePort(t)
	mgr, err := manager.New(env.Config, manager.Options{
		Scheme:        env.Scheme,
		Metrics:       metricsserver.Options{BindAddress: "0"},
		WebhookServer: webhook.NewServer(webhook.Options{Host: "127.0.0.1", Port: port, CertDir: dir}),
	})
	must(t, err)
	h := &highavailabilityconfig.Handler{Logger: testr.New(t), TargetClient: env.Client, Decoder: admission.NewDecoder(env.Scheme)}
	must(t, h.AddToManager(mgr))
	testwait.Run(t, "GRM webhook manager", mgr.Start)
	testwait.For(t, "GRM's webhook server", func() error { return mgr.GetWebhookServer().StartedChecker()(nil) })

	must(t, ca.WriteCA(filepath.Join(dir, "ca.crt")))
	caPEM, err := os.ReadFile(filepath.Join(dir, "ca.crt"))
	must(t, err)
	wh := resourcemanager.NewHighAvailabilityConfigMutatingWebhook(nil, nil, nil, func(_ *corev1.Secret, path string) admissionregistrationv1.WebhookClientConfig {
		return admissionregistrationv1.WebhookClientConfig{URL: ptr.To(fmt.Sprintf("https://127.0.0.1:%d%s", port, path)), CABundle: caPEM}
	})
	must(t, env.Client.Create(context.Background(), &admissionregistrationv1.MutatingWebhookConfiguration{
		ObjectMeta: metav1.ObjectMeta{Name: "gardener-resource-manager"}, Webhooks: []admissionregistrationv1.MutatingWebhook{wh}}))
}
