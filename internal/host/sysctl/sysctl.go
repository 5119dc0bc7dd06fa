// Package sysctl reads and sets the kernel's parameters under /proc/sys by their dotted names
// (net.ipv4.ip_forward), as sysctl(8) does, for the network namespace of the calling thread.
// It knows no parameter's meaning.
package sysctl

import (
	"fmt"
	"net/netip"
	"os"
	"path/filepath"
	"strings"
)

// root is where the parameters are; tests point it elsewhere.
var root = "/proc/sys"

func path(name string) (string, error) {
	if name == "" || strings.Contains(name, "/") || strings.Contains(name, "..") {
		return "", fmt.Errorf("sysctl: %q is not a parameter name", name)
	}
	return filepath.Join(root, strings.ReplaceAll(name, ".", "/")), nil
}

// Get returns the parameter's value without its trailing newline.
func Get(name string) (string, error) {
	p, err := path(name)
	if err != nil {
		return "", err
	}
	b, err := os.ReadFile(p)
	if err != nil {
		return "", fmt.Errorf("sysctl: %w", err)
	}
	return strings.TrimSpace(string(b)), nil
}

// Ensure sets the parameter to value unless it has it already, so that a process that may not
// write /proc/sys (a container's is read-only) runs where something else set it before.
func Ensure(name, value string) error {
	if v, err := Get(name); err == nil && v == value {
		return nil
	}
	p, err := path(name)
	if err != nil {
		return err
	}
	if err := os.WriteFile(p, []byte(value+"\n"), 0o644); err != nil {
		return fmt.Errorf("sysctl: set %s=%s: %w", name, value, err)
	}
	return nil
}

// Forwarding names the parameters that turn on IP forwarding for the families of prefixes
// (net.ipv4.ip_forward, net.ipv6.conf.all.forwarding), in that order.
func Forwarding(prefixes []netip.Prefix) []string {
	var v4, v6 bool
	for _, p := range prefixes {
		v4 = v4 || p.Addr().Is4()
		v6 = v6 || p.Addr().Is6()
	}
	var names []string
	if v4 {
		names = append(names, "net.ipv4.ip_forward")
	}
	if v6 {
		names = append(names, "net.ipv6.conf.all.forwarding")
	}
	return names
}
