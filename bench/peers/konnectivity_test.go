package peers

import (
	"slices"
	"strings"
	"testing"
)

func TestKonnectivityArgs(t *testing.T) {
	k := Konnectivity{CacheDir: t.TempDir()}
	if k.Built() {
		t.Fatal("an empty cache counts as built")
	}
	args, err := k.ServerArgs(KonnectivityServerConfig{Mode: "http-connect", Frontend: "127.0.0.1:1", ServerCert: "s.pem", ServerKey: "s-key.pem",
		ServerCA: "ca.pem", AgentListen: "10.0.0.1:2", ClusterCert: "c.pem", ClusterKey: "c-key.pem", Admin: "127.0.0.1:3", Health: "127.0.0.1:4"})
	if err != nil {
		t.Fatal(err)
	}
	line := strings.Join(args, " ")
	for _, want := range []string{"/proxy-server --mode http-connect", "--server-port 1", "--agent-bind-address 10.0.0.1 --agent-port 2",
		"--cluster-cert c.pem --cluster-key c-key.pem", "--server-ca-cert ca.pem", "--health-port 4"} {
		if !strings.Contains(line, want) {
			t.Errorf("proxy-server %s lacks %q", line, want)
		}
	}
	if _, err := k.ServerArgs(KonnectivityServerConfig{Mode: "udp"}); err == nil {
		t.Error("mode udp accepted")
	}
	args, err = k.AgentArgs(KonnectivityAgentConfig{Server: "10.0.0.1:2", CA: "ca.pem", Cert: "a.pem", Key: "a-key.pem", Admin: "127.0.0.1:5", Health: "127.0.0.1:6"})
	if err != nil {
		t.Fatal(err)
	}
	if !slices.Contains(args, "--proxy-server-host") || !strings.HasSuffix(args[0], "/proxy-agent") {
		t.Errorf("proxy-agent %q", args)
	}
	if got := jsonField([]byte("{\n\t\"Path\": \"x\",\n\t\"Dir\": \"/root/go/pkg/mod/sigs.k8s.io/a@v1\",\n}\n"), "Dir"); got != "/root/go/pkg/mod/sigs.k8s.io/a@v1" {
		t.Errorf("jsonField = %q", got)
	}
}
