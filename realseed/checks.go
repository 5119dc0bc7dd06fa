package realseed

import (
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"net"
	"strings"
	"syscall"
	"time"

	gardencorev1beta1 "github.com/gardener/gardener/pkg/apis/core/v1beta1"
	v1beta1constants "github.com/gardener/gardener/pkg/apis/core/v1beta1/constants"
	extensionsv1alpha1 "github.com/gardener/gardener/pkg/apis/extensions/v1alpha1"
	coordinationv1 "k8s.io/api/coordination/v1"
	"sigs.k8s.io/controller-runtime/pkg/client"
)

// CheckIngressRefusesUnknownName checks the data path into the installed ingress: the
// LoadBalancer shim gave its Service the node's address, kube-proxy forwards that to the
// tendril-ingress pods, and a server name no shoot has is refused (the connection is closed
// without a ServerHello).
func (c *Cluster) CheckIngressRefusesUnknownName(ctx context.Context, inst *Installation) error {
	lctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	lb, err := c.LoadBalancerAddress(lctx, inst.Namespace, "tendril-ingress")
	if err != nil {
		return err
	}
	// kube-proxy programs the address within its sync period after the shim wrote it: until
	// then the node refuses the port.
	var conn *tls.Conn
	for deadline := time.Now().Add(30 * time.Second); ; time.Sleep(200 * time.Millisecond) {
		conn, err = tls.DialWithDialer(&net.Dialer{Timeout: 5 * time.Second}, "tcp", net.JoinHostPort(lb, "443"),
			&tls.Config{ServerName: "api.unknown.example.com", InsecureSkipVerify: true})
		if !errors.Is(err, syscall.ECONNREFUSED) || time.Now().After(deadline) {
			break
		}
	}
	if err == nil {
		conn.Close()
		return errors.New("TLS to an unknown server name through the ingress completed a handshake")
	}
	if !strings.Contains(err.Error(), "EOF") && !strings.Contains(err.Error(), "reset") {
		return fmt.Errorf("TLS to an unknown server name through %s:443: %w, want the connection closed", lb, err)
	}
	return nil
}

// CheckSeedUnderRBAC checks that tendril-seed works with its chart's service account: its
// heartbeat renews its Lease within timeout, and nothing in its log was refused.
func (c *Cluster) CheckSeedUnderRBAC(ctx context.Context, inst *Installation, timeout time.Duration) error {
	key := client.ObjectKey{Namespace: inst.Namespace, Name: "gardener-extension-heartbeat"}
	var first string
	err := c.waitFor(ctx, "kubelet", "heartbeat Lease renewed", timeout, func(ctx context.Context) error {
		var lease coordinationv1.Lease
		if err := c.Client.Get(ctx, key, &lease); err != nil {
			return err
		}
		if lease.Spec.RenewTime == nil {
			return errors.New("no renew time")
		}
		now := lease.Spec.RenewTime.String()
		if first == "" {
			first = now
		}
		if now == first {
			return fmt.Errorf("renewed at %s only", now)
		}
		return nil
	})
	if err != nil {
		return err
	}
	logs, err := c.PodLogs(ctx, inst.Namespace, map[string]string{"app.kubernetes.io/name": "tendril-seed"})
	if err != nil {
		return err
	}
	var refused []string
	for _, l := range strings.Split(logs, "\n") {
		if strings.Contains(l, "forbidden") {
			refused = append(refused, l)
		}
	}
	if len(refused) > 0 {
		return fmt.Errorf("tendril-seed refused by its RBAC %d times, first: %s", len(refused), refused[0])
	}
	return nil
}

// CheckIngressName checks tendril's DNS path on this seed: tendril-seed wrote the seed-level
// DNSRecord with the ingress's load-balancer address, Gardener's dnsrecord controller (the local
// provider) reconciled it, and the cluster DNS answers the name with that address.
func (c *Cluster) CheckIngressName(ctx context.Context, inst *Installation) (string, error) {
	lb, err := c.LoadBalancerAddress(ctx, inst.Namespace, "tendril-ingress")
	if err != nil {
		return "", err
	}
	var name string
	err = c.waitFor(ctx, "kubelet", "the ingress's name resolved", time.Minute, func(ctx context.Context) error {
		var recs extensionsv1alpha1.DNSRecordList
		if err := c.Client.List(ctx, &recs, client.InNamespace(v1beta1constants.GardenNamespace)); err != nil {
			return err
		}
		var rec *extensionsv1alpha1.DNSRecord
		for i := range recs.Items {
			if recs.Items[i].Spec.Type == DNSProviderType {
				rec = &recs.Items[i]
			}
		}
		if rec == nil {
			return errors.New("no DNSRecord of the local provider in garden")
		}
		name = rec.Spec.Name
		if op := rec.Status.LastOperation; op == nil || op.State != gardencorev1beta1.LastOperationStateSucceeded {
			return fmt.Errorf("DNSRecord %s: last operation %v", rec.Name, rec.Status.LastOperation)
		}
		addrs, err := Resolver().LookupHost(ctx, name)
		if err != nil {
			return err
		}
		if len(addrs) != 1 || addrs[0] != lb {
			return fmt.Errorf("%s is %v, want the ingress's %s", name, addrs, lb)
		}
		return nil
	})
	return name, err
}
