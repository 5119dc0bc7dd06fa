package kubesource_test

import (
	"bytes"
	"context"
	"fmt"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"sigs.k8s.io/controller-runtime/pkg/client"

	tendrilv1alpha1 "github.com/tendril-net/tendril/apis/tendril/v1alpha1"
	"github.com/tendril-net/tendril/internal/testing/testwait"
	"github.com/tendril-net/tendril/xds/model"
	"github.com/tendril-net/tendril/xds/model/modeltest"
)

// TestTerminationFromSecret: a Route's termination is read from its labelled Secret (an
// unlabelled one is not even cached, and the condition says so), published in the shoot's model,
// followed through a rotation, and refused with the missing key named.
func TestTerminationFromSecret(t *testing.T) {
	s := startSeed(t, time.Minute)
	ctx := context.Background()
	c := s.env.Client
	ns, host := "shoot--t--term", "api.term.test"
	s.shoot(ns, host, s.upstream(ns, host))
	var r tendrilv1alpha1.Route
	must(t, c.Get(ctx, client.ObjectKey{Namespace: ns, Name: "shoot"}, &r))
	r.Spec.Termination = &tendrilv1alpha1.RouteTermination{SecretName: "tendril-termination", APIServerName: "kube-apiserver"}
	must(t, c.Update(ctx, &r))

	tm, err := modeltest.Termination(host)
	if err != nil {
		t.Fatal(err)
	}
	sec := &corev1.Secret{ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: "tendril-termination"}, Data: map[string][]byte{
		tendrilv1alpha1.TerminationServingCert: tm.ServingCert, tendrilv1alpha1.TerminationServingKey: tm.ServingKey,
		tendrilv1alpha1.TerminationClientCA:       tm.ClientCA,
		tendrilv1alpha1.TerminationFrontProxyCert: tm.FrontProxyCert, tendrilv1alpha1.TerminationFrontProxyKey: tm.FrontProxyKey,
		tendrilv1alpha1.TerminationAPIServerCA: tm.APIServerCA,
	}}
	must(t, c.Create(ctx, sec)) // without the label
	s.waitCondition(ns, tendrilv1alpha1.ReasonInvalid)
	if _, cond, _ := s.condition(ns); !strings.Contains(cond.Message, "lacks the label "+tendrilv1alpha1.TerminationSecretLabel+"=true") {
		t.Errorf("condition %q, want the label named", cond.Message)
	}

	sec.Labels = map[string]string{tendrilv1alpha1.TerminationSecretLabel: "true"}
	must(t, c.Update(ctx, sec))
	published := func(want *model.Termination) func() error {
		return func() error {
			if got := s.xds.ShootStatus(ns).Model.Termination; !got.Equal(want) {
				return fmt.Errorf("termination published: %v", got != nil)
			}
			return nil
		}
	}
	testwait.For(t, "termination published", published(tm))

	rotated, err := modeltest.Termination(host)
	if err != nil {
		t.Fatal(err)
	}
	sec.Data[tendrilv1alpha1.TerminationServingCert], sec.Data[tendrilv1alpha1.TerminationServingKey] = rotated.ServingCert, rotated.ServingKey
	// The rotated pair is of another CA: kube-apiserver's CA follows it, as a rotation of the
	// shoot's CA would.
	sec.Data[tendrilv1alpha1.TerminationAPIServerCA] = rotated.APIServerCA
	must(t, c.Update(ctx, sec))
	want := *tm
	want.ServingCert, want.ServingKey, want.APIServerCA = rotated.ServingCert, rotated.ServingKey, rotated.APIServerCA
	testwait.For(t, "rotation published", published(&want))
	if bytes.Equal(want.ServingCert, tm.ServingCert) {
		t.Fatal("the rotation changed nothing")
	}

	delete(sec.Data, tendrilv1alpha1.TerminationServingKey)
	must(t, c.Update(ctx, sec))
	testwait.For(t, "missing key refused", func() error {
		_, cond, err := s.condition(ns)
		if err != nil || cond == nil || cond.Reason != tendrilv1alpha1.ReasonInvalid || !strings.Contains(cond.Message, "lacks serving.key") {
			return fmt.Errorf("condition %+v, %v", cond, err)
		}
		return nil
	})
}
