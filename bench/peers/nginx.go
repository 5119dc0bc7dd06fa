package peers

import (
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"time"
)

// Nginx runs the distribution's nginx with only a stream block: ssl_preread
// reads the ClientHello and a map on $ssl_preread_server_name picks the
// upstream group. For JobProxy the listen line has proxy_protocol instead and
// the map key is the header's destination, $proxy_protocol_server_addr and
// _port (stream module, nginx ≥ 1.17.6). JobConnect it cannot do: nginx 1.22
// answers 400 to a CONNECT request line, and the stream module cannot answer
// one. The zero value does JobSNI with "nginx" from PATH, DefaultTimeouts and
// one worker per CPU.
//
// Debian ships the stream module as a dynamic module (libnginx-mod-stream,
// nginx -V says --with-stream=dynamic) loaded by an include in the stock
// /etc/nginx/nginx.conf. Our own configuration file does not read that
// include, so it loads the module itself, by absolute path because -p moves
// the prefix into the temporary directory.
type Nginx struct {
	Bin      string   // path or name in PATH; "" means "nginx"
	Job      Job      // "" means JobSNI; JobConnect is refused
	Timeouts Timeouts // zero means DefaultTimeouts
	Workers  int      // worker_processes; 0 means one per CPU
	// MaxConn is worker_connections and worker_rlimit_nofile, per worker;
	// 0 means 8192. A worker counts both sockets of a proxied connection.
	MaxConn int
}

var _ Peer = Nginx{}

// NginxConfig is the data for nginx.conf.tmpl.
type NginxConfig struct {
	Job          Job    // "" means JobSNI
	Listen       string // ip:port of the stream server
	Workers      int
	MaxConn      int    // worker_connections and worker_rlimit_nofile
	Dir          string // pid and error log live here
	StreamModule string // absolute path of ngx_stream_module.so; "" when built in
	Timeouts     Timeouts
	Routes       []Route
}

// RenderNginx renders the nginx configuration for c.
func RenderNginx(c NginxConfig) (string, error) {
	if c.Job == "" {
		c.Job = JobSNI
	}
	if err := validateRoutes(c.Routes); err != nil {
		return "", err
	}
	switch c.Job {
	case JobSNI:
	case JobProxy:
		for _, r := range c.Routes {
			if !r.Advertised.IsValid() {
				return "", fmt.Errorf("route %s: no advertised address to route PROXY headers by", r.Name)
			}
		}
	default:
		return "", fmt.Errorf("nginx cannot do job %q", c.Job)
	}
	if !filepath.IsAbs(c.Dir) {
		return "", fmt.Errorf("nginx dir %q is not absolute", c.Dir)
	}
	return render(nginxTmpl, c)
}

// Name implements Peer.
func (Nginx) Name() string { return "nginx" }

func (n Nginx) bin() (string, error) { return lookBin(n.Bin, "nginx", "nginx libnginx-mod-stream") }

// StreamModule returns the absolute path of the stream module to load, or ""
// when nginx has it built in, or an error when nginx has no usable stream
// module with ssl_preread.
func (n Nginx) StreamModule(ctx context.Context) (string, error) {
	bin, err := n.bin()
	if err != nil {
		return "", err
	}
	out, err := exec.CommandContext(ctx, bin, "-V").CombinedOutput()
	if err != nil {
		return "", fmt.Errorf("%s -V: %w: %s", bin, err, strings.TrimSpace(string(out)))
	}
	opts := strings.Fields(string(out))
	has := func(flag string) bool {
		for _, o := range opts {
			if o == flag {
				return true
			}
		}
		return false
	}
	if !has("--with-stream_ssl_preread_module") {
		return "", errors.New("nginx is built without ssl_preread (--with-stream_ssl_preread_module)")
	}
	switch {
	case has("--with-stream"):
		return "", nil // built in
	case !has("--with-stream=dynamic"):
		return "", errors.New("nginx is built without the stream module")
	}
	var dirs []string
	for _, o := range opts {
		if d, ok := strings.CutPrefix(o, "--modules-path="); ok {
			dirs = append(dirs, d)
		}
	}
	dirs = append(dirs, "/usr/lib/nginx/modules", "/usr/lib64/nginx/modules", "/usr/share/nginx/modules")
	for _, d := range dirs {
		p := filepath.Join(d, "ngx_stream_module.so")
		if _, err := os.Stat(p); err == nil {
			return p, nil
		}
	}
	return "", fmt.Errorf("ngx_stream_module.so not found in %s (Debian: apt-get install libnginx-mod-stream)", strings.Join(dirs, ", "))
}

// Check implements Peer.
func (n Nginx) Check(ctx context.Context) error {
	if n.Job == JobConnect {
		return errors.New("nginx cannot answer CONNECT (nginx 1.22 answers 400 to a CONNECT request line)")
	}
	_, err := n.StreamModule(ctx)
	return err
}

// Config returns the configuration Start would write for routes on listen,
// with its pid and error log in dir.
func (n Nginx) Config(ctx context.Context, dir, listen string, routes []Route) (string, error) {
	mod, err := n.StreamModule(ctx)
	if err != nil {
		return "", err
	}
	workers := n.Workers
	if workers <= 0 {
		workers = cores()
	}
	conns := n.MaxConn
	if conns <= 0 {
		conns = maxConn
	}
	return RenderNginx(NginxConfig{Job: n.Job, Listen: listen, Workers: workers, MaxConn: conns, Dir: dir,
		StreamModule: mod, Timeouts: n.Timeouts.orDefault(), Routes: routes})
}

// args are the command-line options that make nginx use only dir: -p moves
// the prefix (relative paths, temp files) there and -e the error log it
// writes before it has read the configuration (default /var/log/nginx).
func nginxArgs(dir, path string) []string {
	return []string{"-p", dir + "/", "-e", filepath.Join(dir, "error.log"), "-c", path}
}

// CheckConfig runs "nginx -t" on the configuration file path, whose files
// live in dir.
func (n Nginx) CheckConfig(ctx context.Context, dir, path string) error {
	bin, err := n.bin()
	if err != nil {
		return err
	}
	out, err := exec.CommandContext(ctx, bin, append([]string{"-t", "-q"}, nginxArgs(dir, path)...)...).CombinedOutput()
	if err != nil {
		return fmt.Errorf("nginx -t -c %s: %w: %s", path, err, strings.TrimSpace(string(out)))
	}
	return nil
}

// Version returns what "nginx -v" prints ("nginx version: nginx/1.22.1").
func (n Nginx) Version(ctx context.Context) string {
	return versionOf(ctx, n.bin, "-v")
}

// Start implements Peer: "nginx -c dir/nginx.conf -g 'daemon off;'", master
// and workers in the foreground.
func (n Nginx) Start(ctx context.Context, dir string, routes []Route) (*Instance, error) {
	bin, err := n.bin()
	if err != nil {
		return nil, err
	}
	return fileStart{name: "nginx", bin: bin, version: n.Version(ctx), dir: dir, file: "nginx.conf", ready: 10 * time.Second,
		config: func(addr string) (string, error) { return n.Config(ctx, dir, addr, routes) },
		args:   func(_, path string) []string { return append(nginxArgs(dir, path), "-g", "daemon off;") },
	}.start(ctx)
}
