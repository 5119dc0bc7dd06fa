package egresswebhook

import (
	"os"
	"path/filepath"
	"reflect"
	"slices"
	"strings"
	"testing"

	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	"k8s.io/apiserver/pkg/apis/apiserver"
	"k8s.io/apiserver/pkg/server/egressselector"
)

const gardenerEgressFlag = "--egress-selector-config-file=/etc/kubernetes/egress/gardener.yaml"

var otherFlags = []string{
	"--advertise-address=240.0.0.10",
	"--endpoint-reconciler-type=none",
	"--secure-port=443",
}

func deployment(command, args []string) *appsv1.Deployment {
	d := &appsv1.Deployment{}
	d.Name, d.Namespace = "kube-apiserver", "shoot--p--s"
	d.Spec.Template.Spec.Containers = []corev1.Container{
		{Name: "kube-apiserver", Image: "kube-apiserver", Command: command, Args: args,
			VolumeMounts: []corev1.VolumeMount{{Name: "egress-selection-config", MountPath: "/etc/kubernetes/egress"}}},
		{Name: "sidecar", Image: "sidecar", Args: []string{gardenerEgressFlag}},
	}
	d.Spec.Template.Spec.Volumes = []corev1.Volume{{Name: "egress-selection-config"}}
	return d
}

func TestMutateDeployment(t *testing.T) {
	want := FlagEgressSelectorConfigFile + "=" + ConfigFile
	tests := []struct {
		name             string
		command, args    []string
		wantCmd, wantArg []string
	}{
		{
			name:    "gardener flag in args replaced in place",
			command: []string{"/usr/local/bin/kube-apiserver"},
			args:    []string{otherFlags[0], gardenerEgressFlag, otherFlags[1], otherFlags[2]},
			wantCmd: []string{"/usr/local/bin/kube-apiserver"},
			wantArg: []string{otherFlags[0], want, otherFlags[1], otherFlags[2]},
		},
		{
			name:    "no flag: added to args",
			command: []string{"/usr/local/bin/kube-apiserver"},
			args:    otherFlags,
			wantCmd: []string{"/usr/local/bin/kube-apiserver"},
			wantArg: append(slices.Clone(otherFlags), want),
		},
		{
			name:    "flags in command (seed 000 contract)",
			command: append([]string{"/usr/local/bin/kube-apiserver", gardenerEgressFlag}, otherFlags...),
			wantCmd: append([]string{"/usr/local/bin/kube-apiserver", want}, otherFlags...),
		},
		{
			name:    "no flag, flags in command: added to command",
			command: append([]string{"/usr/local/bin/kube-apiserver"}, otherFlags...),
			wantCmd: append(append([]string{"/usr/local/bin/kube-apiserver"}, otherFlags...), want),
		},
		{
			name:    "two occurrences and the separate-value form: one left",
			args:    []string{FlagEgressSelectorConfigFile, "/a.yaml", otherFlags[0], gardenerEgressFlag, otherFlags[1]},
			wantArg: []string{want, otherFlags[0], otherFlags[1]},
		},
		{
			name:    "in both command and args: one left, in command",
			command: []string{"kube-apiserver", gardenerEgressFlag},
			args:    []string{otherFlags[0], gardenerEgressFlag},
			wantCmd: []string{"kube-apiserver", want},
			wantArg: []string{otherFlags[0]},
		},
		{
			name:    "no flags at all",
			wantArg: []string{want},
		},
		{
			name:    "prefix of another flag is not the flag",
			args:    []string{"--egress-selector-config-file-x=1"},
			wantArg: []string{"--egress-selector-config-file-x=1", want},
		},
	}
	secrets := Secrets{Client: "tendril-kube-apiserver-client-abc", CABundle: "ca-tendril-bundle-def"}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			d := deployment(slices.Clone(tt.command), slices.Clone(tt.args))
			if err := MutateDeployment(d, secrets, "cfg"); err != nil {
				t.Fatal(err)
			}
			c := d.Spec.Template.Spec.Containers[0]
			if !slices.Equal(c.Command, tt.wantCmd) || !slices.Equal(c.Args, tt.wantArg) {
				t.Errorf("command %q args %q, want %q %q", c.Command, c.Args, tt.wantCmd, tt.wantArg)
			}
			if got := d.Spec.Template.Spec.Containers[1].Args; !slices.Equal(got, []string{gardenerEgressFlag}) {
				t.Errorf("other container changed: %q", got)
			}
			checkVolumes(t, d, secrets)
			again := d.DeepCopy()
			if err := MutateDeployment(again, secrets, "cfg"); err != nil {
				t.Fatal(err)
			}
			if !reflect.DeepEqual(d, again) {
				t.Errorf("second mutation changed the deployment:\n%+v\n%+v", d.Spec.Template, again.Spec.Template)
			}
		})
	}
}

func checkVolumes(t *testing.T, d *appsv1.Deployment, s Secrets) {
	t.Helper()
	ps := d.Spec.Template.Spec
	vols := map[string]corev1.Volume{}
	for _, v := range ps.Volumes {
		if _, dup := vols[v.Name]; dup {
			t.Errorf("volume %s twice", v.Name)
		}
		vols[v.Name] = v
	}
	if _, ok := vols["egress-selection-config"]; !ok {
		t.Error("Gardener's volume removed")
	}
	if v := vols[VolumeNameConfig]; v.ConfigMap == nil || v.ConfigMap.Name != ConfigMapName {
		t.Errorf("config volume %+v", v)
	}
	if v := vols[VolumeNameClient]; v.Secret == nil || v.Secret.SecretName != s.Client {
		t.Errorf("client volume %+v", v)
	}
	if v := vols[VolumeNameCA]; v.Secret == nil || v.Secret.SecretName != s.CABundle {
		t.Errorf("CA volume %+v", v)
	}
	mounts := map[string]string{}
	for _, m := range ps.Containers[0].VolumeMounts {
		mounts[m.Name] = m.MountPath
	}
	for name, path := range map[string]string{VolumeNameConfig: MountPathConfig, VolumeNameClient: MountPathClient, VolumeNameCA: MountPathCA, "egress-selection-config": "/etc/kubernetes/egress"} {
		if mounts[name] != path {
			t.Errorf("mount %s at %q, want %q", name, mounts[name], path)
		}
	}
	if len(ps.Containers[1].VolumeMounts) != 0 {
		t.Error("sidecar got mounts")
	}
	if d.Spec.Template.Annotations[AnnotationChecksumConfig] != checksum("cfg") {
		t.Error("no checksum annotation")
	}
	if d.Spec.Template.Labels["networking.resources.gardener.cloud/to-tendril-server-tcp-9443"] != "allowed" {
		t.Errorf("network policy label missing: %v", d.Spec.Template.Labels)
	}
}

func TestMutateDeploymentErrors(t *testing.T) {
	d := deployment(nil, nil)
	if err := MutateDeployment(d, Secrets{Client: "c"}, ""); err == nil {
		t.Error("no CA bundle secret accepted")
	}
	d.Spec.Template.Spec.Containers = d.Spec.Template.Spec.Containers[1:]
	if err := MutateDeployment(d, Secrets{Client: "c", CABundle: "b"}, ""); err == nil || !strings.Contains(err.Error(), "no container") {
		t.Errorf("missing container: %v", err)
	}
}

// TestEgressSelectorConfig loads the configuration with kube-apiserver's own loader and
// validator (the validator insists the certificate files exist, so they are created).
func TestEgressSelectorConfig(t *testing.T) {
	dir := t.TempDir()
	for _, f := range []string{"client/tls.crt", "client/tls.key", "ca/bundle.crt"} {
		p := filepath.Join(dir, f)
		if err := os.MkdirAll(filepath.Dir(p), 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(p, []byte("x"), 0o600); err != nil {
			t.Fatal(err)
		}
	}
	data, err := egressSelectorConfig("shoot--p--s", filepath.Join(dir, "client"), filepath.Join(dir, "ca"))
	if err != nil {
		t.Fatal(err)
	}
	file := filepath.Join(dir, "egress.yaml")
	if err := os.WriteFile(file, data, 0o600); err != nil {
		t.Fatal(err)
	}
	cfg, err := egressselector.ReadEgressSelectorConfiguration(file)
	if err != nil {
		t.Fatalf("kube-apiserver cannot read it: %v\n%s", err, data)
	}
	if errs := egressselector.ValidateEgressSelectorConfiguration(cfg); len(errs) > 0 {
		t.Fatalf("invalid: %v\n%s", errs.ToAggregate(), data)
	}
	byName := map[string]apiserver.Connection{}
	for _, s := range cfg.EgressSelections {
		byName[s.Name] = s.Connection
	}
	cl := byName["cluster"]
	if cl.ProxyProtocol != apiserver.ProtocolHTTPConnect || cl.Transport == nil || cl.Transport.TCP == nil ||
		cl.Transport.TCP.URL != "https://tendril-server.shoot--p--s.svc:9443" {
		t.Errorf("cluster selection %+v", cl)
	}
	for _, n := range []string{"controlplane", "etcd"} {
		if byName[n].ProxyProtocol != apiserver.ProtocolDirect {
			t.Errorf("%s: %+v", n, byName[n])
		}
	}
	// The file kube-apiserver really gets names the mount paths.
	real, err := EgressSelectorConfig("ns")
	if err != nil {
		t.Fatal(err)
	}
	for _, p := range []string{MountPathClient + "/tls.crt", MountPathClient + "/tls.key", MountPathCA + "/bundle.crt", "apiVersion: apiserver.k8s.io/v1beta1"} {
		if !strings.Contains(string(real), p) {
			t.Errorf("config lacks %q:\n%s", p, real)
		}
	}
}
