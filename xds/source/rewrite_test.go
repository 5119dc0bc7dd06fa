package source

import (
	"context"
	"errors"
	"os"
	"path/filepath"
	"sync"
	"testing"
	"time"

	"github.com/go-logr/logr/testr"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/tendril-net/tendril/internal/testing/metrictest"
	"github.com/tendril-net/tendril/internal/testing/testwait"
	"github.com/tendril-net/tendril/xds/model"
)

func TestParseRoutesNeedsShootsList(t *testing.T) {
	for name, in := range map[string]string{
		"0 bytes":       "",
		"whitespace":    " \n  \n\n",
		"comment only":  "# routes\n",
		"shoots: null":  "shoots:\n",
		"other key":     "shots: []\n",
		"half a header": "sho",
	} {
		_, err := ParseRoutes(context.Background(), []byte(in), nil)
		if err == nil {
			t.Errorf("%s: accepted", name)
		} else if name != "other key" && name != "half a header" && !errors.Is(err, ErrNoShoots) {
			t.Errorf("%s: %v, want ErrNoShoots", name, err)
		}
	}
	shoots, err := ParseRoutes(context.Background(), []byte("shoots: []\n"), nil)
	if err != nil || len(shoots) != 0 {
		t.Fatalf("explicit empty list: %v, %v; want no shoots and no error", shoots, err)
	}
}

// rewriteInPlace writes content as a shell redirection does, "( sleep d; cat good ) > path": the
// file is truncated at once and written only after d.
func rewriteInPlace(t *testing.T, path, content string, d time.Duration) {
	t.Helper()
	fh, err := os.OpenFile(path, os.O_WRONLY|os.O_TRUNC, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer fh.Close()
	time.Sleep(d)
	if _, err := fh.WriteString(content); err != nil {
		t.Fatal(err)
	}
}

// TestFileInPlaceRewrites rewrites the route file in place 20 times, each leaving it empty for
// longer than the settle time, and then leaves a 0-byte file: no route set without shoots is ever
// published, each empty read is counted, and an explicit "shoots: []" still withdraws them all.
func TestFileInPlaceRewrites(t *testing.T) {
	dir := t.TempDir()
	path := filepath.Join(dir, "routes.yaml")
	good := routeYAML("shoot--a--one", "shoot--a--two")
	if err := os.WriteFile(path, []byte(good), 0o644); err != nil {
		t.Fatal(err)
	}
	reg := prometheus.NewRegistry()
	var mu sync.Mutex
	var published []int
	last := make(chan int, 1000)
	f := &File{Path: path, Log: testr.New(t), Settle: 20 * time.Millisecond, Registry: reg}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() {
		done <- f.Run(ctx, func(s []model.Shoot) error {
			mu.Lock()
			published = append(published, len(s))
			mu.Unlock()
			last <- len(s)
			return nil
		})
	}()
	defer func() {
		cancel()
		if err := <-done; err != nil {
			t.Error(err)
		}
	}()
	wait := func(want int) {
		t.Helper()
		deadline := time.After(10 * time.Second)
		for {
			select {
			case n := <-last:
				if n == want {
					return
				}
			case <-deadline:
				t.Fatalf("no route set of %d shoots published within 10 s", want)
			}
		}
	}
	wait(2)
	for i := range 20 {
		// Empty for 3 to 12 settle times: long enough to be read (twice) while empty.
		rewriteInPlace(t, path, good, time.Duration(60+i*10)*time.Millisecond)
	}
	time.Sleep(100 * time.Millisecond) // the last rewrite's reload
	checkPublished := func() {
		t.Helper()
		mu.Lock()
		defer mu.Unlock()
		for i, n := range published {
			if n != 2 {
				t.Fatalf("publication %d had %d shoots, want 2 (all publications: %v)", i, n, published)
			}
		}
	}
	checkPublished()
	testwait.For(t, "an empty read refused", func() error {
		if metrictest.Sum(t, reg, "tendril_route_file_loads_total", map[string]string{"outcome": "no_shoots"}) == 0 {
			return errors.New("no no_shoots load counted")
		}
		return nil
	})
	before := metrictest.Sum(t, reg, "tendril_route_file_loads_total", map[string]string{"outcome": "no_shoots"})
	if err := os.Truncate(path, 0); err != nil {
		t.Fatal(err)
	}
	testwait.For(t, "the 0-byte file refused", func() error {
		if metrictest.Sum(t, reg, "tendril_route_file_loads_total", map[string]string{"outcome": "no_shoots"}) <= before {
			return errors.New("no further no_shoots load counted")
		}
		return nil
	})
	time.Sleep(100 * time.Millisecond) // past a reload the truncation could have caused
	checkPublished()
	if err := os.WriteFile(path, []byte("shoots: []\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	wait(0)
}

// TestFileHalfWritten rewrites a two-shoot route file in place in two writes, the second 1.1
// settle times after the first: a read between them sees a valid file with only the first shoot.
// A reload needs two identical reads a settle time apart, so that set is never published. The
// pause is just over one settle time (the first read then falls into it) and leaves 0.9 settle
// times (90 ms) for the writer's sleep to overrun before the confirming read: with a 40 ms settle
// and a 1.5× pause the margin was 20 ms, and a loaded machine's late wake-ups published the half
// file (twice in a helper's runs at load average 10–14).
func TestFileHalfWritten(t *testing.T) {
	path := filepath.Join(t.TempDir(), "routes.yaml")
	full := routeYAML("shoot--a--one", "shoot--a--two")
	half := routeYAML("shoot--a--one") // a prefix of full
	if full[:len(half)] != half {
		t.Fatal("the one-shoot file is not a prefix of the two-shoot one")
	}
	if err := os.WriteFile(path, []byte(full), 0o644); err != nil {
		t.Fatal(err)
	}
	const settle = 100 * time.Millisecond
	got := make(chan int, 100)
	f := &File{Path: path, Log: testr.New(t), Settle: settle}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- f.Run(ctx, func(s []model.Shoot) error { got <- len(s); return nil }) }()
	defer func() {
		cancel()
		if err := <-done; err != nil {
			t.Error(err)
		}
	}()
	if n := <-got; n != 2 {
		t.Fatalf("first load: %d shoots", n)
	}
	for range 10 {
		fh, err := os.OpenFile(path, os.O_WRONLY|os.O_TRUNC, 0)
		if err != nil {
			t.Fatal(err)
		}
		if _, err := fh.WriteString(half); err != nil {
			t.Fatal(err)
		}
		time.Sleep(settle * 11 / 10)
		if _, err := fh.WriteString(full[len(half):]); err != nil {
			t.Fatal(err)
		}
		fh.Close()
		select {
		case n := <-got:
			if n != 2 {
				t.Fatalf("published %d shoots from a half-written file", n)
			}
		case <-time.After(10 * time.Second):
			t.Fatal("the complete file was not published within 10 s")
		}
	}
}
