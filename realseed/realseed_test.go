package realseed

import (
	"context"
	"errors"
	"flag"
	"maps"
	"net"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/go-logr/logr"
	"github.com/vishvananda/netlink"
	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"sigs.k8s.io/controller-runtime/pkg/client"
	ctrllog "sigs.k8s.io/controller-runtime/pkg/log"

	"github.com/tendril-net/tendril/extension/manifest"
	"github.com/tendril-net/tendril/internal/host/sysctl"
	"github.com/tendril-net/tendril/internal/testing/kubetest"
)

// testConfig is the configuration of a real seed for a test: the testbin and seedbin
// directories the scripts fill (built here when missing, as kubetest does for envtest) and the
// binaries make build puts in the repository's bin/.
func testConfig(t *testing.T) Config {
	t.Helper()
	root := kubetest.RepoRoot(t)
	cfg := Config{Dir: filepath.Join(t.TempDir(), "seed"), BinDir: filepath.Join(root, "bin"), Out: testWriter{t}}
	// Skip before building anything on a machine that cannot run it at all.
	if err := Preflight(Config{TestbinDir: "/nonexistent"}); errors.Is(err, ErrNotRoot) || errors.Is(err, ErrNoTools) {
		t.Skipf("no real seed here: %v", err)
	}
	for _, s := range []struct {
		script string
		dir    *string
	}{{"hack/testbin.sh", &cfg.TestbinDir}, {"hack/seedbin.sh", &cfg.SeedbinDir}} {
		out, err := exec.Command(filepath.Join(root, s.script)).Output()
		if err != nil {
			t.Fatalf("%s: %v", s.script, err)
		}
		lines := strings.Split(strings.TrimSpace(string(out)), "\n")
		*s.dir = lines[len(lines)-1]
	}
	return cfg
}

type testWriter struct{ t *testing.T }

func (w testWriter) Write(p []byte) (int, error) {
	w.t.Log(strings.TrimRight(string(p), "\n"))
	return len(p), nil
}

var update = flag.Bool("update", false, "rewrite docs/network-paths-measured.md")

func TestMain(m *testing.M) {
	ctrllog.SetLogger(logr.Discard()) // Gardener's controllers log through it
	os.Exit(m.Run())
}

// TestRealSeed brings the cluster up on this machine and checks what Start does not: the
// LoadBalancer shim, restricted Pod Security enforced by kube-apiserver; then that Stop leaves
// the machine as it found it.
func TestRealSeed(t *testing.T) {
	cfg := testConfig(t)
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Minute)
	defer cancel()
	// A run killed before (a test's timeout) left the machine changed; what it found counts.
	if err := RecoverKilledRun(cfg.Out); err != nil {
		t.Fatal(err)
	}
	before := machineState(t)
	c, err := Start(ctx, cfg)
	if err != nil {
		t.Fatal(err)
	}
	stopped := false
	defer func() {
		if !stopped {
			_ = c.Stop(context.Background())
		}
	}()

	t.Run("LoadBalancer", func(t *testing.T) {
		svc := &corev1.Service{ObjectMeta: metav1.ObjectMeta{Name: "lb", Namespace: "default"}, Spec: corev1.ServiceSpec{
			Type: corev1.ServiceTypeLoadBalancer, Selector: map[string]string{"app": "none"},
			Ports: []corev1.ServicePort{{Port: 18443}}}}
		if err := c.Client.Create(ctx, svc); err != nil {
			t.Fatal(err)
		}
		lctx, lcancel := context.WithTimeout(ctx, 30*time.Second)
		defer lcancel()
		ip, err := c.LoadBalancerAddress(lctx, "default", "lb")
		if err != nil {
			t.Fatal(err)
		}
		if ip != c.NodeIP.String() {
			t.Fatalf("load-balancer address %s, want the node's %s", ip, c.NodeIP)
		}
	})

	t.Run("RestrictedPodSecurity", func(t *testing.T) {
		ns := &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: "restricted", Labels: map[string]string{"pod-security.kubernetes.io/enforce": "restricted"}}}
		if err := c.Client.Create(ctx, ns); err != nil {
			t.Fatal(err)
		}
		yes := true
		pod := &corev1.Pod{ObjectMeta: metav1.ObjectMeta{Name: "privileged", Namespace: ns.Name}, Spec: corev1.PodSpec{
			Containers: []corev1.Container{{Name: "c", Image: c.pauseImage, SecurityContext: &corev1.SecurityContext{Privileged: &yes}}}}}
		err := c.Client.Create(ctx, pod)
		if err == nil || !strings.Contains(err.Error(), `violates PodSecurity "restricted`) {
			t.Fatalf("a privileged pod in a restricted namespace: %v", err)
		}
	})

	var inst *Installation
	t.Run("InstallTendril", func(t *testing.T) {
		// A heartbeat every 2 s (the chart's default is 30 s): the RBAC check below sees it beat.
		var err error
		inst, err = c.InstallTendril(ctx, Release{Values: map[string]any{"heartbeat": map[string]any{"renewIntervalSeconds": 2}}})
		if err != nil {
			t.Fatal(err)
		}
		t.Logf("installed %s from %s in %s", inst.Image, inst.Chart, inst.Namespace)
		want, err := os.ReadFile(filepath.Join(cfg.BinDir, "image", "digest"))
		if err != nil {
			t.Fatal(err)
		}
		if !strings.HasSuffix(inst.Image, "@"+strings.TrimSpace(string(want))) {
			t.Errorf("pods run %s, make image built %s", inst.Image, want)
		}
		if err := c.CheckIngressRefusesUnknownName(ctx, inst); err != nil {
			t.Fatal(err)
		}
	})

	if inst == nil {
		t.Fatal("tendril is not installed")
	}
	t.Run("IngressName", func(t *testing.T) {
		name, err := c.CheckIngressName(ctx, inst)
		if err != nil {
			t.Fatal(err)
		}
		t.Logf("%s resolves to the ingress's load balancer", name)
	})

	t.Run("TendrilSeedUnderItsRBAC", func(t *testing.T) {
		// The heartbeat renews its Lease, and nothing tendril-seed does is refused by the
		// chart's RBAC (envtest runs it as admin; here it has its service account).
		if err := c.CheckSeedUnderRBAC(ctx, inst, time.Minute); err != nil {
			t.Fatal(err)
		}
	})

	t.Run("NetworkPoliciesEnforced", func(t *testing.T) {
		// Gardener's NetworkPolicy controllers wrote deny-all and the Service-annotation
		// policies; kube-router drops what they do not allow.
		ns := "extension-" + ControllerInstallation
		var xds corev1.Service
		if err := c.Client.Get(ctx, client.ObjectKey{Namespace: ns, Name: "tendril-xds"}, &xds); err != nil {
			t.Fatal(err)
		}
		target := net.JoinHostPort(xds.Spec.ClusterIP, "18000")
		for _, p := range []struct {
			name   string
			labels map[string]string
			want   bool
		}{
			{"unlabelled", nil, false},
			{"to-xds", map[string]string{"networking.resources.gardener.cloud/to-tendril-xds-tcp-18000": "allowed"}, true},
		} {
			if _, err := c.ProbePod(ctx, ns, "probe-"+p.name, p.labels, 8080); err != nil {
				t.Fatal(err)
			}
			// kube-router puts a new pod into its policies' ipsets on its next sync, which on a
			// loaded machine comes seconds later: until then the allowed pod is still denied.
			var open bool
			var detail string
			for deadline := time.Now().Add(15 * time.Second); ; {
				var err error
				if open, detail, err = c.Dial(ctx, ns, "probe-"+p.name, target, 2*time.Second); err != nil {
					t.Fatal(err)
				}
				if open || !p.want || time.Now().After(deadline) {
					break
				}
				time.Sleep(500 * time.Millisecond)
			}
			if open != p.want {
				t.Errorf("%s pod -> tendril-xds %s: open %v (%s), want %v", p.name, target, open, detail, p.want)
			}
		}
	})

	var seedRows, shootRows []PathRow
	t.Run("NetworkPathsMeasured", func(t *testing.T) {
		rows, err := c.MeasurePaths(ctx)
		if err != nil {
			t.Fatal(err)
		}
		for _, r := range rows {
			if r.Measured != r.Evaluated {
				t.Errorf("%s → %s :%d (%s): the policies say %v, the connection %s", r.From, r.To, r.Port, r.Why, r.Evaluated, r.Detail)
			}
		}
		seedRows = rows
	})

	t.Run("WrongImageDigest", func(t *testing.T) {
		// An image the registry does not have fails the wait at once, naming it, instead of
		// waiting out the deadline while kubelet backs off.
		repo, _, _ := strings.Cut(inst.Image, "@")
		bad := repo + "@sha256:" + strings.Repeat("0", 64)
		ns := &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: "wrong-digest"}}
		if err := c.Client.Create(ctx, ns); err != nil {
			t.Fatal(err)
		}
		labels := map[string]string{"app": "wrong-digest"}
		d := &appsv1.Deployment{ObjectMeta: metav1.ObjectMeta{Name: "wrong-digest", Namespace: ns.Name}, Spec: appsv1.DeploymentSpec{
			Selector: &metav1.LabelSelector{MatchLabels: labels},
			Template: corev1.PodTemplateSpec{ObjectMeta: metav1.ObjectMeta{Labels: labels},
				Spec: corev1.PodSpec{Containers: []corev1.Container{{Name: "c", Image: bad}}}}}}
		if err := c.Client.Create(ctx, d); err != nil {
			t.Fatal(err)
		}
		err := c.waitFor(ctx, "kubelet", "wrong-digest Ready", 3*time.Minute, func(ctx context.Context) error {
			return c.deploymentReady(ctx, ns.Name, d.Name, bad)
		})
		if err == nil || !strings.Contains(err.Error(), bad) || !strings.Contains(err.Error(), "ErrImagePull") && !strings.Contains(err.Error(), "ImagePullBackOff") {
			t.Fatalf("deployment of a digest the registry lacks: %v", err)
		}
		t.Log(err)
	})

	var node1 *Node
	t.Run("SecondNode", func(t *testing.T) {
		// A kubelet with its own containerd in a network namespace of its own: what a shoot's
		// node will be (here registered with the seed).
		n, err := c.StartNode(ctx, NodeConfig{Name: "tendril-node-1", Index: 1, PodCIDR: "10.244.1.0/24"})
		if err != nil {
			t.Fatal(err)
		}
		ip, err := c.ProbePodOn(ctx, "tendril-node-1", "default", "on-node-1", nil, 8080)
		if err != nil {
			t.Fatal(err)
		}
		if !strings.HasPrefix(ip, "10.244.1.") {
			t.Errorf("pod on the second node has address %s, want one of its bridge's 10.244.1.0/24", ip)
		}
		// kube-apiserver → that kubelet (exec), and the pod → a pod on the first node.
		var dns corev1.PodList
		if err := c.Client.List(ctx, &dns, client.InNamespace("kube-system"), client.MatchingLabels{"k8s-app": "kube-dns"}); err != nil || len(dns.Items) == 0 {
			t.Fatalf("CoreDNS pod: %v", err)
		}
		open, detail, err := c.Dial(ctx, "default", "on-node-1", net.JoinHostPort(dns.Items[0].Status.PodIP, "8053"), 2*time.Second)
		if err != nil || !open {
			t.Fatalf("pod on %s (%s) → CoreDNS pod on the first node: %v %s", n.IP, ip, err, detail)
		}
		// It runs no kube-proxy and no kube-router: the seed's workloads (the shoots' control
		// planes below) stay on the first node.
		if _, err := c.setSchedulable(ctx, map[string]bool{n.cfg.Name: false}); err != nil {
			t.Fatal(err)
		}
		node1 = n
	})

	// make seed's shoots: control planes in the seed mutated by tendril's webhook, a node each
	// registered through the ingress, and kubectl logs -f, port-forward and exec through
	// tendril-server and the tunnel, for each egress mode.
	for _, sc := range Shoots {
		name := string(sc.Egress)
		if sc.PerRequest {
			name += "PerRequest"
		}
		if sc.HighAvailability {
			name = "highAvailability"
		}
		t.Run("Shoot/"+name, func(t *testing.T) {
			s, err := c.StartShoot(ctx, inst, sc)
			if err != nil {
				t.Fatal(err)
			}
			pod, err := c.StartWorkload(ctx, s)
			if err != nil {
				t.Fatal(err)
			}
			if !s.Pods.Contains(netip.MustParseAddr(pod.Status.PodIP)) {
				t.Errorf("workload address %s, want one of the shoot's pods %s", pod.Status.PodIP, s.Pods)
			}
			use, err := c.UseTunnel(ctx, s)
			if err != nil {
				t.Fatal(err)
			}
			t.Logf("first kubectl logs through the tunnel %s after the Extension, %s after the agent started",
				s.FirstLogs.Sub(s.Created).Round(10*time.Millisecond), s.FirstLogs.Sub(s.AgentStarted).Round(10*time.Millisecond))
			t.Logf("port-forward read %q; logs -f printed %q; kubectl exec printed %q in %s; tendril-server dialled %v times",
				use.Greeting, use.LogLine, use.ExecOut, use.Exec.Round(time.Millisecond), use.Dials)
			auth, err := c.CheckAuthentication(ctx, s, inst)
			if err != nil {
				t.Fatal(err)
			}
			t.Logf("whoami: %s %v, credential id %q; with forged proxy headers: %s %v; the ingress terminated %v connections, stripped %v requests",
				auth.Owner.User, auth.Owner.Groups, auth.Owner.CredentialID, auth.Forged.User, auth.Forged.Groups, auth.Terminated, auth.Stripped)
			if sc.PerRequest {
				w, err := c.WatchThroughRotation(ctx, s, 30*time.Second)
				if err != nil {
					t.Fatal(err)
				}
				t.Logf("watch through a serving-certificate rotation: %d events, longest lag %s, %d connection; the new certificate served %s after gardenlet's",
					w.Events, w.MaxLag.Round(time.Millisecond), w.Dials, w.Rotated.Round(100*time.Millisecond))
			}
			wh, err := c.CallWebhook(ctx, s)
			if err != nil {
				t.Fatal(err)
			}
			t.Logf("webhook: %s; the webhook logged %q; call median of %d: %s; tendril-server dialled %v times",
				wh.Denial, wh.Review, webhookRounds, wh.Median.Round(100*time.Microsecond), wh.Dials)
			tunnel, direct, err := c.ExecComparison(ctx, s, execRounds)
			if err != nil {
				t.Fatal(err)
			}
			t.Logf("exec, median of %d: %s through the tunnel, %s direct to a seed pod (%.2f×)", execRounds,
				tunnel.Round(time.Millisecond), direct.Round(time.Millisecond), tunnel.Seconds()/direct.Seconds())
			lb, err := c.LoadBalancerAddress(ctx, inst.Namespace, "tendril-ingress")
			if err != nil {
				t.Fatal(err)
			}
			rows, err := c.MeasureShootPaths(ctx, s, lb)
			if err != nil {
				t.Fatal(err)
			}
			for _, r := range rows {
				if r.Measured != r.Evaluated || r.Evaluated != r.Want {
					t.Errorf("%s → %s :%d (%s): wanted %v, the policies say %v, the connection %s", r.From, r.To, r.Port, r.Why, r.Want, r.Evaluated, r.Detail)
				}
			}
			if sc.Name == Shoots[0].Name {
				shootRows = rows
			}
			for _, f := range failovers(s) {
				res, err := c.Failover(ctx, s, f)
				if err != nil {
					t.Fatal(err)
				}
				t.Logf("%s pod deleted: %d of %d log reads through the tunnel failed, outage %s", f.what(), res.Failed, res.Calls, res.Outage.Round(10*time.Millisecond))
			}
			if sc.HighAvailability && node1 != nil {
				// A replica's node lost (not its pod deleted): the other replica carries the
				// calls while Kubernetes has not noticed yet, and after.
				pod := manifest.ServerName + "-1"
				res, err := c.NodeLoss(ctx, s, pod, node1)
				if err != nil {
					t.Fatal(err)
				}
				t.Logf("node %s of %s lost for %s: NotReady after %s, the pod not Ready after %s", node1.cfg.Name, pod,
					res.Window.Round(100*time.Millisecond), res.NodeNotReady.Round(100*time.Millisecond), res.PodNotReady.Round(100*time.Millisecond))
				for _, k := range []struct {
					name string
					cs   CallStats
				}{{"log reads", res.Logs}, {"execs", res.Exec}, {"webhook calls", res.Webhook}} {
					t.Logf("%s: %s", k.name, k.cs)
					if k.cs.Unnoticed == 0 {
						t.Errorf("%s: none passed while the lost node's replica was still published", k.name)
					}
				}
			}
		})
	}

	t.Run("NetworkPathsDocument", func(t *testing.T) {
		if seedRows == nil || shootRows == nil {
			t.Skip("a measurement failed above")
		}
		doc := PathsDocument(seedRows, shootRows)
		t.Log("\n" + doc)
		path := filepath.Join(kubetest.RepoRoot(t), "docs", "network-paths-measured.md")
		if *update {
			if err := os.WriteFile(path, []byte(doc), 0o644); err != nil {
				t.Fatal(err)
			}
			return
		}
		if old, err := os.ReadFile(path); err != nil || string(old) != doc {
			t.Errorf("docs/network-paths-measured.md is stale (go test ./realseed -run TestRealSeed -update, as root): %v", err)
		}
	})

	if err := c.Stop(context.Background()); err != nil {
		t.Errorf("stop: %v", err)
	}
	stopped = true
	after := machineState(t)
	for k, v := range before {
		if after[k] != v {
			t.Errorf("after Stop %s is %q, before Start it was %q", k, after[k], v)
		}
	}

	// The same as the shipped binary runs it (make seed SEED_ARGS=--once): bin/ is make
	// build's, the image make image's; from a directory of its own.
	t.Run("TendrilLocalRealOnce", func(t *testing.T) {
		// A short state directory: kubelet's and containerd's Unix sockets live under it, and a
		// socket path may have at most 107 bytes (this test's TempDir takes 55 of them).
		dir, err := os.MkdirTemp("/var/tmp", "rs")
		if err != nil {
			t.Fatal(err)
		}
		defer os.RemoveAll(dir)
		cmd := exec.CommandContext(ctx, filepath.Join(cfg.BinDir, "tendril-local"), "--real", "--once",
			"--testbin-dir", cfg.TestbinDir, "--seedbin-dir", cfg.SeedbinDir, "--real-dir", filepath.Join(dir, "seed"))
		cmd.Dir = t.TempDir()
		out, err := cmd.CombinedOutput()
		if err != nil {
			t.Fatalf("tendril-local --real --once: %v\n%s", err, out)
		}
		oks := 0
		for _, l := range strings.Split(string(out), "\n") {
			if strings.HasPrefix(l, "ok   ") {
				oks++
				t.Log(l)
			}
		}
		want := 4
		for _, sc := range Shoots {
			// tunnel use, authentication, webhook, paths, the failovers, and the watch of a
			// shoot with per-request balancing.
			want += 4 + len(failovers(&Shoot{cfg: sc}))
			if sc.PerRequest {
				want++
			}
		}
		if oks != want || strings.Contains(string(out), "FAIL ") {
			t.Fatalf("%d checks ok, want %d:\n%s", oks, want, out)
		}
		if after := machineState(t); !maps.Equal(after, before) {
			t.Errorf("after tendril-local --real --once the machine differs: %v, before %v", after, before)
		}
	})
}

// machineState is what Start changes on the machine and Stop must put back.
func machineState(t *testing.T) map[string]string {
	t.Helper()
	s := map[string]string{}
	for _, k := range touchedSysctls {
		v, _ := sysctl.Get(k)
		s["sysctl "+k] = v
	}
	_, err := netlink.LinkByName(Bridge)
	s["link "+Bridge] = map[bool]string{true: "present", false: "absent"}[err == nil]
	tables, err := nftTables()
	if err != nil {
		t.Fatal(err)
	}
	s["nft tables"] = strings.Join(tables, ",")
	sets, err := ipsets()
	if err != nil {
		t.Fatal(err)
	}
	s["ipsets"] = strings.Join(sets, ",")
	// Only the cluster's own: other tests of make test make namespaces and links meanwhile.
	nss, _ := filepath.Glob("/run/netns/tendril-node-*")
	world, _ := filepath.Glob("/run/netns/" + worldNetns)
	s["network namespaces"] = strings.Join(append(nss, world...), ",")
	links, err := netlink.LinkList()
	if err != nil {
		t.Fatal(err)
	}
	var names []string
	for _, l := range links {
		if n := l.Attrs().Name; strings.HasPrefix(n, "tsnode") || n == worldHostLink || n == Bridge {
			names = append(names, n)
		}
	}
	s["links"] = strings.Join(names, ",")
	cg, _ := filepath.Glob("/sys/fs/cgroup/*/kubepods")
	more, _ := filepath.Glob("/sys/fs/cgroup/*/tendril-node-*")
	cg = append(cg, more...)
	s["kubepods cgroups"] = strings.Join(cg, ",")
	shims := 0
	procs, _ := filepath.Glob("/proc/[0-9]*/cmdline")
	for _, p := range procs {
		if b, err := os.ReadFile(p); err == nil && strings.HasPrefix(filepath.Base(strings.Split(string(b), "\x00")[0]), "containerd") {
			shims++
		}
	}
	s["containerd processes"] = strings.Repeat("x", shims)
	return s
}
