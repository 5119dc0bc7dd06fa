package netstack

import (
	"context"
	"fmt"
	"net"
	"net/netip"
	"testing"
	"time"

	"github.com/tendril-net/tendril/internal/testing/testwait"
)

// udpEcho is a UDPHandler that answers each datagram with "<dst> <datagram>" until the flow is
// idle for idle or the stack stops.
func udpEcho(idle time.Duration) UDPHandler {
	return func(ctx context.Context, src, dst netip.AddrPort, c net.Conn) {
		buf := make([]byte, 2048)
		for {
			_ = c.SetReadDeadline(time.Now().Add(idle))
			n, err := c.Read(buf)
			if err != nil {
				return
			}
			if _, err := fmt.Fprintf(c, "%s %s", dst, buf[:n]); err != nil {
				return
			}
		}
	}
}

// TestForwardUDP forwards UDP flows inside the prefixes, drops the rest, bounds the open flows
// and closes them when forwarding stops.
func TestForwardUDP(t *testing.T) {
	a, b := forwardPair(t, Forward{
		Handler:     func(context.Context, *Request) {},
		UDP:         udpEcho(time.Minute),
		MaxUDPFlows: 2,
	})
	exchange := func(c net.Conn, msg string) (string, error) {
		if _, err := c.Write([]byte(msg)); err != nil {
			return "", err
		}
		_ = c.SetReadDeadline(time.Now().Add(500 * time.Millisecond))
		buf := make([]byte, 2048)
		n, err := c.Read(buf)
		return string(buf[:n]), err
	}
	var conns []net.Conn
	for i, dst := range []string{"10.123.0.53:53", "[fd00::2]:53", "10.200.0.1:53", "10.123.0.54:53", "10.123.0.55:53"} {
		c, err := dial(t, a, "udp", dst)
		if err != nil {
			t.Fatal(err)
		}
		defer c.Close()
		conns = append(conns, c)
		got, err := exchange(c, fmt.Sprintf("q%d", i))
		switch dst {
		case "10.123.0.53:53", "10.123.0.54:53":
			if want := fmt.Sprintf("%s q%d", dst, i); err != nil || got != want {
				t.Fatalf("%s: %q, %v; want %q", dst, got, err, want)
			}
			// A second datagram of the same flow reaches the same Handler.
			if got, err := exchange(c, "again"); err != nil || got != dst+" again" {
				t.Fatalf("%s, second datagram: %q, %v", dst, got, err)
			}
		default:
			// Own address without a socket, outside the prefixes, beyond the flow limit.
			if err == nil {
				t.Fatalf("%s answered %q", dst, got)
			}
		}
	}
	st := b.Stats()
	if st.UDPFlows != 2 || st.UDPFlowsActive != 2 || st.Refused[RefusedOutside] != 1 || st.Refused[RefusedUDPFlows] == 0 {
		t.Fatalf("stats %+v", st)
	}
	// Stopping closes the open flows; their Handlers return although they wait for a minute.
	b.StopForwarding()
	if st := b.Stats(); st.UDPFlowsActive != 0 {
		t.Fatalf("flows open after StopForwarding: %+v", st)
	}
}

// TestForwardUDPFlowEnds: a flow whose Handler returned is closed, and the next datagram of
// the same pair opens a new one.
func TestForwardUDPFlowEnds(t *testing.T) {
	a, b := forwardPair(t, Forward{Handler: func(context.Context, *Request) {}, UDP: udpEcho(50 * time.Millisecond)})
	c, err := dial(t, a, "udp", "10.123.0.53:53")
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	buf := make([]byte, 64)
	ask := func() error {
		if _, err := c.Write([]byte("q")); err != nil {
			return err
		}
		_ = c.SetReadDeadline(time.Now().Add(2 * time.Second))
		_, err := c.Read(buf)
		return err
	}
	if err := ask(); err != nil {
		t.Fatal(err)
	}
	testwait.Until(t, "the idle flow ends", func() bool { return b.Stats().UDPFlowsActive == 0 })
	if err := ask(); err != nil {
		t.Fatal(err)
	}
	if st := b.Stats(); st.UDPFlows != 2 {
		t.Fatalf("stats %+v", st)
	}
}
