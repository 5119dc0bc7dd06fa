package localseed

import (
	"bufio"
	"context"
	"crypto/tls"
	"crypto/x509"
	"encoding/pem"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"time"

	"k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/tools/clientcmd"
	clientcmdapi "k8s.io/client-go/tools/clientcmd/api"
	"sigs.k8s.io/controller-runtime/pkg/client"

	tendrilv1alpha1 "github.com/tendril-net/tendril/apis/tendril/v1alpha1"
	"github.com/tendril-net/tendril/edge/connect"
	"github.com/tendril-net/tendril/extension/manifest"
	"github.com/tendril-net/tendril/internal/pki/testpki"
	"github.com/tendril-net/tendril/seedserver"
)

// Names of the checks, in the order they run.
const (
	CheckRoute   = "route"
	CheckKubectl = "kubectl"
	CheckPod     = "seed→pod"
	// CheckAgents: tendril-server sees every agent the shoot runs live (two for an HA shoot).
	CheckAgents = "agents"
	// CheckInCluster needs root (network namespaces); without it its detail says skipped.
	CheckInCluster = "in-cluster"
)

// check runs every check for every shoot; wait retries each for a while (the first round,
// while the ingress takes its routes).
func (s *seed) check(ctx context.Context, wait bool) Report {
	var rep Report
	for _, sh := range s.shoots {
		sr := ShootReport{Namespace: sh.namespace}
		for _, c := range []struct {
			name string
			f    func(context.Context, *shoot) (string, error)
		}{
			{CheckRoute, s.checkRoute},
			{CheckKubectl, s.checkKubectl},
			{CheckPod, s.checkPod},
			{CheckAgents, s.checkAgents},
			{CheckInCluster, s.checkInCluster},
		} {
			detail, err := retry(ctx, wait, func() (string, error) { return c.f(ctx, sh) })
			sr.Checks = append(sr.Checks, Check{Name: c.name, Detail: detail, Err: err})
		}
		rep.Shoots = append(rep.Shoots, sr)
	}
	return rep
}

func retry(ctx context.Context, wait bool, f func() (string, error)) (string, error) {
	deadline := time.Now().Add(30 * time.Second)
	for {
		d, err := f()
		if err == nil || !wait || time.Now().After(deadline) || ctx.Err() != nil {
			return d, err
		}
		select {
		case <-ctx.Done():
		case <-time.After(200 * time.Millisecond):
		}
	}
}

// checkRoute: the shoot's Route is Programmed for its generation.
func (s *seed) checkRoute(ctx context.Context, sh *shoot) (string, error) {
	r := &tendrilv1alpha1.Route{}
	if err := s.client.Get(ctx, client.ObjectKey{Namespace: sh.namespace, Name: manifest.RouteName}, r); err != nil {
		return "", err
	}
	c := meta.FindStatusCondition(r.Status.Conditions, tendrilv1alpha1.ConditionProgrammed)
	if c == nil {
		return "", errors.New("no Programmed condition yet")
	}
	if c.Status != metav1.ConditionTrue || r.Status.ObservedGeneration != r.Generation {
		return "", fmt.Errorf("Programmed=%s %s: %s", c.Status, c.Reason, c.Message)
	}
	return "Programmed (" + strings.Join(r.Spec.Hostnames, ",") + ")", nil
}

// checkKubectl: kubectl with the shoot's kubeconfig lists its namespaces through the ingress's
// SNI listener.
func (s *seed) checkKubectl(ctx context.Context, sh *shoot) (string, error) {
	ctx, cancel := context.WithTimeout(ctx, 15*time.Second)
	defer cancel()
	out, err := exec.CommandContext(ctx, filepath.Join(s.assets, "kubectl"), "--kubeconfig", sh.kubeconfig,
		"get", "namespaces", "-o", "name").CombinedOutput()
	if err != nil {
		return "", fmt.Errorf("kubectl get namespaces: %v: %s", err, strings.TrimSpace(string(out)))
	}
	names := strings.Fields(strings.ReplaceAll(string(out), "namespace/", ""))
	if !strings.Contains(" "+strings.Join(names, " ")+" ", " kube-system ") {
		return "", fmt.Errorf("kubectl get namespaces: no kube-system in %q", names)
	}
	return "get namespaces: " + strings.Join(names, ","), nil
}

// checkPod: a request from the seed side, as kube-apiserver's egress makes it: mutual TLS to
// tendril-server's CONNECT front-end with kube-apiserver's client certificate, CONNECT to the
// pod's address, through the tunnel and the agent to the shoot-side pod.
func (s *seed) checkPod(ctx context.Context, sh *shoot) (string, error) {
	cert, err := tls.LoadX509KeyPair(sh.clientCert, sh.clientKey)
	if err != nil {
		return "", err
	}
	caPEM, err := os.ReadFile(sh.caFile)
	if err != nil {
		return "", err
	}
	pool := x509.NewCertPool()
	if !pool.AppendCertsFromPEM(caPEM) {
		return "", fmt.Errorf("no CA in %s", sh.caFile)
	}
	addr := net.JoinHostPort(s.hostIP.String(), strconv.Itoa(sh.serverPorts["connect"]))
	d := &tls.Dialer{Config: &tls.Config{Certificates: []tls.Certificate{cert}, RootCAs: pool, ServerName: manifest.ServerName}}
	ctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	start := time.Now()
	c, err := d.DialContext(ctx, "tcp", addr)
	if err != nil {
		return "", fmt.Errorf("tendril-server %s: %w", addr, err)
	}
	defer c.Close()
	if dl, ok := ctx.Deadline(); ok {
		_ = c.SetDeadline(dl)
	}
	if err := connect.Open(c, sh.podAddr, "User-Agent", "tendril-local"); err != nil {
		return "", err
	}
	if _, err := fmt.Fprintf(c, "GET / HTTP/1.1\r\nHost: %s\r\nConnection: close\r\n\r\n", sh.podAddr); err != nil {
		return "", err
	}
	r, err := http.ReadResponse(bufio.NewReader(c), nil)
	if err != nil {
		return "", err
	}
	defer r.Body.Close()
	body, _ := io.ReadAll(io.LimitReader(r.Body, 1024))
	if want := "pod in " + sh.namespace; r.StatusCode != http.StatusOK || strings.TrimSpace(string(body)) != want {
		return "", fmt.Errorf("pod answered %s %q, want %q", r.Status, body, want)
	}
	return fmt.Sprintf("CONNECT %s via tendril-server → tunnel → agent: %q in %v", sh.podAddr, strings.TrimSpace(string(body)), time.Since(start).Round(time.Millisecond)), nil
}

// checkAgents reads tendril-server's metrics: every agent the shoot runs is live, one active.
func (s *seed) checkAgents(ctx context.Context, sh *shoot) (string, error) {
	url := "http://" + net.JoinHostPort(s.hostIP.String(), strconv.Itoa(sh.serverPorts["metrics"])) + "/metrics"
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, url, nil)
	if err != nil {
		return "", err
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return "", fmt.Errorf("tendril-server's metrics: %w", err)
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(io.LimitReader(resp.Body, 1<<20))
	if err != nil {
		return "", err
	}
	states := seedserver.AgentStates(string(b))
	known, live, active := len(states), 0, 0
	for _, st := range states {
		if st.Live {
			live++
		}
		if st.Active {
			active++
		}
	}
	// What the extension declared for the shoot, not what this seed started.
	want := 1
	if sh.ha {
		want = tendrilv1alpha1.MaxAgents
	}
	if known != want || live != want || active != 1 {
		return "", fmt.Errorf("tendril-server: %d of %d agents live (%d configured), %d active; want all %d live, one active", live, known, known, active, want)
	}
	return fmt.Sprintf("tendril-server: %d of %d agents live, one active", live, known), nil
}

func (s *seed) printReport(rep Report) {
	for _, sr := range rep.Shoots {
		s.printf("  %s\n", sr.Namespace)
		for _, c := range sr.Checks {
			if c.Err != nil {
				s.printf("    %-10s FAILED: %v\n", c.Name, c.Err)
			} else {
				s.printf("    %-10s ok: %s\n", c.Name, c.Detail)
			}
		}
	}
}

func (s *seed) printStatus(rep Report) {
	now := time.Now().Format("15:04:05")
	for _, sr := range rep.Shoots {
		var parts []string
		for _, c := range sr.Checks {
			st := "ok"
			if c.Err != nil {
				st = "FAILED (" + c.Err.Error() + ")"
			}
			parts = append(parts, c.Name+" "+st)
		}
		s.printf("%s %-22s %s\n", now, sr.Namespace, strings.Join(parts, ", "))
	}
}

func (s *seed) printUsage() {
	s.printf("\nPoint kubectl at a shoot (through the ingress's SNI listener %s):\n", s.cfg.SNIAddress)
	for _, sh := range s.shoots {
		s.printf("  %s --kubeconfig %s get namespaces\n", filepath.Join(s.assets, "kubectl"), sh.kubeconfig)
	}
	s.printf("The seed: %s --kubeconfig %s get extensions,routes,deployments -A\n", filepath.Join(s.assets, "kubectl"), s.seedKubeconfig())
	s.printf("Logs: %s. Running until interrupted (Ctrl-C); a status line per shoot every %v.\n", s.dir, s.cfg.StatusInterval)
}

func pemCert(ca *testpki.CA) []byte {
	return pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: ca.Cert.Raw})
}

// seedKubeconfig writes the seed API server's kubeconfig (envtest's admin) and returns its path.
func (s *seed) seedKubeconfig() string {
	kc := clientcmdapi.NewConfig()
	kc.Clusters["seed"] = &clientcmdapi.Cluster{Server: s.rest.Host, CertificateAuthorityData: s.rest.CAData}
	kc.AuthInfos["seed"] = &clientcmdapi.AuthInfo{ClientCertificateData: s.rest.CertData, ClientKeyData: s.rest.KeyData, Token: s.rest.BearerToken}
	kc.Contexts["seed"] = &clientcmdapi.Context{Cluster: "seed", AuthInfo: "seed"}
	kc.CurrentContext = "seed"
	p := filepath.Join(s.dir, "seed.kubeconfig")
	if err := clientcmd.WriteToFile(*kc, p); err != nil {
		return "(" + err.Error() + ")"
	}
	return p
}
