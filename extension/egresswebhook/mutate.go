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
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	apiserverv1beta1 "k8s.io/apiserver/pkg/apis/apiserver/v1beta1"
	"sigs.k8s.io/yaml"

	"github.com/tendril-net/tendril/extension/manifest"
)

// FlagEgressSelectorConfigFile is kube-apiserver's flag; it may appear once.
const FlagEgressSelectorConfigFile = "--egress-selector-config-file"

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

	MountPathConfig = "/etc/kubernetes/tendril/egress"
	MountPathClient = "/etc/kubernetes/tendril/client"
	MountPathCA     = "/etc/kubernetes/tendril/ca"

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

// Secrets names the current secrets-manager Secrets kube-apiserver mounts (their names carry
// hashes and change on rotation, so they are looked up per admission request).
type Secrets struct {
	// Client holds tls.crt/tls.key, kube-apiserver's client certificate for tendril-server.
	Client string
	// CABundle holds bundle.crt, the CA bundle that signed tendril-server's certificate.
	CABundle string
}

// ServerURL is tendril-server's HTTP CONNECT front-end in namespace; the host is one of the
// DNS names of tendril-server's certificate (extension/secrets.go).
func ServerURL(namespace string) string {
	return fmt.Sprintf("https://%s.%s.svc:%d", manifest.ServerName, namespace, manifest.PortConnect)
}

// EgressSelectorConfig is the apiserver.k8s.io/v1beta1 EgressSelectorConfiguration: `cluster`
// goes HTTP CONNECT over mutual TLS to tendril-server, `controlplane` and `etcd` direct (as
// in Gardener's own configuration). kube-apiserver's gRPC egress works only over a Unix
// socket, so tendril's konnectivity front-end cannot be named here across pods.
func EgressSelectorConfig(namespace string) ([]byte, error) {
	return egressSelectorConfig(namespace, MountPathClient, MountPathCA)
}

func egressSelectorConfig(namespace, clientDir, caDir string) ([]byte, error) {
	cfg := apiserverv1beta1.EgressSelectorConfiguration{
		TypeMeta: metav1.TypeMeta{APIVersion: apiserverv1beta1.SchemeGroupVersion.String(), Kind: "EgressSelectorConfiguration"},
		EgressSelections: []apiserverv1beta1.EgressSelection{
			{
				Name: "cluster",
				Connection: apiserverv1beta1.Connection{
					ProxyProtocol: apiserverv1beta1.ProtocolHTTPConnect,
					Transport: &apiserverv1beta1.Transport{TCP: &apiserverv1beta1.TCPTransport{
						URL: ServerURL(namespace),
						TLSConfig: &apiserverv1beta1.TLSConfig{
							CABundle:   path.Join(caDir, dataKeyCABundle),
							ClientCert: path.Join(clientDir, dataKeyCertificate),
							ClientKey:  path.Join(clientDir, dataKeyPrivateKey),
						},
					}},
				},
			},
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

// ConfigMap is the ConfigMap holding the egress selector configuration of namespace. The
// webhook creates it when it is missing; the actuator may deploy it too (same content).
func ConfigMap(namespace string) (*corev1.ConfigMap, error) {
	data, err := EgressSelectorConfig(namespace)
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

// MutateDeployment points the kube-apiserver Deployment's EgressSelector at tendril-server:
// exactly one --egress-selector-config-file (an existing one, Gardener's for its VPN, gets
// tendril's value in place; a second occurrence is removed; a missing one is added), the
// three volumes and mounts, the config checksum, and the NetworkPolicy label that lets the
// pod reach tendril-server's CONNECT port. Everything else, including --advertise-address and
// --endpoint-reconciler-type, stays as it is. It is idempotent. cfg is the ConfigMap's data
// (for the checksum).
func MutateDeployment(dep *appsv1.Deployment, s Secrets, cfg string) error {
	if s.Client == "" || s.CABundle == "" {
		return fmt.Errorf("secret names missing (client %q, CA bundle %q)", s.Client, s.CABundle)
	}
	ps := &dep.Spec.Template.Spec
	c := extensionswebhook.ContainerWithName(ps.Containers, v1beta1constants.DeploymentNameKubeAPIServer)
	if c == nil {
		return fmt.Errorf("deployment %s/%s has no container %q", dep.Namespace, dep.Name, v1beta1constants.DeploymentNameKubeAPIServer)
	}
	setFlag(c, FlagEgressSelectorConfigFile, ConfigFile)

	c.VolumeMounts = extensionswebhook.EnsureVolumeMountWithName(c.VolumeMounts, corev1.VolumeMount{Name: VolumeNameConfig, MountPath: MountPathConfig, ReadOnly: true})
	c.VolumeMounts = extensionswebhook.EnsureVolumeMountWithName(c.VolumeMounts, corev1.VolumeMount{Name: VolumeNameClient, MountPath: MountPathClient, ReadOnly: true})
	c.VolumeMounts = extensionswebhook.EnsureVolumeMountWithName(c.VolumeMounts, corev1.VolumeMount{Name: VolumeNameCA, MountPath: MountPathCA, ReadOnly: true})

	// The same modes the API server would default, so a re-applied object compares equal.
	cmMode, keyMode := int32(corev1.ConfigMapVolumeSourceDefaultMode), int32(0o640)
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
	t.Annotations = extensionswebhook.EnsureAnnotationOrLabel(t.Annotations, AnnotationChecksumConfig, checksum(cfg))
	t.Labels = extensionswebhook.EnsureAnnotationOrLabel(t.Labels,
		gardenerutils.NetworkPolicyLabel(manifest.ServerName, manifest.PortConnect), v1beta1constants.LabelNetworkPolicyAllowed)
	return nil
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
