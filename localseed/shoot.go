package localseed

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"net/http"
	"net/netip"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"time"

	v1beta1helper "github.com/gardener/gardener/pkg/api/core/v1beta1/helper"
	gardencorev1beta1 "github.com/gardener/gardener/pkg/apis/core/v1beta1"
	extensionsv1alpha1 "github.com/gardener/gardener/pkg/apis/extensions/v1alpha1"
	resourcesv1alpha1 "github.com/gardener/gardener/pkg/apis/resources/v1alpha1"
	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	discoveryv1 "k8s.io/api/discovery/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/tools/clientcmd"
	clientcmdapi "k8s.io/client-go/tools/clientcmd/api"
	"k8s.io/utils/ptr"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/envtest"

	tendrilv1alpha1 "github.com/tendril-net/tendril/apis/tendril/v1alpha1"
	"github.com/tendril-net/tendril/extension"
	"github.com/tendril-net/tendril/extension/manifest"
	"github.com/tendril-net/tendril/extension/networkpaths"
	"github.com/tendril-net/tendril/internal/host/inherit"
	"github.com/tendril-net/tendril/internal/host/procgroup"
	"github.com/tendril-net/tendril/internal/host/reserve"
	"github.com/tendril-net/tendril/internal/kube/kubeenv"
	"github.com/tendril-net/tendril/internal/kube/kubescheme"
	"github.com/tendril-net/tendril/internal/kube/shootgrm"
	"github.com/tendril-net/tendril/internal/pki/testpki"
)

// shoot is one local shoot: its own API server, and what the runner started for it.
type shoot struct {
	name, namespace, host string
	index                 int
	// ha: the shoot runs tendrilv1alpha1.MaxAgents tunnel agents (Config.HAShoots).
	ha         bool
	dir        string
	rest       *rest.Config
	client     client.Client
	apiAddr    netip.AddrPort
	kubeconfig string
	// podAddr is the "pod" HTTP server on the shoot side, podListener its socket (bound when the
	// address is chosen: a port merely free at that moment may be taken before the pod serves,
	// e.g. as another connection's local port); nodes is the shoot's node network.
	podAddr     string
	podListener net.Listener
	nodes       netip.Prefix
	// serverPorts are tendril-server's ports by container port name, on the host address.
	serverPorts map[string]int
	// caFile and client are tendril-server's CA bundle and kube-apiserver's client pair.
	caFile, clientCert, clientKey string
	// agentMetrics are the agents' metrics addresses, agent i's at i.
	agentMetrics []string
	// serverTemplate is tendril-server's pod template, as the extension's Deployment says.
	serverTemplate corev1.PodTemplateSpec
	// netns is the shoot's node namespace (root only); advertised and inCluster are
	// kube-apiserver's advertised address and the kubeconfig that dials it in there.
	netns, advertised, inCluster string
}

// startShootAPIServer starts the shoot's own etcd + kube-apiserver, listening on the host
// address (its EndpointSlice in the seed may not carry loopback), serving a certificate for
// its api.* name to SNI clients, and writes the kubeconfig that reaches it through the ingress.
func (s *seed) startShootAPIServer(sh *shoot) (func(), error) {
	sh.dir = filepath.Join(s.dir, sh.namespace)
	if err := os.MkdirAll(sh.dir, 0o700); err != nil {
		return nil, err
	}
	// The shoot's "node" is this machine: its node network is the host address, where the
	// "pod" listens (the agent's netstack refuses loopback destinations).
	sh.nodes = netip.PrefixFrom(s.hostIP, s.hostIP.BitLen())
	pl, err := net.Listen("tcp", net.JoinHostPort(s.hostIP.String(), "0"))
	if err != nil {
		return nil, fmt.Errorf("pod server: %w", err)
	}
	sh.podListener, sh.podAddr = pl, pl.Addr().String()
	go func() {
		// servePod's server closes it too; this covers a start that fails before it serves.
		<-s.procs.Context().Done()
		pl.Close()
	}()
	ca, err := testpki.NewCA(sh.namespace + " kube-apiserver CA")
	if err != nil {
		return nil, err
	}
	leaf, err := ca.Leaf(sh.host)
	if err != nil {
		return nil, err
	}
	caFile, certFile, keyFile := filepath.Join(sh.dir, "ca.crt"), filepath.Join(sh.dir, "api.crt"), filepath.Join(sh.dir, "api.key")
	if err := ca.WriteCA(caFile); err != nil {
		return nil, err
	}
	if err := testpki.WritePair(leaf, certFile, keyFile); err != nil {
		return nil, err
	}
	// On the host address, which EndpointSlices take (envtest would pick loopback): a port
	// reserved for it until the runner ends (internal/host/reserve: kube-apiserver cannot inherit a
	// socket); envtest picks etcd's, and kubeenv.Start starts again should one be taken.
	te, cfg, err := kubeenv.Start(func() (*envtest.Environment, error) {
		te := kubeenv.Environment(s.assets)
		port, err := reserve.TCP(s.hostIP.String())
		if err != nil {
			return nil, err
		}
		s.addCleanup(func() { port.Close() })
		addr := port.Addr
		sh.apiAddr = netip.MustParseAddrPort(addr)
		api := te.ControlPlane.GetAPIServer()
		api.SecureServing.Address = sh.apiAddr.Addr().String()
		api.SecureServing.Port = strconv.Itoa(int(sh.apiAddr.Port()))
		api.Configure().Append("tls-sni-cert-key", certFile+","+keyFile+":"+sh.host)
		return te, nil
	})
	if err != nil {
		return nil, fmt.Errorf("%s API server: %w", sh.namespace, err)
	}
	stop := func() { _ = te.Stop() }
	sh.rest = cfg
	if sh.client, err = client.New(cfg, client.Options{Scheme: kubescheme.New()}); err != nil {
		return stop, err
	}
	// The kubeconfig a user gets: the ingress's SNI listener, the shoot's name as TLS server
	// name, verified against the shoot's CA; envtest's admin credentials.
	kc := clientcmdapi.NewConfig()
	kc.Clusters[sh.namespace] = &clientcmdapi.Cluster{
		Server:                   "https://" + s.cfg.SNIAddress,
		TLSServerName:            sh.host,
		CertificateAuthorityData: pemCert(ca),
	}
	kc.AuthInfos[sh.namespace] = &clientcmdapi.AuthInfo{ClientCertificateData: cfg.CertData, ClientKeyData: cfg.KeyData, Token: cfg.BearerToken}
	kc.Contexts[sh.namespace] = &clientcmdapi.Context{Cluster: sh.namespace, AuthInfo: sh.namespace}
	kc.CurrentContext = sh.namespace
	sh.kubeconfig = filepath.Join(s.dir, sh.name+".kubeconfig")
	if err := clientcmd.WriteToFile(*kc, sh.kubeconfig); err != nil {
		return stop, err
	}
	return stop, nil
}

// createShoot creates the seed objects Gardener would for the shoot.
func (s *seed) createShoot(ctx context.Context, sh *shoot) error {
	c := s.client
	shootJSON := fmt.Sprintf(`{"apiVersion":"core.gardener.cloud/v1beta1","kind":"Shoot",
		"metadata":{"name":%q,"namespace":"garden-local"},
		"spec":{"dns":{"domain":%q},"networking":{"nodes":%q,"pods":"100.64.0.0/12","services":"100.104.0.0/13"}}}`,
		sh.name, sh.name+"."+Domain, sh.nodes.String())
	port := int32(sh.apiAddr.Port())
	pc := tendrilv1alpha1.ProviderConfig{
		TypeMeta: metav1.TypeMeta{APIVersion: tendrilv1alpha1.SchemeGroupVersion.String(), Kind: "ProviderConfig"},
		Egress:   sh.egressMode(),
	}
	if sh.ha {
		pc.HighAvailability = &tendrilv1alpha1.HighAvailability{Agents: tendrilv1alpha1.MaxAgents}
	}
	if s.netns {
		// apiserver-proxy holds the advertised address on a dummy link: only in a namespace.
		pc.APIServerProxy = &tendrilv1alpha1.APIServerProxy{Enabled: true}
	}
	raw, err := json.Marshal(pc)
	if err != nil {
		return err
	}
	providerConfig := &runtime.RawExtension{Raw: raw}
	// The namespace as gardenlet labels it, and Gardener's kube-apiserver Service
	// (apiserverexposure: the annotations its resource manager derives policies from).
	if err := c.Create(ctx, &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: sh.namespace, Labels: networkpaths.ShootNamespaceLabels()}}); err != nil {
		return fmt.Errorf("create namespace: %w", err)
	}
	if err := networkpaths.DeployKubeAPIServerService(ctx, c, sh.namespace); err != nil {
		return err
	}
	objs := []client.Object{
		&extensionsv1alpha1.Cluster{
			ObjectMeta: metav1.ObjectMeta{Name: sh.namespace},
			Spec: extensionsv1alpha1.ClusterSpec{
				CloudProfile: runtime.RawExtension{Raw: []byte(`{"apiVersion":"core.gardener.cloud/v1beta1","kind":"CloudProfile"}`)},
				Seed:         &runtime.RawExtension{Raw: []byte(`{"apiVersion":"core.gardener.cloud/v1beta1","kind":"Seed"}`)},
				Shoot:        runtime.RawExtension{Raw: []byte(shootJSON)},
			},
		},
		&discoveryv1.EndpointSlice{
			ObjectMeta: metav1.ObjectMeta{Namespace: sh.namespace, Name: manifest.KubeAPIServerName,
				Labels: map[string]string{discoveryv1.LabelServiceName: manifest.KubeAPIServerName, discoveryv1.LabelManagedBy: "tendril-local"}},
			AddressType: discoveryv1.AddressTypeIPv4,
			Ports:       []discoveryv1.EndpointPort{{Name: ptr.To(manifest.KubeAPIServerName), Port: &port, Protocol: ptr.To(corev1.ProtocolTCP)}},
			Endpoints:   []discoveryv1.Endpoint{{Addresses: []string{sh.apiAddr.Addr().String()}, Conditions: discoveryv1.EndpointConditions{Ready: ptr.To(true)}}},
		},
		&extensionsv1alpha1.Extension{
			ObjectMeta: metav1.ObjectMeta{Name: extension.Type, Namespace: sh.namespace},
			Spec:       extensionsv1alpha1.ExtensionSpec{DefaultSpec: extensionsv1alpha1.DefaultSpec{Type: extension.Type, ProviderConfig: providerConfig}},
		},
	}
	for _, o := range objs {
		if err := c.Create(ctx, o); err != nil {
			return fmt.Errorf("create %T %s: %w", o, o.GetName(), err)
		}
	}
	return nil
}

// runShoot plays kubelet and endpoint-slice controller for what the extension declared for
// the shoot; Gardener's resource manager does its own part (startGRM).
func (s *seed) runShoot(ctx context.Context, sh *shoot) error {
	ctx, cancel := context.WithTimeout(ctx, 2*time.Minute)
	defer cancel()
	// tendril-server, exactly as its Deployment says.
	dep := &appsv1.Deployment{}
	if err := poll(ctx, func() error {
		return s.client.Get(ctx, client.ObjectKey{Namespace: sh.namespace, Name: manifest.ServerName}, dep)
	}); err != nil {
		return fmt.Errorf("wait for the tendril-server Deployment: %w", err)
	}
	sh.serverTemplate = dep.Spec.Template
	pod, err := s.materialize(ctx, s.client, sh.namespace, dep.Spec.Template.Spec, filepath.Join(sh.dir, manifest.ServerName), s.hostIP.String(), false)
	if err != nil {
		return fmt.Errorf("tendril-server: %w", err)
	}
	sh.serverPorts = pod.ports
	sh.caFile = filepath.Join(pod.mounts["ca"], "bundle.crt")
	serverLog := filepath.Join(sh.dir, "tendril-server.log")
	ended, err := s.procs.Start(manifest.ServerName+" "+sh.namespace, serverLog, procgroup.Options{Socks: pod.socks}, filepath.Join(s.cfg.BinDir, pod.binary), pod.args...)
	if err != nil {
		return err
	}
	metrics := net.JoinHostPort(s.hostIP.String(), strconv.Itoa(pod.ports["metrics"]))
	if err := waitHTTP(ctx, "http://"+metrics+"/healthz", ended); err != nil {
		return fmt.Errorf("tendril-server: %w; its log ends:\n%s", err, procgroup.LogTail(serverLog))
	}
	if err := s.publishServerEndpoints(ctx, sh); err != nil {
		return err
	}
	// kube-apiserver's client certificate for the egress front-end, as the webhook mounts it.
	if err := s.clientPair(ctx, sh); err != nil {
		return err
	}

	// The shoot side: Gardener's resource manager (started for this shoot in Run) applies the
	// ManagedResource's objects to the shoot's API server; tendril-agent then runs as the
	// Deployment there says.
	if err := poll(ctx, func() error {
		mr := &resourcesv1alpha1.ManagedResource{}
		if err := s.client.Get(ctx, client.ObjectKey{Namespace: sh.namespace, Name: manifest.ManagedResourceName}, mr); err != nil {
			return err
		}
		c := v1beta1helper.GetCondition(mr.Status.Conditions, resourcesv1alpha1.ResourcesApplied)
		if c == nil || c.Status != gardencorev1beta1.ConditionTrue || mr.Status.ObservedGeneration != mr.Generation {
			return fmt.Errorf("ResourcesApplied: %v", c)
		}
		return nil
	}); err != nil {
		return fmt.Errorf("wait for the resource manager to apply the ManagedResource: %w", err)
	}
	if err := s.servePod(ctx, sh); err != nil {
		return err
	}
	// Every agent the extension declared: tendril-agent, and tendril-agent-1 for an HA shoot.
	agents := 1
	if sh.ha {
		agents = tendrilv1alpha1.MaxAgents
	}
	var agentLogs []string
	var agentsEnded []<-chan struct{}
	for i := range agents {
		name := manifest.AgentObjectName(i)
		agent := &appsv1.Deployment{}
		if err := sh.client.Get(ctx, client.ObjectKey{Namespace: manifest.ShootNamespace, Name: name}, agent); err != nil {
			return fmt.Errorf("%s Deployment in the shoot: %w", name, err)
		}
		apod, err := s.materialize(ctx, sh.client, manifest.ShootNamespace, agent.Spec.Template.Spec, filepath.Join(sh.dir, name), "127.0.0.1", false)
		if err != nil {
			return fmt.Errorf("%s: %w", name, err)
		}
		for i, a := range apod.args {
			if strings.HasPrefix(a, "--seed=") {
				apod.args[i] = "--seed=" + s.cfg.ProxyAddress // the ingress's unified port
			}
		}
		sh.agentMetrics = append(sh.agentMetrics, net.JoinHostPort("127.0.0.1", strconv.Itoa(apod.ports["metrics"])))
		agentLog := filepath.Join(sh.dir, name+".log")
		ended, err := s.procs.Start(name+" "+sh.namespace, agentLog, procgroup.Options{Socks: apod.socks}, filepath.Join(s.cfg.BinDir, apod.binary), apod.args...)
		if err != nil {
			return err
		}
		agentLogs, agentsEnded = append(agentLogs, agentLog), append(agentsEnded, ended)
	}
	for i, m := range sh.agentMetrics {
		if err := waitHTTP(ctx, "http://"+m+"/readyz", agentsEnded[i]); err != nil {
			return fmt.Errorf("%s's tunnel: %w; its log ends:\n%s", manifest.AgentObjectName(i), err, procgroup.LogTail(agentLogs[i]))
		}
	}
	if s.netns {
		stop, err := s.makeNode(ctx, sh)
		if err != nil {
			return fmt.Errorf("node namespace: %w", err)
		}
		s.addCleanup(stop)
		return s.startAPIServerProxy(ctx, sh)
	}
	return nil
}

// pod is a container made runnable on this machine.
type pod struct {
	binary string
	args   []string
	// ports are the allocated ports by container port name and by number (a Service's
	// targetPort may give either: tendril-server's are numbers, as Gardener's resource manager
	// names its NetworkPolicies after them); mounts the directories by volume.
	ports  map[string]int
	mounts map[string]string
	// socks are the sockets bound for ports, which the process inherits (procs.Start).
	socks []*inherit.Socket
}

// materialize does what a kubelet would for the pod's only container: the Secret volumes
// become directories (file per key), mount paths in the args point at them, and every
// "--flag=:port" of a container port gets a port on host: bound here, for the process to
// inherit (pod.socks), or, for a process in a network namespace of its own (inNetns), where no
// other process binds, a port just free.
func (s *seed) materialize(ctx context.Context, c client.Client, namespace string, spec corev1.PodSpec, dir, host string, inNetns bool) (*pod, error) {
	if len(spec.Containers) != 1 {
		return nil, fmt.Errorf("%d containers, want 1", len(spec.Containers))
	}
	ctr := spec.Containers[0]
	p := &pod{binary: filepath.Base(ctr.Command[0]), ports: map[string]int{}, mounts: map[string]string{}}
	paths := map[string]string{} // mount path → directory
	for _, v := range spec.Volumes {
		if v.Secret == nil {
			return nil, fmt.Errorf("volume %s: only Secret volumes are supported", v.Name)
		}
		sec := &corev1.Secret{}
		if err := poll(ctx, func() error {
			return c.Get(ctx, client.ObjectKey{Namespace: namespace, Name: v.Secret.SecretName}, sec)
		}); err != nil {
			return nil, fmt.Errorf("secret %s: %w", v.Secret.SecretName, err)
		}
		d := filepath.Join(dir, v.Name)
		if err := os.MkdirAll(d, 0o700); err != nil {
			return nil, err
		}
		for k, b := range sec.Data {
			if err := os.WriteFile(filepath.Join(d, k), b, 0o600); err != nil {
				return nil, err
			}
		}
		p.mounts[v.Name] = d
	}
	for _, m := range ctr.VolumeMounts {
		d, ok := p.mounts[m.Name]
		if !ok {
			return nil, fmt.Errorf("mount of unknown volume %s", m.Name)
		}
		paths[m.MountPath] = d
	}
	portNames := map[string]string{}
	for _, cp := range ctr.Ports {
		portNames[strconv.Itoa(int(cp.ContainerPort))] = cp.Name
	}
	for _, a := range append(append([]string{}, ctr.Command[1:]...), ctr.Args...) {
		if k, v, ok := strings.Cut(a, "="); ok {
			for mp, d := range paths {
				if v == mp || strings.HasPrefix(v, mp+"/") {
					v = d + strings.TrimPrefix(v, mp)
				}
			}
			if port, ok := strings.CutPrefix(v, ":"); ok && portNames[port] != "" {
				var addr string
				var err error
				if inNetns {
					addr, err = freeAddr(host)
				} else {
					var sock *inherit.Socket
					if sock, err = inherit.Bind(net.JoinHostPort(host, "0")); err == nil {
						p.socks, addr = append(p.socks, sock), sock.Addr
					}
				}
				if err != nil {
					inherit.Close(p.socks...)
					return nil, err
				}
				_, ps, _ := net.SplitHostPort(addr)
				p.ports[portNames[port]], _ = strconv.Atoi(ps)
				p.ports[port] = p.ports[portNames[port]]
				v = addr
			}
			a = k + "=" + v
		}
		p.args = append(p.args, a)
	}
	return p, nil
}

// publishServerEndpoints writes the EndpointSlice of the tendril-server Service, as the
// endpoint-slice controller would for the running process.
func (s *seed) publishServerEndpoints(ctx context.Context, sh *shoot) error {
	svc := &corev1.Service{}
	if err := poll(ctx, func() error {
		return s.client.Get(ctx, client.ObjectKey{Namespace: sh.namespace, Name: manifest.ServerName}, svc)
	}); err != nil {
		return fmt.Errorf("tendril-server Service: %w", err)
	}
	es := &discoveryv1.EndpointSlice{
		ObjectMeta: metav1.ObjectMeta{Namespace: sh.namespace, Name: manifest.ServerName,
			Labels: map[string]string{discoveryv1.LabelServiceName: manifest.ServerName, discoveryv1.LabelManagedBy: "tendril-local"}},
		AddressType: discoveryv1.AddressTypeIPv4,
		Endpoints:   []discoveryv1.Endpoint{{Addresses: []string{s.hostIP.String()}, Conditions: discoveryv1.EndpointConditions{Ready: ptr.To(true)}}},
	}
	for _, p := range svc.Spec.Ports {
		port, ok := sh.serverPorts[p.TargetPort.String()]
		if !ok {
			return fmt.Errorf("service port %s: target %s is no container port", p.Name, p.TargetPort.String())
		}
		es.Ports = append(es.Ports, discoveryv1.EndpointPort{Name: ptr.To(p.Name), Port: ptr.To(int32(port)), Protocol: ptr.To(corev1.ProtocolTCP)})
	}
	return apply(ctx, s.client, es)
}

// clientPair writes kube-apiserver's client certificate for tendril-server's egress front-ends
// (the secrets manager's newest Secret of that name).
func (s *seed) clientPair(ctx context.Context, sh *shoot) error {
	var list corev1.SecretList
	if err := poll(ctx, func() error {
		if err := s.client.List(ctx, &list, client.InNamespace(sh.namespace), client.MatchingLabels{
			"name": extension.SecretNameAPIServerClient, "managed-by": "secrets-manager",
		}); err != nil {
			return err
		}
		if len(list.Items) == 0 {
			return fmt.Errorf("no secret")
		}
		return nil
	}); err != nil {
		return fmt.Errorf("kube-apiserver client secret: %w", err)
	}
	newest := list.Items[0]
	for _, it := range list.Items[1:] {
		if it.CreationTimestamp.After(newest.CreationTimestamp.Time) {
			newest = it
		}
	}
	d := filepath.Join(sh.dir, "kube-apiserver-client")
	if err := os.MkdirAll(d, 0o700); err != nil {
		return err
	}
	sh.clientCert, sh.clientKey = filepath.Join(d, "tls.crt"), filepath.Join(d, "tls.key")
	if err := os.WriteFile(sh.clientCert, newest.Data["tls.crt"], 0o600); err != nil {
		return err
	}
	return os.WriteFile(sh.clientKey, newest.Data["tls.key"], 0o600)
}

// servePod serves the shoot's "pod": an HTTP server in the shoot's node network answering its
// shoot's name.
func (s *seed) servePod(ctx context.Context, sh *shoot) error {
	l := sh.podListener
	srv := &http.Server{ReadHeaderTimeout: 10 * time.Second, Handler: http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		fmt.Fprintf(w, "pod in %s\n", sh.namespace)
	})}
	go func() { _ = srv.Serve(l) }()
	go func() {
		<-s.procs.Context().Done()
		_ = srv.Close()
	}()
	return nil
}

// apply creates o or updates it to o.
func apply(ctx context.Context, c client.Client, o client.Object) error {
	o.SetResourceVersion("")
	err := c.Create(ctx, o)
	if !apierrors.IsAlreadyExists(err) {
		return err
	}
	cur := o.DeepCopyObject().(client.Object)
	if err := c.Get(ctx, client.ObjectKeyFromObject(o), cur); err != nil {
		return err
	}
	o.SetResourceVersion(cur.GetResourceVersion())
	return c.Update(ctx, o)
}

func poll(ctx context.Context, f func() error) error {
	for {
		err := f()
		if err == nil {
			return nil
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("%w (last: %v)", ctx.Err(), err)
		case <-time.After(100 * time.Millisecond):
		}
	}
}

func waitHTTP(ctx context.Context, url string, ended <-chan struct{}) error {
	c := &http.Client{Timeout: 2 * time.Second}
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	errEnded := errors.New("the process ended")
	err := poll(ctx, func() error {
		select {
		case <-ended: // it will never answer: poll stops at once
			cancel()
			return errEnded
		default:
		}
		r, err := c.Get(url)
		if err != nil {
			return err
		}
		r.Body.Close()
		if r.StatusCode != http.StatusOK {
			return fmt.Errorf("%s: %s", url, r.Status)
		}
		return nil
	})
	if errors.Is(err, errEnded) {
		return errEnded
	}
	return err
}

// startGRM runs Gardener's resource manager controllers for the shoot (seed namespace →
// shoot API server), as gardenlet deploys one into every shoot namespace; they run until ctx
// ends, and the cleanup waits for them.
func (s *seed) startGRM(ctx context.Context, sh *shoot) error {
	mgr, err := shootgrm.New(ctx, shootgrm.Config{
		Seed: s.rest, Shoot: sh.rest, Namespace: sh.namespace, ClusterID: "local",
		Logger: s.log.WithName("resource-manager").WithValues("namespace", sh.namespace),
	})
	if err != nil {
		return err
	}
	done := make(chan error, 1)
	go func() { done <- mgr.Start(ctx) }()
	s.addCleanup(func() {
		if err := <-done; err != nil {
			s.log.Error(err, "resource manager", "namespace", sh.namespace)
		}
	})
	return nil
}
