// Package testwait polls a condition in a test until it holds. Tests wait for state this way
// instead of sleeping or asserting on time: the deadline is generous (a loaded 2-core CI
// machine must never fail it) and only bounds a test that would otherwise hang. Run is the
// other wait a test has: for what it runs in the background, at its end.
package testwait

import (
	"context"
	"errors"
	"testing"
	"time"
)

// Deadline is how long For waits before failing the test.
const Deadline = 60 * time.Second

// For calls f every 100 ms until it returns nil, and fails t with f's last error, prefixed
// by what, once Deadline has passed.
func For(t testing.TB, what string, f func() error) {
	t.Helper()
	Every(t, 100*time.Millisecond, what, f)
}

// Every is For calling f every interval: for a condition cheap to check that a test waits on
// often.
func Every(t testing.TB, interval time.Duration, what string, f func() error) {
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
		time.Sleep(interval)
	}
}

// Until calls cond every 5 ms until it holds, and fails t, with what, once Deadline has passed.
func Until(t testing.TB, what string, cond func() bool) {
	t.Helper()
	Every(t, 5*time.Millisecond, what, func() error {
		if !cond() {
			return errNotYet
		}
		return nil
	})
}

var errNotYet = errors.New("timed out waiting")

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

// Run calls run on a goroutine until the test ends: cleanup cancels run's context, waits for run
// to return and fails t, with what, if it returned an error.
func Run(t testing.TB, what string, run func(ctx context.Context) error) {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- run(ctx) }()
	t.Cleanup(func() {
		cancel()
		if err := <-done; err != nil {
			t.Errorf("%s: %v", what, err)
		}
	})
}
