package main

import (
	"bytes"
	"encoding/json"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"

	admissionv1 "k8s.io/api/admission/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
)

func TestReviewHandler(t *testing.T) {
	srv := httptest.NewServer(reviewHandler("node-a"))
	defer srv.Close()
	post := func(t *testing.T, body []byte) *http.Response {
		t.Helper()
		resp, err := http.Post(srv.URL, "application/json", bytes.NewReader(body))
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { resp.Body.Close() })
		return resp
	}

	t.Run("review denied with the uid and the object", func(t *testing.T) {
		in, _ := json.Marshal(&admissionv1.AdmissionReview{
			TypeMeta: metav1.TypeMeta{APIVersion: "admission.k8s.io/v1", Kind: "AdmissionReview"},
			Request: &admissionv1.AdmissionRequest{UID: "u-1", Operation: admissionv1.Create,
				Kind: metav1.GroupVersionKind{Version: "v1", Kind: "ConfigMap"}, Namespace: "default", Name: "x"}})
		resp := post(t, in)
		var out admissionv1.AdmissionReview
		if err := json.NewDecoder(resp.Body).Decode(&out); err != nil {
			t.Fatal(err)
		}
		r := out.Response
		if resp.StatusCode != http.StatusOK || r == nil || r.UID != "u-1" || r.Allowed || out.Request != nil ||
			r.Result.Message != "tendril-probe webhook on node-a saw CREATE ConfigMap default/x" {
			t.Fatalf("status %d, review %+v, response %+v", resp.StatusCode, out, r)
		}
		if out.Kind != "AdmissionReview" || out.APIVersion != "admission.k8s.io/v1" {
			t.Errorf("type %+v: kube-apiserver wants the review's own apiVersion and kind back", out.TypeMeta)
		}
	})
	for name, body := range map[string][]byte{
		"garbage":    []byte("\x16\x03\x01garbage"),
		"no request": []byte(`{"apiVersion":"admission.k8s.io/v1","kind":"AdmissionReview"}`),
		"oversized":  []byte(`{"request":{"uid":"` + strings.Repeat("a", maxReview) + `"}}`),
	} {
		t.Run(name, func(t *testing.T) {
			if resp := post(t, body); resp.StatusCode != http.StatusBadRequest {
				t.Errorf("status %d, want 400", resp.StatusCode)
			}
		})
	}
	t.Run("GET", func(t *testing.T) {
		resp, err := http.Get(srv.URL)
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
		if resp.StatusCode != http.StatusMethodNotAllowed {
			t.Errorf("status %d, want 405", resp.StatusCode)
		}
	})
}
