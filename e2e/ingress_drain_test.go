package e2e

import (
	"bufio"
	"context"
	"crypto/tls"
	"encoding/json"
	"errors"
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

	"github.com/tendril-net/tendril/internal/pki/testpki"
)

// TestIngressRolloutWithoutDrops replaces a tendril-ingress replica while clients watch through
// it, as a rolling update does: the new replica is ready, the old one gets SIGTERM. The old one
// fails /readyz at once and refuses new connections, so the load balancer (played by the test:
// it sends new connections to a ready replica) uses the new one; a watch in the middle of a
// transfer finishes it in full through the draining replica; a watch that never ends is closed
// at the end of --drain-timeout, counted, and the old process exits cleanly.
func TestIngressRolloutWithoutDrops(t *testing.T) {
	// The drain timeout is the deadline for everything the test does between SIGTERM and the
	// end of the transfer (a few loopback requests).
	const drainTimeout = 8 * time.Second
	const host = "api.watch.e2e.test"
	ca, err := testpki.NewCA("e2e CA")
	if err != nil {
		t.Fatal(err)
	}
	api := startWatchServer(t, ca, host)
	routeFile := filepath.Join(t.TempDir(), "routes.yaml")
	routes := fmt.Sprintf("shoots:\n- name: shoot--e2e--watch\n  hosts: [%s]\n  apiserver: %s\n", host, api.addr)
	if err := os.WriteFile(routeFile, []byte(routes), 0o644); err != nil {
		t.Fatal(err)
	}
	xdsAddr, seedMetrics := loopbackAddr(t), loopbackAddr(t)
	xdsSeed, xdsIngress := xdsTLS(t)
	start(t, "tendril-seed", []string{xdsAddr, seedMetrics}, append([]string{"--routes", routeFile, "--xds-address", xdsAddr, "--metrics-address", seedMetrics}, xdsSeed...)...)

	oldSNI, oldMetrics, newSNI, newMetrics := loopbackAddr(t), loopbackAddr(t), loopbackAddr(t), loopbackAddr(t)
	old := startProcess(t, "tendril-ingress-old", filepath.Join(binDir, "tendril-ingress"), []string{oldSNI, oldMetrics}, append([]string{"--xds", xdsAddr, "--node-id", "e2e-old",
		"--sni-address", oldSNI, "--metrics-address", oldMetrics, "--drain-timeout", drainTimeout.String(), "--drain-delay", "0"}, xdsIngress...)...)
	start(t, "tendril-ingress", []string{newSNI, newMetrics}, append([]string{"--xds", xdsAddr, "--node-id", "e2e-new", "--sni-address", newSNI, "--metrics-address", newMetrics}, xdsIngress...)...)
	replicas := map[string]string{oldSNI: oldMetrics, newSNI: newMetrics}
	attempt := 0
	for sni, m := range replicas {
		eventually(t, "replica "+sni+" ready", func() error { _, err := get("http://" + m + "/readyz"); return err })
		eventually(t, "watch through "+sni, func() error {
			attempt++
			name := fmt.Sprintf("probe-%d", attempt)
			w, err := openWatch(ca, sni, host, name)
			if err != nil {
				return err
			}
			defer w.close()
			api.finish(name)
			return w.readAll(1)
		})
	}

	// Two watches through the old replica: one will transfer 1 MiB of events and end, the other
	// stays idle.
	transfer, err := openWatch(ca, oldSNI, host, "transfer")
	if err != nil {
		t.Fatal(err)
	}
	defer transfer.close()
	idle, err := openWatch(ca, oldSNI, host, "idle")
	if err != nil {
		t.Fatal(err)
	}
	defer idle.close()
	for _, w := range []*watch{transfer, idle} {
		if err := w.next(1); err != nil {
			t.Fatalf("watch %s: %v", w.name, err)
		}
	}
	// The probe watches' connections are gone once the relay has seen both ends close.
	eventually(t, "the two watches, and only they, proxied by the old replica", func() error {
		m, err := get("http://" + oldMetrics + "/metrics")
		if err != nil {
			return err
		}
		if !strings.Contains(m, `tendril_ingress_active_connections{listener="sni"} 2`+"\n") {
			return fmt.Errorf("metrics: %s", grepLines(m, "tendril_ingress_active"))
		}
		return nil
	})

	sigterm := time.Now()
	if err := old.cmd.Process.Signal(syscall.SIGTERM); err != nil {
		t.Fatal(err)
	}
	eventually(t, "old replica not ready", func() error {
		r, err := http.Get("http://" + oldMetrics + "/readyz")
		if err != nil {
			return fmt.Errorf("/readyz must answer through the drain: %w", err)
		}
		b, _ := io.ReadAll(r.Body)
		r.Body.Close()
		if r.StatusCode != http.StatusServiceUnavailable || !strings.Contains(string(b), "draining") {
			return fmt.Errorf("/readyz: %s %q, want 503 draining", r.Status, b)
		}
		return nil
	})
	eventually(t, "old replica refusing new connections", func() error {
		c, err := net.DialTimeout("tcp", oldSNI, time.Second)
		if errors.Is(err, syscall.ECONNREFUSED) {
			return nil
		}
		if err == nil {
			c.Close()
		}
		return fmt.Errorf("a new connection to the draining replica: %v, want refused", err)
	})

	// The load balancer sends new connections to the ready replicas: the new one only.
	var ready []string
	for sni, m := range replicas {
		if _, err := get("http://" + m + "/readyz"); err == nil {
			ready = append(ready, sni)
		}
	}
	if len(ready) != 1 || ready[0] != newSNI {
		t.Fatalf("ready replicas %v, want only the new one %s", ready, newSNI)
	}
	fresh, err := openWatch(ca, newSNI, host, "fresh")
	if err != nil {
		t.Fatalf("new watch through the new replica: %v", err)
	}
	api.finish("fresh")
	if err := fresh.readAll(1); err != nil {
		t.Fatalf("new watch through the new replica: %v", err)
	}
	fresh.close()

	// The transfer under way finishes through the draining replica, every byte.
	api.send("transfer", transferEvents)
	api.finish("transfer")
	if err := transfer.readAll(1 + transferEvents); err != nil {
		t.Fatalf("watch transfer through the draining replica: %v", err)
	}
	transfer.close()
	// The idle watch is still served: an event sent now arrives.
	api.send("idle", 1)
	if err := idle.next(2); err != nil {
		t.Fatalf("idle watch during the drain: %v", err)
	}

	select {
	case err := <-old.done:
		if err != nil {
			t.Fatalf("old replica exited with %v after SIGTERM", err)
		}
	case <-time.After(drainTimeout + 15*time.Second):
		t.Fatalf("old replica did not exit within the drain timeout %v (+15 s)", drainTimeout)
	}
	if took := time.Since(sigterm); took < drainTimeout {
		t.Errorf("old replica exited %v after SIGTERM, before its drain timeout %v, with a watch open", took, drainTimeout)
	}
	if err := idle.next(3); err == nil {
		t.Error("the idle watch is still open after the old replica exited")
	}
	drained := old.logLine(t, "Drained")
	var closed map[string]int
	if err := json.Unmarshal(drained["closed"], &closed); err != nil || closed["sni"] != 1 {
		t.Errorf("old replica's Drained log: closed %s (%v), want sni 1", drained["closed"], err)
	}
	draining := old.logLine(t, "Draining")
	var open map[string]int
	if err := json.Unmarshal(draining["open"], &open); err != nil || open["sni"] != 2 {
		t.Errorf("old replica's Draining log: open %s (%v), want sni 2", draining["open"], err)
	}
	// The new replica goes on serving.
	if _, err := get("http://" + newMetrics + "/readyz"); err != nil {
		t.Errorf("new replica: %v", err)
	}
}

// transferEvents × eventPayload: 1 MiB, more than the sockets buffer, so it is really relayed.
const (
	transferEvents = 16
	eventPayload   = 64 << 10
)

// event is the seq-th event of a watch, one line of JSON with eventPayload bytes of data.
func event(name string, seq int) string {
	data := strings.Repeat(fmt.Sprintf("%s-%d.", name, seq), eventPayload/len(name))[:eventPayload]
	return fmt.Sprintf(`{"type":"MODIFIED","object":{"name":%q,"seq":%d,"data":%q}}`, name, seq, data) + "\n"
}

// watchServer is a kube-apiserver stand-in: GET /watch?name=N streams N's events as chunked JSON
// lines, as a watch does; the test sends them (send) and ends the response (finish).
type watchServer struct {
	addr   string
	mu     sync.Mutex
	events map[string]chan int // the count of events to send; closed: end the response
	done   chan struct{}
}

func startWatchServer(t *testing.T, ca *testpki.CA, host string) *watchServer {
	t.Helper()
	cert, err := ca.Leaf(host)
	if err != nil {
		t.Fatal(err)
	}
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	s := &watchServer{addr: l.Addr().String(), events: map[string]chan int{}, done: make(chan struct{})}
	srv := &http.Server{Handler: http.HandlerFunc(s.serve), ReadHeaderTimeout: 10 * time.Second}
	served := make(chan struct{})
	go func() {
		defer close(served)
		_ = srv.Serve(tls.NewListener(l, &tls.Config{Certificates: []tls.Certificate{cert}}))
	}()
	t.Cleanup(func() {
		close(s.done)
		srv.Close()
		<-served
	})
	return s
}

func (s *watchServer) ch(name string) chan int {
	s.mu.Lock()
	defer s.mu.Unlock()
	c := s.events[name]
	if c == nil {
		c = make(chan int, 64)
		s.events[name] = c
	}
	return c
}

func (s *watchServer) send(name string, n int) { s.ch(name) <- n }
func (s *watchServer) finish(name string)      { close(s.ch(name)) }

func (s *watchServer) serve(w http.ResponseWriter, r *http.Request) {
	name := r.URL.Query().Get("name")
	if r.URL.Path != "/watch" || name == "" {
		http.NotFound(w, r)
		return
	}
	w.Header().Set("Content-Type", "application/json")
	seq := 1
	write := func() bool {
		if _, err := io.WriteString(w, event(name, seq)); err != nil {
			return false
		}
		seq++
		http.NewResponseController(w).Flush()
		return true
	}
	if !write() { // the initial event, at once
		return
	}
	events := s.ch(name)
	for {
		select {
		case n, ok := <-events:
			if !ok {
				return
			}
			for range n {
				if !write() {
					return
				}
			}
		case <-r.Context().Done():
			return
		case <-s.done:
			return
		}
	}
}

// watch is one client watch through an ingress replica, on a connection of its own.
type watch struct {
	name string
	tr   *http.Transport
	resp *http.Response
	r    *bufio.Reader
	seq  int
}

func openWatch(ca *testpki.CA, ingress, host, name string) (*watch, error) {
	tr := &http.Transport{
		DisableKeepAlives: true,
		DialTLSContext: func(ctx context.Context, _, _ string) (net.Conn, error) {
			c, err := (&net.Dialer{Timeout: 5 * time.Second}).DialContext(ctx, "tcp", ingress)
			if err != nil {
				return nil, err
			}
			tc := tls.Client(c, &tls.Config{ServerName: host, RootCAs: ca.Pool})
			if err := tc.HandshakeContext(ctx); err != nil {
				c.Close()
				return nil, err
			}
			return tc, nil
		},
	}
	// A watch has no overall timeout (next bounds each read); the header must come at once.
	tr.ResponseHeaderTimeout = 10 * time.Second
	resp, err := (&http.Client{Transport: tr}).Get("https://" + host + "/watch?name=" + name)
	if err != nil {
		tr.CloseIdleConnections()
		return nil, err
	}
	if resp.StatusCode != http.StatusOK {
		resp.Body.Close()
		return nil, fmt.Errorf("watch %s: %s", name, resp.Status)
	}
	return &watch{name: name, tr: tr, resp: resp, r: bufio.NewReaderSize(resp.Body, eventPayload+256)}, nil
}

// next reads events up to seq, each checked byte for byte, within a deadline.
func (w *watch) next(seq int) error {
	done := make(chan error, 1)
	go func() {
		for w.seq < seq {
			line, err := w.r.ReadString('\n')
			if err != nil {
				done <- fmt.Errorf("after event %d: %w", w.seq, err)
				return
			}
			if want := event(w.name, w.seq+1); line != want {
				done <- fmt.Errorf("event %d: %d bytes differ from the %d sent", w.seq+1, len(line), len(want))
				return
			}
			w.seq++
		}
		done <- nil
	}()
	select {
	case err := <-done:
		return err
	case <-time.After(15 * time.Second):
		w.close() // ends the read
		<-done
		return fmt.Errorf("watch %s: no event %d within 15 s", w.name, w.seq+1)
	}
}

// readAll reads events up to seq and then the end of the response: the whole body arrived.
func (w *watch) readAll(seq int) error {
	if err := w.next(seq); err != nil {
		return err
	}
	b, err := io.ReadAll(w.r)
	if err != nil || len(b) > 0 {
		return fmt.Errorf("watch %s after event %d: %d more bytes, %v; want the end of the response", w.name, seq, len(b), err)
	}
	return nil
}

func (w *watch) close() {
	w.resp.Body.Close()
	w.tr.CloseIdleConnections()
}

// process is a binary the test stops itself; its exit is reported on done.
type process struct {
	cmd  *exec.Cmd
	log  string
	done chan error
}

func startProcess(t *testing.T, name, path string, listen []string, args ...string) *process {
	t.Helper()
	p := &process{cmd: exec.Command(path, args...), log: filepath.Join(t.TempDir(), name+".log"), done: make(chan error, 1)}
	f, err := os.Create(p.log)
	if err != nil {
		t.Fatal(err)
	}
	p.cmd.Stdout, p.cmd.Stderr = f, f
	release := handOver(t, p.cmd, listen)
	err = p.cmd.Start()
	release()
	if err != nil {
		t.Fatal(err)
	}
	exited := make(chan struct{})
	go func() {
		defer close(exited)
		p.done <- p.cmd.Wait()
		f.Close()
	}()
	t.Cleanup(func() {
		_ = p.cmd.Process.Kill() // no-op once it has exited
		<-exited
		if t.Failed() {
			b, _ := os.ReadFile(p.log)
			t.Logf("%s log:\n%s", name, b)
		}
	})
	return p
}

// logLine returns the fields of the process's first JSON log line with message msg.
func (p *process) logLine(t *testing.T, msg string) map[string]json.RawMessage {
	t.Helper()
	b, err := os.ReadFile(p.log)
	if err != nil {
		t.Fatal(err)
	}
	for _, line := range strings.Split(string(b), "\n") {
		var m map[string]json.RawMessage
		if json.Unmarshal([]byte(line), &m) != nil {
			continue
		}
		if string(m["msg"]) == fmt.Sprintf("%q", msg) {
			return m
		}
	}
	t.Fatalf("no %q line in the log:\n%s", msg, b)
	return nil
}
