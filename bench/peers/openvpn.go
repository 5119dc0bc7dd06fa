package peers

import (
	"context"
	_ "embed"
	"errors"
	"fmt"
	"net"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"text/template"
)

// OpenVPN is the distribution's openvpn (2.6) as the reversed-VPN peer of
// tendril's tunnel, in TCP mode as Gardener's vpn2 runs it: a server on the
// seed with a tun device that routes the shoot's networks, and a client in
// the shoot that dials out, through the seed ingress's CONNECT listener
// (http-proxy with a custom Reversed-VPN header) or to the server itself,
// and forwards what arrives on its tun into the shoot's networks (the
// shoot's kernel routes it; its namespace needs IP forwarding).
//
// This file renders the two configurations and says how to start each; the
// caller owns the processes, the network namespaces and the certificates
// (files named in OpenVPNConfig). The zero value uses "openvpn" from PATH.
type OpenVPN struct {
	Bin string // path or name in PATH; "" means "openvpn"
}

// Name is the peer's name in reports.
func (OpenVPN) Name() string { return "openvpn" }

// Path returns the binary's path, or why it is missing.
func (o OpenVPN) Path() (string, error) { return lookBin(o.Bin, "openvpn", "openvpn") }

// Check reports why OpenVPN cannot run here: the binary, or the tun device
// (/dev/net/tun) is missing.
func (o OpenVPN) Check(context.Context) error {
	if _, err := o.Path(); err != nil {
		return err
	}
	if _, err := os.Stat("/dev/net/tun"); err != nil {
		return fmt.Errorf("openvpn needs /dev/net/tun: %w", err)
	}
	return nil
}

// Version returns the first line of "openvpn --version", without the build
// flags that follow the library list.
func (o OpenVPN) Version(ctx context.Context) string {
	bin, err := o.Path()
	if err != nil {
		return "unknown"
	}
	// openvpn --version exits 1 after printing; the output is what counts.
	out, _ := exec.CommandContext(ctx, bin, "--version").CombinedOutput()
	l := firstLine(string(out))
	if m := regexp.MustCompile(`^OpenVPN \S+`).FindString(l); m != "" {
		return m + " (TCP, " + tunCipher + ")"
	}
	if l == "" {
		return "unknown"
	}
	return l
}

// tunCipher is the data channel cipher both ends offer first.
const tunCipher = "AES-256-GCM"

// OpenVPNConfig is one reversed tunnel: the data for the server's and the
// client's configuration. The certificate files are Dir/ca.pem,
// Dir/server.pem, Dir/server-key.pem, Dir/client.pem and Dir/client-key.pem;
// the client certificate's common name is ClientName.
type OpenVPNConfig struct {
	// Dir holds the configurations, the certificates and the server's
	// client-config-dir (Dir/ccd).
	Dir string
	// Listen is the server's TCP address (ip:port) in the seed.
	Listen string
	// Remote is the host:port the client names: the server's address as
	// the seed ingress knows it (the CONNECT's authority) with HTTPProxy,
	// else where the client connects.
	Remote string
	// HTTPProxy, if set, is the seed ingress's CONNECT listener (ip:port);
	// the client sends ProxyHeader: ProxyHeaderValue with its CONNECT.
	HTTPProxy                     string
	ProxyHeader, ProxyHeaderValue string
	// Network is the tunnel's own /24 (or larger): the server takes its
	// first address, the client gets the next.
	Network netip.Prefix
	// ShootCIDRs are routed from the seed through the tunnel to the
	// client (route on the server, iroute for the client).
	ShootCIDRs []netip.Prefix
	// ServerDev and ClientDev name the tun devices (at most 15 bytes).
	ServerDev, ClientDev string
	// ClientName is the common name of the client's certificate.
	ClientName string
}

var (
	//go:embed openvpn-server.conf.tmpl
	openvpnServerTmplText string
	//go:embed openvpn-client.conf.tmpl
	openvpnClientTmplText string

	openvpnFuncs = template.FuncMap{
		"host": func(hostport string) string { h, _, _ := net.SplitHostPort(hostport); return h },
		"port": func(hostport string) string { _, p, _ := net.SplitHostPort(hostport); return p },
		// mask renders a prefix's length as a dotted IPv4 netmask.
		"mask": func(p netip.Prefix) string { return net.IP(net.CIDRMask(p.Bits(), 32)).String() },
	}
	openvpnServerTmpl = template.Must(template.New("openvpn-server.conf").Funcs(openvpnFuncs).Parse(openvpnServerTmplText))
	openvpnClientTmpl = template.Must(template.New("openvpn-client.conf").Funcs(openvpnFuncs).Parse(openvpnClientTmplText))

	devRE    = regexp.MustCompile(`^[a-z][a-z0-9]{0,14}$`)
	headerRE = regexp.MustCompile(`^[A-Za-z0-9-]+$`)
	valueRE  = regexp.MustCompile(`^[A-Za-z0-9|._:-]+$`)
)

func (c OpenVPNConfig) validate() error {
	var errs []error
	check := func(ok bool, format string, args ...any) {
		if !ok {
			errs = append(errs, fmt.Errorf(format, args...))
		}
	}
	check(filepath.IsAbs(c.Dir), "openvpn dir %q is not absolute", c.Dir)
	for _, a := range []string{c.Listen, c.Remote} {
		_, err := netip.ParseAddrPort(a)
		check(err == nil, "openvpn address %q: want ip:port", a)
	}
	if c.HTTPProxy != "" {
		_, err := netip.ParseAddrPort(c.HTTPProxy)
		check(err == nil, "openvpn http proxy %q: want ip:port", c.HTTPProxy)
		check(headerRE.MatchString(c.ProxyHeader) && valueRE.MatchString(c.ProxyHeaderValue),
			"openvpn proxy header %q: %q: want a token and a value without spaces", c.ProxyHeader, c.ProxyHeaderValue)
	}
	check(c.Network.IsValid() && c.Network.Addr().Is4() && c.Network.Bits() <= 24 && c.Network.Masked() == c.Network,
		"openvpn network %s: want an IPv4 network of /24 or larger", c.Network)
	check(len(c.ShootCIDRs) > 0, "openvpn: no shoot networks to route")
	for _, p := range c.ShootCIDRs {
		check(p.Addr().Is4() && p.Masked() == p, "openvpn shoot network %s: want an IPv4 network", p)
	}
	check(devRE.MatchString(c.ServerDev) && devRE.MatchString(c.ClientDev) && c.ServerDev != c.ClientDev,
		"openvpn devices %q, %q: want two different short names", c.ServerDev, c.ClientDev)
	check(nameRE.MatchString(c.ClientName), "openvpn client name %q", c.ClientName)
	return errors.Join(errs...)
}

// RenderOpenVPNServer renders the server's configuration.
func RenderOpenVPNServer(c OpenVPNConfig) (string, error) {
	if err := c.validate(); err != nil {
		return "", err
	}
	return render(openvpnServerTmpl, c)
}

// RenderOpenVPNClient renders the client's configuration.
func RenderOpenVPNClient(c OpenVPNConfig) (string, error) {
	if err := c.validate(); err != nil {
		return "", err
	}
	return render(openvpnClientTmpl, c)
}

// WriteOpenVPN writes both configurations and the server's client
// configuration (iroute of the shoot's networks for ClientName) into Dir,
// and returns the command lines of the server and the client (the client's
// to be run inside the shoot's network namespace).
func (o OpenVPN) WriteOpenVPN(c OpenVPNConfig) (server, client []string, err error) {
	bin, err := o.Path()
	if err != nil {
		return nil, nil, err
	}
	srv, err := RenderOpenVPNServer(c)
	if err != nil {
		return nil, nil, err
	}
	cl, err := RenderOpenVPNClient(c)
	if err != nil {
		return nil, nil, err
	}
	ccd := filepath.Join(c.Dir, "ccd")
	if err := os.MkdirAll(ccd, 0o755); err != nil {
		return nil, nil, fmt.Errorf("openvpn: %w", err)
	}
	var iroutes string
	for _, p := range c.ShootCIDRs {
		iroutes += fmt.Sprintf("iroute %s %s\n", p.Addr(), net.IP(net.CIDRMask(p.Bits(), 32)))
	}
	for path, content := range map[string]string{
		filepath.Join(ccd, c.ClientName):            iroutes,
		filepath.Join(c.Dir, "openvpn-server.conf"): srv,
		filepath.Join(c.Dir, "openvpn-client.conf"): cl,
	} {
		if err := writeFile(path, content); err != nil {
			return nil, nil, err
		}
	}
	return []string{bin, "--config", filepath.Join(c.Dir, "openvpn-server.conf")},
		[]string{bin, "--config", filepath.Join(c.Dir, "openvpn-client.conf")}, nil
}
