package realseed

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"path/filepath"
	"strings"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/httpstream"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/kubernetes/scheme"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/tools/remotecommand"
	"sigs.k8s.io/controller-runtime/pkg/client"
)

// ProbePod starts a probe pod (tendril-probe serve ports) name in namespace ns with labels, a
// stand-in for a component on a network path, and returns its address once it runs. It is
// restricted-PSS compliant, so it runs in any namespace.
func (c *Cluster) ProbePod(ctx context.Context, ns, name string, labels map[string]string, ports ...int32) (string, error) {
	var cports []corev1.ContainerPort
	for _, p := range ports {
		cports = append(cports, corev1.ContainerPort{ContainerPort: p})
	}
	p, err := c.probePod(ctx, ns, name, "", labels, nil, cports, ports)
	return p.Status.PodIP, err
}

// ProbePodOn is ProbePod on the node nodeName.
func (c *Cluster) ProbePodOn(ctx context.Context, nodeName, ns, name string, labels map[string]string, ports ...int32) (string, error) {
	var cports []corev1.ContainerPort
	for _, p := range ports {
		cports = append(cports, corev1.ContainerPort{ContainerPort: p})
	}
	p, err := c.probePod(ctx, ns, name, nodeName, labels, nil, cports, ports)
	return p.Status.PodIP, err
}

// probePod is ProbePod with the pod's annotations and declared ports apart from those it serves;
// it returns the pod as stored once it runs (never nil).
func (c *Cluster) probePod(ctx context.Context, ns, name, nodeName string, labels, annotations map[string]string, cports []corev1.ContainerPort, serve []int32) (*corev1.Pod, error) {
	c.probeOnce.Do(c.pushProbe)
	if c.probeErr != nil {
		return &corev1.Pod{}, c.probeErr
	}
	pod := probePodSpec(ns, name, nodeName, c.probeImage, labels, annotations, cports, serve)
	if err := c.Client.Create(ctx, pod); err != nil {
		return &corev1.Pod{}, fmt.Errorf("probe pod %s/%s: %w", ns, name, err)
	}
	running := &corev1.Pod{}
	err := c.waitFor(ctx, "kubelet", "probe pod "+ns+"/"+name+" running", 2*time.Minute, func(ctx context.Context) error {
		var p corev1.Pod
		if err := c.Client.Get(ctx, client.ObjectKeyFromObject(pod), &p); err != nil {
			return err
		}
		if p.Status.Phase != corev1.PodRunning || p.Status.PodIP == "" {
			return fmt.Errorf("pod %s", p.Status.Phase)
		}
		running = &p
		return nil
	})
	return running, err
}

// pushProbe pushes tendril-probe's image (once: probeOnce).
func (c *Cluster) pushProbe() {
	c.probeImage, c.probeErr = c.pushBinary(filepath.Join(c.cfg.BinDir, "tendril-probe"), "tendril/probe", "1")
}

// probePodSpec is a restricted-PSS probe pod serving ports serve.
func probePodSpec(ns, name, nodeName, image string, labels, annotations map[string]string, cports []corev1.ContainerPort, serve []int32) *corev1.Pod {
	args := []string{"serve"}
	for _, p := range serve {
		args = append(args, fmt.Sprint(p))
	}
	no, yes, grace := false, true, int64(1)
	return &corev1.Pod{ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: ns, Labels: labels, Annotations: annotations}, Spec: corev1.PodSpec{
		NodeName:                      nodeName,
		TerminationGracePeriodSeconds: &grace,
		AutomountServiceAccountToken:  &no,
		SecurityContext: &corev1.PodSecurityContext{RunAsNonRoot: &yes, SeccompProfile: &corev1.SeccompProfile{Type: corev1.SeccompProfileTypeRuntimeDefault},
			// A probe stands in for kube-apiserver on 443 without a capability: a safe sysctl,
			// which restricted Pod Security admits.
			Sysctls: []corev1.Sysctl{{Name: "net.ipv4.ip_unprivileged_port_start", Value: "0"}}},
		Containers: []corev1.Container{{Name: "probe", Image: image, Args: args, Ports: cports,
			SecurityContext: &corev1.SecurityContext{AllowPrivilegeEscalation: &no, ReadOnlyRootFilesystem: &yes,
				Capabilities: &corev1.Capabilities{Drop: []corev1.Capability{"ALL"}}}}},
	}}
}

// Dial runs `tendril-probe dial address` in probe pod ns/name (an exec through kube-apiserver and
// the kubelet) and tells whether the connection opened; detail is what the probe printed. An
// error means the probe could not run, not that the path is closed.
func (c *Cluster) Dial(ctx context.Context, ns, name, address string, timeout time.Duration) (open bool, detail string, err error) {
	return dialIn(ctx, c.REST, c.kube, ns, name, address, timeout)
}

// dialIn is Dial in the cluster rc names.
func dialIn(ctx context.Context, rc *rest.Config, kube kubernetes.Interface, ns, name, address string, timeout time.Duration) (open bool, detail string, err error) {
	stdout, stderr, err := execIn(ctx, rc, kube, ns, name, "probe", "/tendril-probe", "dial", "--timeout", timeout.String(), address)
	detail = strings.TrimSpace(stdout + " " + stderr)
	var exit interface{ ExitStatus() int }
	switch {
	case err == nil && detail == "open":
		return true, detail, nil
	case errors.As(err, &exit) && exit.ExitStatus() == 1:
		return false, detail, nil
	case err == nil:
		return false, detail, fmt.Errorf("probe %s/%s printed %q", ns, name, detail)
	default:
		return false, detail, fmt.Errorf("exec in probe %s/%s: %w (%s)", ns, name, err, detail)
	}
}

// execIn runs command in container of pod ns/name through the API server rc names (kube is a
// clientset made from rc, kept by the caller: one per cluster, not one per exec), as kubectl
// exec does (WebSocket, SPDY where the server has no WebSocket), and returns what it printed.
func execIn(ctx context.Context, rc *rest.Config, kube kubernetes.Interface, ns, name, container string, command ...string) (stdout, stderr string, err error) {
	req := kube.CoreV1().RESTClient().Post().Resource("pods").Namespace(ns).Name(name).SubResource("exec").
		VersionedParams(&corev1.PodExecOptions{Container: container, Command: command, Stdout: true, Stderr: true}, scheme.ParameterCodec)
	ws, err := remotecommand.NewWebSocketExecutor(rc, "GET", req.URL().String())
	if err != nil {
		return "", "", err
	}
	spdy, err := remotecommand.NewSPDYExecutor(rc, "POST", req.URL())
	if err != nil {
		return "", "", err
	}
	ex, err := remotecommand.NewFallbackExecutor(ws, spdy, httpstream.IsUpgradeFailure)
	if err != nil {
		return "", "", err
	}
	// Two buffers: the streams are copied by goroutines of their own.
	var out, errOut bytes.Buffer
	err = ex.StreamWithContext(ctx, remotecommand.StreamOptions{Stdout: &out, Stderr: &errOut})
	return out.String(), errOut.String(), err
}

// PodLogs is the logs of every container of the pods labelled labels in ns, one after another.
func (c *Cluster) PodLogs(ctx context.Context, ns string, labels map[string]string) (string, error) {
	var pods corev1.PodList
	if err := c.Client.List(ctx, &pods, client.InNamespace(ns), client.MatchingLabels(labels)); err != nil {
		return "", err
	}
	var b strings.Builder
	for _, p := range pods.Items {
		for _, ct := range p.Spec.Containers {
			out, err := c.kube.CoreV1().Pods(ns).GetLogs(p.Name, &corev1.PodLogOptions{Container: ct.Name}).DoRaw(ctx)
			if err != nil {
				return "", fmt.Errorf("logs of %s/%s %s: %w", ns, p.Name, ct.Name, err)
			}
			b.Write(out)
		}
	}
	return b.String(), nil
}
