// Package e2e tests tendril's binaries together as an operator runs them: built from this tree,
// started as processes on loopback, configured only through their flags and files, and checked
// from the outside (client connections, /readyz, /metrics). It has no code of its own.
package e2e
