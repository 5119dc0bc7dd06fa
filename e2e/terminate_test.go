package e2e

import (
	"context"
	"fmt"
	"net"
	"net/http"
	"path/filepath"
	"reflect"
	"slices"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	authenticationv1 "k8s.io/api/authentication/v1"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"

	"github.com/tendril-net/tendril/internal/pki/testpki"
	"github.com/tendril-net/tendril/internal/testing/testnet"
	"github.com/tendril-net/tendril/wire"
	"github.com/tendril-net/tendril/xds/translate"
)

// TestTerminatingAPIServers runs the terminating mode as it ships: tendril-seed serves a route
// file whose shoot has terminate: (its serving certificate, client CA, front-proxy certificate,
// kube-apiserver's CA), tendril-ingress (both as make build makes them) terminates it in front of
// three real kube-apiserver replicas on one etcd that trust the front-proxy certificate
// (--requestheader-*): a client certificate's user and groups are who kube-apiserver sees
// (kubectl auth whoami); X-Remote-* headers a client forges are dropped (without a certificate
// they would make it anyone); a service account's bearer token passes and is authenticated by
// kube-apiserver; 1,200 requests of one client-go client on one connection spread over the
// three within ±10 %; a watch streams through; the ingress's metrics count the stripped
// requests and no refusal.
func TestTerminatingAPIServers(t *testing.T) {
	const host, shoot = "api.terminate.e2e.test", "shoot--e2e--terminate"
	r := newReplicaSet(t, "kube-apiserver", "127.0.0.1")
	dir, files, shootCA := r.dir, r.files, r.ca
	frontProxyCA, err := testpki.NewCA("e2e front-proxy CA")
	if err != nil {
		t.Fatal(err)
	}
	files["front-proxy-ca.crt"] = filepath.Join(dir, "front-proxy-ca.crt")
	if err := frontProxyCA.WriteCA(files["front-proxy-ca.crt"]); err != nil {
		t.Fatal(err)
	}
	var replicas []string
	for i := range goAwayReplicas {
		addr := testnet.Reserve(t, "127.0.0.1")
		replicas = append(replicas, addr)
		r.start(t, i, addr,
			"--requestheader-client-ca-file="+files["front-proxy-ca.crt"], "--requestheader-allowed-names=front-proxy-client",
			"--requestheader-username-headers="+wire.RemoteUserHeader, "--requestheader-group-headers="+wire.RemoteGroupHeader,
			"--requestheader-extra-headers-prefix="+wire.RemoteExtraHeaderPrefix)
	}

	servingCert, servingKey := must2(testpki.PEM(must(shootCA.Leaf(host))))
	frontCert, frontKey := must2(testpki.PEM(must(frontProxyCA.Client("front-proxy-client", nil, time.Time{}, time.Time{}))))
	block := func(pem []byte) string {
		return "|\n      " + strings.ReplaceAll(strings.TrimSpace(string(pem)), "\n", "\n      ")
	}
	routes := writeFile(t, dir, "routes.yaml", fmt.Sprintf(`shoots:
- name: %s
  hosts: [%s]
  apiserver: [%s]
  terminate:
    servingCert: %s
    servingKey: %s
    clientCA: %s
    frontProxyCert: %s
    frontProxyKey: %s
    apiserverCA: %s
    apiserverName: kube-apiserver
`, shoot, host, strings.Join(replicas, ", "), block(servingCert), block(servingKey), block(shootCA.PEM()),
		block(frontCert), block(frontKey), block(shootCA.PEM())))
	xdsAddr, sniAddr, ingressMetrics := loopbackAddr(t), loopbackAddr(t), loopbackAddr(t)
	xdsSeed, xdsIngress := xdsTLS(t)
	start(t, "tendril-seed", []string{xdsAddr}, append([]string{"--routes", routes, "--xds-address", xdsAddr, "--metrics-address", ""}, xdsSeed...)...)
	start(t, "tendril-ingress", []string{sniAddr, ingressMetrics}, append([]string{"--xds", xdsAddr, "--node-id", "e2e", "--sni-address", sniAddr, "--metrics-address", ingressMetrics}, xdsIngress...)...)

	// kubeconfigs: alice by certificate, through the proxy and straight to a replica.
	alice := must(shootCA.Client("alice", []string{"devs"}, time.Time{}, time.Time{}))
	aliceFiles := map[string]string{"crt": filepath.Join(dir, "alice.crt"), "key": filepath.Join(dir, "alice.key")}
	if err := testpki.WritePair(alice, aliceFiles["crt"], aliceFiles["key"]); err != nil {
		t.Fatal(err)
	}
	var dials atomic.Int64
	through := func(cert bool, header http.Header) *rest.Config {
		c := &rest.Config{Host: "https://" + sniAddr, QPS: -1, TLSClientConfig: rest.TLSClientConfig{ServerName: host, CAFile: files["ca.crt"]}}
		if cert {
			c.CertFile, c.KeyFile = aliceFiles["crt"], aliceFiles["key"]
		}
		c.Dial = func(ctx context.Context, network, addr string) (net.Conn, error) {
			dials.Add(1)
			var d net.Dialer
			return d.DialContext(ctx, network, addr)
		}
		if header != nil {
			c.WrapTransport = func(rt http.RoundTripper) http.RoundTripper { return headerAdder{rt, header} }
		}
		return c
	}
	direct := func(addr string) *rest.Config {
		return &rest.Config{Host: "https://" + addr, QPS: -1, TLSClientConfig: rest.TLSClientConfig{
			CAFile: files["ca.crt"], CertFile: aliceFiles["crt"], KeyFile: aliceFiles["key"]}}
	}
	for _, addr := range replicas {
		waitReady(t, direct(addr))
	}
	ctx := context.Background()
	whoami := func(cfg *rest.Config) (authenticationv1.UserInfo, error) {
		cs, err := kubernetes.NewForConfig(cfg)
		if err != nil {
			t.Fatal(err)
		}
		r, err := cs.AuthenticationV1().SelfSubjectReviews().Create(ctx, &authenticationv1.SelfSubjectReview{}, metav1.CreateOptions{})
		if err != nil {
			return authenticationv1.UserInfo{}, err
		}
		return r.Status.UserInfo, nil
	}

	forged := http.Header{"X-Remote-User": {"admin"}, "X-Remote-Group": {"system:masters"}, "X-Remote-Extra-Scopes": {"all"}}
	u, err := whoami(through(true, forged))
	if err != nil {
		t.Fatalf("whoami as alice: %v", err)
	}
	// Exactly what a replica makes of the certificate itself: user, groups and its credential
	// id (the certificate's fingerprint, which the audit log records), nothing forged.
	want, err := whoami(direct(replicas[0]))
	if err != nil {
		t.Fatalf("whoami as alice, straight to a replica: %v", err)
	}
	if u.Username != "alice" || !slices.Contains(u.Groups, "devs") || !reflect.DeepEqual(u, want) {
		t.Errorf("alice through the proxy (forged headers sent) is %+v, want %+v as a replica sees her directly", u, want)
	}
	t.Logf("whoami through the proxy with alice's certificate and forged X-Remote-* headers: %s %v %v", u.Username, u.Groups, u.Extra)
	// Without a certificate the forged headers are all there is; dropped, the request is
	// anonymous, which these replicas refuse (AlwaysAllow turns anonymous authentication off).
	if u, err := whoami(through(false, forged)); !apierrors.IsUnauthorized(err) {
		t.Errorf("forged headers without a certificate: %+v, %v; want 401", u, err)
	}

	// A service account's token, issued by a replica, passes untouched.
	admin, err := kubernetes.NewForConfig(direct(replicas[0]))
	if err != nil {
		t.Fatal(err)
	}
	if _, err := admin.CoreV1().ServiceAccounts("default").Create(ctx, &corev1.ServiceAccount{ObjectMeta: metav1.ObjectMeta{Name: "bot"}}, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	tr, err := admin.CoreV1().ServiceAccounts("default").CreateToken(ctx, "bot", &authenticationv1.TokenRequest{}, metav1.CreateOptions{})
	if err != nil {
		t.Fatal(err)
	}
	tokenCfg := through(false, forged)
	tokenCfg.BearerToken = tr.Status.Token
	if u, err := whoami(tokenCfg); err != nil || u.Username != "system:serviceaccount:default:bot" {
		t.Errorf("bearer token through the proxy: %+v, %v; want the service account", u, err)
	}

	// One client, one connection, requests spread.
	before := make([]int, len(replicas))
	for i, addr := range replicas {
		before[i] = namespaceGets(t, direct(addr))
	}
	dials.Store(0)
	cs, err := kubernetes.NewForConfig(through(true, nil))
	if err != nil {
		t.Fatal(err)
	}
	const n = 1200
	for range n {
		if _, err := cs.CoreV1().Namespaces().Get(ctx, "default", metav1.GetOptions{}); err != nil {
			t.Fatalf("GET through the proxy: %v", err)
		}
	}
	var counts []int
	for i, addr := range replicas {
		counts = append(counts, namespaceGets(t, direct(addr))-before[i])
	}
	t.Logf("%d GETs of one client over %d connection(s): served per replica %v", n, dials.Load(), counts)
	if d := dials.Load(); d != 1 {
		t.Errorf("the client opened %d connections, want 1", d)
	}
	for i, c := range counts {
		if c < n/3*9/10 || c > n/3*11/10 {
			t.Errorf("replica %d served %d of %d, want %d ± 10 %%", i, c, n, n/3)
		}
	}

	// A watch streams through: an event for a namespace created elsewhere arrives.
	wctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	w, err := cs.CoreV1().Namespaces().Watch(wctx, metav1.ListOptions{FieldSelector: "metadata.name=watched"})
	if err != nil {
		t.Fatal(err)
	}
	defer w.Stop()
	if _, err := admin.CoreV1().Namespaces().Create(ctx, &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: "watched"}}, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	select {
	case ev := <-w.ResultChan():
		if ns, ok := ev.Object.(*corev1.Namespace); !ok || ns.Name != "watched" {
			t.Errorf("watch event %s %T, want the namespace", ev.Type, ev.Object)
		}
	case <-wctx.Done():
		t.Error("no watch event through the proxy within 30 s")
	}
	m, err := get("http://" + ingressMetrics + "/metrics")
	if err != nil {
		t.Fatal(err)
	}
	listener := `listener="` + translate.TerminateListener(shoot) + `"`
	if want := "tendril_ingress_terminate_stripped_requests_total{" + listener + "} 3"; !strings.Contains(m, want) {
		t.Errorf("want %q (the 3 forged requests):\n%s", want, grepLines(m, "tendril_ingress_terminate"))
	}
	for _, line := range strings.Split(grepLines(m, "tendril_ingress_terminate_refused_requests_total{"), "\n") {
		if line != "" && !strings.HasSuffix(line, " 0") {
			t.Errorf("the ingress refused requests: %s", line)
		}
	}
	if !strings.Contains(m, "tendril_ingress_terminate_refused_requests_total{"+listener) {
		t.Errorf("no refusal counters for %s:\n%s", shoot, grepLines(m, "tendril_ingress_terminate"))
	}
}

// headerAdder adds headers to every request, as a client forging them would.
type headerAdder struct {
	rt http.RoundTripper
	h  http.Header
}

func (a headerAdder) RoundTrip(r *http.Request) (*http.Response, error) {
	r = r.Clone(r.Context())
	for k, v := range a.h {
		r.Header[k] = v
	}
	return a.rt.RoundTrip(r)
}

func must2[T, U any](v T, w U, err error) (T, U) {
	if err != nil {
		panic(err)
	}
	return v, w
}

func must[T any](v T, err error) T {
	if err != nil {
		panic(err)
	}
	return v
}
