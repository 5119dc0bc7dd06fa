// Command tendril-local runs the local seed for `make run` (package localseed): a seed API
// server with tendril's control plane and tendril-ingress, and two shoots with their own
// kube-apiservers, tendril-server and tendril-agent started from the objects the extension
// created. It checks every path per shoot, prints the network-path table (Gardener's
// NetworkPolicy controllers over its objects) and how to reach the shoots, and keeps running
// with a status line per shoot until interrupted (--once: check, report, exit 0 or 1; 1 also
// when a wanted path is denied or a cross-shoot path allowed), stopping everything it started.
package main

import (
	"context"
	"flag"
	"fmt"
	"github.com/go-logr/logr"
	"os"
	"os/signal"
	ctrllog "sigs.k8s.io/controller-runtime/pkg/log"
	"strings"
	"syscall"
	"time"

	"github.com/tendril-net/tendril/internal/kube/kubeenv"
	"github.com/tendril-net/tendril/internal/proc/buildinfo"
	"github.com/tendril-net/tendril/localseed"
	"github.com/tendril-net/tendril/realseed"
)

func main() {
	var cfg localseed.Config
	var shoots string
	// Our own flag set: a dependency of Gardener's (VictoriaMetrics' buildinfo) registers
	// -version on the global one.
	fs := flag.NewFlagSet("tendril-local", flag.ExitOnError)
	fs.StringVar(&cfg.BinDir, "bin-dir", "", "directory holding tendril-ingress, tendril-server and tendril-agent (default: the one tendril-local is in, as make build puts them)")
	fs.StringVar(&cfg.TestbinDir, "testbin-dir", "", "directory holding kube-apiserver, etcd and kubectl (default: where make testbin builds them, ${XDG_CACHE_HOME:-$HOME/.cache}/tendril/testbin/k8s-"+kubeenv.KubernetesVersion+"-etcd-"+kubeenv.EtcdVersion+"-static)")
	fs.StringVar(&cfg.Dir, "dir", "", "working directory for certificates, kubeconfigs, secrets and logs (default: a new temporary directory, removed at the end)")
	fs.StringVar(&cfg.SNIAddress, "sni-address", "127.0.0.1:9443", "ingress SNI listener (kubectl reaches the shoots here)")
	fs.StringVar(&cfg.ProxyAddress, "proxy-address", "127.0.0.1:9444", "ingress PROXY listener")
	fs.StringVar(&cfg.TunnelAddress, "tunnel-address", "127.0.0.1:9132", "ingress tunnel listener (the agents dial it)")
	fs.StringVar(&cfg.XDSAddress, "xds-address", "127.0.0.1:18000", "xDS server address")
	fs.StringVar(&cfg.IngressMetrics, "ingress-metrics-address", "127.0.0.1:18081", "tendril-ingress metrics and probes")
	fs.StringVar(&shoots, "shoots", "alpha,beta", "shoot names (project local)")
	haShoots := fs.String("ha-shoots", "", "comma-separated shoots (of --shoots) that run two tunnel agents (providerConfig highAvailability.agents: 2)")
	fs.BoolVar(&cfg.Once, "once", false, "run the checks once and exit: 0 when all pass, 1 otherwise")
	fs.DurationVar(&cfg.StatusInterval, "status-interval", 10*time.Second, "how often to print the status lines")
	realSeed := fs.Bool("real", false, "run a real single-node seed cluster on this machine instead (make seed; root, Debian's containerd and friends, make seedbin): kubelet, containerd, kube-proxy, kube-router, CoreDNS, a local registry")
	seedbinDir := fs.String("seedbin-dir", "", "with --real: directory holding kubelet, kube-proxy, kube-controller-manager, kube-scheduler, kube-router and coredns (default: where make seedbin builds them)")
	realWatch := fs.Duration("real-watch", time.Minute, "with --real --once: how long the check of the per-request shoot holds a watch through the terminating ingress, across a serving-certificate rotation")
	realDir := fs.String("real-dir", "", "with --real: the cluster's state directory, emptied at start (default "+realseed.DefaultDir+")")
	version := fs.Bool("version", false, "print the version and exit")
	_ = fs.Parse(os.Args[1:]) // ExitOnError
	if *version {
		fmt.Println(buildinfo.String("tendril-local"))
		return
	}
	cfg.Shoots = strings.Split(shoots, ",")
	if *haShoots != "" {
		cfg.HAShoots = strings.Split(*haShoots, ",")
	}
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	if *realSeed {
		// Gardener's controllers that the real seed runs in-process (the seed's resource
		// manager) log through controller-runtime's logger: their errors reach the report.
		ctrllog.SetLogger(logr.Discard())
		err := realseed.Run(ctx, realseed.Config{Dir: *realDir, TestbinDir: cfg.TestbinDir, SeedbinDir: *seedbinDir, BinDir: cfg.BinDir, Out: os.Stdout, WatchFor: *realWatch}, cfg.Once)
		if err != nil {
			fmt.Fprintln(os.Stderr, "tendril-local:", err)
			stop()
			os.Exit(1)
		}
		return
	}
	rep, err := localseed.Run(ctx, cfg)
	if err != nil {
		fmt.Fprintln(os.Stderr, "tendril-local:", err)
		os.Exit(1)
	}
	if cfg.Once && !rep.OK() {
		fmt.Fprintln(os.Stderr, "tendril-local: a check or a network path failed")
		os.Exit(1)
	}
}
