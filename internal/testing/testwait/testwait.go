// Package testwait polls a condition in a test until it holds. Tests wait for state this way
// instead of sleeping or asserting on time: the deadline is generous (a loaded 2-core CI
// machine must never fail it) and only bounds a test that would otherwise hang.
package testwait

import (
	"testing"
	"time"
)

// Deadline is how long For waits before failing the test.
const Deadline = 60 * time.Second

// For calls f every 100 ms until it returns nil, and fails t with f's last error, prefixed
// by what, once Deadline has passed.
func For(t testing.TB, what string, f func() error) {
	t.Helper()
	deadline := time.Now().Add(Deadline)
	for {
		err := f()
		if err == nil {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("%s: %v", what, err)
		}
		time.Sleep(100 * time.Millisecond)
	}
}

// Receive returns the value that arrives on ch, and fails t, with what, if none arrives
// within Deadline.
func Receive[T any](t testing.TB, what string, ch <-chan T) T {
	t.Helper()
	select {
	case v := <-ch:
		return v
	case <-time.After(Deadline):
		t.Fatalf("%s: nothing after %v", what, Deadline)
	}
	var zero T
	return zero
}
