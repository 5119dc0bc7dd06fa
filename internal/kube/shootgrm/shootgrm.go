// Package shootgrm runs Gardener's own resource manager controllers (gardener-resource-manager's
// managedresource, health and progressing controllers, unchanged) for one shoot, as the
// gardener-resource-manager in a shoot's control-plane namespace does: it reads the
// ManagedResources of that namespace in the seed (source) and applies their objects to the
// shoot's API server (target), writing ResourcesApplied, ResourcesHealthy and
// ResourcesProgressing. The local seed and the extension's tests use it so that what the
// extension puts into a ManagedResource is applied by Gardener's code, not by a stand-in. With
// Class "seed" it is the seed's own resource manager instead (namespace garden, source and
// target the seed), which applies what gardenlet installs there: the real seed installs
// tendril's chart through it, as gardenlet does.
package shootgrm

import (
	"context"
	"fmt"
	"time"

	resourcemanagerconfigv1alpha1 "github.com/gardener/gardener/pkg/apis/config/resourcemanager/v1alpha1"
	resourcemanagerclient "github.com/gardener/gardener/pkg/resourcemanager/client"
	"github.com/gardener/gardener/pkg/resourcemanager/controller/health"
	"github.com/gardener/gardener/pkg/resourcemanager/controller/managedresource"
	resourcemanagerpredicate "github.com/gardener/gardener/pkg/resourcemanager/predicate"
	"github.com/go-logr/logr"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/rest"
	"k8s.io/utils/ptr"
	"sigs.k8s.io/controller-runtime/pkg/cache"
	"sigs.k8s.io/controller-runtime/pkg/client/apiutil"
	"sigs.k8s.io/controller-runtime/pkg/cluster"
	"sigs.k8s.io/controller-runtime/pkg/config"
	"sigs.k8s.io/controller-runtime/pkg/manager"
	metricsserver "sigs.k8s.io/controller-runtime/pkg/metrics/server"
)

// Config is one shoot's resource manager; Seed, Shoot and Namespace are required.
type Config struct {
	// Seed is the seed API server holding the ManagedResources (the source).
	Seed *rest.Config
	// Shoot is the shoot's API server the objects are applied to (the target).
	Shoot *rest.Config
	// Namespace is the shoot's control-plane namespace in the seed: the only one watched.
	Namespace string
	// ClusterID prefixes the origin annotation of every applied object (gardenlet passes the
	// seed's identity); empty leaves the prefix out.
	ClusterID string
	// SyncPeriod is how often the controllers re-check every ManagedResource (Gardener's
	// default of a minute when 0).
	SyncPeriod time.Duration
	// Class is the resource class served: empty for the shoot's (ManagedResources without a
	// class), "seed" for the seed's own.
	Class string
	// Logger is the controllers' logger (discarded when zero).
	Logger logr.Logger
}

// New returns a manager running the controllers; the caller starts it (it runs until its
// context ends) and owns the goroutine that does. ctx bounds the controllers' client calls
// made outside a reconcile (the progressing controller's predicate) and must outlive the
// manager.
func New(ctx context.Context, cfg Config) (manager.Manager, error) {
	if cfg.Seed == nil || cfg.Shoot == nil || cfg.Namespace == "" {
		return nil, fmt.Errorf("shootgrm: seed, shoot and namespace are required")
	}
	if cfg.Logger.GetSink() == nil {
		cfg.Logger = logr.Discard()
	}
	mgr, err := manager.New(cfg.Seed, manager.Options{
		Scheme: resourcemanagerclient.SourceScheme,
		Logger: cfg.Logger,
		// One resource manager per shoot namespace, as in a real seed.
		Cache:   cache.Options{DefaultNamespaces: map[string]cache.Config{cfg.Namespace: {}}},
		Metrics: metricsserver.Options{BindAddress: "0"},
		// Several shoots' resource managers share a process (the local seed, tests): the
		// controllers have the same names in each.
		Controller: config.Controller{SkipNameValidation: ptr.To(true)},
	})
	if err != nil {
		return nil, fmt.Errorf("shootgrm: source manager: %w", err)
	}
	target, err := cluster.New(cfg.Shoot, func(o *cluster.Options) {
		o.Scheme = resourcemanagerclient.TargetScheme
		o.Logger = cfg.Logger
		// As gardener-resource-manager: rediscover resources on NoMatch errors.
		o.MapperProvider = apiutil.NewDynamicRESTMapper
	})
	if err != nil {
		return nil, fmt.Errorf("shootgrm: target cluster: %w", err)
	}
	if err := mgr.Add(target); err != nil {
		return nil, fmt.Errorf("shootgrm: add target cluster: %w", err)
	}

	// Gardener's defaults, with the sync period overridden when asked.
	mrCfg := resourcemanagerconfigv1alpha1.ManagedResourceControllerConfig{}
	healthCfg := resourcemanagerconfigv1alpha1.HealthControllerConfig{}
	if cfg.SyncPeriod > 0 {
		mrCfg.SyncPeriod = &metav1.Duration{Duration: cfg.SyncPeriod}
		healthCfg.SyncPeriod = &metav1.Duration{Duration: cfg.SyncPeriod}
	}
	resourcemanagerconfigv1alpha1.SetDefaults_ManagedResourceControllerConfig(&mrCfg)
	resourcemanagerconfigv1alpha1.SetDefaults_HealthControllerConfig(&healthCfg)
	// The default class ("resources") serves ManagedResources without a class: the shoot's.
	class := cfg.Class
	rmCfg := resourcemanagerconfigv1alpha1.ResourceManagerConfiguration{}
	rmCfg.Controllers.ResourceClass = &class
	rmCfg.Controllers.ClusterID = &cfg.ClusterID
	rmCfg.Controllers.Health = healthCfg
	rmCfg.Controllers.ManagedResource = mrCfg

	if err := health.AddToManager(ctx, mgr, mgr, target, rmCfg); err != nil {
		return nil, fmt.Errorf("shootgrm: health controllers: %w", err)
	}
	if err := (&managedresource.Reconciler{
		Config:      mrCfg,
		ClassFilter: resourcemanagerpredicate.NewClassFilter(class),
		ClusterID:   cfg.ClusterID,
	}).AddToManager(mgr, mgr, target); err != nil {
		return nil, fmt.Errorf("shootgrm: managedresource controller: %w", err)
	}
	return mgr, nil
}
