//go:build !linux

package pipe

import "net"

// waitSocket cannot wait without a buffer here (no MSG_PEEK through the poller): a direction
// keeps its buffer while open.
func waitSocket(*net.TCPConn) (bool, error) { return false, nil }
