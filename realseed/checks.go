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
