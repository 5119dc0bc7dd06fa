//go:build unix

package h2relay

import "syscall"

const canPeek = true

// readable is RawConn.Read's test: is a byte (or the end) there to read? It peeks, so that a
// readiness the runtime's poller saw before the wait began is not waited for again.
func readable(fd uintptr) bool {
	var b [1]byte
	for {
		_, _, err := syscall.Recvfrom(int(fd), b[:], syscall.MSG_PEEK)
		switch err {
		case syscall.EINTR:
			continue
		case syscall.EAGAIN:
			return false
		}
		return true // data, the end, or an error the reader will meet
	}
}
