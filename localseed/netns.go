package localseed

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"time"

	appsv1 "k8s.io/api/apps/v1"
	"k8s.io/client-go/tools/clientcmd"
	clientcmdapi "k8s.io/client-go/tools/clientcmd/api"
	"sigs.k8s.io/controller-runtime/pkg/client"

	"github.com/tendril-net/tendril/extension/manifest"
	"github.com/tendril-net/tendril/internal/host/procgroup"
)

// canNetns tells whether the runner may make network namespaces (root with ip(8)).
func canNetns() bool {
	if os.Geteuid() != 0 {
		return false
	}
	_, err := exec.LookPath("ip")
	return err == nil
}

func run(ctx context.Context, args ...string) error {
	out, err := exec.CommandContext(ctx, args[0], args[1:]...).CombinedOutput()
	if err != nil {
		return fmt.Errorf("%s: %v: %s", strings.Join(args, " "), err, strings.TrimSpace(string(out)))
	}
	return nil
}

// makeNode makes the shoot's "node": a network namespace joined to this machine by a veth
// pair, with a default route to it (the host's own addresses, where the ingress listens,
// are reachable that way). It returns the cleanup.
func (s *seed) makeNode(ctx context.Context, sh *shoot) (func(), error) {
	ns := fmt.Sprintf("tendril-local-%d-%d", os.Getpid(), sh.index)
	host, peer := fmt.Sprintf("tl%dh%d", os.Getpid()%100000, sh.index), fmt.Sprintf("tl%dn%d", os.Getpid()%100000, sh.index)
	hostAddr, nsAddr := fmt.Sprintf("10.199.%d.1", sh.index), fmt.Sprintf("10.199.%d.2", sh.index)
	cleanup := func() {
		_ = run(context.Background(), "ip", "netns", "del", ns)
		_ = run(context.Background(), "ip", "link", "del", host)
	}
	for _, c := range [][]string{
		{"ip", "netns", "add", ns},
		{"ip", "link", "add", host, "type", "veth", "peer", "name", peer},
		{"ip", "link", "set", peer, "netns", ns},
		{"ip", "addr", "add", hostAddr + "/30", "dev", host},
		{"ip", "link", "set", host, "up"},
		{"ip", "-n", ns, "addr", "add", nsAddr + "/30", "dev", peer},
		{"ip", "-n", ns, "link", "set", peer, "up"},
		{"ip", "-n", ns, "link", "set", "lo", "up"},
		{"ip", "-n", ns, "route", "add", "default", "via", hostAddr},
	} {
		if err := run(ctx, c...); err != nil {
			cleanup()
			return nil, err
		}
	}
	sh.netns = ns
	return cleanup, nil
}

// startAPIServerProxy starts the apiserver-proxy DaemonSet's container in the shoot's node
// namespace, as the shoot API server holds it, with the ingress's PROXY listener as target, and
// writes the in-cluster kubeconfig (kube-apiserver's advertised address on 443).
func (s *seed) startAPIServerProxy(ctx context.Context, sh *shoot) error {
	ds := &appsv1.DaemonSet{}
	if err := sh.client.Get(ctx, client.ObjectKey{Namespace: manifest.ShootNamespace, Name: manifest.APIServerProxyName}, ds); err != nil {
		return fmt.Errorf("apiserver-proxy DaemonSet in the shoot: %w", err)
	}
	p, err := s.materialize(ctx, sh.client, manifest.ShootNamespace, ds.Spec.Template.Spec, filepath.Join(sh.dir, manifest.APIServerProxyName), "127.0.0.1", true)
	if err != nil {
		return err
	}
	for i, a := range p.args {
		if strings.HasPrefix(a, "--ingress=") {
			p.args[i] = "--ingress=" + s.cfg.ProxyAddress
		}
		if v, ok := strings.CutPrefix(a, "--advertised-address="); ok {
			sh.advertised = v
		}
		if strings.HasPrefix(a, "--interface=") {
			// Not every kernel has dummy links (this one may be a sandbox's): the runner puts
			// the address on the namespace's loopback and the proxy leaves links alone.
			p.args[i] = "--interface="
		}
	}
	if sh.advertised == "" {
		return fmt.Errorf("apiserver-proxy has no --advertised-address")
	}
	if err := run(ctx, "ip", "-n", sh.netns, "addr", "add", sh.advertised+"/32", "dev", "lo"); err != nil {
		return err
	}
	kc := clientcmdapi.NewConfig()
	kc.Clusters["in-cluster"] = &clientcmdapi.Cluster{
		Server:                   "https://" + sh.advertised + ":443",
		TLSServerName:            "localhost", // envtest's serving certificate
		CertificateAuthorityData: sh.rest.CAData,
	}
	kc.AuthInfos["in-cluster"] = &clientcmdapi.AuthInfo{ClientCertificateData: sh.rest.CertData, ClientKeyData: sh.rest.KeyData, Token: sh.rest.BearerToken}
	kc.Contexts["in-cluster"] = &clientcmdapi.Context{Cluster: "in-cluster", AuthInfo: "in-cluster"}
	kc.CurrentContext = "in-cluster"
	sh.inCluster = filepath.Join(sh.dir, "in-cluster.kubeconfig")
	if err := clientcmd.WriteToFile(*kc, sh.inCluster); err != nil {
		return err
	}
	_, err = s.procs.Start(manifest.APIServerProxyName+" "+sh.namespace, filepath.Join(sh.dir, "apiserver-proxy.log"), procgroup.Options{Netns: sh.netns}, filepath.Join(s.cfg.BinDir, p.binary), p.args...)
	return err
}

// checkInCluster: kubectl in the shoot's node namespace reaches kube-apiserver's advertised
// address, held by apiserver-proxy, which forwards through the ingress's PROXY listener.
func (s *seed) checkInCluster(ctx context.Context, sh *shoot) (string, error) {
	if sh.netns == "" {
		return skipped, nil
	}
	ctx, cancel := context.WithTimeout(ctx, 15*time.Second)
	defer cancel()
	out, err := exec.CommandContext(ctx, "ip", "netns", "exec", sh.netns, filepath.Join(s.assets, "kubectl"), "--kubeconfig", sh.inCluster,
		"get", "namespaces", "-o", "name").CombinedOutput()
	if err != nil {
		return "", fmt.Errorf("kubectl in the node namespace: %v: %s", err, strings.TrimSpace(string(out)))
	}
	if !strings.Contains(string(out), "namespace/kube-system") {
		return "", fmt.Errorf("no kube-system in %q", out)
	}
	return fmt.Sprintf("kubectl → %s:443 (apiserver-proxy) → PROXY %s: get namespaces ok", sh.advertised, s.cfg.ProxyAddress), nil
}

// skipped is the detail of a check that needs root.
const skipped = "skipped: needs root (network namespaces)"
