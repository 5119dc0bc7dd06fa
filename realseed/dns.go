package realseed

import (
	"context"
	"fmt"
	"net/netip"
	"time"

	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	rbacv1 "k8s.io/api/rbac/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/intstr"
	"k8s.io/utils/ptr"
	"sigs.k8s.io/controller-runtime/pkg/client"
)

// CoreDNS runs as on a Gardener seed: pods labelled k8s-app=kube-dns in kube-system (where
// Gardener's allow-to-dns NetworkPolicy points) listening on 8053 behind Service kube-dns :53.
const (
	dnsName = "coredns"
	// dnsPort is the pods' port: unprivileged (the image's user is 65532), as Gardener's.
	dnsPort = 8053
	// dnsReadyPort and dnsHealthPort are the ready and health plugins' ports.
	dnsReadyPort  = 8181
	dnsHealthPort = 8080
)

// corefile serves the cluster's names and nothing else: pods cannot reach the machine's
// resolver (the guard drops pod traffic that would leave the machine), so there is no forward.
var corefile = fmt.Sprintf(`.:%d {
    errors
    health :%d
    ready :%d
    # DNSRecords of the local provider (dnsrecords.go), read again every second.
    hosts /etc/coredns/records/hosts {
        ttl 5
        reload 1s
        fallthrough
    }
    kubernetes cluster.local in-addr.arpa ip6.arpa {
        pods insecure
        fallthrough in-addr.arpa ip6.arpa
    }
    cache 30
    loop
    reload
}
`, dnsPort, dnsHealthPort, dnsReadyPort)

func (c *Cluster) startCoreDNS(ctx context.Context) error {
	if err := c.prepareDNSRecords(); err != nil {
		return err
	}
	image, err := c.pushBinary(c.seedbin("coredns"), "tendril/coredns", CoreDNSVersion)
	if err != nil {
		return err
	}
	labels := map[string]string{"k8s-app": "kube-dns"}
	ns := metav1.NamespaceSystem
	meta := metav1.ObjectMeta{Name: dnsName, Namespace: ns}
	no, yes := false, true
	objs := []client.Object{
		&corev1.ServiceAccount{ObjectMeta: meta},
		&rbacv1.ClusterRole{ObjectMeta: metav1.ObjectMeta{Name: "system:coredns"}, Rules: []rbacv1.PolicyRule{
			{APIGroups: []string{""}, Resources: []string{"endpoints", "services", "pods", "namespaces"}, Verbs: []string{"list", "watch"}},
			{APIGroups: []string{"discovery.k8s.io"}, Resources: []string{"endpointslices"}, Verbs: []string{"list", "watch"}},
		}},
		&rbacv1.ClusterRoleBinding{ObjectMeta: metav1.ObjectMeta{Name: "system:coredns"},
			RoleRef:  rbacv1.RoleRef{APIGroup: rbacv1.GroupName, Kind: "ClusterRole", Name: "system:coredns"},
			Subjects: []rbacv1.Subject{{Kind: rbacv1.ServiceAccountKind, Name: dnsName, Namespace: ns}}},
		&corev1.ConfigMap{ObjectMeta: meta, Data: map[string]string{"Corefile": corefile}},
		&appsv1.Deployment{ObjectMeta: meta, Spec: appsv1.DeploymentSpec{
			Replicas: ptr.To(int32(1)),
			Selector: &metav1.LabelSelector{MatchLabels: labels},
			Template: corev1.PodTemplateSpec{
				ObjectMeta: metav1.ObjectMeta{Labels: labels},
				Spec: corev1.PodSpec{
					ServiceAccountName: dnsName,
					DNSPolicy:          corev1.DNSDefault,
					PriorityClassName:  "system-cluster-critical",
					SecurityContext:    &corev1.PodSecurityContext{RunAsNonRoot: &yes, SeccompProfile: &corev1.SeccompProfile{Type: corev1.SeccompProfileTypeRuntimeDefault}},
					Containers: []corev1.Container{{
						Name: dnsName, Image: image, Args: []string{"-conf", "/etc/coredns/Corefile"},
						Ports: []corev1.ContainerPort{
							{Name: "dns", ContainerPort: dnsPort, Protocol: corev1.ProtocolUDP},
							{Name: "dns-tcp", ContainerPort: dnsPort, Protocol: corev1.ProtocolTCP},
						},
						ReadinessProbe: &corev1.Probe{ProbeHandler: corev1.ProbeHandler{HTTPGet: &corev1.HTTPGetAction{Path: "/ready", Port: intstr.FromInt32(dnsReadyPort)}}, PeriodSeconds: 1},
						LivenessProbe:  &corev1.Probe{ProbeHandler: corev1.ProbeHandler{HTTPGet: &corev1.HTTPGetAction{Path: "/health", Port: intstr.FromInt32(dnsHealthPort)}}, PeriodSeconds: 10},
						VolumeMounts: []corev1.VolumeMount{{Name: "config", MountPath: "/etc/coredns", ReadOnly: true},
							{Name: "records", MountPath: "/etc/coredns/records", ReadOnly: true}},
						SecurityContext: &corev1.SecurityContext{AllowPrivilegeEscalation: &no, ReadOnlyRootFilesystem: &yes,
							Capabilities: &corev1.Capabilities{Drop: []corev1.Capability{"ALL"}}},
					}},
					Volumes: []corev1.Volume{{Name: "config", VolumeSource: corev1.VolumeSource{ConfigMap: &corev1.ConfigMapVolumeSource{LocalObjectReference: corev1.LocalObjectReference{Name: dnsName}}}},
						// The node's directory, not a ConfigMap: kubelet brings a ConfigMap's change into
						// a pod only on its next sync (up to a minute); this is read within a second.
						{Name: "records", VolumeSource: corev1.VolumeSource{HostPath: &corev1.HostPathVolumeSource{Path: c.dnsRecordsDir(), Type: ptr.To(corev1.HostPathDirectory)}}}},
				},
			},
		}},
		&corev1.Service{ObjectMeta: metav1.ObjectMeta{Name: "kube-dns", Namespace: ns, Labels: labels}, Spec: corev1.ServiceSpec{
			ClusterIP: DNSServiceIP, Selector: labels,
			Ports: []corev1.ServicePort{
				{Name: "dns", Port: 53, TargetPort: intstr.FromInt32(dnsPort), Protocol: corev1.ProtocolUDP},
				{Name: "dns-tcp", Port: 53, TargetPort: intstr.FromInt32(dnsPort), Protocol: corev1.ProtocolTCP},
			},
		}},
	}
	for _, o := range objs {
		if err := c.Client.Create(ctx, o); err != nil {
			return fmt.Errorf("CoreDNS: create %T %s: %w", o, o.GetName(), err)
		}
	}
	r := Resolver()
	return c.waitFor(ctx, "kubelet", "CoreDNS answering for kubernetes.default.svc.cluster.local", 2*time.Minute, func(ctx context.Context) error {
		addrs, err := r.LookupHost(ctx, "kubernetes.default.svc.cluster.local")
		if err != nil {
			return fmt.Errorf("%w (%s)", err, c.podState(ctx, ns, labels))
		}
		if len(addrs) != 1 || netip.MustParseAddr(addrs[0]) != netip.MustParseAddr(APIServiceIP) {
			return fmt.Errorf("kubernetes.default.svc.cluster.local is %v, want %s", addrs, APIServiceIP)
		}
		return nil
	})
}

// podState says in a few words where the pods labelled labels in ns stand, for an error.
func (c *Cluster) podState(ctx context.Context, ns string, labels map[string]string) string {
	var pods corev1.PodList
	if err := c.Client.List(ctx, &pods, client.InNamespace(ns), client.MatchingLabels(labels)); err != nil {
		return err.Error()
	}
	if len(pods.Items) == 0 {
		return "no pod yet"
	}
	p := pods.Items[0]
	s := fmt.Sprintf("pod %s %s", p.Name, p.Status.Phase)
	for _, cs := range p.Status.ContainerStatuses {
		switch {
		case cs.State.Waiting != nil:
			s += fmt.Sprintf(", %s waiting: %s %s", cs.Name, cs.State.Waiting.Reason, cs.State.Waiting.Message)
		case cs.State.Terminated != nil:
			s += fmt.Sprintf(", %s terminated: %s", cs.Name, cs.State.Terminated.Reason)
		default:
			s += fmt.Sprintf(", %s ready %v", cs.Name, cs.Ready)
		}
	}
	return s
}
