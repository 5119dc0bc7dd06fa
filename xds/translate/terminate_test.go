package translate_test

import (
	"bytes"
	"context"
	"fmt"
	"os"
	"testing"

	"google.golang.org/protobuf/proto"

	"github.com/tendril-net/tendril/xds/model"
	"github.com/tendril-net/tendril/xds/source"
	"github.com/tendril-net/tendril/xds/translate"
)

// terminatingShoots reads the golden input with a terminating shoot (alpha) and a passthrough
// one (beta).
func terminatingShoots(t *testing.T) []model.Shoot {
	t.Helper()
	data, err := os.ReadFile("testdata/in/terminate.yaml")
	if err != nil {
		t.Fatal(err)
	}
	shoots, err := source.ParseRoutes(context.Background(), data, nil)
	if err != nil {
		t.Fatal(err)
	}
	if shoots[0].Termination == nil || shoots[1].Termination != nil {
		t.Fatal("terminate.yaml: want alpha terminating and beta passed through")
	}
	return shoots
}

// TestTerminationTouchesNoOther: opting a shoot in changes neither the constant listeners nor
// another shoot's resources, and keeps its own CONNECT and PROXY routes (in-cluster clients
// stay passthrough); only its server names lead elsewhere.
func TestTerminationTouchesNoOther(t *testing.T) {
	shoots := terminatingShoots(t)
	plain := shoots[0]
	plain.Termination = nil
	withPlain := translate.All(translate.Options{}, []model.Shoot{plain, shoots[1]})
	withTerm := translate.All(translate.Options{}, shoots)
	constant := translate.Constant(translate.Options{})
	for i, l := range constant.Listeners {
		if !proto.Equal(l, withTerm.Listeners[i]) {
			t.Errorf("listener %s changes with a terminating shoot", l.GetName())
		}
	}
	term := translate.Shoot(shoots[0])
	names := map[string]bool{}
	for _, c := range term.Clusters {
		names[c.GetName()] = true
	}
	for _, c := range translate.Shoot(plain).Clusters {
		if !names[c.GetName()] {
			t.Errorf("cluster %s of the passthrough form is missing", c.GetName())
		}
	}
	for _, want := range []string{translate.TerminateCluster(plain.Name), translate.TerminateUpgradeCluster(plain.Name), translate.APIServerWireName(plain.Name)} {
		if !names[want] {
			t.Errorf("no cluster %s", want)
		}
	}
	if len(term.Listeners) != 1 || term.Listeners[0].GetName() != translate.TerminateListener(plain.Name) || len(term.Secrets) != 4 {
		t.Errorf("got %d listeners, %d secrets; want its internal listener and 4 secrets", len(term.Listeners), len(term.Secrets))
	}
	// beta's resources, as both whole sets carry them, are the same.
	if a, b := resourcesOf(withPlain, shoots[1]), resourcesOf(withTerm, shoots[1]); len(a) == 0 || len(a) != len(b) {
		t.Errorf("the other shoot has %d resources beside a passthrough alpha, %d beside a terminating one", len(a), len(b))
	} else {
		for i := range a {
			if !proto.Equal(a[i], b[i]) {
				t.Errorf("the other shoot's resource %d changes with alpha's termination", i)
			}
		}
	}
}

// resourcesOf picks s's resources out of a whole set, in order: those translate.Shoot(s) names.
func resourcesOf(all translate.Resources, s model.Shoot) []proto.Message {
	names := map[string]bool{}
	for _, m := range messages(translate.Shoot(s)) {
		names[resourceName(m)] = true
	}
	var out []proto.Message
	for _, m := range messages(all) {
		if names[resourceName(m)] {
			out = append(out, m)
		}
	}
	return out
}

func resourceName(m proto.Message) string {
	switch r := m.(type) {
	case interface{ GetClusterName() string }:
		return "endpoints/" + r.GetClusterName()
	case interface{ GetName() string }:
		return fmt.Sprintf("%T/%s", m, r.GetName())
	}
	return ""
}

// TestRotationChangesOnlyItsSecret: a new serving certificate changes one secret and nothing
// else, so Envoy and tendril-ingress swap the certificate without touching listeners or
// clusters (which would drain connections).
func TestRotationChangesOnlyItsSecret(t *testing.T) {
	s := terminatingShoots(t)[0]
	rotated := s
	tm := *s.Termination
	tm.ServingCert = append(bytes.Clone(tm.ServingCert), '\n')
	rotated.Termination = &tm
	a, b := translate.Shoot(s), translate.Shoot(rotated)
	if !equalResources(translate.Resources{Listeners: a.Listeners, Clusters: a.Clusters, Endpoints: a.Endpoints},
		translate.Resources{Listeners: b.Listeners, Clusters: b.Clusters, Endpoints: b.Endpoints}) {
		t.Error("a serving certificate's rotation changes a listener, cluster or assignment")
	}
	changed := 0
	for i := range a.Secrets {
		if !proto.Equal(a.Secrets[i], b.Secrets[i]) {
			changed++
			if a.Secrets[i].GetName() != translate.ServingSecret(s.Name) {
				t.Errorf("secret %s changed", a.Secrets[i].GetName())
			}
		}
	}
	if changed != 1 {
		t.Errorf("%d secrets changed, want the serving one", changed)
	}
}

func equalResources(a, b translate.Resources) bool {
	ma, mb := messages(a), messages(b)
	if len(ma) != len(mb) {
		return false
	}
	for i := range ma {
		if !proto.Equal(ma[i], mb[i]) {
			return false
		}
	}
	return true
}
