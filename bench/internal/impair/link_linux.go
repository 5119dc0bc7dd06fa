package impair

import (
	"context"
	"errors"
	"fmt"
	"net/netip"
	"os"
	"strconv"
	"sync"

	"golang.org/x/sys/unix"

	"github.com/tendril-net/tendril/internal/host/netns"
)

// End is one end of a Link: a TUN device in a network namespace.
type End struct {
	// NS is the namespace's name; "" is this process's own.
	NS string
	// Name is the device's name, at most 15 bytes.
	Name string
	// Addr is the device's address and prefix (the link's subnet).
	Addr netip.Prefix
}

// LinkConfig is a Link between A and B.
type LinkConfig struct {
	A, B End
	// AtoB and BtoA impair the two directions.
	AtoB, BtoA Config
	// MTU is both devices' MTU; 0 means 1500 (a path across the Internet).
	MTU int
}

// Link is two TUN devices joined by the two Directions: what a veth pair is, impaired.
type Link struct {
	a, b     *os.File
	ab, ba   *Direction
	cancel   context.CancelFunc
	wg       sync.WaitGroup
	errs     [2]error
	closeOne sync.Once
}

// NewLink makes the two devices, with their addresses, up, and starts carrying packets
// between them. Close stops it and deletes the devices. It needs CAP_NET_ADMIN and
// /dev/net/tun.
func NewLink(cfg LinkConfig) (_ *Link, err error) {
	if cfg.MTU <= 0 {
		cfg.MTU = 1500
	}
	cfg.AtoB.MTU, cfg.BtoA.MTU = cfg.MTU, cfg.MTU
	l := &Link{}
	defer func() {
		if err != nil {
			err = errors.Join(err, l.closeFiles())
		}
	}()
	if l.a, err = openTUN(cfg.A, cfg.MTU); err != nil {
		return nil, err
	}
	if l.b, err = openTUN(cfg.B, cfg.MTU); err != nil {
		return nil, err
	}
	if l.ab, err = NewDirection(cfg.AtoB, l.a, l.b); err != nil {
		return nil, err
	}
	if l.ba, err = NewDirection(cfg.BtoA, l.b, l.a); err != nil {
		return nil, err
	}
	ctx, cancel := context.WithCancel(context.Background())
	l.cancel = cancel
	for i, d := range []*Direction{l.ab, l.ba} {
		l.wg.Add(1)
		go func() { defer l.wg.Done(); l.errs[i] = d.Run(ctx) }()
	}
	return l, nil
}

// Set changes both directions' impairment (see Direction.Set).
func (l *Link) Set(aToB, bToA Config) error {
	return errors.Join(l.ab.Set(aToB), l.ba.Set(bToA))
}

// Stats are the two directions' counts.
func (l *Link) Stats() (aToB, bToA Stats) { return l.ab.Stats(), l.ba.Stats() }

// Close stops the Link and deletes its devices (a TUN device goes with its last file), and
// returns the error either direction ended with.
func (l *Link) Close() error {
	var err error
	l.closeOne.Do(func() {
		l.cancel()
		err = l.closeFiles() // ends the readers' Read
		l.wg.Wait()
		err = errors.Join(err, l.errs[0], l.errs[1])
	})
	return err
}

func (l *Link) closeFiles() error {
	var errs []error
	for _, f := range []*os.File{l.a, l.b} {
		if f != nil {
			errs = append(errs, f.Close())
		}
	}
	return errors.Join(errs...)
}

// openTUN makes end's device in its namespace and configures it with ip(8). The file
// descriptor is non-blocking, so that the runtime's poller serves its reads and Close ends
// them.
func openTUN(end End, mtu int) (*os.File, error) {
	if end.Name == "" || len(end.Name) >= unix.IFNAMSIZ {
		return nil, fmt.Errorf("impair: device name %q: want 1 to %d bytes", end.Name, unix.IFNAMSIZ-1)
	}
	var fd int
	create := func() error {
		var err error
		if fd, err = unix.Open("/dev/net/tun", unix.O_RDWR|unix.O_CLOEXEC, 0); err != nil {
			return fmt.Errorf("open /dev/net/tun: %w", err)
		}
		ifr, err := unix.NewIfreq(end.Name)
		if err != nil {
			unix.Close(fd)
			return err
		}
		// IFF_NO_PI: bare IP packets. No IFF_VNET_HDR: the kernel segments before the device,
		// so that every packet read is one the size of a packet on the wire, each lost or
		// delayed on its own.
		ifr.SetUint16(unix.IFF_TUN | unix.IFF_NO_PI)
		if err := unix.IoctlIfreq(fd, unix.TUNSETIFF, ifr); err != nil {
			unix.Close(fd)
			return fmt.Errorf("TUNSETIFF %s: %w", end.Name, err)
		}
		return nil
	}
	if end.NS == "" {
		if err := create(); err != nil {
			return nil, fmt.Errorf("impair: %w", err)
		}
	} else if err := netns.In(end.NS, create); err != nil {
		return nil, fmt.Errorf("impair: in %s: %w", end.NS, err)
	}
	if err := unix.SetNonblock(fd, true); err != nil {
		unix.Close(fd)
		return nil, fmt.Errorf("impair: %w", err)
	}
	f := os.NewFile(uintptr(fd), "/dev/net/tun:"+end.Name)
	in := func(args ...string) []string {
		if end.NS == "" {
			return args
		}
		return append([]string{"-n", end.NS}, args...)
	}
	ctx := context.Background()
	for _, args := range [][]string{
		in("addr", "add", end.Addr.String(), "dev", end.Name),
		in("link", "set", end.Name, "mtu", strconv.Itoa(mtu), "txqueuelen", "1000", "up"),
	} {
		if err := netns.IP(ctx, args...); err != nil {
			f.Close()
			return nil, fmt.Errorf("impair: %w", err)
		}
	}
	return f, nil
}
