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
	"k8s.io/utils/ptr"

	tendrilv1alpha1 "github.com/tendril-net/tendril/apis/tendril/v1alpha1"
)

const relayImage = "example.org/tendril:v1"

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
	for _, mode := range tendrilv1alpha1.EgressModes {
		m := Mutation{Egress: mode, Secrets: secrets, Config: "cfg", RelayImage: relayImage}
		for _, tt := range tests {
			t.Run(string(mode)+"/"+tt.name, func(t *testing.T) {
				d := deployment(slices.Clone(tt.command), slices.Clone(tt.args))
				if err := MutateDeployment(d, m); err != nil {
					t.Fatal(err)
				}
				c := d.Spec.Template.Spec.Containers[0]
				if !slices.Equal(c.Command, tt.wantCmd) || !slices.Equal(c.Args, tt.wantArg) {
					t.Errorf("command %q args %q, want %q %q", c.Command, c.Args, tt.wantCmd, tt.wantArg)
				}
				if got := d.Spec.Template.Spec.Containers[1].Args; !slices.Equal(got, []string{gardenerEgressFlag}) {
					t.Errorf("other container changed: %q", got)
				}
				checkVolumes(t, d, m)
				again := d.DeepCopy()
				if err := MutateDeployment(again, m); err != nil {
					t.Fatal(err)
				}
				if !reflect.DeepEqual(d, again) {
					t.Errorf("second mutation changed the deployment:\n%+v\n%+v", d.Spec.Template, again.Spec.Template)
				}
			})
		}
	}
}

// TestMutateDeploymentRelay: the relay sidecar's command line, mounts and user in both relayed
// modes (each serves only its mode's socket, the configuration's udsName); switching the mode
// any way leaves nothing of the one before behind.
func TestMutateDeploymentRelay(t *testing.T) {
	for _, tc := range []struct {
		mode   tendrilv1alpha1.EgressMode
		socket string // the relay's socket flag
	}{
		{tendrilv1alpha1.EgressGRPC, "--socket=/var/run/tendril-egress/tendril-server.sock"},
		{tendrilv1alpha1.EgressHTTPConnectRelay, "--connect-socket=/var/run/tendril-egress/tendril-server-connect.sock"},
	} {
		t.Run(string(tc.mode), func(t *testing.T) { testMutateDeploymentRelay(t, tc.mode, tc.socket) })
	}
}

func testMutateDeploymentRelay(t *testing.T, mode tendrilv1alpha1.EgressMode, socketArg string) {
	secrets := Secrets{Client: "client-1", CABundle: "bundle-1"}
	relayed := Mutation{Egress: mode, Secrets: secrets, Config: string(mode), RelayImage: relayImage}
	d := deployment([]string{"/usr/local/bin/kube-apiserver"}, []string{gardenerEgressFlag})
	d.Spec.Template.Spec.InitContainers = []corev1.Container{{Name: "gardener-init"}}
	d.Spec.Template.Spec.Containers[0].SecurityContext = &corev1.SecurityContext{RunAsUser: ptr.To[int64](65532), RunAsNonRoot: ptr.To(true)}
	if err := MutateDeployment(d, relayed); err != nil {
		t.Fatal(err)
	}
	inits := d.Spec.Template.Spec.InitContainers
	if len(inits) != 2 || inits[0].Name != "gardener-init" || inits[1].Name != ContainerNameRelay {
		t.Fatalf("init containers %+v", inits)
	}
	r := inits[1]
	wantArgs := []string{
		socketArg,
		"--server=tendril-server.shoot--p--s.svc:8090",
		"--server-name=tendril-server.shoot--p--s.svc",
		"--tls-cert-file=/etc/kubernetes/tendril/client/tls.crt",
		"--tls-key-file=/etc/kubernetes/tendril/client/tls.key",
		"--ca-file=/etc/kubernetes/tendril/ca/bundle.crt",
	}
	if r.Image != relayImage || !slices.Equal(r.Command, []string{"/tendril-egress-relay"}) || !slices.Equal(r.Args, wantArgs) {
		t.Errorf("relay %s %q %q", r.Image, r.Command, r.Args)
	}
	if r.RestartPolicy == nil || *r.RestartPolicy != corev1.ContainerRestartPolicyAlways {
		t.Error("relay is not a native sidecar")
	}
	sc := r.SecurityContext
	if sc == nil || ptr.Deref(sc.RunAsUser, 0) != 65532 || !ptr.Deref(sc.RunAsNonRoot, false) || ptr.Deref(sc.AllowPrivilegeEscalation, true) ||
		!ptr.Deref(sc.ReadOnlyRootFilesystem, false) {
		t.Errorf("relay security context %+v", sc)
	}
	// The relay's socket path is the configuration's UDS name.
	cfg, err := EgressSelectorConfig("shoot--p--s", mode)
	if err != nil {
		t.Fatal(err)
	}
	_, socket, _ := strings.Cut(socketArg, "=")
	if !strings.Contains(string(cfg), "udsName: "+socket+"\n") {
		t.Errorf("socket %s not in the configuration:\n%s", socket, cfg)
	}

	// The mode → each other mode → the mode: each result is what the mode alone gives.
	var others []Mutation
	for _, m := range tendrilv1alpha1.EgressModes {
		if m != mode {
			others = append(others, Mutation{Egress: m, Secrets: secrets, Config: string(m), RelayImage: relayImage})
		}
	}
	fresh := func(m Mutation) *appsv1.Deployment {
		f := deployment([]string{"/usr/local/bin/kube-apiserver"}, []string{gardenerEgressFlag})
		f.Spec.Template.Spec.InitContainers = []corev1.Container{{Name: "gardener-init"}}
		f.Spec.Template.Spec.Containers[0].SecurityContext = d.Spec.Template.Spec.Containers[0].SecurityContext
		if err := MutateDeployment(f, m); err != nil {
			t.Fatal(err)
		}
		return f
	}
	for _, m := range append(others, relayed) {
		if err := MutateDeployment(d, m); err != nil {
			t.Fatal(err)
		}
		want := fresh(m)
		sortVolumes(d)
		sortVolumes(want)
		if !reflect.DeepEqual(d.Spec.Template, want.Spec.Template) {
			t.Errorf("switched to %s:\n%+v\nwant\n%+v", m.Egress, d.Spec.Template, want.Spec.Template)
		}
	}
}

// sortVolumes orders volumes and mounts by name: after a switch they may be in another order.
func sortVolumes(d *appsv1.Deployment) {
	ps := &d.Spec.Template.Spec
	slices.SortFunc(ps.Volumes, func(a, b corev1.Volume) int { return strings.Compare(a.Name, b.Name) })
	for i := range ps.Containers {
		slices.SortFunc(ps.Containers[i].VolumeMounts, func(a, b corev1.VolumeMount) int { return strings.Compare(a.Name, b.Name) })
	}
}

func checkVolumes(t *testing.T, d *appsv1.Deployment, m Mutation) {
	t.Helper()
	s := m.Secrets
	relayed := m.Egress.Relayed()
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
	if v, ok := vols[VolumeNameSocket]; ok != relayed || (relayed && v.EmptyDir == nil) {
		t.Errorf("socket volume %+v (relayed %v)", v, relayed)
	}
	mounts := func(c corev1.Container) map[string]string {
		out := map[string]string{}
		for _, m := range c.VolumeMounts {
			out[m.Name] = m.MountPath
		}
		return out
	}
	want := map[string]string{VolumeNameConfig: MountPathConfig, VolumeNameClient: MountPathClient, VolumeNameCA: MountPathCA, "egress-selection-config": "/etc/kubernetes/egress"}
	if relayed {
		want = map[string]string{VolumeNameConfig: MountPathConfig, VolumeNameSocket: MountPathSocket, "egress-selection-config": "/etc/kubernetes/egress"}
	}
	if got := mounts(ps.Containers[0]); !reflect.DeepEqual(got, want) {
		t.Errorf("kube-apiserver mounts %v, want %v", got, want)
	}
	if len(ps.Containers) != 2 || len(ps.Containers[1].VolumeMounts) != 0 {
		t.Error("sidecar got mounts or containers were added")
	}
	relay := extensionsContainer(ps.InitContainers, ContainerNameRelay)
	if (relay != nil) != relayed {
		t.Errorf("relay sidecar present %v, want %v", relay != nil, relayed)
	}
	if relay != nil {
		wantRelay := map[string]string{VolumeNameClient: MountPathClient, VolumeNameCA: MountPathCA, VolumeNameSocket: MountPathSocket}
		if got := mounts(*relay); !reflect.DeepEqual(got, wantRelay) {
			t.Errorf("relay mounts %v, want %v", got, wantRelay)
		}
	}
	if d.Spec.Template.Annotations[AnnotationChecksumConfig] != checksum("cfg") {
		t.Error("no checksum annotation")
	}
	labels := d.Spec.Template.Labels
	port, other := "9443", "8090"
	if relayed {
		port, other = other, port
	}
	if labels["networking.resources.gardener.cloud/to-tendril-server-tcp-"+port] != "allowed" {
		t.Errorf("network policy label for %s missing: %v", port, labels)
	}
	if _, ok := labels["networking.resources.gardener.cloud/to-tendril-server-tcp-"+other]; ok {
		t.Errorf("network policy label for %s set: %v", other, labels)
	}
}

func extensionsContainer(cs []corev1.Container, name string) *corev1.Container {
	for i := range cs {
		if cs[i].Name == name {
			return &cs[i]
		}
	}
	return nil
}

// TestMutateDeploymentGoAwayChance: a goaway chance sets exactly one --goaway-chance (one
// already there, in either spelling, takes the value in place); without one the flag stays as
// it was, absent or not.
func TestMutateDeploymentGoAwayChance(t *testing.T) {
	secrets := Secrets{Client: "c", CABundle: "b"}
	egress := FlagEgressSelectorConfigFile + "=" + ConfigFile
	for _, tc := range []struct {
		name    string
		chance  string
		args    []string
		wantArg []string
	}{
		{name: "added", chance: "0.001", args: []string{"--v=2"}, wantArg: []string{"--v=2", egress, "--goaway-chance=0.001"}},
		{name: "replaced in place", chance: "0.02", args: []string{"--goaway-chance=0.001", "--v=2"}, wantArg: []string{"--goaway-chance=0.02", "--v=2", egress}},
		{name: "separate value, a second occurrence removed", chance: "0.01", args: []string{"--goaway-chance", "0.001", "--v=2", "--goaway-chance=0.005"}, wantArg: []string{"--goaway-chance=0.01", "--v=2", egress}},
		{name: "unset adds none", args: []string{"--v=2"}, wantArg: []string{"--v=2", egress}},
		{name: "unset keeps what is there", args: []string{"--goaway-chance=0.001"}, wantArg: []string{"--goaway-chance=0.001", egress}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			d := deployment(nil, slices.Clone(tc.args))
			m := Mutation{Secrets: secrets, Config: "cfg", GoAwayChance: tc.chance}
			if err := MutateDeployment(d, m); err != nil {
				t.Fatal(err)
			}
			if got := d.Spec.Template.Spec.Containers[0].Args; !slices.Equal(got, tc.wantArg) {
				t.Errorf("args %q, want %q", got, tc.wantArg)
			}
			if got := d.Spec.Template.Spec.Containers[1].Args; !slices.Equal(got, []string{gardenerEgressFlag}) {
				t.Errorf("other container changed: %q", got)
			}
			again := d.DeepCopy()
			if err := MutateDeployment(again, m); err != nil {
				t.Fatal(err)
			}
			if !reflect.DeepEqual(d, again) {
				t.Errorf("second mutation changed the deployment: %q", again.Spec.Template.Spec.Containers[0].Args)
			}
		})
	}
}

func TestMutateDeploymentErrors(t *testing.T) {
	d := deployment(nil, nil)
	if err := MutateDeployment(d, Mutation{Secrets: Secrets{Client: "c"}}); err == nil {
		t.Error("no CA bundle secret accepted")
	}
	ok := Secrets{Client: "c", CABundle: "b"}
	for _, mode := range []tendrilv1alpha1.EgressMode{tendrilv1alpha1.EgressGRPC, tendrilv1alpha1.EgressHTTPConnectRelay} {
		if err := MutateDeployment(d, Mutation{Egress: mode, Secrets: ok}); err == nil || !strings.Contains(err.Error(), "needs the tendril image") {
			t.Errorf("%s without an image: %v", mode, err)
		}
	}
	if err := MutateDeployment(d, Mutation{Egress: "socks", Secrets: ok}); err == nil || !strings.Contains(err.Error(), "unknown egress mode") {
		t.Errorf("unknown mode: %v", err)
	}
	d.Spec.Template.Spec.Containers = d.Spec.Template.Spec.Containers[1:]
	if err := MutateDeployment(d, Mutation{Secrets: ok}); err == nil || !strings.Contains(err.Error(), "no container") {
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
	data, err := egressSelectorConfig("shoot--p--s", tendrilv1alpha1.EgressHTTPConnect, filepath.Join(dir, "client"), filepath.Join(dir, "ca"))
	if err != nil {
		t.Fatal(err)
	}
	cfg := loadEgressSelectorConfig(t, filepath.Join(dir, "egress.yaml"), data)
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
	real, err := EgressSelectorConfig("ns", "")
	if err != nil {
		t.Fatal(err)
	}
	for _, p := range []string{MountPathClient + "/tls.crt", MountPathClient + "/tls.key", MountPathCA + "/bundle.crt", "apiVersion: apiserver.k8s.io/v1beta1"} {
		if !strings.Contains(string(real), p) {
			t.Errorf("config lacks %q:\n%s", p, real)
		}
	}
}

// loadEgressSelectorConfig writes data to file and reads it with kube-apiserver's loader, failing
// the test unless the loader and the validator accept it.
func loadEgressSelectorConfig(t *testing.T, file string, data []byte) *apiserver.EgressSelectorConfiguration {
	t.Helper()
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
	return cfg
}

// TestEgressSelectorConfigRelayed: kube-apiserver's loader and validator accept the relayed
// modes' configurations, GRPC or HTTPConnect over UDS on the relay's socket for the mode.
func TestEgressSelectorConfigRelayed(t *testing.T) {
	testEgressSelectorConfigUDS(t, tendrilv1alpha1.EgressGRPC, apiserver.ProtocolGRPC, "/var/run/tendril-egress/tendril-server.sock")
	testEgressSelectorConfigUDS(t, tendrilv1alpha1.EgressHTTPConnectRelay, apiserver.ProtocolHTTPConnect, "/var/run/tendril-egress/tendril-server-connect.sock")
	if _, err := EgressSelectorConfig("ns", "socks"); err == nil {
		t.Error("unknown mode accepted")
	}
}

func testEgressSelectorConfigUDS(t *testing.T, mode tendrilv1alpha1.EgressMode, protocol apiserver.ProtocolType, socket string) {
	t.Helper()
	data, err := EgressSelectorConfig("shoot--p--s", mode)
	if err != nil {
		t.Fatal(err)
	}
	cfg := loadEgressSelectorConfig(t, filepath.Join(t.TempDir(), "egress.yaml"), data)
	for _, s := range cfg.EgressSelections {
		c := s.Connection
		switch s.Name {
		case "cluster":
			if c.ProxyProtocol != protocol || c.Transport == nil || c.Transport.UDS == nil || c.Transport.TCP != nil ||
				c.Transport.UDS.UDSName != socket {
				t.Errorf("%s: cluster selection %+v", mode, c)
			}
		default:
			if c.ProxyProtocol != apiserver.ProtocolDirect {
				t.Errorf("%s: %s: %+v", mode, s.Name, c)
			}
		}
	}
}

// TestRelayServersHA: with the HA control plane's two tendril-server replicas the relay sidecar
// dials each by its pod's name (checking the certificate for the Service's name all the same);
// with one, the Service.
func TestRelayServersHA(t *testing.T) {
	for _, tc := range []struct {
		servers int
		want    string
	}{
		{0, "--server=tendril-server.shoot--p--s.svc:8090"},
		{1, "--server=tendril-server.shoot--p--s.svc:8090"},
		{2, "--server=tendril-server-0.tendril-server.shoot--p--s.svc:8090,tendril-server-1.tendril-server.shoot--p--s.svc:8090"},
	} {
		d := deployment([]string{"/usr/local/bin/kube-apiserver"}, nil)
		m := Mutation{Egress: tendrilv1alpha1.EgressGRPC, Secrets: Secrets{Client: "c", CABundle: "b"}, Config: "x", RelayImage: relayImage, Servers: tc.servers}
		if err := MutateDeployment(d, m); err != nil {
			t.Fatal(err)
		}
		args := d.Spec.Template.Spec.InitContainers[len(d.Spec.Template.Spec.InitContainers)-1].Args
		if !slices.Contains(args, tc.want) || !slices.Contains(args, "--server-name=tendril-server.shoot--p--s.svc") {
			t.Errorf("%d servers: relay args %q, want %q and the Service's name", tc.servers, args, tc.want)
		}
	}
}
