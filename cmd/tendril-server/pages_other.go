//go:build !linux

package main

// releaseStartupPages does nothing outside Linux (see pages_linux.go).
func releaseStartupPages() (int, error) { return 0, nil }
