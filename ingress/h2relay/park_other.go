//go:build !unix

package h2relay

// canPeek: no socket peek here, so connections are not parked.
const canPeek = false

func readable(uintptr) bool { return true }
