package realseed

import (
	"bytes"
	"fmt"
	"os"
	"text/template"
)

// The configuration files of the node's daemons. Each is written only when its content changes:
// kube-proxy watches its file and exits on any write, even of the same bytes.
var (
	containerdTOML = template.Must(template.New("containerd.toml").Parse(`version = 2
root = "{{.Dir}}/var/containerd"
state = "{{.Dir}}/run/containerd"
[grpc]
  address = "{{.ContainerdSocket}}"
[plugins."io.containerd.grpc.v1.cri"]
  sandbox_image = "{{.PauseImage}}"
  # This machine drops CAP_SYS_RESOURCE from every process's bounding set, so nobody may lower
  # oom_score_adj (containerd sets -998 on sandboxes, kubelet -997 on Guaranteed pods) and runc
  # fails every sandbox ("failed to update /proc/self/oom_score_adj: Permission denied"). Clamp
  # them to containerd's own value instead.
  restrict_oom_score_adj = true
  [plugins."io.containerd.grpc.v1.cri".containerd]
    snapshotter = "overlayfs"
    default_runtime_name = "runc"
    [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc.options]
        SystemdCgroup = false
  [plugins."io.containerd.grpc.v1.cri".cni]
    bin_dir = "{{.CNIBinDir}}"
    conf_dir = "{{.Dir}}/etc/cni/net.d"
  # The local registry speaks plain HTTP, as a cluster's in-house mirror might; a node in a
  # network namespace of its own reaches it through its link to the machine.
  [plugins."io.containerd.grpc.v1.cri".registry.mirrors."{{.Registry}}"]
    endpoint = ["http://{{.RegistryEndpoint}}"]
[plugins."io.containerd.internal.v1.opt"]
  path = "{{.Dir}}/var/containerd-opt"
`))

	cniConflist = template.Must(template.New("10-tendril.conflist").Parse(`{
  "cniVersion": "1.0.0",
  "name": "tendril-seed",
  "plugins": [
    {
      "type": "bridge", "bridge": "{{.Bridge}}", "isGateway": true, "ipMasq": false, "hairpinMode": true,
      "ipam": {"type": "host-local", "dataDir": "{{.Dir}}/var/cni",
               "ranges": [[{"subnet": "{{.NodePodCIDR}}"}]], "routes": [{"dst": "0.0.0.0/0"}]}
    },
    {"type": "portmap", "capabilities": {"portMappings": true}}
  ]
}
`))

	kubeletYAML = template.Must(template.New("kubelet.yaml").Parse(`apiVersion: kubelet.config.k8s.io/v1beta1
kind: KubeletConfiguration
# This machine has cgroup v1 only (the memory controller is bound to the v1 hierarchy):
# kubelet 1.37 still runs there when told to.
failCgroupV1: false
cgroupDriver: cgroupfs{{if .CgroupRoot}}
# A second kubelet on the machine keeps its pods' cgroups apart from the first's.
cgroupRoot: {{.CgroupRoot}}{{end}}
containerRuntimeEndpoint: unix://{{.ContainerdSocket}}
imageServiceEndpoint: unix://{{.ContainerdSocket}}
podLogsDir: {{.Dir}}/var/log/pods
# kube-apiserver reaches the kubelet for logs, exec and port-forward without client
# certificates: a shortcut of a one-machine cluster.
authentication:
  anonymous: {enabled: true}
  webhook: {enabled: false}
authorization: {mode: AlwaysAllow}
readOnlyPort: 0
address: {{.NodeIP}}
port: {{.KubeletPort}}
healthzBindAddress: 127.0.0.1
healthzPort: {{.KubeletHealthzPort}}
clusterDomain: cluster.local
clusterDNS: [{{.DNSServiceIP}}]
failSwapOn: false
serializeImagePulls: false
# Never collect images or evict for a full disk on a developer's machine.
imageGCHighThresholdPercent: 100
imageGCLowThresholdPercent: 99
evictionHard: {memory.available: 100Mi, nodefs.available: 1%, imagefs.available: 1%, nodefs.inodesFree: 1%}
protectKernelDefaults: false
makeIPTablesUtilChains: true
`))

	kubeProxyYAML = template.Must(template.New("kube-proxy.yaml").Parse(`apiVersion: kubeproxy.config.k8s.io/v1alpha1
kind: KubeProxyConfiguration
clientConnection: {kubeconfig: {{.Kubeconfig}}}
mode: iptables
clusterCIDR: {{.PodCIDR}}
hostnameOverride: {{.NodeName}}
# NodePorts only on the node's address: tests elsewhere on this machine bind loopback ports.
nodePortAddresses: ["{{.NodeIP}}/32"]
metricsBindAddress: 127.0.0.1:{{.KubeProxyMetricsPort}}
healthzBindAddress: {{.HealthzAddress}}
# Leave the machine's conntrack sysctls alone.
conntrack: {maxPerCore: 0, min: 0, tcpEstablishedTimeout: 0s, tcpCloseWaitTimeout: 0s, udpTimeout: 0s, udpStreamTimeout: 0s}
# No route_localnet and no NodePorts on 127.0.0.1.
iptables: {localhostNodePorts: false}
`))

	registryYAML = template.Must(template.New("registry.yaml").Parse(`version: 0.1
log:
  level: warn
storage:
  filesystem:
    rootdirectory: {{.Dir}}/var/registry
  delete:
    enabled: true
http:
  addr: {{.Listen}}
`))

	kubeconfigYAML = template.Must(template.New("kubeconfig").Parse(`apiVersion: v1
kind: Config
clusters:
- name: {{.Name}}
  cluster:
    server: https://{{.APIServer}}{{if .ServerName}}
    tls-server-name: {{.ServerName}}{{end}}
    certificate-authority: {{.CAFile}}
users:
- name: admin
  user:{{if .Token}}
    token: {{.Token}}{{else}}
    client-certificate: {{.CertFile}}
    client-key: {{.KeyFile}}{{end}}
contexts:
- name: {{.Name}}
  context: {cluster: {{.Name}}, user: admin}
current-context: {{.Name}}
`))
)

// render writes t executed with data to path, unless the file already holds exactly that.
func render(t *template.Template, data any, path string) error {
	var b bytes.Buffer
	if err := t.Execute(&b, data); err != nil {
		return fmt.Errorf("render %s: %w", t.Name(), err)
	}
	return writeIfChanged(path, b.Bytes(), 0o644)
}

func writeIfChanged(path string, b []byte, mode os.FileMode) error {
	if old, err := os.ReadFile(path); err == nil && bytes.Equal(old, b) {
		return nil
	}
	tmp := path + ".tmp"
	if err := os.WriteFile(tmp, b, mode); err != nil {
		return err
	}
	return os.Rename(tmp, path)
}
