// Package inherit hands listening TCP sockets from a parent process to a child: the parent binds
// (port 0 picks a port) and keeps the socket, passes it as an extra file named in the child's
// environment, and the child's listener for that address is the socket itself. No port is ever
// picked free, released and bound again, so no other process can take it in between (the race
// of "find a free port" helpers). Tests, tendril-bench and tendril-local start tendril's binaries
// this way; on a seed nothing is inherited and every listener is bound as usual.
//
// It covers TCP listeners only. It does not pick addresses for the child or read the environment
// itself: cmd/* reads EnvVar and calls Parse.
package inherit

import (
	"errors"
	"fmt"
	"net"
	"os"
	"os/exec"
	"slices"
	"strconv"
	"strings"
	"syscall"
)

// EnvVar names the inherited sockets in a child's environment: comma-separated address=fd pairs,
// e.g. 127.0.0.1:41234=3,127.0.0.1:41235=4.
const EnvVar = "TENDRIL_LISTEN_FDS"

// Listeners are the sockets a process inherited, by the address they are bound to. A nil
// *Listeners holds none, and its Listen is net.Listen.
type Listeners struct {
	byAddr map[string]*os.File
}

// Parse takes EnvVar's value. Every named descriptor must be a listening socket bound to the
// address it is named by: a wrong one is refused here, not served by mistake.
func Parse(value string) (*Listeners, error) {
	ls := &Listeners{byAddr: map[string]*os.File{}}
	for _, pair := range strings.Split(value, ",") {
		if pair = strings.TrimSpace(pair); pair == "" {
			continue
		}
		addr, fdText, ok := strings.Cut(pair, "=")
		fd, err := strconv.Atoi(fdText)
		if !ok || err != nil || fd < 3 {
			return nil, fmt.Errorf("%s: %q is not address=fd with fd ≥ 3", EnvVar, pair)
		}
		if _, dup := ls.byAddr[addr]; dup {
			return nil, fmt.Errorf("%s: %s named twice", EnvVar, addr)
		}
		f := os.NewFile(uintptr(fd), "inherited "+addr)
		l, err := net.FileListener(f) // a duplicate; f stays for Listen
		if err != nil {
			f.Close()
			return nil, fmt.Errorf("%s: descriptor %d for %s: %w", EnvVar, fd, addr, err)
		}
		got := l.Addr().String()
		l.Close()
		if got != addr {
			f.Close()
			return nil, fmt.Errorf("%s: descriptor %d is bound to %s, not %s", EnvVar, fd, got, addr)
		}
		ls.byAddr[addr] = f
	}
	return ls, nil
}

// Of is Listeners holding socks as this process's own, for a Run in the same process (a test):
// each is duplicated, so the caller still closes socks.
func Of(socks ...*Socket) (*Listeners, error) {
	ls := &Listeners{byAddr: map[string]*os.File{}}
	for _, s := range socks {
		fd, err := syscall.Dup(int(s.file.Fd()))
		if err != nil {
			ls.Close()
			return nil, fmt.Errorf("duplicate the socket of %s: %w", s.Addr, err)
		}
		syscall.CloseOnExec(fd)
		ls.byAddr[s.Addr] = os.NewFile(uintptr(fd), "socket "+s.Addr)
	}
	return ls, nil
}

// Listen returns the inherited listener for address, once; any other address (and the same one
// again) is bound by net.Listen.
func (ls *Listeners) Listen(network, address string) (net.Listener, error) {
	if ls == nil || network != "tcp" {
		return net.Listen(network, address)
	}
	f, ok := ls.byAddr[address]
	if !ok {
		return net.Listen(network, address)
	}
	delete(ls.byAddr, address)
	defer f.Close()
	l, err := net.FileListener(f)
	if err != nil {
		return nil, fmt.Errorf("inherited listener %s: %w", address, err)
	}
	return l, nil
}

// Close closes the inherited sockets that no Listen took.
func (ls *Listeners) Close() error {
	if ls == nil {
		return nil
	}
	var errs []error
	for addr, f := range ls.byAddr {
		errs = append(errs, f.Close())
		delete(ls.byAddr, addr)
	}
	return errors.Join(errs...)
}

// Socket is a listening socket this process bound to hand to a child.
type Socket struct {
	// Addr is the address it is bound to, with the port the kernel picked for port 0.
	Addr string
	file *os.File
}

// Bind binds a TCP listening socket to address ("127.0.0.1:0" picks a port).
func Bind(address string) (*Socket, error) {
	l, err := net.Listen("tcp", address)
	if err != nil {
		return nil, err
	}
	defer l.Close() // File duplicated the descriptor
	f, err := l.(*net.TCPListener).File()
	if err != nil {
		return nil, fmt.Errorf("listener %s: %w", address, err)
	}
	return &Socket{Addr: l.Addr().String(), file: f}, nil
}

// Close closes this process's descriptor of the socket. Close it once the child has started:
// the child's copy keeps the socket, and once the child is gone the port refuses connections
// instead of queueing them.
func (s *Socket) Close() error { return s.file.Close() }

// Pass hands socks to cmd before it starts, once with all of them: each becomes one of
// cmd.ExtraFiles, named in its environment (cmd.Env, or this process's when that is nil), in
// place of any EnvVar there: that one named this process's own descriptors.
func Pass(cmd *exec.Cmd, socks ...*Socket) {
	if len(socks) == 0 {
		return
	}
	env := cmd.Env
	if env == nil {
		env = os.Environ()
	}
	env = slices.DeleteFunc(slices.Clone(env), func(kv string) bool { return strings.HasPrefix(kv, EnvVar+"=") })
	var pairs []string
	for _, s := range socks {
		// ExtraFiles[i] is the child's descriptor 3+i.
		pairs = append(pairs, s.Addr+"="+strconv.Itoa(3+len(cmd.ExtraFiles)))
		cmd.ExtraFiles = append(cmd.ExtraFiles, s.file)
	}
	cmd.Env = append(env, EnvVar+"="+strings.Join(pairs, ","))
}

// Close closes every socket of socks (this process's descriptors).
func Close(socks ...*Socket) {
	for _, s := range socks {
		s.Close()
	}
}
