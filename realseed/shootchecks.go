package realseed

import (
	"bufio"
	"bytes"
	"context"
	"fmt"
	"net"
	"os/exec"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"
	"sigs.k8s.io/controller-runtime/pkg/client"

	v1beta1constants "github.com/gardener/gardener/pkg/apis/core/v1beta1/constants"
	"github.com/tendril-net/tendril/extension/manifest"
)

// The shoot's workload: a probe pod in its default namespace that serves workloadPort, greets
// and logs every connection.
const (
	workloadName = "probe"
	workloadPort = 8080
)

// StartWorkload runs the shoot's workload on its node and returns it once it runs.
func (c *Cluster) StartWorkload(ctx context.Context, s *Shoot) (*corev1.Pod, error) {
	c.probeOnce.Do(c.pushProbe)
	if c.probeErr != nil {
		return nil, c.probeErr
	}
	pod := probePodSpec(metav1.NamespaceDefault, workloadName, s.Node.cfg.Name, c.probeImage, nil, nil,
		[]corev1.ContainerPort{{Name: "probe", ContainerPort: workloadPort}}, []int32{workloadPort})
	return c.runInShoot(ctx, s, pod)
}

// runInShoot creates pod in shoot s and returns it once it runs and is Ready.
func (c *Cluster) runInShoot(ctx context.Context, s *Shoot, pod *corev1.Pod) (*corev1.Pod, error) {
	if err := s.Client.Create(ctx, pod); err != nil {
		return nil, fmt.Errorf("shoot %s: pod %s: %w", s.cfg.Name, pod.Name, err)
	}
	var running corev1.Pod
	err := c.waitFor(ctx, "kubelet "+s.Node.cfg.Name, "pod "+pod.Name+" Ready in shoot "+s.cfg.Name, 2*time.Minute, func(ctx context.Context) error {
		if err := s.Client.Get(ctx, client.ObjectKeyFromObject(pod), &running); err != nil {
			return err
		}
		if err := c.podStuck(&running); err != nil {
			return &fatalError{err}
		}
		if running.Status.Phase != corev1.PodRunning || !podIsReady(&running) {
			return fmt.Errorf("pod %s, not Ready", running.Status.Phase)
		}
		return nil
	})
	return &running, err
}

// TunnelUse is what one round of kubectl logs -f, port-forward and exec against a shoot's
// workload saw.
type TunnelUse struct {
	// Greeting is what the workload wrote to the connection port-forward carried; LogLine the
	// line kubectl logs -f printed for that connection; ExecOut what kubectl exec printed.
	Greeting, LogLine, ExecOut string
	// Exec is how long kubectl exec took, start to end of the process.
	Exec time.Duration
	// Dials is how many more connections tendril-server opened through the tunnel meanwhile.
	Dials float64
}

// UseTunnel does what a shoot owner does with kubectl, each of which kube-apiserver carries to
// the shoot node's kubelet through its egress (tendril-server, the tunnel, the agent): it
// follows the workload's log (kubectl logs -f), connects to it through kubectl port-forward
// and reads its greeting, waits for the log to show that connection, and runs kubectl exec in
// it. tendril-server's count of connections through the tunnel must have grown by one for
// each upgraded connection (port-forward, exec).
func (c *Cluster) UseTunnel(ctx context.Context, s *Shoot) (*TunnelUse, error) {
	ctx, cancel := context.WithTimeout(ctx, time.Minute)
	defer cancel()
	before, err := c.serverDials(ctx, s)
	if err != nil {
		return nil, err
	}
	use := &TunnelUse{}
	logs := &lineWaiter{}
	follow := c.kubectl(ctx, s, "logs", "-f", workloadName)
	follow.Stdout = logs
	var stderr bytes.Buffer
	follow.Stderr = &stderr
	if err := follow.Start(); err != nil {
		return nil, err
	}
	defer func() { _ = follow.Process.Kill(); _ = follow.Wait() }()
	if _, err := logs.wait(ctx, regexp.MustCompile(`^serving `)); err != nil {
		return nil, fmt.Errorf("kubectl logs -f %s: %w (%s)", workloadName, err, strings.TrimSpace(stderr.String()))
	}

	local, stopForward, err := c.portForward(ctx, s)
	if err != nil {
		return nil, err
	}
	defer stopForward()
	conn, err := (&net.Dialer{}).DialContext(ctx, "tcp", local)
	if err != nil {
		return nil, fmt.Errorf("kubectl port-forward: connect to %s: %w", local, err)
	}
	_ = conn.SetDeadline(time.Now().Add(20 * time.Second))
	use.Greeting, err = bufio.NewReader(conn).ReadString('\n')
	conn.Close()
	if err != nil {
		return nil, fmt.Errorf("kubectl port-forward: read the workload's greeting through %s: %w", local, err)
	}
	use.Greeting = strings.TrimSpace(use.Greeting)
	if use.LogLine, err = logs.wait(ctx, regexp.MustCompile(`^accepted `)); err != nil {
		return nil, fmt.Errorf("kubectl logs -f: no line for the port-forwarded connection: %w", err)
	}

	t0 := time.Now()
	out, err := c.kubectl(ctx, s, "exec", workloadName, "--", "/tendril-probe", "--version").CombinedOutput()
	use.Exec = time.Since(t0)
	use.ExecOut = strings.TrimSpace(string(out))
	if err != nil {
		return nil, fmt.Errorf("kubectl exec: %w: %s", err, use.ExecOut)
	}
	if !strings.HasPrefix(use.ExecOut, "tendril-probe") {
		return nil, fmt.Errorf("kubectl exec printed %q, want tendril-probe's version", use.ExecOut)
	}
	after, err := c.serverDials(ctx, s)
	if err != nil {
		return nil, err
	}
	// port-forward and exec are upgraded connections of their own; the log may come over a
	// connection to the kubelet that kube-apiserver keeps from an earlier request.
	if use.Dials = after - before; use.Dials < 2 {
		return nil, fmt.Errorf("tendril-server opened %v connections through the tunnel for port-forward and exec, want at least 2: kube-apiserver did not use its egress", use.Dials)
	}
	return use, nil
}

// kubectl is make testbin's kubectl against the shoot, as its owner runs it: by the API
// server's name, resolved by the cluster's DNS (StartShoot put the shoot's DNSRecord in place).
func (c *Cluster) kubectl(ctx context.Context, s *Shoot, args ...string) *exec.Cmd {
	return c.clusterDNSCommand(ctx, c.testbin("kubectl"), append([]string{"--kubeconfig", s.UserKubeconfig, "--request-timeout", "30s"}, args...)...)
}

var forwarding = regexp.MustCompile(`^Forwarding from (127\.0\.0\.1:\d+) -> `)

// portForward runs kubectl port-forward to the workload's port on a free local port and
// returns that address once kubectl listens, and a function that ends it.
func (c *Cluster) portForward(ctx context.Context, s *Shoot) (string, func(), error) {
	pf := c.kubectl(ctx, s, "port-forward", "--address", "127.0.0.1", "pod/"+workloadName, ":"+strconv.Itoa(workloadPort))
	lines := &lineWaiter{}
	var stderr bytes.Buffer
	pf.Stdout, pf.Stderr = lines, &stderr
	if err := pf.Start(); err != nil {
		return "", nil, err
	}
	stop := func() { _ = pf.Process.Kill(); _ = pf.Wait() }
	line, err := lines.wait(ctx, forwarding)
	if err != nil {
		stop()
		return "", nil, fmt.Errorf("kubectl port-forward: %w (%s)", err, strings.TrimSpace(stderr.String()))
	}
	return forwarding.FindStringSubmatch(line)[1], stop, nil
}

// serverDials is the shoot's tendril-servers' count of connections they opened through the
// tunnel (tendril_server_dials_total{outcome="ok"}), summed over every server pod (an HA shoot
// has two).
func (c *Cluster) serverDials(ctx context.Context, s *Shoot) (float64, error) {
	byPod, err := c.serverDialsByPod(ctx, s)
	var n float64
	for _, v := range byPod {
		n += v
	}
	return n, err
}

// serverDialsByPod is that count for each running tendril-server pod of the shoot, read through
// the seed's API server's pod proxy.
func (c *Cluster) serverDialsByPod(ctx context.Context, s *Shoot) (map[string]float64, error) {
	var pods corev1.PodList
	if err := c.Client.List(ctx, &pods, client.InNamespace(s.Namespace), client.MatchingLabels{v1beta1constants.LabelApp: manifest.ServerName}); err != nil {
		return nil, err
	}
	byPod := map[string]float64{}
	for _, p := range pods.Items {
		// Running, not Ready: tendril-server is Ready once it sees a live agent, which its
		// readiness probe may not have asked yet (its Service publishes it all the same).
		if p.DeletionTimestamp != nil || p.Status.Phase != corev1.PodRunning {
			continue
		}
		b, err := c.kube.CoreV1().Pods(s.Namespace).ProxyGet("http", p.Name, strconv.Itoa(manifest.PortMetrics), "/metrics", nil).DoRaw(ctx)
		if err != nil {
			return nil, fmt.Errorf("tendril-server's metrics in %s/%s: %w", s.Namespace, p.Name, err)
		}
		byPod[p.Name] = 0
		for _, line := range strings.Split(string(b), "\n") {
			if !strings.HasPrefix(line, `tendril_server_dials_total{outcome="ok"}`) {
				continue
			}
			f := strings.Fields(line)
			v, err := strconv.ParseFloat(f[len(f)-1], 64)
			if err != nil {
				return nil, fmt.Errorf("tendril-server's metrics: %q: %w", line, err)
			}
			byPod[p.Name] += v
		}
	}
	if len(byPod) == 0 {
		return nil, fmt.Errorf("no running tendril-server pod in %s", s.Namespace)
	}
	return byPod, nil
}

// lineWaiter collects a process's output lines; wait returns the first line matching re.
type lineWaiter struct {
	mu      sync.Mutex
	partial []byte
	lines   []string
	changed chan struct{}
}

func (w *lineWaiter) Write(p []byte) (int, error) {
	w.mu.Lock()
	defer w.mu.Unlock()
	w.partial = append(w.partial, p...)
	for {
		i := bytes.IndexByte(w.partial, '\n')
		if i < 0 {
			break
		}
		w.lines = append(w.lines, string(w.partial[:i]))
		w.partial = w.partial[i+1:]
	}
	if w.changed != nil {
		close(w.changed)
		w.changed = nil
	}
	return len(p), nil
}

func (w *lineWaiter) wait(ctx context.Context, re *regexp.Regexp) (string, error) {
	for {
		w.mu.Lock()
		for _, l := range w.lines {
			if re.MatchString(l) {
				w.mu.Unlock()
				return l, nil
			}
		}
		if w.changed == nil {
			w.changed = make(chan struct{})
		}
		ch := w.changed
		seen := strings.Join(w.lines, " | ")
		w.mu.Unlock()
		select {
		case <-ch:
		case <-ctx.Done():
			return "", fmt.Errorf("no line matching %q (%v); saw: %q", re, ctx.Err(), seen)
		}
	}
}

// ExecRoundTrips runs command in pod ns/name n times, one after another, through the API server
// rc names (kube made from it) (as kubectl exec does, in this process: a kubectl process would add its own start to
// each), and returns how long each took.
func ExecRoundTrips(ctx context.Context, rc *rest.Config, kube kubernetes.Interface, ns, name, container string, n int, command ...string) ([]time.Duration, error) {
	var took []time.Duration
	for range n {
		t0 := time.Now()
		if _, stderr, err := execIn(ctx, rc, kube, ns, name, container, command...); err != nil {
			return nil, fmt.Errorf("exec in %s/%s: %w (%s)", ns, name, err, strings.TrimSpace(stderr))
		}
		took = append(took, time.Since(t0))
	}
	return took, nil
}

// median is the middle of ds (which it sorts).
func median(ds []time.Duration) time.Duration {
	if len(ds) == 0 {
		return 0
	}
	slices.Sort(ds)
	return ds[len(ds)/2]
}

// ExecComparison runs an exec n times in the shoot's workload (tendril-ingress → the shoot's
// kube-apiserver → tendril-server → tunnel → agent → kubelet) and n times in the seed's
// CoreDNS pod (the seed's kube-apiserver → kubelet, the direct route) and returns both medians.
func (c *Cluster) ExecComparison(ctx context.Context, s *Shoot, n int) (tunnel, direct time.Duration, err error) {
	var dns corev1.PodList
	if err := c.Client.List(ctx, &dns, client.InNamespace(metav1.NamespaceSystem), client.MatchingLabels{"k8s-app": "kube-dns"}); err != nil || len(dns.Items) == 0 {
		return 0, 0, fmt.Errorf("CoreDNS pod: %v", err)
	}
	t, err := ExecRoundTrips(ctx, s.REST, s.kube, metav1.NamespaceDefault, workloadName, "probe", n, "/tendril-probe", "--version")
	if err != nil {
		return 0, 0, err
	}
	d, err := ExecRoundTrips(ctx, c.REST, c.kube, metav1.NamespaceSystem, dns.Items[0].Name, dnsName, n, "/coredns", "-version")
	if err != nil {
		return 0, 0, err
	}
	return median(t), median(d), nil
}

// FailoverResult is what calls through a shoot's tunnel saw while one of its pods was replaced.
type FailoverResult struct {
	// Calls and Failed count the log reads made from the deletion until the replacement ran
	// and three reads in a row passed; Outage is from the start of the first failed read to the
	// end of the next that passed (0 when none failed).
	Calls, Failed int
	Outage        time.Duration
}

// failoverInterval is how often Failover reads the workload's log.
const failoverInterval = 250 * time.Millisecond

// Failover deletes the pods of Deployment f.ns/f.name, or the one pod f.pod of that workload
// (in the seed when f.inShoot is false, else in the shoot), and meanwhile reads the shoot
// workload's log through the tunnel every failoverInterval, until a new pod in the place of the
// deleted is Ready and three reads in a row pass.
func (c *Cluster) Failover(ctx context.Context, s *Shoot, f failover) (*FailoverResult, error) {
	ctx, cancel := context.WithTimeout(ctx, 3*time.Minute)
	defer cancel()
	cl := c.Client
	if f.inShoot {
		cl = s.Client
	}
	ns := f.ns
	var pods []corev1.Pod
	if f.pod != "" {
		var p corev1.Pod
		if err := cl.Get(ctx, client.ObjectKey{Namespace: ns, Name: f.pod}, &p); err != nil {
			return nil, fmt.Errorf("pod %s/%s: %w", ns, f.pod, err)
		}
		pods = []corev1.Pod{p}
	} else {
		_, list, err := deploymentPods(ctx, cl, ns, f.name)
		if err != nil {
			return nil, err
		}
		pods = list.Items
	}
	if len(pods) == 0 {
		return nil, fmt.Errorf("%s: no pod to delete", f.what())
	}
	labels := pods[0].Labels
	old := map[types.UID]bool{}
	for _, p := range pods {
		old[p.UID] = true
		if err := cl.Delete(ctx, &p); err != nil {
			return nil, fmt.Errorf("delete pod %s/%s: %w", ns, p.Name, err)
		}
	}
	res := &FailoverResult{}
	var firstFail time.Time
	passed := 0
	tick := time.NewTicker(failoverInterval)
	defer tick.Stop()
	for {
		t0 := time.Now()
		err := readLog(ctx, s)
		res.Calls++
		switch {
		case err != nil:
			res.Failed++
			passed = 0
			if firstFail.IsZero() {
				firstFail = t0
			}
		default:
			passed++
			if !firstFail.IsZero() && res.Outage == 0 {
				res.Outage = time.Since(firstFail)
			}
		}
		if passed >= 3 && replaced(ctx, cl, ns, labels, f.pod, old) {
			return res, nil
		}
		select {
		case <-ctx.Done():
			return res, fmt.Errorf("%s: no replacement Ready with reads passing (%d of %d reads failed): %w", f.what(), res.Failed, res.Calls, ctx.Err())
		case <-tick.C:
		}
	}
}

// what names the failover's pod in a message.
func (f failover) what() string {
	if f.pod != "" {
		return f.pod
	}
	return f.name
}

// replaced tells whether a pod not in old, with the labels of the deleted ones (and named name,
// if not empty: a StatefulSet's replica is replaced under its name), is Ready.
func replaced(ctx context.Context, cl client.Client, ns string, labels map[string]string, name string, old map[types.UID]bool) bool {
	var pods corev1.PodList
	if err := cl.List(ctx, &pods, client.InNamespace(ns), client.MatchingLabels(labels)); err != nil {
		return false
	}
	for _, p := range pods.Items {
		if !old[p.UID] && (name == "" || p.Name == name) && p.DeletionTimestamp == nil && podIsReady(&p) {
			return true
		}
	}
	return false
}

// podIsReady tells whether p's Ready condition is true.
func podIsReady(p *corev1.Pod) bool {
	for _, cond := range p.Status.Conditions {
		if cond.Type == corev1.PodReady {
			return cond.Status == corev1.ConditionTrue
		}
	}
	return false
}
