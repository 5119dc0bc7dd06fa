package main

import (
	"context"
	"crypto/tls"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"time"

	admissionv1 "k8s.io/api/admission/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
)

// maxReview bounds an AdmissionReview's body: kube-apiserver sends at most the object twice
// (object and oldObject) and an object is at most etcd's 1.5 MiB request limit.
const maxReview = 2 * 3 << 19 // 2 × 1.5 MiB

// webhook serves kube-apiserver's validating admission calls on listen with the certificate
// pair until ctx ends. It denies every request it is asked about, with a message that names
// the probe and the object: a shoot's check creates an object the webhook selects and reads
// in kube-apiserver's refusal that the call reached the probe (through the tunnel, when the
// probe runs on a shoot's node).
func webhook(ctx context.Context, listen, certFile, keyFile string) error {
	pair, err := tls.LoadX509KeyPair(certFile, keyFile)
	if err != nil {
		return fmt.Errorf("webhook: %w", err)
	}
	l, err := net.Listen("tcp", listen)
	if err != nil {
		return fmt.Errorf("webhook: %w", err)
	}
	host, _ := os.Hostname()
	srv := &http.Server{
		Handler:           reviewHandler(host),
		TLSConfig:         &tls.Config{Certificates: []tls.Certificate{pair}, MinVersion: tls.VersionTLS12},
		ReadHeaderTimeout: 5 * time.Second,
		ReadTimeout:       10 * time.Second,
		WriteTimeout:      10 * time.Second,
	}
	fmt.Printf("serving webhook %s\n", l.Addr())
	done := make(chan error, 1)
	go func() { done <- srv.ServeTLS(l, "", "") }()
	select {
	case err := <-done:
		return fmt.Errorf("webhook: %w", err)
	case <-ctx.Done():
	}
	shutdown, cancel := context.WithTimeout(context.Background(), 2*time.Second)
	defer cancel()
	_ = srv.Shutdown(shutdown)
	if err := <-done; !errors.Is(err, http.ErrServerClosed) {
		return fmt.Errorf("webhook: %w", err)
	}
	return nil
}

// reviewHandler answers AdmissionReview v1 requests, denying each; anything else is a 400
// with the reason, and a line in the log.
func reviewHandler(host string) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.Method != http.MethodPost {
			http.Error(w, "POST an AdmissionReview", http.StatusMethodNotAllowed)
			return
		}
		var review admissionv1.AdmissionReview
		body, err := io.ReadAll(io.LimitReader(r.Body, maxReview+1))
		switch {
		case err != nil:
		case len(body) > maxReview:
			err = fmt.Errorf("body over %d bytes", maxReview)
		default:
			err = json.Unmarshal(body, &review)
		}
		if err == nil && review.Request == nil {
			err = errors.New("no request in the AdmissionReview")
		}
		if err != nil {
			fmt.Printf("refused a review from %s: %v\n", r.RemoteAddr, err)
			http.Error(w, "bad AdmissionReview: "+err.Error(), http.StatusBadRequest)
			return
		}
		req := review.Request
		msg := fmt.Sprintf("tendril-probe webhook on %s saw %s %s %s/%s", host, req.Operation, req.Kind.Kind, req.Namespace, req.Name)
		fmt.Printf("review from %s: %s\n", r.RemoteAddr, msg)
		review.Response = &admissionv1.AdmissionResponse{UID: req.UID, Allowed: false,
			Result: &metav1.Status{Code: http.StatusForbidden, Message: msg}}
		review.Request = nil
		w.Header().Set("Content-Type", "application/json")
		_ = json.NewEncoder(w).Encode(&review)
	})
}
