package egresswebhook

import (
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"path"
	"strings"

	extensionswebhook "github.com/gardener/gardener/extensions/pkg/webhook"
	v1beta1constants "github.com/gardener/gardener/pkg/apis/core/v1beta1/constants"
	gardenerutils "github.com/gardener/gardener/pkg/utils/gardener"
	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	apiserverv1beta1 "k8s.io/apiserver/pkg/apis/apiserver/v1beta1"
	"k8s.io/utils/ptr"
	"sigs.k8s.io/yaml"

	tendrilv1alpha1 "github.com/tendril-net/tendril/apis/tendril/v1alpha1"
	"github.com/tendril-net/tendril/extension/manifest"
)

// FlagEgressSelectorConfigFile is kube-apiserver's flag; it may appear once.
const FlagEgressSelectorConfigFile = "--egress-selector-config-file"

// FlagGoAwayChance is kube-apiserver's flag for the providerConfig's kubeAPIServer.goAwayChance.
const FlagGoAwayChance = "--goaway-chance"

// Names of what the webhook adds to the kube-apiserver pod. They carry tendril's name so they
// never collide with Gardener's own VPN volumes (egress-selection-config, ca-vpn, http-proxy),
// which stay in the pod untouched.
const (
	// ConfigMapName is the ConfigMap with the EgressSelectorConfiguration in the shoot namespace.
	ConfigMapName = "tendril-egress-selector"
	// ConfigMapDataKey is the ConfigMap's key (the file name in the pod).
	ConfigMapDataKey = "egress-selector-configuration.yaml"

	VolumeNameConfig = "tendril-egress-selector"
	VolumeNameClient = "tendril-egress-client"
	VolumeNameCA     = "tendril-egress-ca"
	// VolumeNameSocket is the emptyDir kube-apiserver and the relay share (egress grpc and
	// httpConnectRelay).
	VolumeNameSocket = "tendril-egress-socket"

	MountPathConfig = "/etc/kubernetes/tendril/egress"
	MountPathClient = "/etc/kubernetes/tendril/client"
	MountPathCA     = "/etc/kubernetes/tendril/ca"
	MountPathSocket = "/var/run/tendril-egress"

	// ContainerNameRelay is the egress relay sidecar (egress grpc and httpConnectRelay): a
	// native sidecar (an init container with restartPolicy Always), so it starts before
	// kube-apiserver and stops after it, and kube-apiserver's egress works during its whole
	// graceful shutdown.
	ContainerNameRelay = "tendril-egress-relay"
	// RelayCommand is the relay's binary in the tendril image.
	RelayCommand = "/tendril-egress-relay"

	// AnnotationChecksumConfig rolls kube-apiserver when the configuration's content changes
	// (kube-apiserver reads the file only at start); Gardener's checksum/… convention.
	AnnotationChecksumConfig = "checksum/configmap-" + ConfigMapName
)

// Data keys of the secrets-manager Secrets (Gardener's pkg/utils/secrets DataKey* values).
const (
	dataKeyCertificate = "tls.crt"
	dataKeyPrivateKey  = "tls.key"
	dataKeyCABundle    = "bundle.crt"
)

// ConfigFile is the value the webhook gives --egress-selector-config-file.
var ConfigFile = path.Join(MountPathConfig, ConfigMapDataKey)

// SocketPath is the relay's Unix socket, kube-apiserver's gRPC egress target (egress: grpc).
var SocketPath = path.Join(MountPathSocket, "tendril-server.sock")

// ConnectSocketPath is the relay's CONNECT socket, kube-apiserver's HTTPConnect egress target
// (egress: httpConnectRelay).
var ConnectSocketPath = path.Join(MountPathSocket, "tendril-server-connect.sock")

// Secrets names the current secrets-manager Secrets kube-apiserver mounts (their names carry
// hashes and change on rotation, so they are looked up per admission request).
type Secrets struct {
	// Client holds tls.crt/tls.key, kube-apiserver's client certificate for tendril-server.
	Client string
	// CABundle holds bundle.crt, the CA bundle that signed tendril-server's certificate.
	CABundle string
}

// ServerHost is tendril-server's Service name in namespace, one of the DNS names of its
// certificate (extension/secrets.go).
func ServerHost(namespace string) string {
	return fmt.Sprintf("%s.%s.svc", manifest.ServerName, namespace)
}

// ServerURL is tendril-server's HTTP CONNECT front-end in namespace.
func ServerURL(namespace string) string {
	return fmt.Sprintf("https://%s:%d", ServerHost(namespace), manifest.PortConnect)
}

// GRPCServerAddress is tendril-server's konnectivity gRPC front-end in namespace, host:port,
// the relay's upstream.
func GRPCServerAddress(namespace string) string {
	return fmt.Sprintf("%s:%d", ServerHost(namespace), manifest.PortGRPC)
}

// RelayServers are the gRPC front-ends the relay sidecar dials: tendril-server's Service for one
// replica; each of several replicas by its pod's name (tendril-server-N.tendril-server.<ns>.svc),
// so that the relay reaches a live one at once rather than through kube-proxy, which keeps a lost
// node's pod among the Service's endpoints until the node is marked unreachable. The certificate
// is checked for ServerHost all the same (--server-name).
func RelayServers(namespace string, servers int) []string {
	if servers <= 1 {
		return []string{GRPCServerAddress(namespace)}
	}
	out := make([]string, servers)
	for i := range out {
		out[i] = fmt.Sprintf("%s-%d.%s:%d", manifest.ServerName, i, ServerHost(namespace), manifest.PortGRPC)
	}
	return out
}

// EgressSelectorConfig is the apiserver.k8s.io/v1beta1 EgressSelectorConfiguration for egress
// mode (empty: httpConnect): `cluster` goes HTTP CONNECT over mutual TLS to tendril-server, or
// GRPC (kube-apiserver's gRPC egress works only over a Unix socket) or HTTP CONNECT over one of
// the relay's Unix sockets (the relay in its pod carries the connections to tendril-server's
// :8090 as streams of one mutual-TLS connection);
// `controlplane` and `etcd` direct (as in Gardener's own configuration).
func EgressSelectorConfig(namespace string, mode tendrilv1alpha1.EgressMode) ([]byte, error) {
	return egressSelectorConfig(namespace, mode, MountPathClient, MountPathCA)
}

func egressSelectorConfig(namespace string, mode tendrilv1alpha1.EgressMode, clientDir, caDir string) ([]byte, error) {
	var cluster apiserverv1beta1.Connection
	switch mode {
	case "", tendrilv1alpha1.EgressHTTPConnect:
		cluster = apiserverv1beta1.Connection{
			ProxyProtocol: apiserverv1beta1.ProtocolHTTPConnect,
			Transport: &apiserverv1beta1.Transport{TCP: &apiserverv1beta1.TCPTransport{
				URL: ServerURL(namespace),
				TLSConfig: &apiserverv1beta1.TLSConfig{
					CABundle:   path.Join(caDir, dataKeyCABundle),
					ClientCert: path.Join(clientDir, dataKeyCertificate),
					ClientKey:  path.Join(clientDir, dataKeyPrivateKey),
				},
			}},
		}
	case tendrilv1alpha1.EgressGRPC:
		cluster = apiserverv1beta1.Connection{
			ProxyProtocol: apiserverv1beta1.ProtocolGRPC,
			Transport:     &apiserverv1beta1.Transport{UDS: &apiserverv1beta1.UDSTransport{UDSName: SocketPath}},
		}
	case tendrilv1alpha1.EgressHTTPConnectRelay:
		cluster = apiserverv1beta1.Connection{
			ProxyProtocol: apiserverv1beta1.ProtocolHTTPConnect,
			Transport:     &apiserverv1beta1.Transport{UDS: &apiserverv1beta1.UDSTransport{UDSName: ConnectSocketPath}},
		}
	default:
		return nil, fmt.Errorf("egress selector configuration: unknown egress mode %q", mode)
	}
	cfg := apiserverv1beta1.EgressSelectorConfiguration{
		TypeMeta: metav1.TypeMeta{APIVersion: apiserverv1beta1.SchemeGroupVersion.String(), Kind: "EgressSelectorConfiguration"},
		EgressSelections: []apiserverv1beta1.EgressSelection{
			{Name: "cluster", Connection: cluster},
			{Name: "controlplane", Connection: apiserverv1beta1.Connection{ProxyProtocol: apiserverv1beta1.ProtocolDirect}},
			{Name: "etcd", Connection: apiserverv1beta1.Connection{ProxyProtocol: apiserverv1beta1.ProtocolDirect}},
		},
	}
	data, err := yaml.Marshal(cfg)
	if err != nil {
		return nil, fmt.Errorf("egress selector configuration: %w", err)
	}
	return data, nil
}

// ConfigMap is the ConfigMap holding the egress selector configuration of namespace for egress
// mode. The webhook creates it when it is missing; the actuator may deploy it too (same content).
func ConfigMap(namespace string, mode tendrilv1alpha1.EgressMode) (*corev1.ConfigMap, error) {
	data, err := EgressSelectorConfig(namespace, mode)
	if err != nil {
		return nil, err
	}
	return &corev1.ConfigMap{
		TypeMeta: metav1.TypeMeta{APIVersion: "v1", Kind: "ConfigMap"},
		ObjectMeta: metav1.ObjectMeta{
			Name:      ConfigMapName,
			Namespace: namespace,
			Labels:    map[string]string{v1beta1constants.LabelApp: manifest.ServerName},
		},
		Data: map[string]string{ConfigMapDataKey: string(data)},
	}, nil
}

func checksum(data string) string {
	sum := sha256.Sum256([]byte(data))
	return hex.EncodeToString(sum[:])
}

// Mutation is what MutateDeployment applies.
type Mutation struct {
	// Egress is the providerConfig's mode; empty is httpConnect.
	Egress tendrilv1alpha1.EgressMode
	// Secrets are the client certificate and CA bundle Secrets to mount.
	Secrets Secrets
	// Config is the ConfigMap's data (for the checksum).
	Config string
	// RelayImage is the tendril image the relay sidecar runs; required for the relayed modes
	// (grpc, httpConnectRelay).
	RelayImage string
	// Servers is how many tendril-server replicas the shoot runs (manifest.ServerCount; 0 is
	// one): with several, the relay dials each by name and uses one that answers.
	Servers int
	// GoAwayChance is kube-apiserver's --goaway-chance (ProviderConfig.GoAwayChance); empty
	// leaves the flag as it is.
	GoAwayChance string
}

// MutateDeployment points the kube-apiserver Deployment's EgressSelector at tendril-server:
// exactly one --egress-selector-config-file (an existing one, Gardener's for its VPN, gets
// tendril's value in place; a second occurrence is removed; a missing one is added), the
// volumes and mounts, the config checksum, and the NetworkPolicy label that lets the pod reach
// tendril-server's egress port.
//
// httpConnect: kube-apiserver mounts the configuration, the client certificate and the CA
// bundle, and may reach port 9443. grpc and httpConnectRelay: kube-apiserver mounts the
// configuration and the socket's emptyDir; the relay sidecar (ContainerNameRelay, a native
// sidecar, serving the mode's socket) mounts the socket's emptyDir, the client certificate and
// the CA bundle, and the pod may reach port 8090. What another mode added is removed, so a
// shoot can switch. Everything else, including --advertise-address and
// --endpoint-reconciler-type, stays as it is. It is idempotent.
func MutateDeployment(dep *appsv1.Deployment, m Mutation) error {
	s := m.Secrets
	if s.Client == "" || s.CABundle == "" {
		return fmt.Errorf("secret names missing (client %q, CA bundle %q)", s.Client, s.CABundle)
	}
	var relayArg string // the relay's socket flag
	switch m.Egress {
	case "", tendrilv1alpha1.EgressHTTPConnect:
	case tendrilv1alpha1.EgressGRPC:
		relayArg = "--socket=" + SocketPath
	case tendrilv1alpha1.EgressHTTPConnectRelay:
		relayArg = "--connect-socket=" + ConnectSocketPath
	default:
		return fmt.Errorf("unknown egress mode %q", m.Egress)
	}
	if relayArg != "" && m.RelayImage == "" {
		return fmt.Errorf("egress %s needs the tendril image for the %s sidecar, and the webhook has none (tendril-seed's --image)", m.Egress, ContainerNameRelay)
	}
	ps := &dep.Spec.Template.Spec
	c := extensionswebhook.ContainerWithName(ps.Containers, v1beta1constants.DeploymentNameKubeAPIServer)
	if c == nil {
		return fmt.Errorf("deployment %s/%s has no container %q", dep.Namespace, dep.Name, v1beta1constants.DeploymentNameKubeAPIServer)
	}
	setFlag(c, FlagEgressSelectorConfigFile, ConfigFile)
	if m.GoAwayChance != "" {
		setFlag(c, FlagGoAwayChance, m.GoAwayChance)
	}

	// The same modes the API server would default, so a re-applied object compares equal.
	cmMode, keyMode := int32(corev1.ConfigMapVolumeSourceDefaultMode), int32(0o640)
	configMount := corev1.VolumeMount{Name: VolumeNameConfig, MountPath: MountPathConfig, ReadOnly: true}
	clientMount := corev1.VolumeMount{Name: VolumeNameClient, MountPath: MountPathClient, ReadOnly: true}
	caMount := corev1.VolumeMount{Name: VolumeNameCA, MountPath: MountPathCA, ReadOnly: true}
	socketMount := corev1.VolumeMount{Name: VolumeNameSocket, MountPath: MountPathSocket}
	c.VolumeMounts = extensionswebhook.EnsureVolumeMountWithName(c.VolumeMounts, configMount)
	ps.Volumes = extensionswebhook.EnsureVolumeWithName(ps.Volumes, corev1.Volume{Name: VolumeNameConfig, VolumeSource: corev1.VolumeSource{
		ConfigMap: &corev1.ConfigMapVolumeSource{LocalObjectReference: corev1.LocalObjectReference{Name: ConfigMapName}, DefaultMode: &cmMode},
	}})
	ps.Volumes = extensionswebhook.EnsureVolumeWithName(ps.Volumes, corev1.Volume{Name: VolumeNameClient, VolumeSource: corev1.VolumeSource{
		Secret: &corev1.SecretVolumeSource{SecretName: s.Client, DefaultMode: &keyMode},
	}})
	ps.Volumes = extensionswebhook.EnsureVolumeWithName(ps.Volumes, corev1.Volume{Name: VolumeNameCA, VolumeSource: corev1.VolumeSource{
		Secret: &corev1.SecretVolumeSource{SecretName: s.CABundle, DefaultMode: &cmMode},
	}})

	t := &dep.Spec.Template
	t.Annotations = extensionswebhook.EnsureAnnotationOrLabel(t.Annotations, AnnotationChecksumConfig, checksum(m.Config))
	connectLabel := gardenerutils.NetworkPolicyLabel(manifest.ServerName, manifest.PortConnect)
	grpcLabel := gardenerutils.NetworkPolicyLabel(manifest.ServerName, manifest.PortGRPC)
	if relayArg == "" {
		c.VolumeMounts = extensionswebhook.EnsureVolumeMountWithName(c.VolumeMounts, clientMount)
		c.VolumeMounts = extensionswebhook.EnsureVolumeMountWithName(c.VolumeMounts, caMount)
		c.VolumeMounts = extensionswebhook.EnsureNoVolumeMountWithName(c.VolumeMounts, VolumeNameSocket)
		ps.InitContainers = extensionswebhook.EnsureNoContainerWithName(ps.InitContainers, ContainerNameRelay)
		ps.Volumes = extensionswebhook.EnsureNoVolumeWithName(ps.Volumes, VolumeNameSocket)
		t.Labels = extensionswebhook.EnsureAnnotationOrLabel(t.Labels, connectLabel, v1beta1constants.LabelNetworkPolicyAllowed)
		delete(t.Labels, grpcLabel)
		return nil
	}
	c.VolumeMounts = extensionswebhook.EnsureNoVolumeMountWithName(c.VolumeMounts, VolumeNameClient)
	c.VolumeMounts = extensionswebhook.EnsureNoVolumeMountWithName(c.VolumeMounts, VolumeNameCA)
	c.VolumeMounts = extensionswebhook.EnsureVolumeMountWithName(c.VolumeMounts, socketMount)
	ps.Volumes = extensionswebhook.EnsureVolumeWithName(ps.Volumes, corev1.Volume{Name: VolumeNameSocket, VolumeSource: corev1.VolumeSource{
		EmptyDir: &corev1.EmptyDirVolumeSource{Medium: corev1.StorageMediumMemory, SizeLimit: ptr.To(resource.MustParse("1Mi"))},
	}})
	ps.InitContainers = extensionswebhook.EnsureContainerWithName(ps.InitContainers,
		relayContainer(dep.Namespace, m.RelayImage, relayArg, m.Servers, c.SecurityContext, clientMount, caMount, socketMount))
	t.Labels = extensionswebhook.EnsureAnnotationOrLabel(t.Labels, grpcLabel, v1beta1constants.LabelNetworkPolicyAllowed)
	delete(t.Labels, connectLabel)
	return nil
}

// relayContainer is the egress relay sidecar. It runs as kube-apiserver's user (its container's
// runAsUser/runAsGroup when set, else the pod's like kube-apiserver): that user must be able to
// connect to the relay's 0600 socket, and the certificate volumes' modes already serve it.
func relayContainer(namespace, image, socketArg string, servers int, apiserver *corev1.SecurityContext, mounts ...corev1.VolumeMount) corev1.Container {
	sc := &corev1.SecurityContext{
		AllowPrivilegeEscalation: ptr.To(false),
		ReadOnlyRootFilesystem:   ptr.To(true),
		Capabilities:             &corev1.Capabilities{Drop: []corev1.Capability{"ALL"}},
	}
	if apiserver != nil {
		sc.RunAsUser, sc.RunAsGroup, sc.RunAsNonRoot = apiserver.RunAsUser, apiserver.RunAsGroup, apiserver.RunAsNonRoot
	}
	return corev1.Container{
		Name:    ContainerNameRelay,
		Image:   image,
		Command: []string{RelayCommand},
		Args: []string{
			socketArg,
			"--server=" + strings.Join(RelayServers(namespace, servers), ","),
			"--server-name=" + ServerHost(namespace),
			"--tls-cert-file=" + path.Join(MountPathClient, dataKeyCertificate),
			"--tls-key-file=" + path.Join(MountPathClient, dataKeyPrivateKey),
			"--ca-file=" + path.Join(MountPathCA, dataKeyCABundle),
		},
		// A native sidecar: started before kube-apiserver, stopped after it.
		RestartPolicy: ptr.To(corev1.ContainerRestartPolicyAlways),
		Resources: corev1.ResourceRequirements{Requests: corev1.ResourceList{
			corev1.ResourceCPU:    resource.MustParse("10m"),
			corev1.ResourceMemory: resource.MustParse("16Mi"),
		}},
		SecurityContext: sc,
		VolumeMounts:    mounts,
	}
}

// setFlag leaves exactly one occurrence of flag, with value, in the container's command line.
// Gardener puts kube-apiserver's flags in args; the contract (seed 000) speaks of command, so
// both are searched. Both spellings count: "--flag=value" and "--flag" "value".
func setFlag(c *corev1.Container, flag, value string) {
	found := false
	c.Command, found = replaceFlag(c.Command, flag, value, found)
	c.Args, found = replaceFlag(c.Args, flag, value, found)
	if found {
		return
	}
	// Append where the flags are: args, unless the flags live in command (more than the binary).
	if len(c.Args) == 0 && len(c.Command) > 1 {
		c.Command = append(c.Command, flag+"="+value)
		return
	}
	c.Args = append(c.Args, flag+"="+value)
}

// replaceFlag sets the first occurrence of flag in items to value (unless found already) and
// removes every other one. It reports whether an occurrence is now in place.
func replaceFlag(items []string, flag, value string, found bool) ([]string, bool) {
	out := items[:0:0]
	for i := 0; i < len(items); i++ {
		item := items[i]
		separate := item == flag
		if !separate && !strings.HasPrefix(item, flag+"=") {
			out = append(out, item)
			continue
		}
		if separate && i+1 < len(items) {
			i++ // skip the value too
		}
		if !found {
			out = append(out, flag+"="+value)
			found = true
		}
	}
	if len(out) == 0 && items == nil {
		return nil, found
	}
	return out, found
}
