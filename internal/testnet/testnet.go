// Package testnet holds the small network fixtures tendril's tests share: a serve loop whose
// handlers the test waits for, an echo that passes half-closes on, and an echo round trip. It is
// imported by tests only and does nothing on its own.
package testnet

import (
	"bytes"
	"fmt"
	"io"
	"net"
	"sync"
	"testing"
)

// Serve accepts on ln until the test ends and runs handle for each connection, closing it
// afterwards; cleanup closes ln and waits for every handler.
func Serve(t testing.TB, ln net.Listener, handle func(net.Conn)) {
	t.Helper()
	var wg sync.WaitGroup
	wg.Add(1)
	go func() {
		defer wg.Done()
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			wg.Add(1)
			go func() {
				defer wg.Done()
				defer c.Close()
				handle(c)
			}()
		}
	}()
	t.Cleanup(func() { ln.Close(); wg.Wait() })
}

// Echo copies everything back and half-closes when the client does.
func Echo(c net.Conn) {
	_, _ = io.Copy(c, c)
	if cw, ok := c.(interface{ CloseWrite() error }); ok {
		_ = cw.CloseWrite()
	}
}

// EchoServer serves Echo on a new loopback listener until the test ends and returns its address.
func EchoServer(t testing.TB) string {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	Serve(t, ln, Echo)
	return ln.Addr().String()
}

// RoundTrip sends payload on c, half-closes, and checks that the echo is identical.
func RoundTrip(c net.Conn, payload []byte) error {
	errc := make(chan error, 1)
	go func() {
		_, err := c.Write(payload)
		if err == nil {
			err = c.(interface{ CloseWrite() error }).CloseWrite()
		}
		errc <- err
	}()
	got, err := io.ReadAll(c)
	if werr := <-errc; werr != nil {
		return fmt.Errorf("write: %w", werr)
	}
	if err != nil {
		return fmt.Errorf("read: %w", err)
	}
	if !bytes.Equal(got, payload) {
		return fmt.Errorf("echo differs: got %d bytes, want %d identical bytes", len(got), len(payload))
	}
	return nil
}
