package extension

import (
	"context"
	"fmt"
	"strconv"
	"strings"
	"time"

	"github.com/gardener/gardener/extensions/pkg/controller/healthcheck"
	"github.com/gardener/gardener/extensions/pkg/controller/healthcheck/general"
	gardencorev1beta1 "github.com/gardener/gardener/pkg/apis/core/v1beta1"
	extensionsv1alpha1 "github.com/gardener/gardener/pkg/apis/extensions/v1alpha1"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/kubernetes"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/manager"

	"github.com/tendril-net/tendril/extension/manifest"
)

// TunnelProbe reports whether a shoot's tendril-server has a live agent tunnel.
type TunnelProbe interface {
	TunnelUp(ctx context.Context, namespace string) (up bool, detail string, err error)
}

// HealthOptions configure the health check controller.
type HealthOptions struct {
	// SyncPeriod is how often every Extension is checked (30 s when 0, Gardener's default).
	SyncPeriod time.Duration
	// TunnelProbe asks tendril-server about its tunnel; nil uses the API server's pod proxy.
	TunnelProbe TunnelProbe
	// RolloutGrace is how long a tunnel may be down after the server started before the
	// condition turns from Progressing to False (3 minutes when 0).
	RolloutGrace time.Duration
}

// AddHealthCheck registers Gardener's health check controller for tendril Extensions: the
// shoot-side ManagedResource feeds SystemComponentsHealthy; the tendril-server Deployment
// and the tunnel itself feed ControlPlaneHealthy (a shoot whose agent is not connected is
// not healthy). Never APIServerAvailable: that condition is Gardener's own.
func AddHealthCheck(mgr manager.Manager, opts HealthOptions) error {
	if opts.SyncPeriod == 0 {
		opts.SyncPeriod = 30 * time.Second
	}
	if opts.RolloutGrace == 0 {
		opts.RolloutGrace = 3 * time.Minute
	}
	if opts.TunnelProbe == nil {
		cs, err := kubernetes.NewForConfig(mgr.GetConfig())
		if err != nil {
			return err
		}
		opts.TunnelProbe = podProxyProbe{cs: cs}
	}
	args := healthcheck.DefaultAddArgs{}
	args.HealthCheckConfig.SyncPeriod = metav1.Duration{Duration: opts.SyncPeriod}
	return healthcheck.DefaultRegistration(
		Type,
		extensionsv1alpha1.SchemeGroupVersion.WithKind(extensionsv1alpha1.ExtensionResource),
		func() client.ObjectList { return &extensionsv1alpha1.ExtensionList{} },
		func() extensionsv1alpha1.Object { return &extensionsv1alpha1.Extension{} },
		mgr, args, nil,
		[]healthcheck.ConditionTypeToHealthCheck{
			{ConditionType: string(gardencorev1beta1.ShootSystemComponentsHealthy), HealthCheck: general.CheckManagedResource(manifest.ManagedResourceName)},
			{ConditionType: string(gardencorev1beta1.ShootControlPlaneHealthy), HealthCheck: general.NewSeedDeploymentHealthChecker(manifest.ServerName)},
			{ConditionType: string(gardencorev1beta1.ShootControlPlaneHealthy), HealthCheck: &tunnelCheck{probe: opts.TunnelProbe, grace: opts.RolloutGrace, client: mgr.GetClient()}},
		},
		nil,
	)
}

// tunnelCheck is ControlPlaneHealthy's tunnel half.
type tunnelCheck struct {
	probe  TunnelProbe
	grace  time.Duration
	client client.Client
}

func (c *tunnelCheck) SetLoggerSuffix(string, string) {}

func (c *tunnelCheck) Check(ctx context.Context, req types.NamespacedName) (*healthcheck.SingleCheckResult, error) {
	up, detail, err := c.probe.TunnelUp(ctx, req.Namespace)
	if err != nil {
		return nil, fmt.Errorf("tunnel probe: %w", err)
	}
	if up {
		return &healthcheck.SingleCheckResult{Status: gardencorev1beta1.ConditionTrue}, nil
	}
	// A freshly started server waits for its agent: Progressing until the grace runs out,
	// after which the library turns the condition False.
	return &healthcheck.SingleCheckResult{
		Status:               gardencorev1beta1.ConditionProgressing,
		Detail:               "no shoot agent connected to tendril-server: " + detail,
		ProgressingThreshold: &c.grace,
	}, nil
}

// podProxyProbe asks each running tendril-server pod's /readyz through the API server's pod
// proxy, so the extension needs no network path (or NetworkPolicy) to the shoot namespace.
type podProxyProbe struct{ cs kubernetes.Interface }

func (p podProxyProbe) TunnelUp(ctx context.Context, namespace string) (bool, string, error) {
	pods, err := p.cs.CoreV1().Pods(namespace).List(ctx, metav1.ListOptions{LabelSelector: "app=" + manifest.ServerName})
	if err != nil {
		return false, "", err
	}
	var details []string
	for _, pod := range pods.Items {
		if pod.Status.Phase != corev1.PodRunning || pod.DeletionTimestamp != nil {
			continue
		}
		body, err := p.cs.CoreV1().Pods(namespace).ProxyGet("http", pod.Name, strconv.Itoa(manifest.PortMetrics), "/readyz", nil).DoRaw(ctx)
		if err == nil {
			return true, "", nil
		}
		details = append(details, fmt.Sprintf("%s: %v %s", pod.Name, err, strings.TrimSpace(string(body))))
	}
	if len(details) == 0 {
		return false, "no running tendril-server pod", nil
	}
	return false, strings.Join(details, "; "), nil
}
