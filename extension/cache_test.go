package extension_test

import (
	"context"
	"testing"

	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	networkingv1 "k8s.io/api/networking/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"sigs.k8s.io/controller-runtime/pkg/cache"
	"sigs.k8s.io/controller-runtime/pkg/client"

	"github.com/tendril-net/tendril/extension"
	"github.com/tendril-net/tendril/internal/kube/kubescheme"
	"github.com/tendril-net/tendril/internal/testing/kubetest"
)

// TestCacheHoldsOnlyTendrilsObjects starts a cache with the extension's options against a real
// API server holding a shoot namespace's tendril-server and kube-apiserver Deployments and
// NetworkPolicies: only tendril's are cached, without managed fields.
func TestCacheHoldsOnlyTendrilsObjects(t *testing.T) {
	env := kubetest.Start(t)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	ns := "shoot--cache--alpha"
	if err := env.Client.Create(ctx, &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: ns}}); err != nil {
		t.Fatal(err)
	}
	deployment := func(name string, labels map[string]string) *appsv1.Deployment {
		sel := map[string]string{"x": name}
		return &appsv1.Deployment{
			ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: name, Labels: labels},
			Spec: appsv1.DeploymentSpec{
				Selector: &metav1.LabelSelector{MatchLabels: sel},
				Template: corev1.PodTemplateSpec{
					ObjectMeta: metav1.ObjectMeta{Labels: sel},
					Spec:       corev1.PodSpec{Containers: []corev1.Container{{Name: "c", Image: "example.org/c"}}},
				},
			},
		}
	}
	policy := func(name string, labels map[string]string) *networkingv1.NetworkPolicy {
		return &networkingv1.NetworkPolicy{ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: name, Labels: labels}}
	}
	ours := map[string]string{"app": "tendril-server"}
	theirs := map[string]string{"app": "kubernetes", "role": "apiserver"}
	for _, o := range []client.Object{
		deployment("tendril-server", ours), deployment("kube-apiserver", theirs),
		policy("tendril-server", ours), policy("allow-to-dns", nil),
	} {
		if err := env.Client.Create(ctx, o); err != nil {
			t.Fatal(err)
		}
	}

	opts := extension.CacheOptions()
	opts.Scheme = kubescheme.New()
	c, err := cache.New(env.Config, opts)
	if err != nil {
		t.Fatal(err)
	}
	done := make(chan error, 1)
	go func() { done <- c.Start(ctx) }()
	defer func() {
		cancel()
		if err := <-done; err != nil {
			t.Error(err)
		}
	}()
	if !c.WaitForCacheSync(ctx) {
		t.Fatal("cache did not start")
	}
	for _, tc := range []struct {
		obj    client.Object
		name   string
		cached bool
	}{
		{&appsv1.Deployment{}, "tendril-server", true},
		{&appsv1.Deployment{}, "kube-apiserver", false},
		{&networkingv1.NetworkPolicy{}, "tendril-server", true},
		{&networkingv1.NetworkPolicy{}, "allow-to-dns", false},
	} {
		// Get starts the kind's informer and waits for its first list.
		err := c.Get(ctx, client.ObjectKey{Namespace: ns, Name: tc.name}, tc.obj)
		switch {
		case tc.cached && err != nil:
			t.Errorf("%T %s: %v, want it cached", tc.obj, tc.name, err)
		case tc.cached && len(tc.obj.GetManagedFields()) != 0:
			t.Errorf("%T %s: cached with %d managed fields entries", tc.obj, tc.name, len(tc.obj.GetManagedFields()))
		case !tc.cached && !apierrors.IsNotFound(err):
			t.Errorf("%T %s: %v, want NotFound (not cached)", tc.obj, tc.name, err)
		}
	}
}
