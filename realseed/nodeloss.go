package realseed

import (
	"context"
	"errors"
	"fmt"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/utils/ptr"
	"sigs.k8s.io/controller-runtime/pkg/client"

	"github.com/tendril-net/tendril/extension/egresswebhook"
	"github.com/tendril-net/tendril/internal/host/netns"
)

// CallStats counts one kind of call through a shoot's tunnel.
type CallStats struct {
	Calls, Failed int
	// Unnoticed is how many passed while the node was lost and Kubernetes did not know yet
	// (the lost replica's pod still Ready, its endpoint still published).
	Unnoticed int
	Slowest   time.Duration
	// FirstError is the first failure's message.
	FirstError string
}

func (cs *CallStats) record(took time.Duration, err error, unnoticed bool) {
	cs.Calls++
	cs.Slowest = max(cs.Slowest, took)
	switch {
	case err != nil:
		cs.Failed++
		if cs.FirstError == "" {
			cs.FirstError = err.Error()
		}
	case unnoticed:
		cs.Unnoticed++
	}
}

// String is the stats in a log line.
func (cs CallStats) String() string {
	s := fmt.Sprintf("%d of %d failed, %d passed before Kubernetes noticed, slowest %s", cs.Failed, cs.Calls, cs.Unnoticed, cs.Slowest.Round(time.Millisecond))
	if cs.FirstError != "" {
		s += fmt.Sprintf(" (first failure: %s)", cs.FirstError)
	}
	return s
}

// NodeLossResult is what calls through a highly available shoot's tunnel saw while the node of
// one of its two tendril-server replicas was lost.
type NodeLossResult struct {
	Logs, Exec, Webhook CallStats
	// NodeNotReady is from the cut until the node controller marked the node NotReady,
	// PodNotReady until it marked the lost replica's pod not Ready, which takes its endpoint out
	// of the Service (and the ingress's route to it); Window is how long the calls ran.
	NodeNotReady, PodNotReady, Window time.Duration
}

const (
	// nodeLossAfterNoticed is how long the calls go on after Kubernetes took the lost replica
	// out: the path as it runs until the node comes back.
	nodeLossAfterNoticed = 10 * time.Second
	// nodeLossLimit bounds the wait for Kubernetes to notice: kube-controller-manager's
	// node-monitor-grace-period (50 s) plus its 5 s node-monitor-period, twice.
	nodeLossLimit = 2 * (50 + 5) * time.Second
	// nodeLossInterval is how often the calls start.
	nodeLossInterval = 250 * time.Millisecond
)

// NodeLoss moves replica pod of highly available shoot s's tendril-server onto node n, then
// loses n: every packet in its network namespace is dropped, as when a node loses power or its
// network (nothing is reset, nothing answers, its kubelet stops reporting). Meanwhile it calls
// through the shoot's tunnel every nodeLossInterval, one of each: a log read (kubelet through
// the tunnel), an exec, a create its webhook refuses (the webhook on the shoot's node through the
// tunnel), until Kubernetes has marked the replica's pod not Ready and nodeLossAfterNoticed
// more passed. Then the node is given back its network and the replica waited for.
func (c *Cluster) NodeLoss(ctx context.Context, s *Shoot, pod string, n *Node) (*NodeLossResult, error) {
	ctx, cancel := context.WithTimeout(ctx, 8*time.Minute)
	defer cancel()
	if err := c.moveReplica(ctx, s, pod, n); err != nil {
		return nil, err
	}
	_, remove, err := c.registerWebhook(ctx, s)
	if err != nil {
		return nil, err
	}
	defer remove()
	// The moved replica carries calls before its node goes. One exec a second (an exec opens a
	// tunnel of its own, where kube-apiserver may send log reads over a kubelet connection it
	// kept; and the seed client's 5 requests a second also serve the dial counts): the relay
	// alternates between the ready replicas, so one of the next execs goes through the moved one
	// once it has a connection to it.
	if err := c.carriesDials(ctx, s, pod, 2*time.Minute); err != nil {
		return nil, fmt.Errorf("%s on %s: %w", pod, n.cfg.Name, err)
	}

	if err := n.cut(ctx); err != nil {
		return nil, err
	}
	cutAt := time.Now()
	restored := false
	defer func() {
		if !restored {
			_ = n.restore(context.Background())
		}
	}()
	res := &NodeLossResult{}
	tick := time.NewTicker(nodeLossInterval)
	defer tick.Stop()
	for round := 0; ; round++ {
		if res.NodeNotReady == 0 && nodeReady(ctx, c.Client, n.cfg.Name) != nil {
			res.NodeNotReady = time.Since(cutAt)
		}
		if res.PodNotReady == 0 {
			var p corev1.Pod
			if err := c.Client.Get(ctx, client.ObjectKey{Namespace: s.Namespace, Name: pod}, &p); err == nil && !podIsReady(&p) {
				res.PodNotReady = time.Since(cutAt)
			}
		}
		unnoticed := res.PodNotReady == 0
		call := func(cs *CallStats, f func() error) {
			t0 := time.Now()
			err := f()
			cs.record(time.Since(t0), err, unnoticed)
		}
		call(&res.Logs, func() error { return readLog(ctx, s) })
		call(&res.Exec, func() error {
			ectx, ecancel := context.WithTimeout(ctx, 10*time.Second)
			defer ecancel()
			_, err := ExecRoundTrips(ectx, s.REST, s.kube, metav1.NamespaceDefault, workloadName, "probe", 1, "/tendril-probe", "--version")
			return err
		})
		call(&res.Webhook, func() error {
			wctx, wcancel := context.WithTimeout(ctx, 15*time.Second)
			defer wcancel()
			_, err := createDenied(wctx, s.Client, fmt.Sprintf("node-loss-%d", round))
			return err
		})
		res.Window = time.Since(cutAt)
		if res.PodNotReady != 0 && res.Window > res.PodNotReady+nodeLossAfterNoticed {
			break
		}
		if res.Window > nodeLossLimit {
			return res, fmt.Errorf("node %s lost %s ago: Kubernetes has not marked %s not Ready (node NotReady after %s)", n.cfg.Name, res.Window.Round(time.Second), pod, res.NodeNotReady)
		}
		select {
		case <-ctx.Done():
			return res, ctx.Err()
		case <-tick.C:
		}
	}

	if err := n.restore(ctx); err != nil {
		return res, err
	}
	restored = true
	return res, c.replicaReadyOn(ctx, s, pod, n, "")
}

// carriesDials execs in the shoot's workload once a second until tendril-server pod has dialled
// for one of the execs.
func (c *Cluster) carriesDials(ctx context.Context, s *Shoot, pod string, timeout time.Duration) error {
	deadline := time.Now().Add(timeout)
	prev, err := c.serverDialsByPod(ctx, s)
	if err != nil {
		return err
	}
	last := errors.New("no read yet")
	for time.Now().Before(deadline) {
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(time.Second):
		}
		if _, err := ExecRoundTrips(ctx, s.REST, s.kube, metav1.NamespaceDefault, workloadName, "probe", 1, "/tendril-probe", "--version"); err != nil {
			last = err
			continue
		}
		now, err := c.serverDialsByPod(ctx, s)
		if err != nil {
			last = err
			continue
		}
		if now[pod] > prev[pod] {
			return nil
		}
		last = fmt.Errorf("the last exec went through another replica (dials %v, then %v)", prev, now)
		prev = now
	}
	return fmt.Errorf("no dial through it in %s (%v); the relay's log ends: %s", timeout, last, c.relayLog(ctx, s))
}

// readLog reads the last line of the shoot's workload's log (kube-apiserver → kubelet through
// the tunnel).
func readLog(ctx context.Context, s *Shoot) error {
	rctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	_, err := s.kube.CoreV1().Pods(metav1.NamespaceDefault).GetLogs(workloadName, &corev1.PodLogOptions{TailLines: ptr.To[int64](1)}).DoRaw(rctx)
	return err
}

// moveReplica deletes StatefulSet replica pod of the shoot's tendril-server and has its
// replacement scheduled onto node n (the seed's own node cordoned meanwhile, n uncordoned; both
// are put back as they were) and Ready there.
func (c *Cluster) moveReplica(ctx context.Context, s *Shoot, pod string, n *Node) (err error) {
	undo, err := c.setSchedulable(ctx, map[string]bool{NodeName: false, n.cfg.Name: true})
	defer func() { err = errors.Join(err, undo()) }()
	if err != nil {
		return err
	}
	var old corev1.Pod
	if err := c.Client.Get(ctx, client.ObjectKey{Namespace: s.Namespace, Name: pod}, &old); err != nil {
		return fmt.Errorf("pod %s/%s: %w", s.Namespace, pod, err)
	}
	if err := c.Client.Delete(ctx, &old); err != nil {
		return fmt.Errorf("delete pod %s/%s: %w", s.Namespace, pod, err)
	}
	return c.replicaReadyOn(ctx, s, pod, n, old.UID)
}

// replicaReadyOn waits until the shoot's tendril-server pod, if replaced not the one of UID
// (when not empty), runs on node n and is Ready.
func (c *Cluster) replicaReadyOn(ctx context.Context, s *Shoot, pod string, n *Node, replaced types.UID) error {
	return c.waitFor(ctx, "tendril-server "+pod, "Ready on "+n.cfg.Name, 3*time.Minute, func(ctx context.Context) error {
		var p corev1.Pod
		if err := c.Client.Get(ctx, client.ObjectKey{Namespace: s.Namespace, Name: pod}, &p); err != nil {
			return err
		}
		switch {
		case replaced != "" && p.UID == replaced:
			return errors.New("the old pod is still there")
		case p.Spec.NodeName != n.cfg.Name:
			return fmt.Errorf("scheduled onto %q", p.Spec.NodeName)
		case !podIsReady(&p):
			return errors.New("not Ready")
		}
		return nil
	})
}

// setSchedulable sets the nodes' schedulability as want says and returns a function that puts
// back what it changed.
func (c *Cluster) setSchedulable(ctx context.Context, want map[string]bool) (undo func() error, err error) {
	was := map[string]bool{}
	set := func(ctx context.Context, name string, schedulable bool) error {
		var node corev1.Node
		if err := c.Client.Get(ctx, client.ObjectKey{Name: name}, &node); err != nil {
			return err
		}
		if _, seen := was[name]; !seen {
			was[name] = !node.Spec.Unschedulable
		}
		patch := client.MergeFrom(node.DeepCopy())
		node.Spec.Unschedulable = !schedulable
		return c.Client.Patch(ctx, &node, patch)
	}
	undo = func() error {
		var errs []error
		for name, schedulable := range was {
			errs = append(errs, set(context.Background(), name, schedulable))
		}
		return errors.Join(errs...)
	}
	for name, schedulable := range want {
		if err := set(ctx, name, schedulable); err != nil {
			return undo, fmt.Errorf("node %s schedulable %v: %w", name, schedulable, err)
		}
	}
	return undo, nil
}

// lostNodeTable is the nftables table in a node's namespace that makes it lost.
const lostNodeTable = "tendril_realseed_lost_node"

// cut drops every packet in and out of the node's namespace and every packet it forwards (its
// pods'): nothing is reset or closed, nothing answers.
func (n *Node) cut(ctx context.Context) error { return netns.Cut(ctx, n.netns(), lostNodeTable) }

// restore lets the node's packets through again.
func (n *Node) restore(ctx context.Context) error { return netns.Uncut(ctx, n.netns(), lostNodeTable) }

// relayLog is the end of the log of the relay sidecar in the shoot's kube-apiserver pod.
func (c *Cluster) relayLog(ctx context.Context, s *Shoot) string {
	_, pods, err := deploymentPods(ctx, c.Client, s.Namespace, "kube-apiserver")
	if err != nil || len(pods.Items) == 0 {
		return fmt.Sprintf("(no kube-apiserver pod: %v)", err)
	}
	b, err := c.kube.CoreV1().Pods(s.Namespace).GetLogs(pods.Items[0].Name, &corev1.PodLogOptions{
		Container: egresswebhook.ContainerNameRelay, TailLines: ptr.To[int64](15)}).DoRaw(ctx)
	if err != nil {
		return fmt.Sprintf("(%v)", err)
	}
	return string(b)
}
