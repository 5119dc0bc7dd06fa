package idle

import (
	"bufio"
	"context"
	"fmt"
	"io"
	"net/http"
	"strconv"
	"strings"
	"time"
)

// goroutines counts a Go data plane's goroutines from its metrics endpoint
// (go_goroutines). Its HTTP connection is opened at the baseline and kept
// alive: a data plane that has run out of descriptors still answers on it.
// When /metrics fails (its process collector opens /proc files, which needs
// descriptors too) the count comes from /debug/pprof/goroutine on the same
// connection (tendril-ingress runs with --profiling here).
type goroutines struct {
	metrics string // "" for a data plane without one
	client  *http.Client
	tr      *http.Transport
}

func newGoroutines(metricsURL string) *goroutines {
	// One connection, never closed for being idle: the tendril's metrics
	// server has no idle timeout either.
	tr := &http.Transport{MaxIdleConnsPerHost: 1, MaxConnsPerHost: 1, IdleConnTimeout: 0, DisableCompression: true}
	return &goroutines{metrics: metricsURL, tr: tr, client: &http.Client{Transport: tr, Timeout: 10 * time.Second}}
}

func (g *goroutines) close() { g.tr.CloseIdleConnections() }

// count returns the goroutines, or -1 and why not ("" for a data plane that
// is not a Go program).
func (g *goroutines) count() (int, string) {
	if g.metrics == "" {
		return -1, ""
	}
	n, err := g.get(g.metrics, "go_goroutines ")
	if err == nil {
		return n, ""
	}
	pprofURL := strings.TrimSuffix(g.metrics, "/metrics") + "/debug/pprof/goroutine?debug=1"
	n, err2 := g.get(pprofURL, "goroutine profile: total ")
	if err2 == nil {
		return n, fmt.Sprintf("go_goroutines failed (%v); counted from the goroutine profile", err)
	}
	return -1, fmt.Sprintf("no goroutine count: %v; %v", err, err2)
}

// get fetches url and returns the integer after the first line that starts
// with prefix.
func (g *goroutines) get(url, prefix string) (int, error) {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, url, nil)
	if err != nil {
		return 0, err
	}
	resp, err := g.client.Do(req)
	if err != nil {
		return 0, err
	}
	defer resp.Body.Close()
	// The body is read to its end either way, so that the connection can
	// be used again.
	defer io.Copy(io.Discard, resp.Body)
	if resp.StatusCode != http.StatusOK {
		return 0, fmt.Errorf("GET %s: %s", url, resp.Status)
	}
	return parseCount(resp.Body, prefix)
}

func parseCount(r io.Reader, prefix string) (int, error) {
	sc := bufio.NewScanner(r)
	sc.Buffer(make([]byte, 64<<10), 1<<20)
	for sc.Scan() {
		if v, ok := strings.CutPrefix(sc.Text(), prefix); ok {
			f, err := strconv.ParseFloat(strings.TrimSpace(v), 64)
			if err != nil {
				return 0, fmt.Errorf("%s%q: %w", prefix, v, err)
			}
			return int(f), nil
		}
	}
	if err := sc.Err(); err != nil {
		return 0, err
	}
	return 0, fmt.Errorf("no line %q…", prefix)
}
