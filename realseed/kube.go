package realseed

import (
	"context"
	"errors"
	"fmt"
	"net"
	"slices"
	"time"

	appsv1 "k8s.io/api/apps/v1"
	batchv1 "k8s.io/api/batch/v1"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/utils/ptr"
	"sigs.k8s.io/controller-runtime/pkg/client"
)

// nodeReady checks that node name, as the API server c talks to sees it, is Ready.
func nodeReady(ctx context.Context, c client.Client, name string) error {
	var n corev1.Node
	if err := c.Get(ctx, client.ObjectKey{Name: name}, &n); err != nil {
		return err
	}
	for _, cond := range n.Status.Conditions {
		if cond.Type == corev1.NodeReady {
			if cond.Status == corev1.ConditionTrue {
				return nil
			}
			return fmt.Errorf("node %s: Ready %s: %s", name, cond.Status, cond.Message)
		}
	}
	return fmt.Errorf("node %s: no Ready condition yet", name)
}

// drain deletes every workload and pod of the cluster cl reaches (the seed, a shoot) and waits
// until the kubelets have ended them all, so that CNI removes each pod's interface and address
// before the daemons stop.
func drain(ctx context.Context, cl client.Client) error {
	var nss corev1.NamespaceList
	if err := cl.List(ctx, &nss); err != nil {
		return err
	}
	one := int64(1)
	for _, ns := range nss.Items {
		in := client.InNamespace(ns.Name)
		for _, obj := range []client.Object{&appsv1.Deployment{}, &appsv1.StatefulSet{}, &appsv1.DaemonSet{}, &appsv1.ReplicaSet{}, &batchv1.Job{}} {
			if err := cl.DeleteAllOf(ctx, obj, in, client.PropagationPolicy("Background")); err != nil && !apierrors.IsNotFound(err) {
				return fmt.Errorf("delete %T in %s: %w", obj, ns.Name, err)
			}
		}
		if err := cl.DeleteAllOf(ctx, &corev1.Pod{}, in, client.GracePeriodSeconds(one)); err != nil && !apierrors.IsNotFound(err) {
			return fmt.Errorf("delete pods in %s: %w", ns.Name, err)
		}
	}
	for {
		var pods corev1.PodList
		err := cl.List(ctx, &pods)
		if err == nil && len(pods.Items) == 0 {
			return nil
		}
		select {
		case <-ctx.Done():
			if err == nil {
				err = fmt.Errorf("%d pods left, first %s/%s", len(pods.Items), pods.Items[0].Namespace, pods.Items[0].Name)
			}
			return err
		case <-time.After(200 * time.Millisecond):
		}
	}
}

// lbInterval is how often the LoadBalancer shim looks for Services to serve.
const lbInterval = 500 * time.Millisecond

// loadBalancers is the LoadBalancer shim: every LoadBalancer Service gets the node's address as
// its status.loadBalancer.ingress, and kube-proxy then forwards that address's Service ports to
// the endpoints, as a cloud's load balancer in front of the node would. It runs until ctx ends.
func (c *Cluster) loadBalancers(ctx context.Context) {
	t := time.NewTicker(lbInterval)
	defer t.Stop()
	want := []corev1.LoadBalancerIngress{{IP: c.NodeIP.String(), IPMode: ptr.To(corev1.LoadBalancerIPModeVIP)}}
	for {
		var svcs corev1.ServiceList
		if err := c.Client.List(ctx, &svcs); err == nil {
			for i := range svcs.Items {
				s := &svcs.Items[i]
				if s.Spec.Type != corev1.ServiceTypeLoadBalancer || slices.EqualFunc(s.Status.LoadBalancer.Ingress, want, func(a, b corev1.LoadBalancerIngress) bool { return a.IP == b.IP }) {
					continue
				}
				s.Status.LoadBalancer.Ingress = want
				if err := c.Client.Status().Update(ctx, s); err != nil && ctx.Err() == nil {
					fmt.Fprintf(c.cfg.Out, "load balancer shim: %s/%s: %v\n", s.Namespace, s.Name, err)
				}
			}
		}
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
	}
}

// LoadBalancerAddress waits until Service namespace/name has a load-balancer address and
// returns it.
func (c *Cluster) LoadBalancerAddress(ctx context.Context, namespace, name string) (string, error) {
	for {
		var s corev1.Service
		err := c.Client.Get(ctx, client.ObjectKey{Namespace: namespace, Name: name}, &s)
		if err == nil && len(s.Status.LoadBalancer.Ingress) > 0 {
			return s.Status.LoadBalancer.Ingress[0].IP, nil
		}
		select {
		case <-ctx.Done():
			return "", errors.Join(fmt.Errorf("service %s/%s has no load-balancer address", namespace, name), err, ctx.Err())
		case <-time.After(lbInterval):
		}
	}
}

// Resolver resolves through the cluster DNS (Service kube-dns), as a pod with dnsPolicy
// ClusterFirst does; the host reaches the Service address through kube-proxy.
func Resolver() *net.Resolver {
	return &net.Resolver{PreferGo: true, Dial: func(ctx context.Context, network, _ string) (net.Conn, error) {
		var d net.Dialer
		return d.DialContext(ctx, network, net.JoinHostPort(DNSServiceIP, "53"))
	}}
}
