package wg

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/netip"
)

// HeartbeatPort is the inner UDP port on which the accepting side (tendril-server) echoes
// heartbeats, ServeHeartbeat. The dialing side (the agent) sends one every second or so and
// declares its stream dead when the echoes stop: WireGuard's own keepalives flow one way only
// (a received keepalive resets the receiver's persistent-keepalive timer, and keepalives do
// not trigger passive ones), so without a round trip the agent could not tell a path that
// silently stopped forwarding from an idle one. Port 7 is the classic echo port.
const HeartbeatPort = 7

// MaxHeartbeatSize is the largest heartbeat ServeHeartbeat answers; larger datagrams are
// ignored, so that the echo never amplifies.
const MaxHeartbeatSize = 64

// ServeHeartbeat echoes every datagram of at most MaxHeartbeatSize bytes that arrives on
// HeartbeatPort of any of the Tunnel's addresses back to its sender, until ctx ends or the
// Tunnel closes. One goroutine, one buffer: a flood costs only what it sends.
func (t *Tunnel) ServeHeartbeat(ctx context.Context) error {
	pc, err := t.ListenUDP(netip.AddrPortFrom(netip.IPv6Unspecified(), HeartbeatPort))
	if err != nil {
		return err
	}
	stop := context.AfterFunc(ctx, func() { pc.Close() })
	defer stop()
	defer pc.Close()
	buf := make([]byte, MaxHeartbeatSize+1)
	for {
		n, from, err := pc.ReadFrom(buf)
		if err != nil {
			if ctx.Err() != nil || errors.Is(err, net.ErrClosed) {
				return nil
			}
			// gonet reports a closed stack with its own error text.
			if t.muted.Load() {
				return nil
			}
			return fmt.Errorf("wg: heartbeat: %w", err)
		}
		if n == 0 || n > MaxHeartbeatSize {
			continue
		}
		// A failed echo is a lost heartbeat, which the sender counts.
		_, _ = pc.WriteTo(buf[:n], from)
	}
}
