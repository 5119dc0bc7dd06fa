package pipe

import (
	"net"
	"unsafe"

	"golang.org/x/sys/unix"
)

// waitSocket waits until c's socket has bytes, its end or an error (a one-byte MSG_PEEK that
// does not say EAGAIN), or c's read deadline passes, through Go's poller.
func waitSocket(c *net.TCPConn) (bool, error) {
	rc, err := c.SyscallConn()
	if err != nil {
		return true, err
	}
	var b [1]byte
	err = rc.Read(func(fd uintptr) bool {
		_, _, e := unix.RawSyscall6(unix.SYS_RECVFROM, fd, uintptr(unsafe.Pointer(&b[0])), 1, unix.MSG_PEEK|unix.MSG_DONTWAIT, 0, 0)
		return e != unix.EAGAIN
	})
	return true, err
}
