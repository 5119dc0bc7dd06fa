package realseed

import (
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"time"

	admissionregistrationv1 "k8s.io/api/admissionregistration/v1"
	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/intstr"
	"k8s.io/utils/ptr"
	"sigs.k8s.io/controller-runtime/pkg/client"

	"github.com/tendril-net/tendril/extension/manifest"
	"github.com/tendril-net/tendril/internal/pki/testpki"
)

// The shoot's webhook: tendril-probe's webhook mode in a pod on the shoot's node behind a
// Service, registered for ConfigMaps that carry webhookLabel only, so that nothing else in the
// shoot waits for it.
const (
	webhookName    = "probe-webhook"
	webhookConfig  = "probe.tendril.dev"
	webhookLabel   = "tendril.dev/webhook-probe"
	webhookPort    = 9443
	webhookSvcPort = 443
	// webhookRounds is how many calls the round-trip median is taken over.
	webhookRounds = 10
)

// WebhookUse is what the shoot's kube-apiserver did with a webhook on the shoot's node.
type WebhookUse struct {
	// Denial is kube-apiserver's refusal, which carries the webhook's message; Review the line
	// the webhook logged for that call (with the address it came from).
	Denial, Review string
	// Median is the median of webhookRounds refused creates, each one call of the webhook.
	Median time.Duration
	// Dials is how many more connections tendril-server opened through the tunnel meanwhile.
	Dials float64
}

// CallWebhook has the shoot's kube-apiserver call a validating webhook on the shoot's node, as
// every shoot with an admission controller of its own needs: kube-apiserver resolves the
// webhook's Service to its ClusterIP and dials it through its egress (tendril-server, the
// tunnel, the agent, the node's kube-proxy). The webhook denies what it is asked about with its
// own message: a refusal that carries it proves the call arrived. failurePolicy Fail: a call
// that does not arrive is an error, never an admitted object. The configuration is removed
// again.
func (c *Cluster) CallWebhook(ctx context.Context, s *Shoot) (*WebhookUse, error) {
	ctx, cancel := context.WithTimeout(ctx, 2*time.Minute)
	defer cancel()
	before, err := c.serverDials(ctx, s)
	if err != nil {
		return nil, err
	}
	denial, remove, err := c.registerWebhook(ctx, s)
	if err != nil {
		return nil, err
	}
	defer remove()
	use := &WebhookUse{Denial: denial}
	rounds := make([]time.Duration, 0, webhookRounds)
	for i := range webhookRounds {
		t0 := time.Now()
		if _, err := createDenied(ctx, s.Client, fmt.Sprintf("probe-timed-%d", i)); err != nil {
			return nil, fmt.Errorf("webhook call %d of %d: %w", i+1, webhookRounds, err)
		}
		rounds = append(rounds, time.Since(t0))
	}
	use.Median = median(rounds)
	after, err := c.serverDials(ctx, s)
	if err != nil {
		return nil, err
	}
	if use.Dials = after - before; use.Dials < 1 {
		return nil, fmt.Errorf("tendril-server opened no connection through the tunnel while the webhook was called: kube-apiserver did not use its egress")
	}
	logs, err := s.kube.CoreV1().Pods(metav1.NamespaceDefault).GetLogs(webhookName, &corev1.PodLogOptions{}).DoRaw(ctx)
	if err != nil {
		return nil, fmt.Errorf("the webhook's log: %w", err)
	}
	for _, line := range strings.Split(string(logs), "\n") {
		if strings.HasPrefix(line, "review from ") {
			use.Review = line
		}
	}
	if use.Review == "" {
		return nil, fmt.Errorf("the webhook logged no review; its log: %s", logs)
	}
	// The call came from the agent's pod: the end of the tunnel, not a route around it.
	agents, err := agentPodIPs(ctx, s)
	if err != nil {
		return nil, err
	}
	from, _, _ := strings.Cut(strings.TrimPrefix(use.Review, "review from "), ": ")
	if host, _, err := net.SplitHostPort(from); err != nil || !slices.Contains(agents, host) {
		return nil, fmt.Errorf("the webhook was called from %q, not from the agent's pod %v: %s", from, agents, use.Review)
	}
	return use, nil
}

// agentPodIPs are the addresses of the shoot's tendril-agent pods.
func agentPodIPs(ctx context.Context, s *Shoot) ([]string, error) {
	// Every agent: an HA shoot has two, and tendril-server routes through whichever is live.
	var deps appsv1.DeploymentList
	if err := s.Client.List(ctx, &deps, client.InNamespace(manifest.ShootNamespace)); err != nil {
		return nil, fmt.Errorf("shoot %s: the agents: %w", s.cfg.Name, err)
	}
	var ips []string
	for _, d := range deps.Items {
		if d.Name != manifest.AgentName && !strings.HasPrefix(d.Name, manifest.AgentName+"-") {
			continue
		}
		_, pods, err := deploymentPods(ctx, s.Client, manifest.ShootNamespace, d.Name)
		if err != nil {
			return nil, fmt.Errorf("shoot %s: agent %s: %w", s.cfg.Name, d.Name, err)
		}
		for _, p := range pods.Items {
			if p.Status.PodIP != "" {
				ips = append(ips, p.Status.PodIP)
			}
		}
	}
	return ips, nil
}

// registerWebhook registers the shoot's webhook (its backend started on the first call) and
// returns kube-apiserver's first refusal, which carries the webhook's message, and a function
// that removes the registration again.
func (c *Cluster) registerWebhook(ctx context.Context, s *Shoot) (denial string, remove func(), err error) {
	c.probeOnce.Do(c.pushProbe)
	if c.probeErr != nil {
		return "", nil, c.probeErr
	}
	if s.webhookCA == nil {
		if s.webhookCA, err = c.webhookBackend(ctx, s); err != nil {
			return "", nil, err
		}
	}
	vwc := webhookConfiguration(s.webhookCA)
	if err := s.Client.Create(ctx, vwc); err != nil {
		return "", nil, fmt.Errorf("shoot %s: ValidatingWebhookConfiguration: %w", s.cfg.Name, err)
	}
	remove = func() { _ = s.Client.Delete(context.Background(), vwc) }
	// kube-apiserver reads the configuration through an informer and kube-proxy programs the
	// Service when it sees its endpoints: until both have, a create is admitted (not yet
	// called) or fails calling the webhook; both are retried, a denial by another is not.
	round := 0
	err = c.waitFor(ctx, "kube-apiserver of shoot "+s.cfg.Name, "a call of the webhook on its node", time.Minute, func(ctx context.Context) error {
		round++
		d, err := createDenied(ctx, s.Client, fmt.Sprintf("probe-%d", round))
		denial = d
		return err
	})
	if err != nil {
		remove()
		return "", nil, err
	}
	return denial, remove, nil
}

// createDenied creates a ConfigMap the webhook selects and returns kube-apiserver's refusal
// when it carries the webhook's message; an admitted ConfigMap (deleted again) or a failed call
// is an error to retry.
func createDenied(ctx context.Context, cl client.Client, name string) (string, error) {
	cm := &corev1.ConfigMap{ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: metav1.NamespaceDefault,
		Labels: map[string]string{webhookLabel: "true"}}}
	err := cl.Create(ctx, cm)
	switch {
	case err == nil:
		_ = cl.Delete(ctx, cm)
		return "", errors.New("ConfigMap admitted: kube-apiserver does not call the webhook yet")
	case apierrors.IsForbidden(err) && strings.Contains(err.Error(), "tendril-probe webhook on "+webhookName):
		return err.Error(), nil
	default:
		return "", err
	}
}

// webhookBackend starts the webhook in shoot s (its serving certificate signed by a CA of its
// own, in a Secret; the pod on the shoot's node; its Service) and returns the CA in PEM.
func (c *Cluster) webhookBackend(ctx context.Context, s *Shoot) ([]byte, error) {
	dir := filepath.Join(s.dir, "webhook")
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return nil, err
	}
	ca, err := testpki.NewCA("tendril real seed shoot " + s.cfg.Name + " webhook CA")
	if err != nil {
		return nil, err
	}
	pair, err := ca.Leaf(webhookName+"."+metav1.NamespaceDefault+".svc", webhookName+"."+metav1.NamespaceDefault+".svc.cluster.local")
	if err != nil {
		return nil, err
	}
	files := map[string]string{"ca.crt": "", "tls.crt": "", "tls.key": ""}
	for f := range files {
		files[f] = filepath.Join(dir, f)
	}
	if err := testpki.WriteFiles(pair, ca, files["tls.crt"], files["tls.key"], files["ca.crt"]); err != nil {
		return nil, err
	}
	secret := &corev1.Secret{ObjectMeta: metav1.ObjectMeta{Name: webhookName + "-tls", Namespace: metav1.NamespaceDefault},
		Type: corev1.SecretTypeTLS, Data: map[string][]byte{}}
	for _, f := range []string{"tls.crt", "tls.key"} {
		if secret.Data[f], err = os.ReadFile(files[f]); err != nil {
			return nil, err
		}
	}
	caPEM, err := os.ReadFile(files["ca.crt"])
	if err != nil {
		return nil, err
	}
	labels := map[string]string{"app": webhookName}
	pod := probePodSpec(metav1.NamespaceDefault, webhookName, s.Node.cfg.Name, c.probeImage, labels, nil,
		[]corev1.ContainerPort{{Name: "https", ContainerPort: webhookPort}}, nil)
	ctr := &pod.Spec.Containers[0]
	ctr.Args = []string{"webhook", "--listen", fmt.Sprintf(":%d", webhookPort), "--cert", "/certs/tls.crt", "--key", "/certs/tls.key"}
	ctr.VolumeMounts = []corev1.VolumeMount{{Name: "tls", MountPath: "/certs", ReadOnly: true}}
	ctr.ReadinessProbe = &corev1.Probe{PeriodSeconds: 1,
		ProbeHandler: corev1.ProbeHandler{TCPSocket: &corev1.TCPSocketAction{Port: intstr.FromInt32(webhookPort)}}}
	// The probe runs as a user of its image, not root: the key must be readable by others.
	pod.Spec.Volumes = []corev1.Volume{{Name: "tls", VolumeSource: corev1.VolumeSource{
		Secret: &corev1.SecretVolumeSource{SecretName: secret.Name, DefaultMode: ptr.To[int32](0o444)}}}}
	svc := &corev1.Service{ObjectMeta: metav1.ObjectMeta{Name: webhookName, Namespace: metav1.NamespaceDefault},
		Spec: corev1.ServiceSpec{Selector: labels, Ports: []corev1.ServicePort{{Name: "https", Port: webhookSvcPort,
			TargetPort: intstr.FromInt32(webhookPort)}}}}
	for _, o := range []client.Object{secret, svc} {
		if err := s.Client.Create(ctx, o); err != nil {
			return nil, fmt.Errorf("shoot %s: webhook %T: %w", s.cfg.Name, o, err)
		}
	}
	if _, err := c.runInShoot(ctx, s, pod); err != nil {
		return nil, err
	}
	return caPEM, nil
}

// webhookConfiguration registers the webhook's Service for creates of ConfigMaps that carry
// webhookLabel.
func webhookConfiguration(caPEM []byte) *admissionregistrationv1.ValidatingWebhookConfiguration {
	fail, none := admissionregistrationv1.Fail, admissionregistrationv1.SideEffectClassNone
	return &admissionregistrationv1.ValidatingWebhookConfiguration{ObjectMeta: metav1.ObjectMeta{Name: webhookConfig},
		Webhooks: []admissionregistrationv1.ValidatingWebhook{{
			Name: webhookConfig,
			ClientConfig: admissionregistrationv1.WebhookClientConfig{CABundle: caPEM,
				Service: &admissionregistrationv1.ServiceReference{Namespace: metav1.NamespaceDefault, Name: webhookName,
					Port: ptr.To[int32](webhookSvcPort), Path: ptr.To("/validate")}},
			Rules: []admissionregistrationv1.RuleWithOperations{{Operations: []admissionregistrationv1.OperationType{admissionregistrationv1.Create},
				Rule: admissionregistrationv1.Rule{APIGroups: []string{""}, APIVersions: []string{"v1"}, Resources: []string{"configmaps"}}}},
			ObjectSelector:          &metav1.LabelSelector{MatchLabels: map[string]string{webhookLabel: "true"}},
			FailurePolicy:           &fail,
			SideEffects:             &none,
			TimeoutSeconds:          ptr.To[int32](10),
			AdmissionReviewVersions: []string{"v1"},
		}},
	}
}
