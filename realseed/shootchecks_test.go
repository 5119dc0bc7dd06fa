package realseed

import (
	"context"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
	"time"
)

// TestLineWaiter: lines split over writes are joined, the first match is returned, and a wait
// that ends unmatched says what it saw.
func TestLineWaiter(t *testing.T) {
	w := &lineWaiter{}
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	go func() {
		for _, p := range []string{"serving [::]:8080\nacc", "epted 10.0.0.1:5 on 10.0.0.2:8080\n", "accepted again\n"} {
			time.Sleep(10 * time.Millisecond)
			_, _ = w.Write([]byte(p))
		}
	}()
	got, err := w.wait(ctx, regexp.MustCompile(`^accepted `))
	if err != nil || got != "accepted 10.0.0.1:5 on 10.0.0.2:8080" {
		t.Fatalf("wait = %q, %v", got, err)
	}
	short, scancel := context.WithTimeout(context.Background(), 50*time.Millisecond)
	defer scancel()
	_, err = w.wait(short, regexp.MustCompile(`^never`))
	if err == nil || !strings.Contains(err.Error(), "serving [::]:8080") {
		t.Fatalf("unmatched wait: %v, want an error naming the lines seen", err)
	}
}

func TestMedian(t *testing.T) {
	if m := median([]time.Duration{5, 1, 3}); m != 3 {
		t.Errorf("median of 5,1,3 = %v", m)
	}
	if m := median(nil); m != 0 {
		t.Errorf("median of none = %v", m)
	}
}

// TestStaticBinary: an image of one file runs only a binary without a dynamic loader; a dynamic
// one is refused with the way out.
func TestStaticBinary(t *testing.T) {
	dir := t.TempDir()
	if err := os.WriteFile(filepath.Join(dir, "main.go"), []byte("package main\nfunc main() {}\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	bin := filepath.Join(dir, "static")
	cmd := exec.Command("go", "build", "-o", bin, "main.go")
	cmd.Dir = dir
	cmd.Env = append(os.Environ(), "CGO_ENABLED=0", "GOFLAGS=", "GO111MODULE=off")
	if out, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("go build: %v\n%s", err, out)
	}
	if err := staticBinary(bin); err != nil {
		t.Errorf("a CGO_ENABLED=0 binary: %v", err)
	}
	sh, err := exec.LookPath("sh")
	if err != nil {
		t.Skip("no sh to stand for a dynamic binary")
	}
	if err := staticBinary(sh); err == nil || !strings.Contains(err.Error(), "make testbin") {
		t.Errorf("%s (dynamic): %v, want an error naming make testbin", sh, err)
	}
	if err := staticBinary(filepath.Join(dir, "missing")); err == nil {
		t.Error("a missing file: no error")
	}
}

// TestStartShootRefusesBadConfig: a name that is no DNS label or an index out of range is
// refused before anything is made.
func TestStartShootRefusesBadConfig(t *testing.T) {
	c := &Cluster{}
	for _, cfg := range []ShootConfig{{Name: "A", Index: 1}, {Name: "a_b", Index: 1}, {Name: "a", Index: 0}, {Name: "a", Index: maxShoots + 1},
		{Name: strings.Repeat("a", 21), Index: 1}, {Name: "a-", Index: 1}} {
		if _, err := c.StartShoot(context.Background(), nil, cfg); err == nil || !strings.Contains(err.Error(), "are required") {
			t.Errorf("%+v: %v, want the requirements", cfg, err)
		}
	}
	if len(c.shoots) != 0 {
		t.Errorf("%d shoots recorded", len(c.shoots))
	}
}
