//go:build !linux

package apiserverproxy

import (
	"errors"
	"net/netip"
)

func ensureAddress(string, netip.Addr) error {
	return errors.New("apiserver-proxy: managing links needs Linux; start with an empty interface name")
}
