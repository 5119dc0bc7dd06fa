package realseed

import (
	"context"
	"errors"
	"fmt"
	"os/exec"
	"path/filepath"
	"strings"
	"time"

	"github.com/tendril-net/tendril/internal/host/netns"
)

// The internet, for the paths that start outside the cluster at a load balancer: a network
// namespace joined to the node by a veth pair. Its connections reach the pods through the
// node's forwarding, as a load balancer's do, with a source address that is neither a pod's nor
// the node's (kube-router admits the node's own traffic to its pods whatever the policies say).
const (
	worldNetns    = "tendril-seed-world"
	worldHostLink = "tsworld0"
	worldLink     = "tsworld1"
	// TEST-NET-2 (RFC 5737): never routed anywhere, so nothing of it can be a real peer.
	worldHostAddr = "198.51.100.1"
	worldAddr     = "198.51.100.2"
)

// makeWorld makes the internet's namespace (a stale one of a killed run is replaced).
func makeWorld(ctx context.Context) error {
	removeWorld()
	for _, args := range [][]string{
		{"netns", "add", worldNetns},
		{"link", "add", worldHostLink, "type", "veth", "peer", "name", worldLink},
		{"link", "set", worldLink, "netns", worldNetns},
		{"addr", "add", worldHostAddr + "/30", "dev", worldHostLink},
		{"link", "set", worldHostLink, "up"},
		{"-n", worldNetns, "addr", "add", worldAddr + "/30", "dev", worldLink},
		{"-n", worldNetns, "link", "set", worldLink, "up"},
		{"-n", worldNetns, "link", "set", "lo", "up"},
		{"-n", worldNetns, "route", "add", "default", "via", worldHostAddr},
	} {
		if err := netns.IP(ctx, args...); err != nil {
			removeWorld()
			return fmt.Errorf("the internet's namespace: %w", err)
		}
	}
	return nil
}

// removeWorld deletes the internet's namespace and link, if there are any.
func removeWorld() {
	_ = netns.IP(context.Background(), "netns", "del", worldNetns)
	_ = netns.IP(context.Background(), "link", "del", worldHostLink)
}

// dialFromWorld opens a TCP connection to address from the internet's namespace
// (tendril-probe dial there) and tells whether it opened.
func (c *Cluster) dialFromWorld(ctx context.Context, address string, timeout time.Duration) (bool, string, error) {
	ctx, cancel := context.WithTimeout(ctx, timeout+5*time.Second)
	defer cancel()
	out, err := exec.CommandContext(ctx, "ip", "netns", "exec", worldNetns, filepath.Join(c.cfg.BinDir, "tendril-probe"),
		"dial", "--timeout", timeout.String(), address).CombinedOutput()
	detail := strings.TrimSpace(string(out)) + " (from " + worldAddr + ")"
	var exit *exec.ExitError
	switch {
	case err == nil:
		return true, detail, nil
	case errors.As(err, &exit) && exit.ExitCode() == 1:
		return false, detail, nil
	default:
		return false, detail, fmt.Errorf("dial %s from the internet's namespace: %w (%s)", address, err, detail)
	}
}
