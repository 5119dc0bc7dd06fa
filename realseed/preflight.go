package realseed

import (
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"

	"github.com/tendril-net/tendril/internal/kube/kubeenv"
)

// The versions hack/seedbin.sh builds by default (its K8S, KUBE_ROUTER and COREDNS);
// TestSeedbinDirMatchesScript holds them in step.
const (
	KubeRouterVersion = "v2.1.0"
	CoreDNSVersion    = "v1.14.7"
)

// SeedbinBinaries are the files a seedbin directory holds.
var SeedbinBinaries = []string{"kubelet", "kube-proxy", "kube-controller-manager", "kube-scheduler", "kube-router", "coredns"}

// DefaultSeedbinDir is where hack/seedbin.sh (make seedbin) puts the binaries when SEEDBIN_DIR
// is unset.
func DefaultSeedbinDir() (string, error) {
	cache, err := os.UserCacheDir()
	if err != nil {
		return "", fmt.Errorf("cache directory of hack/seedbin.sh: %w", err)
	}
	return filepath.Join(cache, "tendril", "seedbin", "k8s-"+kubeenv.KubernetesVersion+"-kube-router-"+KubeRouterVersion+"-coredns-"+CoreDNSVersion+"-static"), nil
}

// cniBinDir is where Debian's containernetworking-plugins puts the plugins.
const cniBinDir = "/usr/lib/cni"

// Packages is the apt line that installs the machine's part of the real seed.
const Packages = "containerd runc containernetworking-plugins iptables ipset nftables conntrack docker-registry"

// ErrNotRoot and ErrNoTools say the machine cannot run a real seed at all (a test skips on
// them); a missing binary of make testbin or make seedbin is an error of its own.
var (
	ErrNotRoot = errors.New("the real seed needs root (network namespaces, iptables, cgroups, mounts)")
	ErrNoTools = errors.New("the real seed needs Debian's packages: apt-get install --no-install-recommends " + Packages)
)

// tools are the programs the node's daemons run or Start and Stop call.
var tools = []string{"containerd", "containerd-shim-runc-v2", "runc", "ctr", "iptables", "iptables-save", "iptables-restore", "ipset", "nft", "conntrack", "docker-registry", "ip", "nsenter", "unshare", "mount"}

var cniPlugins = []string{"bridge", "host-local", "portmap", "loopback"}

// Preflight checks, before anything is started, that the machine and the configured
// directories hold everything Start runs, and names what is missing.
func Preflight(cfg Config) error {
	if os.Geteuid() != 0 {
		return ErrNotRoot
	}
	var missing []string
	for _, t := range tools {
		if _, err := exec.LookPath(t); err != nil {
			missing = append(missing, t)
		}
	}
	for _, p := range cniPlugins {
		if _, err := os.Stat(filepath.Join(cniBinDir, p)); err != nil {
			missing = append(missing, filepath.Join(cniBinDir, p))
		}
	}
	if len(missing) > 0 {
		return fmt.Errorf("%w (missing: %s)", ErrNoTools, strings.Join(missing, ", "))
	}
	if err := kubeenv.CheckTestbin(cfg.TestbinDir); err != nil {
		return err
	}
	for _, b := range SeedbinBinaries {
		if _, err := os.Stat(filepath.Join(cfg.SeedbinDir, b)); err != nil {
			return fmt.Errorf("%s is not in %s: run `make seedbin` (hack/seedbin.sh builds kubelet, kube-proxy, kube-controller-manager, kube-scheduler, kube-router and CoreDNS from the Go module proxy, once)", b, cfg.SeedbinDir)
		}
	}
	for _, b := range []string{"tendril-pause", "tendril-probe"} {
		if _, err := os.Stat(filepath.Join(cfg.BinDir, b)); err != nil {
			return fmt.Errorf("%s is not in %s: run `make build`", b, cfg.BinDir)
		}
	}
	return nil
}
