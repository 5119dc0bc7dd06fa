package model

import (
	"bytes"
	"fmt"
	"reflect"
	"strings"
	"testing"
	"time"

	"github.com/tendril-net/tendril/internal/pki/testpki"
)

// newTermination returns a valid termination: a serving certificate for the shoot's host, a
// client CA, a front-proxy certificate of its own CA, and kube-apiserver's CA.
func newTermination(t *testing.T) *Termination {
	t.Helper()
	var cas [3]*testpki.CA
	for i, cn := range []string{"shoot-ca", "client-ca", "front-proxy-ca"} {
		ca, err := testpki.NewCA(cn)
		if err != nil {
			t.Fatal(err)
		}
		cas[i] = ca
	}
	serving, err := cas[0].Leaf("api.a.b", "kube-apiserver")
	if err != nil {
		t.Fatal(err)
	}
	front, err := cas[2].Client("front-proxy", nil, time.Time{}, time.Time{})
	if err != nil {
		t.Fatal(err)
	}
	tm := &Termination{ClientCA: cas[1].PEM(), APIServerCA: cas[0].PEM(), APIServerName: "kube-apiserver"}
	if tm.ServingCert, tm.ServingKey, err = testpki.PEM(serving); err != nil {
		t.Fatal(err)
	}
	if tm.FrontProxyCert, tm.FrontProxyKey, err = testpki.PEM(front); err != nil {
		t.Fatal(err)
	}
	return tm
}

// TestTerminationEqualCoversEveryField: as TestEqualCoversEveryField, for the termination.
func TestTerminationEqualCoversEveryField(t *testing.T) {
	base := newTermination(t)
	typ := reflect.TypeFor[Termination]()
	for i := range typ.NumField() {
		other := *base
		f := reflect.ValueOf(&other).Elem().Field(i)
		switch v := f.Interface().(type) {
		case []byte:
			f.SetBytes(append(bytes.Clone(v), '\n'))
		case string:
			f.SetString(v + "x")
		default:
			t.Fatalf("field %s: a %T; teach this test to change it", typ.Field(i).Name, v)
		}
		if base.Equal(&other) || other.Equal(base) {
			t.Errorf("field %s changed, but Equal reports the terminations equal", typ.Field(i).Name)
		}
	}
	same := *base
	if !base.Equal(&same) {
		t.Error("a copy is not Equal")
	}
	if base.Equal(nil) || (*Termination)(nil).Equal(base) || !(*Termination)(nil).Equal(nil) {
		t.Error("nil is equal only to nil")
	}
}

// TestValidateTermination: a shoot's termination is refused for each part that does not parse,
// with the part named.
func TestValidateTermination(t *testing.T) {
	good := newTermination(t)
	s := Shoot{Name: "shoot--a--b", Hosts: []string{"api.a.b"}, Termination: good}
	if err := s.Validate(); err != nil {
		t.Fatalf("Validate: %v", err)
	}
	other := newTermination(t)
	for _, tc := range []struct {
		name, want string
		change     func(*Termination)
	}{
		{"key of another certificate", "serving certificate", func(tm *Termination) { tm.ServingKey = other.ServingKey }},
		{"no serving key", "serving certificate", func(tm *Termination) { tm.ServingKey = nil }},
		{"front-proxy garbage", "front-proxy certificate", func(tm *Termination) { tm.FrontProxyCert = []byte("garbage") }},
		{"empty client CA", "client CA: no certificate", func(tm *Termination) { tm.ClientCA = nil }},
		{"key in a bundle", `client CA: a "PRIVATE KEY" block`, func(tm *Termination) { tm.ClientCA = append(bytes.Clone(tm.ClientCA), tm.ServingKey...) }},
		{"trailing garbage", "kube-apiserver CA: not PEM", func(tm *Termination) { tm.APIServerCA = append(bytes.Clone(tm.APIServerCA), "junk"...) }},
		{"no name", "kube-apiserver name", func(tm *Termination) { tm.APIServerName = "" }},
	} {
		tm := *good
		tc.change(&tm)
		s.Termination = &tm
		err := s.Validate()
		if err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%s: %v, want an error with %q", tc.name, err, tc.want)
		}
	}
}

// TestTerminationStringRedactsKeys: printing a route's termination shows no key material.
func TestTerminationStringRedactsKeys(t *testing.T) {
	tm := newTermination(t)
	for _, s := range []string{fmt.Sprint(tm), fmt.Sprintf("%v", tm), fmt.Sprintf("%+v", Shoot{Name: "x", Termination: tm})} {
		if strings.Contains(s, "PRIVATE KEY") || strings.Contains(s, string(tm.ServingKey[40:60])) {
			t.Errorf("key material printed: %s", s)
		}
	}
	if !strings.Contains(fmt.Sprint(tm), `apiserverName "kube-apiserver"`) {
		t.Errorf("String: %s", tm)
	}
}
