package realseed

import (
	"cmp"
	"context"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"time"

	tendrilv1alpha1 "github.com/tendril-net/tendril/apis/tendril/v1alpha1"
	"github.com/tendril-net/tendril/extension/manifest"
)

// Run starts the cluster, says how to reach it and how long each step took, and then, with
// once, stops it again; without, it keeps it running until ctx ends or one of its processes
// ends on its own, and stops it then.
func Run(ctx context.Context, cfg Config, once bool) (err error) {
	c, err := Start(ctx, cfg)
	if err != nil {
		return err
	}
	defer func() {
		if serr := c.Stop(context.WithoutCancel(ctx)); serr != nil && err == nil {
			err = fmt.Errorf("stop: %w", serr)
		}
	}()
	out := c.cfg.Out
	t0 := time.Now()
	inst, err := c.InstallTendril(ctx, Release{})
	if err != nil {
		return fmt.Errorf("install tendril: %w", err)
	}
	fmt.Fprintf(out, "[%5.1fs] tendril installed in %.1f s: %s from chart %s, namespace %s\n", time.Since(c.started).Seconds(), time.Since(t0).Seconds(), inst.Image, inst.Chart, inst.Namespace)
	fmt.Fprintf(out, "real seed ready after %.1f s; memory of the whole set %.0f MiB RSS\n", time.Since(c.started).Seconds(), float64(c.RSS())/(1<<20))
	fmt.Fprintf(out, "  kubectl --kubeconfig %s get pods -A\n", c.Kubeconfig)
	fmt.Fprintf(out, "  registry http://%s, logs %s\n", c.Registry, c.path("logs"))
	var shoots []*Shoot
	for _, sc := range Shoots {
		s, err := c.StartShoot(ctx, inst, sc)
		if err != nil {
			return err
		}
		if _, err := c.StartWorkload(ctx, s); err != nil {
			return err
		}
		fmt.Fprintf(out, "[%5.1fs] shoot %s ready: first kubectl logs through the tunnel %.1f s after its Extension, %.1f s after the agent started; kubectl --kubeconfig %s get pods -A\n",
			time.Since(c.started).Seconds(), s.cfg.Name, s.FirstLogs.Sub(s.Created).Seconds(), s.FirstLogs.Sub(s.AgentStarted).Seconds(), s.Kubeconfig)
		shoots = append(shoots, s)
	}
	failed := c.check(ctx, inst, shoots)
	if once && failed > 0 {
		return fmt.Errorf("%d of the real seed's checks failed", failed)
	}
	if once {
		return nil
	}
	select {
	case <-ctx.Done():
		return nil
	case err := <-c.Exited():
		return err
	}
}

// Shoots are make seed's shoots: one for each of kube-apiserver's egress modes through
// tendril-server's own front-ends.
var Shoots = []ShootConfig{
	{Name: "a", Index: 1, Egress: tendrilv1alpha1.EgressHTTPConnect},
	// Per-request balancing: the ingress terminates its API traffic (kubectl's certificate,
	// the kubelet's token, exec and port-forward upgrades).
	{Name: "b", Index: 2, Egress: tendrilv1alpha1.EgressGRPC, PerRequest: true},
	// Highly available: two tendril-server replicas and two agents, kube-apiserver's egress the
	// extension's default for it (httpConnectRelay: the relay races the replicas).
	{Name: "c", Index: 3, HighAvailability: true},
}

// failover is a pod Failover replaces.
type failover struct {
	inShoot  bool
	ns, name string
	// pod, if set, is the one pod of workload name that is deleted (a StatefulSet's replica),
	// else every pod of the Deployment name.
	pod string
}

// failovers are the shoot's tunnel ends: tendril-server in the seed, the agent in the shoot.
// A highly available shoot loses one tendril-server replica of two, the first.
func failovers(s *Shoot) []failover {
	server := failover{false, s.Namespace, manifest.ServerName, ""}
	if s.cfg.HighAvailability {
		server.pod = manifest.ServerName + "-0"
	}
	return []failover{server, {true, manifest.ShootNamespace, manifest.AgentObjectName(0), ""}}
}

// execRounds is how many kubectl execs each side of ExecComparison takes the median of.
const execRounds = 10

// check runs the real seed's checks, prints a line for each and returns how many failed.
func (c *Cluster) check(ctx context.Context, inst *Installation, shoots []*Shoot) (failed int) {
	report := func(name string, err error, detail string) {
		if err != nil {
			failed++
			fmt.Fprintf(c.cfg.Out, "FAIL %s: %v\n", name, err)
			return
		}
		fmt.Fprintf(c.cfg.Out, "ok   %s%s\n", name, detail)
	}
	report("ingress: its load balancer refuses a server name no shoot has", c.CheckIngressRefusesUnknownName(ctx, inst), "")
	name, err := c.CheckIngressName(ctx, inst)
	report("DNS: the cluster resolves the ingress's DNSRecord "+name+" to its load balancer", err, "")
	t0 := time.Now()
	rows, err := c.MeasurePaths(ctx)
	agree := 0
	for _, r := range rows {
		if r.Measured == r.Evaluated {
			agree++
		} else if err == nil {
			err = fmt.Errorf("%s → %s :%d: the policies say %v, the connection %s", r.From, r.To, r.Port, r.Evaluated, r.Detail)
		}
	}
	report("network paths: kube-router treats each as Gardener's policies say", err,
		fmt.Sprintf(" (%d of %d paths agree, %.1f s)", agree, len(rows), time.Since(t0).Seconds()))
	lb, err := c.LoadBalancerAddress(ctx, inst.Namespace, "tendril-ingress")
	if err != nil {
		report("the ingress's load balancer address", err, "")
		return failed
	}
	for _, s := range shoots {
		use, err := c.UseTunnel(ctx, s)
		detail := ""
		if err == nil {
			var tunnel, direct time.Duration
			if tunnel, direct, err = c.ExecComparison(ctx, s, execRounds); err == nil {
				detail = fmt.Sprintf(" (%v connections through the tunnel; exec median of %d: %.1f ms, direct to a seed pod %.1f ms)",
					use.Dials, execRounds, tunnel.Seconds()*1000, direct.Seconds()*1000)
			}
		}
		report(fmt.Sprintf("shoot %s (%s%s): kubectl by %s (CoreDNS's answer): logs -f, port-forward and exec through tendril-server and the tunnel", s.cfg.Name, cmp.Or(string(s.cfg.Egress), "the extension's default"), s.balancing(), s.Host), err, detail)
		auth, err := c.CheckAuthentication(ctx, s, inst)
		detail = ""
		if err == nil {
			detail = fmt.Sprintf(" (owner %s %v, credential id %q; forged headers gave %s; %v connections terminated, %v requests stripped)",
				auth.Owner.User, auth.Owner.Groups, auth.Owner.CredentialID, auth.Forged.User, auth.Terminated, auth.Stripped)
		}
		report(fmt.Sprintf("shoot %s: kube-apiserver authenticates the owner's certificate%s and ignores forged proxy headers", s.cfg.Name, s.authenticatedBy()), err, detail)
		if s.cfg.PerRequest {
			d := cmp.Or(c.cfg.WatchFor, time.Minute)
			w, err := c.WatchThroughRotation(ctx, s, d)
			detail = ""
			if err == nil {
				detail = fmt.Sprintf(" (%d events, longest lag %.0f ms, %d connection; new certificate served %.1f s after gardenlet's)",
					w.Events, w.MaxLag.Seconds()*1000, w.Dials, w.Rotated.Seconds())
			}
			report(fmt.Sprintf("shoot %s: a %v watch through the terminating ingress outlives a serving-certificate rotation", s.cfg.Name, d), err, detail)
		}
		wh, err := c.CallWebhook(ctx, s)
		detail = ""
		if err == nil {
			detail = fmt.Sprintf(" (call median of %d: %.1f ms; %s)", webhookRounds, wh.Median.Seconds()*1000, wh.Review)
		}
		report(fmt.Sprintf("shoot %s: kube-apiserver calls a webhook on the shoot's node by its Service through the tunnel", s.cfg.Name), err, detail)
		rows, err := c.MeasureShootPaths(ctx, s, lb)
		agree := 0
		for _, r := range rows {
			if r.Measured == r.Evaluated && r.Evaluated == r.Want {
				agree++
			} else if err == nil {
				err = fmt.Errorf("%s → %s :%d: wanted %v, the policies say %v, the connection %s", r.From, r.To, r.Port, r.Want, r.Evaluated, r.Detail)
			}
		}
		report(fmt.Sprintf("shoot %s: network paths of its kube-system: kube-router on its node treats each as the policies say", s.cfg.Name), err,
			fmt.Sprintf(" (%d of %d paths agree)", agree, len(rows)))
		for _, f := range failovers(s) {
			res, err := c.Failover(ctx, s, f)
			detail := ""
			if err == nil {
				detail = fmt.Sprintf(": %d of %d log reads failed, outage %.1f s", res.Failed, res.Calls, res.Outage.Seconds())
			}
			report(fmt.Sprintf("shoot %s: %s pod deleted, the tunnel carries logs again", s.cfg.Name, f.what()), err, detail)
		}
	}
	// The chart's heartbeat is every 30 s: a renewal comes within a minute.
	report("tendril-seed under its chart's RBAC: heartbeat renewed, nothing refused", c.CheckSeedUnderRBAC(ctx, inst, time.Minute), "")
	return failed
}

// RSS is the resident memory of every process of the cluster: the daemons Start ran, the
// containerd shims, every container, and this process (Gardener's controllers run in it).
func (c *Cluster) RSS() int64 {
	pids := map[int]bool{os.Getpid(): true}
	for name := range c.ended {
		if pid, ok := c.procs.Pid(name); ok && c.running(name) {
			pids[pid] = true
		}
	}
	procs, _ := filepath.Glob("/proc/[0-9]*/cmdline")
	for _, p := range procs {
		b, err := os.ReadFile(p)
		if err != nil || !strings.Contains(string(b), c.containerdSocket()) {
			continue
		}
		if pid, err := strconv.Atoi(filepath.Base(filepath.Dir(p))); err == nil {
			pids[pid] = true
		}
	}
	for _, pid := range cgroupPids("/sys/fs/cgroup/memory/kubepods") {
		pids[pid] = true
	}
	var total int64
	for pid := range pids {
		b, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", pid))
		if err != nil {
			continue
		}
		for _, line := range strings.Split(string(b), "\n") {
			if f := strings.Fields(line); len(f) >= 2 && f[0] == "VmRSS:" {
				kb, _ := strconv.ParseInt(f[1], 10, 64)
				total += kb << 10
			}
		}
	}
	return total
}
