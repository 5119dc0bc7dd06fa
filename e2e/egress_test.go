package e2e

import (
	"context"
	"encoding/json"
	"fmt"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"testing"

	"github.com/go-logr/logr"
	admissionv1 "k8s.io/api/admission/v1"
	admissionregistrationv1 "k8s.io/api/admissionregistration/v1"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/utils/ptr"
	ctrllog "sigs.k8s.io/controller-runtime/pkg/log"

	"github.com/tendril-net/tendril/internal/pki/testpki"
	"github.com/tendril-net/tendril/internal/testing/kubetest"
	"github.com/tendril-net/tendril/tunnel/wg"
	"github.com/tendril-net/tendril/xds/translate"
)

// webhookServeEnv makes the test binary an admission webhook "pod" instead of running tests:
// run inside a network namespace, it serves HTTPS on the address given, with the certificate and
// key files named by webhookCertEnv ("cert,key"), and denies every request, naming itself.
const (
	webhookServeEnv = "TENDRIL_E2E_WEBHOOK_ADDRESS"
	webhookCertEnv  = "TENDRIL_E2E_WEBHOOK_CERT"
)

func init() {
	addr := os.Getenv(webhookServeEnv)
	if addr == "" {
		return
	}
	cert, key, _ := strings.Cut(os.Getenv(webhookCertEnv), ",")
	err := http.ListenAndServeTLS(addr, cert, key, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		var review admissionv1.AdmissionReview
		if err := json.NewDecoder(r.Body).Decode(&review); err != nil || review.Request == nil {
			http.Error(w, "not an AdmissionReview", http.StatusBadRequest)
			return
		}
		review.Response = &admissionv1.AdmissionResponse{UID: review.Request.UID, Allowed: false,
			Result: &metav1.Status{Message: "denied by the webhook pod at " + addr}}
		review.Request = nil
		_ = json.NewEncoder(w).Encode(&review)
	}))
	fmt.Fprintln(os.Stderr, err)
	os.Exit(1)
}

// udsEgress is an EgressSelectorConfiguration that sends `cluster` over the Unix socket with
// protocol (GRPC or HTTPConnect).
func udsEgress(protocol, socket string) string {
	return fmt.Sprintf(`apiVersion: apiserver.k8s.io/v1beta1
kind: EgressSelectorConfiguration
egressSelections:
- name: cluster
  connection:
    proxyProtocol: %s
    transport:
      uds:
        udsName: %s
`, protocol, socket)
}

// TestKubeAPIServerEgress puts a real kube-apiserver in front of the reversed VPN, as a shoot's
// control plane runs in the seed: its EgressSelector sends "cluster" traffic to tendril-server,
// as HTTP CONNECT over mutual TLS, as konnectivity gRPC over a Unix socket, and as HTTP CONNECT
// over tendril-egress-relay's Unix socket (the extension's httpConnectRelay), and an
// admission webhook of the shoot, a Service whose address is a pod reachable only through the
// tunnel (tendril-agent in the shoot's network namespace), decides whether a ConfigMap may be
// created. The webhook's denial, naming the pod, proves kube-apiserver reached it through
// tendril-server → tendril-ingress → tendril-agent.
func TestKubeAPIServerEgress(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("needs root: creates network namespaces and veth pairs (run make test as root, as CI does)")
	}
	ctrllog.SetLogger(logr.Discard()) // envtest logs through controller-runtime's logger
	dir := t.TempDir()
	// seed ⇄ shoot: 10.217.0.1/30 ⇄ .2; the shoot's pod network 10.218.0.0/24, the webhook pod .2.
	shoot, pod := shootNetworks(t, "te", "10.217.0", "10.218.0")
	const podAddr = "10.218.0.2"

	write := func(name, content string) string { return writeFile(t, dir, name, content) }
	ca, caFile := shootCA(t, dir)
	pair := func(name string, names ...string) (certFile, keyFile string) {
		c, err := ca.Leaf(names...)
		if err != nil {
			t.Fatal(err)
		}
		certFile, keyFile = filepath.Join(dir, name+".pem"), filepath.Join(dir, name+"-key.pem")
		if err := testpki.WritePair(c, certFile, keyFile); err != nil {
			t.Fatal(err)
		}
		return certFile, keyFile
	}
	srvCert, srvKey := pair("srv", "tendril-server", "127.0.0.1")
	apiCert, apiKey := pair("api", "kube-apiserver")
	hookCert, hookKey := pair("hook", "webhook.default.svc")

	self, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	hook := exec.Command("ip", "netns", "exec", pod, self)
	hook.Env = append(os.Environ(), webhookServeEnv+"="+podAddr+":443", webhookCertEnv+"="+hookCert+","+hookKey)
	if err := hook.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = hook.Process.Kill(); _ = hook.Wait() })

	// The seed: tendril-seed, tendril-ingress, tendril-server; the shoot: tendril-agent vpn.
	serverKey, _ := wg.GenerateKey()
	agentKey, _ := wg.GenerateKey()
	const ns = "shoot--e2e--egress"
	tunnelAddr, connectAddr, grpcAddr, serverMetrics := loopbackAddr(t), loopbackAddr(t), loopbackAddr(t), loopbackAddr(t)
	grpcSocket := filepath.Join(dir, "grpc.sock")
	relaySocket := filepath.Join(dir, "relay-connect.sock")
	routes := write("routes.yaml", fmt.Sprintf("shoots:\n- name: %s\n  hosts: [api.egress.e2e.test]\n  apiserver: 127.0.0.1:1\n  vpnServer: %s\n", ns, tunnelAddr))
	xdsAddr, ingressMetrics := loopbackAddr(t), loopbackAddr(t)
	ingressTunnel := bindAddr(t, "10.217.0.1:0") // the shoot's side of its veth reaches it
	_, port, _ := net.SplitHostPort(ingressTunnel)
	xdsSeed, xdsIngress := xdsTLS(t)
	start(t, "tendril-seed", []string{xdsAddr}, append([]string{"--routes", routes, "--xds-address", xdsAddr, "--metrics-address", ""}, xdsSeed...)...)
	start(t, "tendril-ingress", []string{ingressTunnel, ingressMetrics}, append([]string{"--xds", xdsAddr, "--node-id", "e2e", "--tunnel-address", ingressTunnel, "--metrics-address", ingressMetrics}, xdsIngress...)...)
	start(t, "tendril-server", []string{tunnelAddr, connectAddr, grpcAddr, serverMetrics}, "--private-key-file", write("server.key", serverKey.String()),
		"--agent-public-key", agentKey.PublicKey().String(), "--shoot-cidrs", "10.218.0.0/24",
		"--tunnel-address", tunnelAddr, "--connect-address", connectAddr, "--grpc-address", grpcAddr, "--grpc-socket", grpcSocket,
		"--tls-cert-file", srvCert, "--tls-key-file", srvKey, "--client-ca-file", caFile, "--metrics-address", serverMetrics)
	eventually(t, "ingress ready", func() error { _, err := get("http://" + ingressMetrics + "/readyz"); return err })
	startBinary(t, "tendril-agent", "ip", nil, "netns", "exec", shoot, filepath.Join(binDir, "tendril-agent"), "vpn",
		"--private-key-file", write("agent.key", agentKey.String()), "--server-public-key", serverKey.PublicKey().String(),
		"--shoot-cidrs", "10.218.0.0/24", "--seed", "10.217.0.1:"+port, "--destination", translate.TendrilServerWireName(ns),
		"--metrics-address", "")
	eventually(t, "server ready (tunnel up)", func() error { _, err := get("http://" + serverMetrics + "/readyz"); return err })
	// The extension's httpConnectRelay: the relay sidecar's CONNECT socket, each CONNECT a stream
	// of its one mutual-TLS connection to tendril-server's gRPC port.
	relayMetrics := loopbackAddr(t)
	start(t, "tendril-egress-relay", []string{relayMetrics}, "--connect-socket", relaySocket, "--server", grpcAddr, "--server-name", "tendril-server",
		"--tls-cert-file", apiCert, "--tls-key-file", apiKey, "--ca-file", caFile, "--metrics-address", relayMetrics)
	eventually(t, "relay ready", func() error { _, err := get("http://" + relayMetrics + "/readyz"); return err })

	egressConfigs := map[string]string{
		// kube-apiserver's HTTPConnect over TCP: a new mutual-TLS connection per dial.
		"http-connect-tls": fmt.Sprintf(`apiVersion: apiserver.k8s.io/v1beta1
kind: EgressSelectorConfiguration
egressSelections:
- name: cluster
  connection:
    proxyProtocol: HTTPConnect
    transport:
      tcp:
        url: https://%s
        tlsConfig:
          caBundle: %s
          clientCert: %s
          clientKey: %s
`, connectAddr, caFile, apiCert, apiKey),
		// konnectivity's gRPC, which kube-apiserver speaks over a Unix socket only.
		"grpc-uds": udsEgress("GRPC", grpcSocket),
		// HTTPConnect over a Unix socket to tendril-egress-relay (egress: httpConnectRelay).
		"http-connect-relay-uds": udsEgress("HTTPConnect", relaySocket),
	}
	for _, mode := range []string{"http-connect-tls", "grpc-uds", "http-connect-relay-uds"} {
		t.Run(mode, func(t *testing.T) {
			// The pod network is the Service network here, so the webhook's Service can have the
			// pod's address as its ClusterIP, which kube-apiserver dials for a Service reference.
			env := kubetest.StartWith(t, map[string]string{
				"egress-selector-config-file": write("egress-"+mode+".yaml", egressConfigs[mode]),
				"service-cluster-ip-range":    "10.218.0.0/24",
			})
			ctx := context.Background()
			svc := &corev1.Service{ObjectMeta: metav1.ObjectMeta{Name: "webhook", Namespace: "default"},
				Spec: corev1.ServiceSpec{ClusterIP: podAddr, Ports: []corev1.ServicePort{{Name: "https", Port: 443}}}}
			if err := env.Client.Create(ctx, svc); err != nil {
				t.Fatal(err)
			}
			caPEM, err := os.ReadFile(caFile)
			if err != nil {
				t.Fatal(err)
			}
			vwc := &admissionregistrationv1.ValidatingWebhookConfiguration{ObjectMeta: metav1.ObjectMeta{Name: "shoot-webhook"},
				Webhooks: []admissionregistrationv1.ValidatingWebhook{{
					Name: "deny.e2e.tendril.dev",
					ClientConfig: admissionregistrationv1.WebhookClientConfig{
						Service:  &admissionregistrationv1.ServiceReference{Namespace: "default", Name: "webhook", Path: ptr.To("/validate"), Port: ptr.To[int32](443)},
						CABundle: caPEM,
					},
					Rules: []admissionregistrationv1.RuleWithOperations{{
						Operations: []admissionregistrationv1.OperationType{admissionregistrationv1.Create},
						Rule:       admissionregistrationv1.Rule{APIGroups: []string{""}, APIVersions: []string{"v1"}, Resources: []string{"configmaps"}},
					}},
					ObjectSelector:          &metav1.LabelSelector{MatchLabels: map[string]string{"e2e.tendril.dev/webhook": "on"}},
					FailurePolicy:           ptr.To(admissionregistrationv1.Fail),
					SideEffects:             ptr.To(admissionregistrationv1.SideEffectClassNone),
					AdmissionReviewVersions: []string{"v1"},
				}},
			}
			if err := env.Client.Create(ctx, vwc); err != nil {
				t.Fatal(err)
			}
			// kube-apiserver picks the webhook configuration up within moments; until then the
			// ConfigMap is admitted (and deleted again for the next try).
			want := "denied by the webhook pod at " + podAddr + ":443"
			n := 0
			eventually(t, "the webhook's answer through the tunnel", func() error {
				n++
				cm := &corev1.ConfigMap{ObjectMeta: metav1.ObjectMeta{Name: fmt.Sprintf("probe-%d", n), Namespace: "default",
					Labels: map[string]string{"e2e.tendril.dev/webhook": "on"}}}
				err := env.Client.Create(ctx, cm)
				if err == nil {
					_ = env.Client.Delete(ctx, cm)
					return fmt.Errorf("ConfigMap %s admitted: the webhook was not called yet", cm.Name)
				}
				if !strings.Contains(err.Error(), want) {
					return fmt.Errorf("create: %v", err)
				}
				return nil
			})
			// The denial is the webhook's choice, not an egress failure: what it does not select
			// is admitted.
			if err := env.Client.Create(ctx, &corev1.ConfigMap{ObjectMeta: metav1.ObjectMeta{Name: "unselected", Namespace: "default"}}); err != nil {
				t.Errorf("a ConfigMap the webhook does not select: %v", err)
			}
			if mode == "http-connect-relay-uds" { // the calls went through the relay, not around it
				m, err := get("http://" + relayMetrics + "/metrics")
				if err != nil {
					t.Fatal(err)
				}
				const relayed = `tendril_egress_relay_connections_total{outcome="relayed"} `
				i := strings.Index(m, "\n"+relayed)
				if i < 0 {
					t.Fatalf("the relay relayed nothing:\n%s", m)
				}
				n, _, _ := strings.Cut(m[i+1+len(relayed):], "\n")
				if v, err := strconv.ParseFloat(n, 64); err != nil || v < 1 {
					t.Errorf("relayed CONNECTs %q (%v), want at least one", n, err)
				}
			}
		})
	}
}
