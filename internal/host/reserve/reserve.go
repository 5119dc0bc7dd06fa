// Package reserve holds TCP ports for servers that cannot inherit a socket (kube-apiserver
// under envtest, HAProxy, nginx, squid, OpenVPN, a controller-runtime webhook server): a
// reservation is a socket bound with SO_REUSEADDR that never listens. While it is held, the
// kernel hands the port to no other bind of port 0 and refuses connections to it, yet the server,
// whose listener sets SO_REUSEADDR too (Go's, HAProxy's, nginx's, squid's and OpenVPN's do),
// binds and listens on it. A port picked free and released instead can be taken in between.
//
// It does not start servers and does not pick addresses: internal/host/inherit hands a bound socket
// to a child that can take one, which is the better way for tendril's own binaries.
package reserve

import (
	"fmt"
	"net"
	"net/netip"
	"syscall"
)

// Port is one reservation.
type Port struct {
	// Addr is the reserved address: the host given to TCP, the port the kernel picked.
	Addr string
	fd   int
}

// TCP reserves a port on host (an IP address).
func TCP(host string) (*Port, error) {
	ip, err := netip.ParseAddr(host)
	if err != nil {
		return nil, fmt.Errorf("reserve a port: %w", err)
	}
	family, sa := syscall.AF_INET, syscall.Sockaddr(&syscall.SockaddrInet4{Addr: ip.As4()})
	if ip.Is6() && !ip.Is4In6() {
		family, sa = syscall.AF_INET6, &syscall.SockaddrInet6{Addr: ip.As16()}
	}
	fd, err := syscall.Socket(family, syscall.SOCK_STREAM|syscall.SOCK_CLOEXEC, 0)
	if err != nil {
		return nil, fmt.Errorf("reserve a port on %s: %w", host, err)
	}
	if err := syscall.SetsockoptInt(fd, syscall.SOL_SOCKET, syscall.SO_REUSEADDR, 1); err != nil {
		syscall.Close(fd)
		return nil, fmt.Errorf("reserve a port on %s: %w", host, err)
	}
	if err := syscall.Bind(fd, sa); err != nil {
		syscall.Close(fd)
		return nil, fmt.Errorf("reserve a port on %s: %w", host, err)
	}
	got, err := syscall.Getsockname(fd)
	if err != nil {
		syscall.Close(fd)
		return nil, fmt.Errorf("reserve a port on %s: %w", host, err)
	}
	var port int
	switch a := got.(type) {
	case *syscall.SockaddrInet4:
		port = a.Port
	case *syscall.SockaddrInet6:
		port = a.Port
	}
	return &Port{Addr: net.JoinHostPort(ip.String(), fmt.Sprint(port)), fd: fd}, nil
}

// Close gives the port up (once the server that uses it has stopped, or when it never
// starts). A second Close does nothing.
func (p *Port) Close() error {
	if p == nil || p.fd < 0 {
		return nil
	}
	err := syscall.Close(p.fd)
	p.fd = -1
	return err
}
