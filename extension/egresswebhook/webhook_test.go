package egresswebhook_test

import (
	"context"
	"errors"
	"fmt"
	"reflect"
	"slices"
	"strings"
	"testing"
	"time"

	extensionsv1alpha1 "github.com/gardener/gardener/pkg/apis/extensions/v1alpha1"
	secretsutils "github.com/gardener/gardener/pkg/utils/secrets"
	secretsmanager "github.com/gardener/gardener/pkg/utils/secrets/manager"
	"github.com/go-logr/logr/testr"
	admissionregistrationv1 "k8s.io/api/admissionregistration/v1"
	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/utils/clock"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/manager"
	metricsserver "sigs.k8s.io/controller-runtime/pkg/metrics/server"
	"sigs.k8s.io/controller-runtime/pkg/webhook"

	tendrilv1alpha1 "github.com/tendril-net/tendril/apis/tendril/v1alpha1"
	"github.com/tendril-net/tendril/extension"
	"github.com/tendril-net/tendril/extension/egresswebhook"
	"github.com/tendril-net/tendril/internal/testing/kubetest"
	"github.com/tendril-net/tendril/internal/testing/testnet"
)

// The webhook cannot import extension; its copies of the names must agree.
func TestNamesMatchExtension(t *testing.T) {
	for _, c := range [][2]string{
		{egresswebhook.ExtensionType, extension.Type},
		{egresswebhook.SecretsManagerIdentity, extension.SecretsManagerIdentity},
		{egresswebhook.SecretNameClient, extension.SecretNameAPIServerClient},
		{egresswebhook.SecretNameCABundle, extension.SecretNameCA + "-bundle"},
	} {
		if c[0] != c[1] {
			t.Errorf("egresswebhook has %q, extension %q", c[0], c[1])
		}
	}
}

const (
	relayImage       = "example.org/tendril:v1"
	webhookNamespace = "garden-tendril"
	gardenerFlag     = "--egress-selector-config-file=/etc/kubernetes/egress/gardener.yaml"
	mutatedByLabel   = "provider.extensions.gardener.cloud/mutated-by-controlplane-webhook"
)

var gardenerArgs = []string{
	"--advertise-address=240.0.0.10",
	gardenerFlag,
	"--endpoint-reconciler-type=none",
	"--secure-port=443",
}

// TestWebhook registers the webhook with a real kube-apiserver through Gardener's webhook
// library (managed certificates, URL mode on loopback) and drives it with Deployment writes.
func TestWebhook(t *testing.T) {
	env := kubetest.Start(t)
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	c := env.Client
	startWebhook(ctx, t, env)

	shoot := "shoot--p--s"
	createNamespace(ctx, t, c, shoot, map[string]string{"extensions.gardener.cloud/tendril": "true"})
	createExtension(ctx, t, c, shoot, "tendril")
	client1, bundle1 := generateSecrets(ctx, t, c, shoot)

	// Create: retried until the webhook server has its certificate and the configuration its
	// CA bundle (failurePolicy Fail: nothing is stored unmutated meanwhile).
	dep := kubeAPIServer(shoot, true)
	waitFor(ctx, t, "webhook serving", func() error { return c.Create(ctx, dep.DeepCopy()) })
	got := get(ctx, t, c, shoot)
	checkMutated(t, got, client1, bundle1)

	var cm corev1.ConfigMap
	if err := c.Get(ctx, client.ObjectKey{Namespace: shoot, Name: egresswebhook.ConfigMapName}, &cm); err != nil {
		t.Fatalf("configmap: %v", err)
	}
	if want, _ := egresswebhook.EgressSelectorConfig(shoot, ""); cm.Data[egresswebhook.ConfigMapDataKey] != string(want) {
		t.Errorf("configmap data:\n%s", cm.Data[egresswebhook.ConfigMapDataKey])
	}

	// An update without changes changes nothing.
	before := got.DeepCopy()
	if err := c.Update(ctx, got); err != nil {
		t.Fatal(err)
	}
	if got.ResourceVersion != before.ResourceVersion || got.Generation != before.Generation {
		t.Errorf("no-op update changed the object: rv %s→%s generation %d→%d", before.ResourceVersion, got.ResourceVersion, before.Generation, got.Generation)
	}

	// gardenlet applies its desired (unmutated) object again: same result, no new generation.
	reapply := kubeAPIServer(shoot, true)
	reapply.ResourceVersion = got.ResourceVersion
	if err := c.Update(ctx, reapply); err != nil {
		t.Fatal(err)
	}
	if reapply.Generation != before.Generation {
		t.Errorf("re-applying Gardener's object rolled kube-apiserver: generation %d→%d", before.Generation, reapply.Generation)
	}
	checkMutated(t, get(ctx, t, c, shoot), client1, bundle1)

	// An update by gardenlet with a changed flag set keeps one egress flag and the new flag.
	upd := get(ctx, t, c, shoot)
	upd.Spec.Template.Spec.Containers[0].Args = append(slices.Clone(gardenerArgs), "--v=2")
	if err := c.Update(ctx, upd); err != nil {
		t.Fatal(err)
	}
	got = get(ctx, t, c, shoot)
	checkMutated(t, got, client1, bundle1)
	if !slices.Contains(got.Spec.Template.Spec.Containers[0].Args, "--v=2") {
		t.Error("gardenlet's new flag lost")
	}

	testGRPC(ctx, t, c)

	// The Extension exists but its secrets do not (not reconciled yet): refused, so that
	// kube-apiserver never starts half-configured; gardenlet retries.
	early := "shoot--p--early"
	createNamespace(ctx, t, c, early, map[string]string{"extensions.gardener.cloud/tendril": "true"})
	createExtension(ctx, t, c, early, "tendril")
	if err := c.Create(ctx, kubeAPIServer(early, true)); err == nil || !strings.Contains(err.Error(), "not generated yet") {
		t.Errorf("create without secrets: %v", err)
	}

	// Outside the selectors nothing changes: without gardenlet's object label (in the namespace
	// above, where a call would be refused); a namespace without the extension label; a
	// labelled namespace without the Extension.
	mustCreate(ctx, t, c, kubeAPIServer(early, false))
	createNamespace(ctx, t, c, "shoot--p--plain", nil)
	mustCreate(ctx, t, c, kubeAPIServer("shoot--p--plain", true))
	createNamespace(ctx, t, c, "shoot--p--noext", map[string]string{"extensions.gardener.cloud/tendril": "true"})
	mustCreate(ctx, t, c, kubeAPIServer("shoot--p--noext", true))
	for _, ns := range []string{early, "shoot--p--plain", "shoot--p--noext"} {
		checkUntouched(t, ns, get(ctx, t, c, ns))
	}

	// The Extension is being deleted: gardenlet's object passes unchanged (its own VPN again).
	ext := &extensionsv1alpha1.Extension{}
	if err := c.Get(ctx, client.ObjectKey{Namespace: shoot, Name: "tendril"}, ext); err != nil {
		t.Fatal(err)
	}
	if err := c.Delete(ctx, ext); err != nil {
		t.Fatal(err)
	}
	restore := kubeAPIServer(shoot, true)
	restore.ResourceVersion = get(ctx, t, c, shoot).ResourceVersion
	if err := c.Update(ctx, restore); err != nil {
		t.Fatal(err)
	}
	if args := get(ctx, t, c, shoot).Spec.Template.Spec.Containers[0].Args; !slices.Equal(args, gardenerArgs) {
		t.Errorf("while the Extension is deleted: args %q", args)
	}
}

func startWebhook(ctx context.Context, t *testing.T, env *kubetest.Env) {
	t.Helper()
	port := testnet.ReservePort(t) // the webhook server binds it
	createNamespace(ctx, t, env.Client, webhookNamespace, nil)
	mgr, err := manager.New(env.Config, manager.Options{
		Scheme:                 env.Scheme,
		Logger:                 testr.New(t),
		Metrics:                metricsserver.Options{BindAddress: "0"},
		HealthProbeBindAddress: "0",
		WebhookServer:          webhook.NewServer(webhook.Options{Host: "127.0.0.1", Port: port, CertDir: t.TempDir()}),
	})
	if err != nil {
		t.Fatal(err)
	}
	if err := egresswebhook.AddToManager(ctx, mgr, egresswebhook.Options{
		Namespace: webhookNamespace,
		Mode:      egresswebhook.ModeURL,
		URL:       fmt.Sprintf("127.0.0.1:%d", port),
		Image:     relayImage,
		// The seed's default: shoots whose providerConfig names no chance get it.
		GoAwayChance: seedGoAwayChance,
	}); err != nil {
		t.Fatal(err)
	}
	mctx, stop := context.WithCancel(ctx)
	done := make(chan error, 1)
	go func() { done <- mgr.Start(mctx) }()
	t.Cleanup(func() {
		stop()
		if err := <-done; err != nil {
			t.Errorf("manager: %v", err)
		}
	})
	// Registered by Gardener's library with the managed CA injected.
	waitFor(ctx, t, "webhook configuration", func() error {
		var mwc admissionregistrationv1.MutatingWebhookConfiguration
		if err := env.Client.Get(ctx, client.ObjectKey{Name: "gardener-extension-tendril"}, &mwc); err != nil {
			return err
		}
		if len(mwc.Webhooks) != 1 || len(mwc.Webhooks[0].ClientConfig.CABundle) == 0 {
			return errors.New("no CA bundle yet")
		}
		w := mwc.Webhooks[0]
		if w.FailurePolicy == nil || *w.FailurePolicy != admissionregistrationv1.Fail {
			t.Errorf("failure policy %v", w.FailurePolicy)
		}
		if w.ObjectSelector == nil || w.ObjectSelector.MatchLabels[mutatedByLabel] != "true" {
			t.Errorf("object selector %+v", w.ObjectSelector)
		}
		return nil
	})
}

func waitFor(ctx context.Context, t *testing.T, what string, f func() error) {
	t.Helper()
	var err error
	for {
		if err = f(); err == nil {
			return
		}
		select {
		case <-ctx.Done():
			t.Fatalf("%s: %v", what, err)
		case <-time.After(200 * time.Millisecond):
		}
	}
}

func createNamespace(ctx context.Context, t *testing.T, c client.Client, name string, labels map[string]string) {
	t.Helper()
	mustCreate(ctx, t, c, &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: name, Labels: labels}})
}

func createExtension(ctx context.Context, t *testing.T, c client.Client, ns, typ string) {
	t.Helper()
	createExtensionWithEgress(ctx, t, c, ns, typ, "httpConnect")
}

func createExtensionWithEgress(ctx context.Context, t *testing.T, c client.Client, ns, typ, egress string) {
	t.Helper()
	ext := &extensionsv1alpha1.Extension{
		ObjectMeta: metav1.ObjectMeta{Name: typ, Namespace: ns, Finalizers: []string{"extensions.gardener.cloud/tendril"}},
		Spec: extensionsv1alpha1.ExtensionSpec{DefaultSpec: extensionsv1alpha1.DefaultSpec{
			Type:           typ,
			ProviderConfig: &runtime.RawExtension{Raw: []byte(`{"egress":"` + egress + `"}`)},
		}},
	}
	mustCreate(ctx, t, c, ext)
}

func mustCreate(ctx context.Context, t *testing.T, c client.Client, obj client.Object) {
	t.Helper()
	if err := c.Create(ctx, obj); err != nil {
		t.Fatalf("create %T %s: %v", obj, obj.GetName(), err)
	}
}

// generateSecrets makes the CA (with its bundle) and kube-apiserver's client certificate as
// the actuator does: Gardener's secrets manager, tendril's identity and config names.
func generateSecrets(ctx context.Context, t *testing.T, c client.Client, ns string) (clientName, bundleName string) {
	t.Helper()
	sm, err := secretsmanager.New(ctx, testr.New(t), clock.RealClock{}, c, extension.SecretsManagerIdentity, secretsmanager.WithNamespaces(ns))
	if err != nil {
		t.Fatal(err)
	}
	if _, err := sm.Generate(ctx, &secretsutils.CertificateSecretConfig{Name: extension.SecretNameCA, CommonName: extension.SecretNameCA, CertType: secretsutils.CACert}); err != nil {
		t.Fatal(err)
	}
	cl, err := sm.Generate(ctx, &secretsutils.CertificateSecretConfig{
		Name: extension.SecretNameAPIServerClient, CommonName: "kube-apiserver", CertType: secretsutils.ClientCert, SkipPublishingCACertificate: true,
	}, secretsmanager.SignedByCA(extension.SecretNameCA, secretsmanager.UseCurrentCA))
	if err != nil {
		t.Fatal(err)
	}
	bundle, ok := sm.Get(extension.SecretNameCA, secretsmanager.Bundle)
	if !ok {
		t.Fatal("no CA bundle")
	}
	if cl.Name == extension.SecretNameAPIServerClient || bundle.Name == extension.SecretNameCA+"-bundle" {
		t.Fatalf("secret names without hashes: %s %s", cl.Name, bundle.Name)
	}
	return cl.Name, bundle.Name
}

func kubeAPIServer(ns string, selected bool) *appsv1.Deployment {
	labels := map[string]string{"app": "kubernetes", "role": "apiserver"}
	d := &appsv1.Deployment{
		ObjectMeta: metav1.ObjectMeta{Name: "kube-apiserver", Namespace: ns},
		Spec: appsv1.DeploymentSpec{
			Selector: &metav1.LabelSelector{MatchLabels: labels},
			Template: corev1.PodTemplateSpec{
				ObjectMeta: metav1.ObjectMeta{Labels: labels},
				Spec: corev1.PodSpec{
					Containers: []corev1.Container{{
						Name:         "kube-apiserver",
						Image:        "registry.k8s.io/kube-apiserver:v1.37.1",
						Command:      []string{"/usr/local/bin/kube-apiserver"},
						Args:         slices.Clone(gardenerArgs),
						VolumeMounts: []corev1.VolumeMount{{Name: "egress-selection-config", MountPath: "/etc/kubernetes/egress"}},
					}},
					Volumes: []corev1.Volume{{Name: "egress-selection-config", VolumeSource: corev1.VolumeSource{
						ConfigMap: &corev1.ConfigMapVolumeSource{LocalObjectReference: corev1.LocalObjectReference{Name: "kube-apiserver-egress-selector-config-abc"}},
					}}},
				},
			},
		},
	}
	if selected {
		d.Labels = map[string]string{mutatedByLabel: "true"}
	}
	return d
}

func get(ctx context.Context, t *testing.T, c client.Client, ns string) *appsv1.Deployment {
	t.Helper()
	var d appsv1.Deployment
	if err := c.Get(ctx, client.ObjectKey{Namespace: ns, Name: "kube-apiserver"}, &d); err != nil {
		t.Fatal(err)
	}
	return &d
}

func egressFlags(args []string) []string {
	var out []string
	for _, a := range args {
		if strings.HasPrefix(a, egresswebhook.FlagEgressSelectorConfigFile) {
			out = append(out, a)
		}
	}
	return out
}

func checkMutated(t *testing.T, d *appsv1.Deployment, clientSecret, bundleSecret string) {
	t.Helper()
	ctr := d.Spec.Template.Spec.Containers[0]
	want := []string{egresswebhook.FlagEgressSelectorConfigFile + "=" + egresswebhook.ConfigFile}
	if got := egressFlags(append(slices.Clone(ctr.Command), ctr.Args...)); !slices.Equal(got, want) {
		t.Errorf("egress flags %q, want %q", got, want)
	}
	for _, a := range []string{"--advertise-address=240.0.0.10", "--endpoint-reconciler-type=none", "--secure-port=443"} {
		if !slices.Contains(ctr.Args, a) {
			t.Errorf("flag %s lost: %q", a, ctr.Args)
		}
	}
	if i := slices.Index(ctr.Args, want[0]); i != 1 {
		t.Errorf("egress flag not in Gardener's place: %q", ctr.Args)
	}
	vols := map[string]corev1.Volume{}
	for _, v := range d.Spec.Template.Spec.Volumes {
		vols[v.Name] = v
	}
	if len(vols) != 4 || len(d.Spec.Template.Spec.Volumes) != 4 {
		t.Errorf("volumes %+v", d.Spec.Template.Spec.Volumes)
	}
	if v := vols[egresswebhook.VolumeNameClient]; v.Secret == nil || v.Secret.SecretName != clientSecret {
		t.Errorf("client volume %+v, want secret %s", v, clientSecret)
	}
	if v := vols[egresswebhook.VolumeNameCA]; v.Secret == nil || v.Secret.SecretName != bundleSecret {
		t.Errorf("CA volume %+v, want secret %s", v, bundleSecret)
	}
	if v := vols[egresswebhook.VolumeNameConfig]; v.ConfigMap == nil || v.ConfigMap.Name != egresswebhook.ConfigMapName {
		t.Errorf("config volume %+v", v)
	}
	mounts := map[string]string{}
	for _, m := range ctr.VolumeMounts {
		mounts[m.Name] = m.MountPath
	}
	if len(mounts) != 4 || mounts[egresswebhook.VolumeNameConfig] != egresswebhook.MountPathConfig ||
		mounts[egresswebhook.VolumeNameClient] != egresswebhook.MountPathClient || mounts[egresswebhook.VolumeNameCA] != egresswebhook.MountPathCA {
		t.Errorf("mounts %v", mounts)
	}
}

func checkUntouched(t *testing.T, what string, d *appsv1.Deployment) {
	t.Helper()
	ctr := d.Spec.Template.Spec.Containers[0]
	if !slices.Equal(ctr.Args, gardenerArgs) || len(d.Spec.Template.Spec.Volumes) != 1 || len(ctr.VolumeMounts) != 1 || len(d.Spec.Template.Annotations) != 0 {
		t.Errorf("%s was mutated: args %q volumes %d", what, ctr.Args, len(d.Spec.Template.Spec.Volumes))
	}
}

// testGRPC: a shoot with egress grpc gets the GRPC-over-UDS configuration and the relay sidecar,
// idempotently; switching the Extension to httpConnect and back, then to httpConnectRelay (the
// relay serving its CONNECT socket instead), changes the Deployment to what each mode alone gives.
func testGRPC(ctx context.Context, t *testing.T, c client.Client) {
	t.Helper()
	ns := "shoot--p--grpc"
	createNamespace(ctx, t, c, ns, map[string]string{"extensions.gardener.cloud/tendril": "true"})
	createExtensionWithEgress(ctx, t, c, ns, "tendril", "grpc")
	clientSecret, bundleSecret := generateSecrets(ctx, t, c, ns)
	mustCreate(ctx, t, c, kubeAPIServer(ns, true))
	got := get(ctx, t, c, ns)
	checkMutatedRelayed(t, got, ns, tendrilv1alpha1.EgressGRPC, clientSecret, bundleSecret)

	var cm corev1.ConfigMap
	if err := c.Get(ctx, client.ObjectKey{Namespace: ns, Name: egresswebhook.ConfigMapName}, &cm); err != nil {
		t.Fatalf("configmap: %v", err)
	}
	if want, _ := egresswebhook.EgressSelectorConfig(ns, "grpc"); cm.Data[egresswebhook.ConfigMapDataKey] != string(want) {
		t.Errorf("configmap data:\n%s", cm.Data[egresswebhook.ConfigMapDataKey])
	}

	// No-op update and gardenlet's re-apply: nothing changes, kube-apiserver does not roll.
	before := got.DeepCopy()
	if err := c.Update(ctx, got); err != nil {
		t.Fatal(err)
	}
	if got.ResourceVersion != before.ResourceVersion {
		t.Errorf("no-op update changed the object: rv %s→%s", before.ResourceVersion, got.ResourceVersion)
	}
	reapply := kubeAPIServer(ns, true)
	reapply.ResourceVersion = got.ResourceVersion
	if err := c.Update(ctx, reapply); err != nil {
		t.Fatal(err)
	}
	if reapply.Generation != before.Generation {
		t.Errorf("re-applying Gardener's object rolled kube-apiserver: generation %d→%d", before.Generation, reapply.Generation)
	}
	checkMutatedRelayed(t, get(ctx, t, c, ns), ns, tendrilv1alpha1.EgressGRPC, clientSecret, bundleSecret)

	// Switch to httpConnect: an update of the stored (grpc) object loses the relay.
	setEgress(ctx, t, c, ns, "httpConnect")
	cur := get(ctx, t, c, ns)
	if err := c.Update(ctx, cur); err != nil {
		t.Fatal(err)
	}
	got = get(ctx, t, c, ns)
	checkMutated(t, got, clientSecret, bundleSecret)
	if len(got.Spec.Template.Spec.InitContainers) != 0 {
		t.Errorf("relay left behind: %+v", got.Spec.Template.Spec.InitContainers)
	}
	if err := c.Get(ctx, client.ObjectKey{Namespace: ns, Name: egresswebhook.ConfigMapName}, &cm); err != nil {
		t.Fatal(err)
	}
	if want, _ := egresswebhook.EgressSelectorConfig(ns, "httpConnect"); cm.Data[egresswebhook.ConfigMapDataKey] != string(want) {
		t.Errorf("configmap not switched:\n%s", cm.Data[egresswebhook.ConfigMapDataKey])
	}
	// And back.
	setEgress(ctx, t, c, ns, "grpc")
	if err := c.Update(ctx, get(ctx, t, c, ns)); err != nil {
		t.Fatal(err)
	}
	checkMutatedRelayed(t, get(ctx, t, c, ns), ns, tendrilv1alpha1.EgressGRPC, clientSecret, bundleSecret)
	// grpc → httpConnectRelay: the same sidecar, serving the CONNECT socket only.
	setEgress(ctx, t, c, ns, "httpConnectRelay")
	if err := c.Update(ctx, get(ctx, t, c, ns)); err != nil {
		t.Fatal(err)
	}
	checkMutatedRelayed(t, get(ctx, t, c, ns), ns, tendrilv1alpha1.EgressHTTPConnectRelay, clientSecret, bundleSecret)
	if err := c.Get(ctx, client.ObjectKey{Namespace: ns, Name: egresswebhook.ConfigMapName}, &cm); err != nil {
		t.Fatal(err)
	}
	if want, _ := egresswebhook.EgressSelectorConfig(ns, "httpConnectRelay"); cm.Data[egresswebhook.ConfigMapDataKey] != string(want) {
		t.Errorf("configmap not switched:\n%s", cm.Data[egresswebhook.ConfigMapDataKey])
	}

	// A goaway chance: gardenlet's next apply gets exactly one --goaway-chance beside the
	// egress flag; taken out of the providerConfig, the apply after it has the seed's default;
	// "0" opts out of that, and so does balancing per request.
	goAway := func() []string {
		var fs []string
		for _, a := range get(ctx, t, c, ns).Spec.Template.Spec.Containers[0].Args {
			if strings.HasPrefix(a, egresswebhook.FlagGoAwayChance) {
				fs = append(fs, a)
			}
		}
		return fs
	}
	setProviderConfig(ctx, t, c, ns, `{"egress":"httpConnectRelay","kubeAPIServer":{"goAwayChance":"0.001"}}`)
	reapplyGardeners(ctx, t, c, ns)
	if got, want := goAway(), []string{"--goaway-chance=0.001"}; !slices.Equal(got, want) {
		t.Errorf("goaway flags %q, want %q", got, want)
	}
	checkMutatedRelayed(t, get(ctx, t, c, ns), ns, tendrilv1alpha1.EgressHTTPConnectRelay, clientSecret, bundleSecret)
	setEgress(ctx, t, c, ns, "httpConnectRelay")
	reapplyGardeners(ctx, t, c, ns)
	if got, want := goAway(), []string{"--goaway-chance=" + seedGoAwayChance}; !slices.Equal(got, want) {
		t.Errorf("goaway flags %q after the chance was taken out, want the seed's %q", got, want)
	}
	for _, raw := range []string{`{"egress":"httpConnectRelay","kubeAPIServer":{"goAwayChance":"0"}}`,
		`{"egress":"httpConnectRelay","kubeAPIServer":{"balancing":"PerRequest"}}`} {
		setProviderConfig(ctx, t, c, ns, raw)
		reapplyGardeners(ctx, t, c, ns)
		if got := goAway(); len(got) != 0 {
			t.Errorf("goaway flags %q with providerConfig %s", got, raw)
		}
	}
}

// seedGoAwayChance is the test webhook's seed default (egresswebhook.Options.GoAwayChance).
const seedGoAwayChance = "0.002"

// reapplyGardeners updates the namespace's kube-apiserver Deployment to Gardener's object, as
// gardenlet's next reconciliation does.
func reapplyGardeners(ctx context.Context, t *testing.T, c client.Client, ns string) {
	t.Helper()
	reapply := kubeAPIServer(ns, true)
	reapply.ResourceVersion = get(ctx, t, c, ns).ResourceVersion
	if err := c.Update(ctx, reapply); err != nil {
		t.Fatal(err)
	}
}

func setEgress(ctx context.Context, t *testing.T, c client.Client, ns, egress string) {
	t.Helper()
	setProviderConfig(ctx, t, c, ns, `{"egress":"`+egress+`"}`)
}

func setProviderConfig(ctx context.Context, t *testing.T, c client.Client, ns, raw string) {
	t.Helper()
	ext := &extensionsv1alpha1.Extension{}
	if err := c.Get(ctx, client.ObjectKey{Namespace: ns, Name: "tendril"}, ext); err != nil {
		t.Fatal(err)
	}
	ext.Spec.ProviderConfig = &runtime.RawExtension{Raw: []byte(raw)}
	if err := c.Update(ctx, ext); err != nil {
		t.Fatal(err)
	}
}

// checkMutatedRelayed checks a Deployment mutated for a relayed egress mode: the relay serves
// that mode's socket and no other.
func checkMutatedRelayed(t *testing.T, d *appsv1.Deployment, ns string, mode tendrilv1alpha1.EgressMode, clientSecret, bundleSecret string) {
	t.Helper()
	socketArg, otherArg := "--socket="+egresswebhook.SocketPath, "--connect-socket="+egresswebhook.ConnectSocketPath
	if mode == tendrilv1alpha1.EgressHTTPConnectRelay {
		socketArg, otherArg = otherArg, socketArg
	}
	ps := d.Spec.Template.Spec
	ctr := ps.Containers[0]
	want := []string{egresswebhook.FlagEgressSelectorConfigFile + "=" + egresswebhook.ConfigFile}
	if got := egressFlags(append(slices.Clone(ctr.Command), ctr.Args...)); !slices.Equal(got, want) {
		t.Errorf("egress flags %q, want %q", got, want)
	}
	vols := map[string]corev1.Volume{}
	for _, v := range ps.Volumes {
		vols[v.Name] = v
	}
	if len(vols) != 5 || len(ps.Volumes) != 5 {
		t.Errorf("volumes %+v", ps.Volumes)
	}
	if v := vols[egresswebhook.VolumeNameClient]; v.Secret == nil || v.Secret.SecretName != clientSecret {
		t.Errorf("client volume %+v, want secret %s", v, clientSecret)
	}
	if v := vols[egresswebhook.VolumeNameCA]; v.Secret == nil || v.Secret.SecretName != bundleSecret {
		t.Errorf("CA volume %+v, want secret %s", v, bundleSecret)
	}
	if v := vols[egresswebhook.VolumeNameSocket]; v.EmptyDir == nil {
		t.Errorf("socket volume %+v", v)
	}
	mounts := func(c corev1.Container) map[string]string {
		out := map[string]string{}
		for _, m := range c.VolumeMounts {
			out[m.Name] = m.MountPath
		}
		return out
	}
	wantAPIServer := map[string]string{"egress-selection-config": "/etc/kubernetes/egress",
		egresswebhook.VolumeNameConfig: egresswebhook.MountPathConfig, egresswebhook.VolumeNameSocket: egresswebhook.MountPathSocket}
	if got := mounts(ctr); !reflect.DeepEqual(got, wantAPIServer) {
		t.Errorf("kube-apiserver mounts %v, want %v", got, wantAPIServer)
	}
	if len(ps.InitContainers) != 1 {
		t.Fatalf("init containers %+v", ps.InitContainers)
	}
	r := ps.InitContainers[0]
	if r.Name != egresswebhook.ContainerNameRelay || r.Image != relayImage || !slices.Equal(r.Command, []string{"/tendril-egress-relay"}) ||
		!slices.Contains(r.Args, "--server=tendril-server."+ns+".svc:8090") || !slices.Contains(r.Args, socketArg) || slices.Contains(r.Args, otherArg) {
		t.Errorf("relay %s %s %q %q", r.Name, r.Image, r.Command, r.Args)
	}
	if r.RestartPolicy == nil || *r.RestartPolicy != corev1.ContainerRestartPolicyAlways {
		t.Errorf("relay restart policy %v: not a native sidecar", r.RestartPolicy)
	}
	wantRelay := map[string]string{egresswebhook.VolumeNameClient: egresswebhook.MountPathClient,
		egresswebhook.VolumeNameCA: egresswebhook.MountPathCA, egresswebhook.VolumeNameSocket: egresswebhook.MountPathSocket}
	if got := mounts(r); !reflect.DeepEqual(got, wantRelay) {
		t.Errorf("relay mounts %v, want %v", got, wantRelay)
	}
	labels := d.Spec.Template.Labels
	if labels["networking.resources.gardener.cloud/to-tendril-server-tcp-8090"] != "allowed" {
		t.Errorf("network policy label missing: %v", labels)
	}
	if _, ok := labels["networking.resources.gardener.cloud/to-tendril-server-tcp-9443"]; ok {
		t.Errorf("CONNECT label set in %s mode: %v", mode, labels)
	}
}
