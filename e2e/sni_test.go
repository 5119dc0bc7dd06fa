package e2e

import (
	"crypto/tls"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/tendril-net/tendril/internal/host/inherit"
	"github.com/tendril-net/tendril/internal/pki/testpki"
	"github.com/tendril-net/tendril/internal/testing/testwait"
)

var binDir string

func TestMain(m *testing.M) {
	dir, err := os.MkdirTemp("", "tendril-e2e-bin-")
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	binDir = dir
	cmd := exec.Command("go", "build", "-o", dir+"/", "../cmd/tendril-seed", "../cmd/tendril-ingress", "../cmd/tendril-agent", "../cmd/tendril-server",
		"../cmd/tendril-egress-relay")
	cmd.Stdout, cmd.Stderr = os.Stderr, os.Stderr
	if err := cmd.Run(); err != nil {
		fmt.Fprintln(os.Stderr, "build binaries:", err)
		os.Exit(1)
	}
	code := m.Run()
	os.RemoveAll(dir)
	os.Exit(code)
}

// held are the sockets bound for the test's processes and not yet handed over, by address.
var held sync.Map // string → *inherit.Socket

// loopbackAddr binds a port on loopback for a process the test starts: the test knows the address
// at once, and the process inherits the socket (internal/host/inherit), so no other process can take
// the port in between. The process that serves it names it in its listen list.
func loopbackAddr(t *testing.T) string {
	t.Helper()
	return bindAddr(t, "127.0.0.1:0")
}

// bindAddr is loopbackAddr for any address (port 0 picks one), bound the same way.
func bindAddr(t *testing.T, address string) string {
	t.Helper()
	a, err := tryBind(t, address)
	if err != nil {
		t.Fatal(err)
	}
	return a
}

// tryBind is bindAddr returning the error.
func tryBind(t *testing.T, address string) (string, error) {
	s, err := inherit.Bind(address)
	if err != nil {
		return "", err
	}
	held.Store(s.Addr, s)
	t.Cleanup(func() {
		// Never handed over, the socket would have queued connections meant to be refused.
		if _, ok := held.LoadAndDelete(s.Addr); ok {
			s.Close()
			if t.Failed() || t.Skipped() {
				return // ended before its processes started
			}
			t.Errorf("%s was bound for a process that never got it (no listen list names it)", s.Addr)
		}
	})
	return s.Addr, nil
}

// handOver passes the sockets of listen (bound by loopbackAddr or bindAddr) to cmd, and returns
// what closes this process's copies once cmd has started: from then on only cmd holds them.
func handOver(t *testing.T, cmd *exec.Cmd, listen []string) (release func()) {
	t.Helper()
	var socks []*inherit.Socket
	for _, a := range listen {
		v, ok := held.LoadAndDelete(a)
		if !ok {
			t.Fatalf("%s: no socket bound for it (loopbackAddr) or handed over already", a)
		}
		socks = append(socks, v.(*inherit.Socket))
	}
	inherit.Pass(cmd, socks...)
	return func() { inherit.Close(socks...) }
}

// start runs one of tendril's binaries until the test ends; it serves the addresses of listen.
func start(t *testing.T, name string, listen []string, args ...string) {
	t.Helper()
	startBinary(t, name, filepath.Join(binDir, name), listen, args...)
}

// startBinary runs path until the test ends, then stops it with SIGTERM and requires a clean
// exit; name labels its log.
func startBinary(t *testing.T, name, path string, listen []string, args ...string) {
	t.Helper()
	runBinary(t, name, path, false, listen, args...)
}

// runBinary starts path, handing it the sockets of listen, and, when the test ends, stops it
// with SIGTERM and requires a clean exit, printing its log if the test failed. With killable, a
// process the test SIGKILLed is only reaped.
func runBinary(t *testing.T, name, path string, killable bool, listen []string, args ...string) *exec.Cmd {
	t.Helper()
	cmd := exec.Command(path, args...)
	log, err := os.Create(filepath.Join(t.TempDir(), name+".log"))
	if err != nil {
		t.Fatal(err)
	}
	cmd.Stdout, cmd.Stderr = log, log
	release := handOver(t, cmd, listen)
	err = cmd.Start()
	release()
	if err != nil {
		t.Fatal(err)
	}
	done := make(chan error, 1)
	go func() { done <- cmd.Wait() }()
	t.Cleanup(func() {
		_ = cmd.Process.Signal(syscall.SIGTERM)
		select {
		case err := <-done:
			if err != nil && !(killable && killed(err)) {
				t.Errorf("%s exited with %v after SIGTERM", name, err)
			}
		case <-time.After(10 * time.Second):
			_ = cmd.Process.Kill()
			<-done
			t.Errorf("%s did not exit within 10 s of SIGTERM", name)
		}
		if t.Failed() {
			b, _ := os.ReadFile(log.Name())
			t.Logf("%s log:\n%s", name, b)
		}
	})
	return cmd
}

// eventually polls f every 20 ms until it returns nil (testwait.Every).
func eventually(t *testing.T, what string, f func() error) {
	t.Helper()
	testwait.Every(t, 20*time.Millisecond, what, f)
}

// every runs f every interval, on a goroutine wg waits for, until stop is closed.
func every(wg *sync.WaitGroup, stop <-chan struct{}, interval time.Duration, f func()) {
	wg.Add(1)
	go func() {
		defer wg.Done()
		tick := time.NewTicker(interval)
		defer tick.Stop()
		for {
			select {
			case <-stop:
				return
			case <-tick.C:
			}
			f()
		}
	}()
}

func get(url string) (string, error) {
	r, err := http.Get(url)
	if err != nil {
		return "", err
	}
	defer r.Body.Close()
	b, err := io.ReadAll(r.Body)
	if r.StatusCode != http.StatusOK {
		return string(b), fmt.Errorf("%s: %s", url, r.Status)
	}
	return string(b), err
}

// TestSNIPathBinaries runs tendril-seed with a route file and tendril-ingress against it, reaches
// two shoots by server name, then edits the route file while both run: a new shoot appears, a bad
// edit is refused with the last good routes still served, a removed shoot is refused.
func TestSNIPathBinaries(t *testing.T) {
	ca, err := testpki.NewCA("e2e CA")
	if err != nil {
		t.Fatal(err)
	}
	shoots := map[string]string{} // host → upstream address
	for _, n := range []string{"alpha", "beta", "gamma"} {
		host := "api." + n + ".e2e.test"
		shoots[host] = upstream(t, ca, host)
	}
	routeFile := filepath.Join(t.TempDir(), "routes.yaml")
	writeRoutes := func(content string) {
		t.Helper()
		tmp := routeFile + ".tmp"
		if err := os.WriteFile(tmp, []byte(content), 0o644); err != nil {
			t.Fatal(err)
		}
		if err := os.Rename(tmp, routeFile); err != nil {
			t.Fatal(err)
		}
	}
	route := func(hosts ...string) string {
		var b strings.Builder
		b.WriteString("shoots:\n")
		for _, h := range hosts {
			name := "shoot--e2e--" + strings.Split(h, ".")[1]
			fmt.Fprintf(&b, "- name: %s\n  hosts: [%s]\n  apiserver: %s\n", name, h, shoots[h])
		}
		return b.String()
	}
	writeRoutes(route("api.alpha.e2e.test", "api.beta.e2e.test"))

	xdsAddr, seedMetrics, sniAddr, ingressMetrics := loopbackAddr(t), loopbackAddr(t), loopbackAddr(t), loopbackAddr(t)
	xdsSeed, xdsIngress := xdsTLS(t)
	start(t, "tendril-seed", []string{xdsAddr, seedMetrics}, append([]string{"--routes", routeFile, "--xds-address", xdsAddr, "--metrics-address", seedMetrics}, xdsSeed...)...)
	start(t, "tendril-ingress", []string{sniAddr, ingressMetrics}, append([]string{"--xds", xdsAddr, "--node-id", "e2e", "--sni-address", sniAddr, "--metrics-address", ingressMetrics}, xdsIngress...)...)
	eventually(t, "ingress ready", func() error { _, err := get("http://" + ingressMetrics + "/readyz"); return err })
	eventually(t, "seed ready", func() error { _, err := get("http://" + seedMetrics + "/readyz"); return err })

	reach := func(host string) error { return reachSNI(sniAddr, host, ca) }
	refused := func(host string) error {
		if err := reach(host); err == nil {
			return fmt.Errorf("%s is still reachable", host)
		}
		return nil
	}
	eventually(t, "alpha", func() error { return reach("api.alpha.e2e.test") })
	eventually(t, "beta", func() error { return reach("api.beta.e2e.test") })
	if err := refused("api.gamma.e2e.test"); err != nil {
		t.Fatal(err)
	}

	writeRoutes(route("api.alpha.e2e.test", "api.beta.e2e.test", "api.gamma.e2e.test"))
	eventually(t, "gamma after the file gained it", func() error { return reach("api.gamma.e2e.test") })

	writeRoutes("shoots:\n- name: shoot--e2e--alpha\n  hosts: [API.ALPHA]\n") // invalid
	time.Sleep(500 * time.Millisecond)                                        // the reload happens and is refused
	for _, h := range []string{"api.alpha.e2e.test", "api.beta.e2e.test", "api.gamma.e2e.test"} {
		if err := reach(h); err != nil {
			t.Fatalf("%s after a bad route file: %v (the last good routes must stay)", h, err)
		}
	}

	writeRoutes(route("api.alpha.e2e.test"))
	eventually(t, "beta refused after removal", func() error { return refused("api.beta.e2e.test") })
	if err := reach("api.alpha.e2e.test"); err != nil {
		t.Fatal(err)
	}
	m, err := get("http://" + ingressMetrics + "/metrics")
	if err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(m, `tendril_ingress_connections_total{cluster="",listener="sni",outcome="unknown_route"}`) {
		t.Errorf("ingress metrics lack the refused connections:\n%s", m)
	}
}

// upstream serves TLS for host and answers every connection with the host name.
// reachSNI opens a TLS connection with server name host through the ingress's SNI listener at
// sniAddr and checks that the upstream behind it is host's (upstream writes its name and closes).
func reachSNI(sniAddr, host string, ca *testpki.CA) error {
	c, err := tls.DialWithDialer(&net.Dialer{Timeout: 5 * time.Second}, "tcp", sniAddr, &tls.Config{ServerName: host, RootCAs: ca.Pool})
	if err != nil {
		return err
	}
	defer c.Close()
	b, err := io.ReadAll(c)
	if err != nil {
		return err
	}
	if string(b) != host {
		return fmt.Errorf("reached %q", b)
	}
	return nil
}

func upstream(t *testing.T, ca *testpki.CA, host string) string {
	t.Helper()
	cert, err := ca.Leaf(host)
	if err != nil {
		t.Fatal(err)
	}
	l, err := tls.Listen("tcp", "127.0.0.1:0", &tls.Config{Certificates: []tls.Certificate{cert}})
	if err != nil {
		t.Fatal(err)
	}
	done := make(chan struct{})
	go func() {
		defer close(done)
		for {
			c, err := l.Accept()
			if err != nil {
				return
			}
			go func() {
				defer c.Close()
				_ = c.SetDeadline(time.Now().Add(10 * time.Second))
				_, _ = io.WriteString(c, host)
			}()
		}
	}()
	t.Cleanup(func() {
		l.Close()
		<-done
	})
	return l.Addr().String()
}
