package realseed

import (
	"context"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"time"

	v1beta1constants "github.com/gardener/gardener/pkg/apis/core/v1beta1/constants"
	extensionsv1alpha1 "github.com/gardener/gardener/pkg/apis/extensions/v1alpha1"
	extensionsdnsrecord "github.com/gardener/gardener/pkg/component/extensions/dnsrecord"
	"github.com/go-logr/logr"
	"k8s.io/utils/ptr"
	"sigs.k8s.io/controller-runtime/pkg/client"

	"github.com/tendril-net/tendril/extension/manifest"
)

// istioStandIn is the address the shoot's api.* record has before tendril's DNS webhook
// mutates it: on a seed, Istio's ingress gateway's (gardenlet writes that); here an address of
// TEST-NET-1 (RFC 5737) that nothing answers, so a name left unmutated cannot pass.
const istioStandIn = "192.0.2.99"

// externalDNSRecord writes shoot s's external DNSRecord as gardenlet does (Gardener's dnsrecord
// component, as botanist's DefaultExternalDNSRecord configures it: <shoot>-external, role
// external, its credentials Secret, the local provider), with Istio's stand-in address, and
// waits for Gardener's dnsrecord controller to reconcile it. tendril's DNSRecord webhook,
// served by the installed tendril-seed, changes that address to the ingress's load balancer
// as the record is admitted; the check is that the cluster DNS then answers the name with the
// load balancer and that kubectl works by that name (UserKubeconfig).
func (c *Cluster) externalDNSRecord(ctx context.Context, s *Shoot, inst *Installation) error {
	lb, err := c.LoadBalancerAddress(ctx, inst.Namespace, "tendril-ingress")
	if err != nil {
		return err
	}
	name := s.cfg.Name + "-" + v1beta1constants.DNSRecordExternalName
	rec := extensionsdnsrecord.New(logr.Discard(), c.Client, &extensionsdnsrecord.Values{
		Name:       name,
		SecretName: "dnsrecord-" + name, // botanist.DNSRecordSecretPrefix
		Namespace:  s.Namespace,
		TTL:        ptr.To[int64](120),
		Labels: map[string]string{
			v1beta1constants.LabelRole:  v1beta1constants.LabelDNSRecordExternal,
			v1beta1constants.GardenRole: v1beta1constants.GardenRoleControlPlane,
		},
		Type:       DNSProviderType,
		DNSName:    s.Host,
		RecordType: extensionsv1alpha1.DNSRecordTypeA,
		Values:     []string{istioStandIn},
	}, time.Second, 15*time.Second, time.Minute, extensionsdnsrecord.DeploySecretCredentials(map[string][]byte{}))
	if err := rec.Deploy(ctx); err != nil {
		return fmt.Errorf("DNSRecord %s/%s: %w", s.Namespace, name, err)
	}
	if err := rec.Wait(ctx); err != nil {
		return fmt.Errorf("DNSRecord %s/%s: %w", s.Namespace, name, err)
	}
	var got extensionsv1alpha1.DNSRecord
	if err := c.Client.Get(ctx, client.ObjectKey{Namespace: s.Namespace, Name: name}, &got); err != nil {
		return err
	}
	if !slices.Equal(got.Spec.Values, []string{lb}) {
		return fmt.Errorf("DNSRecord %s/%s holds %v, want the ingress's load balancer %s: tendril's DNSRecord webhook did not mutate it (%s)",
			s.Namespace, name, got.Spec.Values, lb, c.extensionState(ctx, s, inst))
	}
	if err := c.waitFor(ctx, "CoreDNS", s.Host+" resolved to the ingress", 30*time.Second, func(ctx context.Context) error {
		addrs, err := Resolver().LookupHost(ctx, s.Host)
		if err != nil {
			return err
		}
		if !slices.Equal(addrs, []string{lb}) {
			return fmt.Errorf("%s is %v, want %s", s.Host, addrs, lb)
		}
		return nil
	}); err != nil {
		return err
	}
	if err := os.WriteFile(c.clusterResolvConf(), []byte("nameserver "+DNSServiceIP+"\noptions ndots:1 timeout:2 attempts:2\n"), 0o644); err != nil {
		return err
	}
	// The owner's kubeconfig names the API server as Gardener's does (https://api.<shoot>.<domain>)
	// and authenticates as Gardener's admin kubeconfigs do, with a client certificate of the
	// shoot's client CA.
	s.UserKubeconfig = filepath.Join(s.dir, "kubeconfig-by-name")
	return render(kubeconfigYAML, map[string]string{"Name": s.Namespace, "APIServer": net.JoinHostPort(s.Host, strconv.Itoa(manifest.PortKubeAPIServer)),
		"CAFile": filepath.Join(s.dir, "ca.crt"), "CertFile": filepath.Join(s.dir, shootPKIOwnerCert), "KeyFile": filepath.Join(s.dir, shootPKIOwnerKey)}, s.UserKubeconfig)
}

// clusterResolvConf is a resolv.conf that asks the cluster's DNS only: the one kubectl sees
// (clusterDNSCommand), so that it resolves the shoots' api.* names as a machine whose resolver
// is the cluster's DNS would.
func (c *Cluster) clusterResolvConf() string { return c.path("etc", "resolv-cluster.conf") }

// clusterDNSCommand runs path with args in a mount namespace of its own whose /etc/resolv.conf
// is the cluster's DNS (clusterResolvConf); the machine's resolver stays as it is for everything
// else. unshare execs the shell and the shell execs path: the command's process is path's.
func (c *Cluster) clusterDNSCommand(ctx context.Context, path string, args ...string) *exec.Cmd {
	return exec.CommandContext(ctx, "unshare", append([]string{"--mount", "--propagation", "private", "--", "sh", "-c",
		`mount --bind "$0" /etc/resolv.conf && exec "$@"`, c.clusterResolvConf(), path}, args...)...)
}
