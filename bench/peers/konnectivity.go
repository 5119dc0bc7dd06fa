package peers

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
)

// KonnectivityModule is the module of konnectivity's proxy-server and
// proxy-agent, and KonnectivityVersion the version built: the newest the
// Go module proxy serves here.
const (
	KonnectivityModule  = "sigs.k8s.io/apiserver-network-proxy"
	KonnectivityVersion = "v0.36.0"
	konnectivityClient  = "sigs.k8s.io/apiserver-network-proxy/konnectivity-client"
)

// Konnectivity is konnectivity's own proxy-server (seed) and proxy-agent
// (shoot), the peer of tendril-server's egress front-ends: kube-apiserver
// reaches the shoot through the server's front-end (gRPC ProxyService or
// HTTP CONNECT, one mode per server process, over mutual TLS), and the
// server forwards each connection over the one gRPC stream the agent keeps to
// it.
//
// No distribution ships it, so Build compiles both from the Go module proxy
// into CacheDir, once: the module's go.mod replaces konnectivity-client with
// a folder that the module zip lacks, so the build runs in a writable copy
// of the module with that replace dropped and konnectivity-client required
// at the same version. This file builds and says how to start each; the
// caller owns the processes, namespaces and certificates. proxy-agent
// ignores SIGTERM: stop it with SIGKILL.
type Konnectivity struct {
	// CacheDir receives the build (CacheDir/konnectivity-<version>/);
	// "" means the user's cache directory + "/tendril-bench".
	CacheDir string
	// Go is the go command for the build; "" means "go" from PATH.
	Go string
}

// Name is the peer's name in reports.
func (Konnectivity) Name() string { return "konnectivity" }

// Dir is where the build lives.
func (k Konnectivity) Dir() (string, error) {
	dir := k.CacheDir
	if dir == "" {
		c, err := os.UserCacheDir()
		if err != nil {
			return "", fmt.Errorf("konnectivity: no cache directory (set one): %w", err)
		}
		dir = filepath.Join(c, "tendril-bench")
	}
	return filepath.Join(dir, "konnectivity-"+KonnectivityVersion), nil
}

// Bins returns the paths of proxy-server and proxy-agent (built or not).
func (k Konnectivity) Bins() (server, agent string, err error) {
	dir, err := k.Dir()
	if err != nil {
		return "", "", err
	}
	return filepath.Join(dir, "bin", "proxy-server"), filepath.Join(dir, "bin", "proxy-agent"), nil
}

// Built reports whether both binaries are in the cache.
func (k Konnectivity) Built() bool {
	s, a, err := k.Bins()
	if err != nil {
		return false
	}
	for _, b := range []string{s, a} {
		if st, err := os.Stat(b); err != nil || st.Mode()&0o111 == 0 {
			return false
		}
	}
	return true
}

func (k Konnectivity) goBin() (string, error) {
	name := k.Go
	if name == "" {
		name = "go"
	}
	p, err := exec.LookPath(name)
	if err != nil {
		return "", fmt.Errorf("konnectivity: not built, and no go command to build it: %w", err)
	}
	return p, nil
}

// Check reports why konnectivity cannot run here: neither built nor
// buildable (no go command).
func (k Konnectivity) Check(context.Context) error {
	if k.Built() {
		return nil
	}
	_, err := k.goBin()
	return err
}

// Version names what runs.
func (k Konnectivity) Version() string {
	return "konnectivity proxy-server/proxy-agent " + KonnectivityVersion + " (" + KonnectivityModule + ")"
}

// EnsureBuilt builds proxy-server and proxy-agent (Build) unless they are
// built: it says so through logf first, as the build takes minutes, and
// writes the go command's output to logFile.
func (k Konnectivity) EnsureBuilt(ctx context.Context, logFile string, logf func(string, ...any)) error {
	if k.Built() {
		return nil
	}
	d, _ := k.Dir()
	logf("konnectivity: building proxy-server and proxy-agent %s into %s (once; a few minutes)", KonnectivityVersion, d)
	f, err := os.Create(logFile)
	if err != nil {
		return err
	}
	err = k.Build(ctx, f)
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	if err != nil {
		return fmt.Errorf("konnectivity: build (log %s): %w", logFile, err)
	}
	return nil
}

// Build compiles proxy-server and proxy-agent into the cache unless both are
// there already. It needs the Go module proxy the first time (a few minutes
// on 2 cores); the go command's output goes to log. The go command runs with
// GOFLAGS=-mod=mod and GOTOOLCHAIN=local: the module's go directive must not
// be newer than the local toolchain.
func (k Konnectivity) Build(ctx context.Context, log io.Writer) error {
	if k.Built() {
		return nil
	}
	goBin, err := k.goBin()
	if err != nil {
		return err
	}
	dir, err := k.Dir()
	if err != nil {
		return err
	}
	serverBin, agentBin, _ := k.Bins()
	if log == nil {
		log = io.Discard
	}
	env := append(os.Environ(), "GOFLAGS=-mod=mod", "GOTOOLCHAIN=local", "GOWORK=off", "CGO_ENABLED=0")
	run := func(wd string, args ...string) ([]byte, error) {
		cmd := exec.CommandContext(ctx, goBin, args...)
		cmd.Dir, cmd.Env = wd, env
		var out bytes.Buffer
		cmd.Stdout, cmd.Stderr = &out, io.MultiWriter(&out, log)
		err := cmd.Run()
		if err != nil {
			return out.Bytes(), fmt.Errorf("go %s: %w: %s", strings.Join(args, " "), err, lastLines(out.String(), 5))
		}
		return out.Bytes(), nil
	}
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return fmt.Errorf("konnectivity: %w", err)
	}
	// The module's source, from the module cache (download fills it).
	out, err := run(dir, "mod", "download", "-json", KonnectivityModule+"@"+KonnectivityVersion)
	if err != nil {
		return fmt.Errorf("konnectivity: %w", err)
	}
	modDir := jsonField(out, "Dir")
	if modDir == "" {
		return fmt.Errorf("konnectivity: go mod download named no directory: %s", lastLines(string(out), 5))
	}
	src := filepath.Join(dir, "src")
	if err := os.RemoveAll(src); err != nil {
		return fmt.Errorf("konnectivity: %w", err)
	}
	if err := copyTree(modDir, src); err != nil {
		return fmt.Errorf("konnectivity: copy %s: %w", modDir, err)
	}
	if _, err := run(src, "mod", "edit", "-dropreplace="+konnectivityClient,
		"-require="+konnectivityClient+"@"+KonnectivityVersion); err != nil {
		return fmt.Errorf("konnectivity: %w", err)
	}
	tmp := filepath.Join(dir, "bin.tmp")
	_ = os.RemoveAll(tmp)
	if err := os.MkdirAll(tmp, 0o755); err != nil {
		return fmt.Errorf("konnectivity: %w", err)
	}
	if _, err := run(src, "build", "-trimpath", "-o", filepath.Join(tmp, "proxy-server"), "./cmd/server"); err != nil {
		return fmt.Errorf("konnectivity: %w", err)
	}
	if _, err := run(src, "build", "-trimpath", "-o", filepath.Join(tmp, "proxy-agent"), "./cmd/agent"); err != nil {
		return fmt.Errorf("konnectivity: %w", err)
	}
	// Both binaries appear at once, so an interrupted build is redone.
	_ = os.RemoveAll(filepath.Dir(serverBin))
	if err := os.Rename(tmp, filepath.Dir(serverBin)); err != nil {
		return fmt.Errorf("konnectivity: %w", err)
	}
	_ = os.RemoveAll(src)
	if !k.Built() {
		return fmt.Errorf("konnectivity: build left no %s and %s", serverBin, agentBin)
	}
	return nil
}

// KonnectivityServerConfig is one proxy-server.
type KonnectivityServerConfig struct {
	// Mode is "grpc" or "http-connect".
	Mode string
	// Frontend is kube-apiserver's side (ip:port), mutual TLS with
	// ServerCert/ServerKey, clients verified against ServerCA.
	Frontend                        string
	ServerCert, ServerKey, ServerCA string
	// AgentListen is the agents' side (ip:port), TLS with ClusterCert and
	// ClusterKey; agents' certificates verified against ClusterCA if set.
	AgentListen                        string
	ClusterCert, ClusterKey, ClusterCA string
	// Admin and Health are the admin and health ports' addresses (ip:port).
	Admin, Health string
	// UDS, if set, is a Unix socket path for kube-apiserver's side instead of Frontend: no TLS,
	// as when proxy-server runs beside kube-apiserver in its pod (Frontend and the Server*
	// files are then not used).
	UDS string
}

// ServerArgs returns proxy-server's command line for c.
func (k Konnectivity) ServerArgs(c KonnectivityServerConfig) ([]string, error) {
	bin, _, err := k.Bins()
	if err != nil {
		return nil, err
	}
	if c.Mode != "grpc" && c.Mode != "http-connect" {
		return nil, fmt.Errorf("konnectivity: mode %q: want grpc or http-connect", c.Mode)
	}
	var fh, fp string
	var err1 error
	if c.UDS == "" {
		fh, fp, err1 = splitPort(c.Frontend)
	}
	ah, ap, err2 := splitPort(c.AgentListen)
	adh, adp, err3 := splitPort(c.Admin)
	hh, hp, err4 := splitPort(c.Health)
	if err := errors.Join(err1, err2, err3, err4); err != nil {
		return nil, fmt.Errorf("konnectivity: %w", err)
	}
	args := []string{bin, "--mode", c.Mode, "--uds-name", "",
		"--server-bind-address", fh, "--server-port", fp,
		"--server-cert", c.ServerCert, "--server-key", c.ServerKey, "--server-ca-cert", c.ServerCA}
	if c.UDS != "" {
		args = []string{bin, "--mode", c.Mode, "--uds-name", c.UDS, "--delete-existing-uds-file", "--server-port", "0"}
	}
	args = append(args,
		"--agent-bind-address", ah, "--agent-port", ap,
		"--cluster-cert", c.ClusterCert, "--cluster-key", c.ClusterKey,
		"--admin-bind-address", adh, "--admin-port", adp,
		"--health-bind-address", hh, "--health-port", hp,
		"--server-count", "1", "--proxy-strategies", "default")
	if c.ClusterCA != "" {
		args = append(args, "--cluster-ca-cert", c.ClusterCA)
	}
	return args, nil
}

// KonnectivityAgentConfig is one proxy-agent.
type KonnectivityAgentConfig struct {
	// Server is the proxy-server's agent port (ip:port), verified against
	// CA; Cert and Key are the agent's client certificate.
	Server        string
	CA, Cert, Key string
	AgentID       string
	Admin, Health string // ip:port of the agent's own admin and health servers
	SyncInterval  string // e.g. "1s" (the default); "" keeps the default
}

// AgentArgs returns proxy-agent's command line for c.
func (k Konnectivity) AgentArgs(c KonnectivityAgentConfig) ([]string, error) {
	_, bin, err := k.Bins()
	if err != nil {
		return nil, err
	}
	sh, sp, err1 := splitPort(c.Server)
	adh, adp, err2 := splitPort(c.Admin)
	hh, hp, err3 := splitPort(c.Health)
	if err := errors.Join(err1, err2, err3); err != nil {
		return nil, fmt.Errorf("konnectivity: %w", err)
	}
	args := []string{bin, "--proxy-server-host", sh, "--proxy-server-port", sp,
		"--ca-cert", c.CA, "--agent-cert", c.Cert, "--agent-key", c.Key,
		"--admin-bind-address", adh, "--admin-server-port", adp,
		"--health-server-host", hh, "--health-server-port", hp}
	if c.AgentID != "" {
		args = append(args, "--agent-id", c.AgentID)
	}
	if c.SyncInterval != "" {
		args = append(args, "--sync-interval", c.SyncInterval)
	}
	return args, nil
}

func splitPort(hostport string) (host, port string, err error) {
	host, port, err = net.SplitHostPort(hostport)
	if err != nil {
		return "", "", err
	}
	if n, err := strconv.Atoi(port); err != nil || n <= 0 || n > 65535 {
		return "", "", fmt.Errorf("address %q: bad port", hostport)
	}
	return host, port, nil
}

// jsonField returns the string value of "key" in go's indented JSON output,
// enough for go mod download -json (no escaping beyond what paths need).
func jsonField(out []byte, key string) string {
	for l := range strings.Lines(string(out)) {
		l = strings.TrimSpace(l)
		if v, ok := strings.CutPrefix(l, `"`+key+`": "`); ok {
			v = strings.TrimSuffix(strings.TrimSuffix(v, ","), `"`)
			return strings.ReplaceAll(v, `\\`, `\`)
		}
	}
	return ""
}

// lastLines returns the last n non-empty lines of s, joined by " | ".
func lastLines(s string, n int) string {
	var ls []string
	for l := range strings.Lines(s) {
		if l = strings.TrimSpace(l); l != "" {
			ls = append(ls, l)
		}
	}
	return strings.Join(ls[max(0, len(ls)-n):], " | ")
}

// copyTree copies the regular files and directories below src to dst, all
// writable by the owner (the module cache's are read-only).
func copyTree(src, dst string) error {
	return filepath.WalkDir(src, func(path string, d os.DirEntry, err error) error {
		if err != nil {
			return err
		}
		rel, err := filepath.Rel(src, path)
		if err != nil {
			return err
		}
		target := filepath.Join(dst, rel)
		if d.IsDir() {
			return os.MkdirAll(target, 0o755)
		}
		if !d.Type().IsRegular() {
			return nil
		}
		b, err := os.ReadFile(path)
		if err != nil {
			return err
		}
		return os.WriteFile(target, b, 0o644)
	})
}
