package inflight

import (
	"errors"
	"io"
	"net"
	"os"
	"testing"
	"time"
)

func TestSlotExpireTimesOutAndRefuses(t *testing.T) {
	a, b := net.Pipe()
	defer b.Close()
	var s Slot
	if !s.Set(a) {
		t.Fatal("Set on a new Slot failed")
	}
	done := make(chan error, 1)
	go func() {
		_, err := a.Read(make([]byte, 1))
		done <- err
	}()
	s.Expire()
	if err := <-done; !errors.Is(err, os.ErrDeadlineExceeded) {
		t.Errorf("read after Expire: %v, want a timeout", err)
	}
	if !s.Aborted() || s.Set(b) {
		t.Error("Set after Expire succeeded")
	}
	a.Close()
}

func TestSlotAbortCloses(t *testing.T) {
	a, b := net.Pipe()
	defer b.Close()
	var s Slot
	s.Set(a)
	s.Abort()
	if _, err := a.Write([]byte{1}); !errors.Is(err, io.ErrClosedPipe) {
		t.Errorf("write after Abort: %v, want a closed connection", err)
	}
	if s.Set(b) {
		t.Error("Set after Abort succeeded")
	}
}

func TestSetResetAndClose(t *testing.T) {
	var s Set
	a, b := net.Pipe()
	if !s.Add(a, b) {
		t.Fatal("Add on a new Set failed")
	}
	s.Reset()
	if _, err := a.Write([]byte{1}); !errors.Is(err, io.ErrClosedPipe) {
		t.Errorf("write after Reset: %v, want a closed connection", err)
	}
	c, d := net.Pipe()
	defer d.Close()
	if !s.Add(c) {
		t.Fatal("Add after Reset failed")
	}
	s.Remove(c)
	s.Close()
	if err := c.SetDeadline(time.Time{}); err != nil {
		t.Errorf("a removed connection was closed: %v", err)
	}
	if s.Add(d) {
		t.Error("Add after Close succeeded")
	}
	s.Done(c)
	if _, err := c.Write([]byte{1}); !errors.Is(err, io.ErrClosedPipe) {
		t.Errorf("write after Done: %v, want a closed connection", err)
	}
}
