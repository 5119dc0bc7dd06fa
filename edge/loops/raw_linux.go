package loops

import (
	"encoding/binary"

	"net/netip"
	"syscall"
	"unsafe"

	"golang.org/x/sys/unix"
)

// The loops' system calls on non-blocking descriptors, made raw: without the Go runtime's
// entersyscall/exitsyscall, which for a call that cannot block is pure cost, and whose
// entersyscall wakes the runtime's sysmon thread when it sleeps (a visible share of
// tendril-ingress's CPU: docs/performance.md, "The handshake on the loops"). None of them
// waits: reads, writes and accepts say EAGAIN, a connect EINPROGRESS, epoll_pwait is given no
// timeout, and a TCP close without SO_LINGER sends its FIN in the background.

func rawRead(fd int, p []byte) (int, error) {
	n, _, e := unix.RawSyscall(unix.SYS_READ, uintptr(fd), uintptr(unsafe.Pointer(unsafe.SliceData(p))), uintptr(len(p)))
	if e != 0 {
		return 0, e
	}
	return int(n), nil
}

func rawWrite(fd int, p []byte) (int, error) {
	n, _, e := unix.RawSyscall(unix.SYS_WRITE, uintptr(fd), uintptr(unsafe.Pointer(unsafe.SliceData(p))), uintptr(len(p)))
	if e != 0 {
		return 0, e
	}
	return int(n), nil
}

func rawClose(fd int) error {
	if _, _, e := unix.RawSyscall(unix.SYS_CLOSE, uintptr(fd), 0, 0); e != 0 {
		return e
	}
	return nil
}

func rawShutdown(fd, how int) error {
	if _, _, e := unix.RawSyscall(unix.SYS_SHUTDOWN, uintptr(fd), uintptr(how), 0); e != 0 {
		return e
	}
	return nil
}

// rawEpollWait polls without waiting (timeout 0); epoll_pwait exists on every architecture.
func rawEpollWait(epfd int, events []unix.EpollEvent) (int, error) {
	n, _, e := unix.RawSyscall6(unix.SYS_EPOLL_PWAIT, uintptr(epfd), uintptr(unsafe.Pointer(unsafe.SliceData(events))), uintptr(len(events)), 0, 0, 0)
	if e != 0 {
		return 0, e
	}
	return int(n), nil
}

func rawEpollCtl(epfd, op, fd int, ev *unix.EpollEvent) error {
	if _, _, e := unix.RawSyscall6(unix.SYS_EPOLL_CTL, uintptr(epfd), uintptr(op), uintptr(fd), uintptr(unsafe.Pointer(ev)), 0, 0); e != 0 {
		return e
	}
	return nil
}

// rawAccept accepts a connection, non-blocking and close-on-exec, and returns its peer.
func rawAccept(lfd int) (int, netip.AddrPort, error) {
	var sa unix.RawSockaddrAny
	size := uint32(unsafe.Sizeof(sa))
	fd, _, e := unix.RawSyscall6(unix.SYS_ACCEPT4, uintptr(lfd), uintptr(unsafe.Pointer(&sa)), uintptr(unsafe.Pointer(&size)),
		uintptr(unix.SOCK_NONBLOCK|unix.SOCK_CLOEXEC), 0, 0)
	if e != 0 {
		return -1, netip.AddrPort{}, e
	}
	return int(fd), rawAddrPort(&sa), nil
}

// rawLocal is a socket's own address.
func rawLocal(fd int) netip.AddrPort {
	var sa unix.RawSockaddrAny
	size := uint32(unsafe.Sizeof(sa))
	if _, _, e := unix.RawSyscall(unix.SYS_GETSOCKNAME, uintptr(fd), uintptr(unsafe.Pointer(&sa)), uintptr(unsafe.Pointer(&size))); e != 0 {
		return netip.AddrPort{}
	}
	return rawAddrPort(&sa)
}

func rawAddrPort(sa *unix.RawSockaddrAny) netip.AddrPort {
	switch sa.Addr.Family {
	case syscall.AF_INET:
		a := (*unix.RawSockaddrInet4)(unsafe.Pointer(sa))
		return netip.AddrPortFrom(netip.AddrFrom4(a.Addr), ntohs(a.Port))
	case syscall.AF_INET6:
		a := (*unix.RawSockaddrInet6)(unsafe.Pointer(sa))
		return netip.AddrPortFrom(netip.AddrFrom16(a.Addr).Unmap(), ntohs(a.Port))
	}
	return netip.AddrPort{}
}

// rawSetsockoptInt sets an int socket option.
func rawSetsockoptInt(fd, level, opt, value int) error {
	v := int32(value)
	if _, _, e := unix.RawSyscall6(unix.SYS_SETSOCKOPT, uintptr(fd), uintptr(level), uintptr(opt), uintptr(unsafe.Pointer(&v)), 4, 0); e != 0 {
		return e
	}
	return nil
}

// rawSoError is a socket's pending error (SO_ERROR), which reading clears: a non-blocking
// connect's outcome once the socket is writable.
func rawSoError(fd int) (unix.Errno, error) {
	var v int32
	size := uint32(4)
	if _, _, e := unix.RawSyscall6(unix.SYS_GETSOCKOPT, uintptr(fd), unix.SOL_SOCKET, unix.SO_ERROR, uintptr(unsafe.Pointer(&v)), uintptr(unsafe.Pointer(&size)), 0); e != 0 {
		return 0, e
	}
	return unix.Errno(v), nil
}

// rawConnect starts a connect of a non-blocking socket to addr (EINPROGRESS, or done at once).
func rawConnect(fd int, addr netip.AddrPort) error {
	var sa unix.RawSockaddrAny
	var size uintptr
	if ip := addr.Addr().Unmap(); ip.Is4() {
		a := (*unix.RawSockaddrInet4)(unsafe.Pointer(&sa))
		a.Family, a.Port, a.Addr = unix.AF_INET, htons(addr.Port()), ip.As4()
		size = unsafe.Sizeof(*a)
	} else {
		a := (*unix.RawSockaddrInet6)(unsafe.Pointer(&sa))
		a.Family, a.Port, a.Addr = unix.AF_INET6, htons(addr.Port()), ip.As16()
		size = unsafe.Sizeof(*a)
	}
	if _, _, e := unix.RawSyscall(unix.SYS_CONNECT, uintptr(fd), uintptr(unsafe.Pointer(&sa)), size); e != 0 {
		return e
	}
	return nil
}

// htons writes a port as the kernel stores it: network byte order.
func htons(p uint16) uint16 {
	var b [2]byte
	binary.BigEndian.PutUint16(b[:], p)
	return *(*uint16)(unsafe.Pointer(&b[0]))
}

// ntohs reads a port as the kernel stores it: network byte order.
func ntohs(p uint16) uint16 {
	var b [2]byte
	*(*uint16)(unsafe.Pointer(&b[0])) = p
	return binary.BigEndian.Uint16(b[:])
}
