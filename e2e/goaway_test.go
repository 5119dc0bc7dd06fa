package e2e

import (
	"bufio"
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/x509"
	"encoding/pem"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"
	"sigs.k8s.io/controller-runtime/pkg/envtest"

	"github.com/tendril-net/tendril/internal/pki/testpki"
	"github.com/tendril-net/tendril/internal/testing/kubetest"
	"github.com/tendril-net/tendril/internal/testing/testnet"
	"github.com/tendril-net/tendril/internal/testing/testwait"
)

// goAwayRequests is how many requests one client sends per measurement. With --goaway-chance
// 0.02 that is about 100 new connections, some 33 per replica; a replica's share then varies by
// about 50 × √33 / 5,000 ≈ 0.06 around a third, so the bound below (0.55) is almost 4 of those
// away.
const (
	goAwayRequests  = 5000
	goAwayReplicas  = 3
	goAwayMaxShare  = 0.55
	goAwayPinnedMin = 1.0 // without GOAWAYs one connection carries every request
)

// TestGoAwayRebalancesAPIServerClients runs one shoot's kube-apiserver as three replicas on one
// etcd, with one serving certificate, behind tendril-ingress's SNI passthrough route (its
// cluster picks an endpoint round robin per connection), and sends goAwayRequests GETs from one
// client-go client, as a controller in the shoot does: its requests share one HTTP/2
// connection. The replicas count what they served (apiserver_request_total). Without
// --goaway-chance every request lands on the replica the one connection reached. With
// --goaway-chance (the providerConfig's kubeAPIServer.goAwayChance) a replica now and then ends
// the connection after a response, client-go carries on over a new one, the ingress gives that
// one to the next replica, and the requests spread. No request may fail either way.
func TestGoAwayRebalancesAPIServerClients(t *testing.T) {
	const host = "api.goaway.e2e.test"
	r := newReplicaSet(t, host, "127.0.0.1")
	dir, files := r.dir, r.files
	files["admin.crt"], files["admin.key"] = filepath.Join(dir, "admin.crt"), filepath.Join(dir, "admin.key")
	admin, err := r.ca.Leaf("e2e-admin")
	if err != nil {
		t.Fatal(err)
	}
	if err := testpki.WritePair(admin, files["admin.crt"], files["admin.key"]); err != nil {
		t.Fatal(err)
	}

	// kube-apiserver cannot inherit a socket: reserved ports, the same for every measurement,
	// so the route stays as it is.
	var replicas []string
	for range goAwayReplicas {
		replicas = append(replicas, testnet.Reserve(t, "127.0.0.1"))
	}
	routes := writeFile(t, dir, "routes.yaml", fmt.Sprintf("shoots:\n- name: shoot--e2e--goaway\n  hosts: [%s]\n  apiserver: [%s]\n",
		host, strings.Join(replicas, ", ")))
	xdsAddr, sniAddr, ingressMetrics := loopbackAddr(t), loopbackAddr(t), loopbackAddr(t)
	xdsSeed, xdsIngress := xdsTLS(t)
	start(t, "tendril-seed", []string{xdsAddr}, append([]string{"--routes", routes, "--xds-address", xdsAddr, "--metrics-address", ""}, xdsSeed...)...)
	start(t, "tendril-ingress", []string{sniAddr, ingressMetrics}, append([]string{"--xds", xdsAddr, "--node-id", "e2e", "--sni-address", sniAddr, "--metrics-address", ingressMetrics}, xdsIngress...)...)

	through := &rest.Config{Host: "https://" + sniAddr, QPS: -1, TLSClientConfig: rest.TLSClientConfig{
		ServerName: host, CAFile: files["ca.crt"], CertFile: files["admin.crt"], KeyFile: files["admin.key"]}}
	direct := func(addr string) *rest.Config {
		c := rest.CopyConfig(through)
		c.Host, c.ServerName = "https://"+addr, ""
		return c
	}
	var lines []string
	for _, chance := range []string{"", "0.001", "0.02"} {
		name := "without"
		if chance != "" {
			name = "goaway-chance=" + chance
		}
		t.Run(name, func(t *testing.T) {
			for i, addr := range replicas {
				var extra []string
				if chance != "" {
					extra = append(extra, "--goaway-chance="+chance)
				}
				r.start(t, i, addr, extra...)
			}
			for _, addr := range replicas {
				waitReady(t, direct(addr))
			}
			waitReady(t, through) // and the default namespace is there: the first GETs below
			before := make([]int, len(replicas))
			for i, addr := range replicas {
				before[i] = namespaceGets(t, direct(addr))
			}
			// A client of its own, so its connections are opened for the measurement, and counted.
			var dials atomic.Int64
			cfg := rest.CopyConfig(through)
			cfg.Dial = func(ctx context.Context, network, addr string) (net.Conn, error) {
				dials.Add(1)
				var d net.Dialer
				return d.DialContext(ctx, network, addr)
			}
			cs, err := kubernetes.NewForConfig(cfg)
			if err != nil {
				t.Fatal(err)
			}
			failed := 0
			for range goAwayRequests {
				if _, err := cs.CoreV1().Namespaces().Get(context.Background(), "default", metav1.GetOptions{}); err != nil {
					if failed == 0 {
						t.Errorf("GET through the ingress: %v", err)
					}
					failed++
				}
			}
			served := make([]int, len(replicas))
			most, total := 0, 0
			for i, addr := range replicas {
				served[i] = namespaceGets(t, direct(addr)) - before[i]
				most, total = max(most, served[i]), total+served[i]
			}
			share := float64(most) / float64(goAwayRequests)
			line := fmt.Sprintf("%s: %d GETs on one client over %d connections, %d failed; served per replica %v (sum %d), busiest replica %.2f of them",
				name, goAwayRequests, dials.Load(), failed, served, total, share)
			t.Log(line)
			lines = append(lines, line)
			if failed > 0 {
				t.Errorf("%d of %d requests failed", failed, goAwayRequests)
			}
			if total != goAwayRequests {
				t.Errorf("the replicas count %d GETs, the client sent %d", total, goAwayRequests)
			}
			switch chance {
			case "":
				if n := dials.Load(); n != 1 {
					t.Errorf("without GOAWAYs the client opened %d connections, want 1", n)
				}
				if share < goAwayPinnedMin {
					t.Errorf("without GOAWAYs the busiest replica served %.2f of the requests, want all of them (one connection)", share)
				}
			case "0.02":
				for i, n := range served {
					if n == 0 {
						t.Errorf("replica %d served none", i)
					}
				}
				if share > goAwayMaxShare {
					t.Errorf("the busiest replica served %.2f of the requests, want at most %.2f", share, goAwayMaxShare)
				}
			}
		})
	}
	t.Logf("summary:\n%s", strings.Join(lines, "\n"))
}

// replicaSet is what one shoot's kube-apiserver replicas share: etcd (running until the test
// ends), the shoot's CA (it signs the serving certificate and the clients), the serving
// certificate (tls.crt, tls.key, with ca.crt) and the service-account key pair.
type replicaSet struct {
	assets, dir, etcd string
	ca                *testpki.CA
	files             map[string]string
}

// newReplicaSet writes the files, with a serving certificate for names, and starts etcd.
func newReplicaSet(t *testing.T, names ...string) *replicaSet {
	t.Helper()
	assets, err := kubetest.Assets()
	if err != nil {
		t.Fatalf("kube-apiserver and etcd: %v", err)
	}
	r := &replicaSet{assets: assets, dir: t.TempDir(), files: map[string]string{}}
	for _, n := range []string{"ca.crt", "tls.crt", "tls.key", "sa.key", "sa.pub"} {
		r.files[n] = filepath.Join(r.dir, n)
	}
	if r.ca, err = testpki.NewCA("e2e shoot CA"); err != nil {
		t.Fatal(err)
	}
	serving, err := r.ca.Leaf(names...)
	if err != nil {
		t.Fatal(err)
	}
	if err := testpki.WriteFiles(serving, r.ca, r.files["tls.crt"], r.files["tls.key"], r.files["ca.crt"]); err != nil {
		t.Fatal(err)
	}
	writeServiceAccountKey(t, r.files["sa.key"], r.files["sa.pub"])
	etcd := &envtest.Etcd{Path: filepath.Join(assets, "etcd"), StartTimeout: time.Minute, StopTimeout: time.Minute}
	if err := etcd.Start(); err != nil {
		t.Fatalf("etcd: %v", err)
	}
	t.Cleanup(func() { _ = etcd.Stop() })
	r.etcd = etcd.URL.String()
	return r
}

// start runs replica i on addr until the test ends (startAPIServer).
func (r *replicaSet) start(t *testing.T, i int, addr string, extra ...string) {
	t.Helper()
	startAPIServer(t, fmt.Sprintf("kube-apiserver-%d", i), r.assets, r.etcd, addr, r.files, extra...)
}

// writeServiceAccountKey writes an ECDSA key for kube-apiserver's service-account tokens and its
// public half (what the replicas verify tokens with).
func writeServiceAccountKey(t *testing.T, path, pubPath string) {
	t.Helper()
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	der, err := x509.MarshalPKCS8PrivateKey(key)
	if err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(path, pem.EncodeToMemory(&pem.Block{Type: "PRIVATE KEY", Bytes: der}), 0o600); err != nil {
		t.Fatal(err)
	}
	pub, err := x509.MarshalPKIXPublicKey(&key.PublicKey)
	if err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(pubPath, pem.EncodeToMemory(&pem.Block{Type: "PUBLIC KEY", Bytes: pub}), 0o644); err != nil {
		t.Fatal(err)
	}
}

// startAPIServer runs one kube-apiserver replica on etcd until the test ends, with extra flags.
// Every replica serves the same certificate and trusts the same client CA, as the replicas of
// one Deployment do; none reconciles the kubernetes Service's endpoints, which three replicas on
// one host would fight over.
func startAPIServer(t *testing.T, name, assets, etcdURL, addr string, files map[string]string, extra ...string) {
	t.Helper()
	_, port, _ := strings.Cut(addr, ":")
	args := []string{
		"--etcd-servers=" + etcdURL,
		"--bind-address=127.0.0.1", "--advertise-address=127.0.0.1", "--secure-port=" + port,
		"--tls-cert-file=" + files["tls.crt"], "--tls-private-key-file=" + files["tls.key"],
		"--client-ca-file=" + files["ca.crt"], "--authorization-mode=AlwaysAllow",
		"--service-account-issuer=https://kubernetes.default.svc.cluster.local",
		"--service-account-key-file=" + files["sa.pub"], "--service-account-signing-key-file=" + files["sa.key"],
		"--service-cluster-ip-range=10.0.0.0/24", "--endpoint-reconciler-type=none",
		"--disable-admission-plugins=ServiceAccount", "--cert-dir=" + t.TempDir(),
	}
	startBinary(t, name, filepath.Join(assets, "kube-apiserver"), nil, append(args, extra...)...)
}

// waitReady waits until the API server behind cfg answers /readyz and has the default
// namespace.
func waitReady(t *testing.T, cfg *rest.Config) {
	t.Helper()
	cs, err := kubernetes.NewForConfig(cfg)
	if err != nil {
		t.Fatal(err)
	}
	testwait.Every(t, 100*time.Millisecond, cfg.Host+" ready", func() error {
		if _, err := cs.RESTClient().Get().AbsPath("/readyz").DoRaw(context.Background()); err != nil {
			return err
		}
		_, err := cs.CoreV1().Namespaces().Get(context.Background(), "default", metav1.GetOptions{})
		return err
	})
}

// namespaceGets is what the API server behind cfg counts of the GETs of one namespace it
// answered with 200 (apiserver_request_total).
func namespaceGets(t *testing.T, cfg *rest.Config) int {
	t.Helper()
	cs, err := kubernetes.NewForConfig(cfg)
	if err != nil {
		t.Fatal(err)
	}
	b, err := cs.RESTClient().Get().AbsPath("/metrics").DoRaw(context.Background())
	if err != nil {
		t.Fatalf("%s/metrics: %v", cfg.Host, err)
	}
	n := 0
	sc := bufio.NewScanner(strings.NewReader(string(b)))
	sc.Buffer(nil, 1<<20)
	for sc.Scan() {
		l := sc.Text()
		if !strings.HasPrefix(l, "apiserver_request_total{") {
			continue
		}
		for _, want := range []string{`code="200"`, `resource="namespaces"`, `scope="resource"`, `subresource=""`, `verb="GET"`} {
			if !strings.Contains(l, want) {
				l = ""
				break
			}
		}
		if l == "" {
			continue
		}
		v, err := strconv.ParseFloat(l[strings.LastIndexByte(l, ' ')+1:], 64)
		if err != nil {
			t.Fatalf("%s/metrics: %q: %v", cfg.Host, l, err)
		}
		n += int(v)
	}
	return n
}
