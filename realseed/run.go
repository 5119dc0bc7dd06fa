package realseed

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"time"
)

// Run starts the cluster, says how to reach it and how long each step took, and then, with
// once, stops it again; without, it keeps it running until ctx ends or one of its processes
// ends on its own, and stops it then.
func Run(ctx context.Context, cfg Config, once bool) (err error) {
	c, err := Start(ctx, cfg)
	if err != nil {
		return err
	}
	defer func() {
		if serr := c.Stop(context.WithoutCancel(ctx)); serr != nil && err == nil {
			err = fmt.Errorf("stop: %w", serr)
		}
	}()
	out := c.cfg.Out
	t0 := time.Now()
	inst, err := c.InstallTendril(ctx, Release{})
	if err != nil {
		return fmt.Errorf("install tendril: %w", err)
	}
	fmt.Fprintf(out, "[%5.1fs] tendril installed in %.1f s: %s from chart %s, namespace %s\n", time.Since(c.started).Seconds(), time.Since(t0).Seconds(), inst.Image, inst.Chart, inst.Namespace)
	fmt.Fprintf(out, "real seed ready after %.1f s; memory of the whole set %.0f MiB RSS\n", time.Since(c.started).Seconds(), float64(c.RSS())/(1<<20))
	fmt.Fprintf(out, "  kubectl --kubeconfig %s get pods -A\n", c.Kubeconfig)
	fmt.Fprintf(out, "  registry http://%s, logs %s\n", c.Registry, c.path("logs"))
	if once {
		return nil
	}
	select {
	case <-ctx.Done():
		return nil
	case err := <-c.Exited():
		return err
	}
}

// RSS is the resident memory of every process of the cluster: the daemons Start ran, the
// containerd shims, every container, and this process (Gardener's controllers run in it).
func (c *Cluster) RSS() int64 {
	pids := map[int]bool{os.Getpid(): true}
	for name := range c.ended {
		if pid, ok := c.procs.Pid(name); ok && c.running(name) {
			pids[pid] = true
		}
	}
	procs, _ := filepath.Glob("/proc/[0-9]*/cmdline")
	for _, p := range procs {
		b, err := os.ReadFile(p)
		if err != nil || !strings.Contains(string(b), c.containerdSocket()) {
			continue
		}
		if pid, err := strconv.Atoi(filepath.Base(filepath.Dir(p))); err == nil {
			pids[pid] = true
		}
	}
	for _, pid := range cgroupPids("/sys/fs/cgroup/memory/kubepods") {
		pids[pid] = true
	}
	var total int64
	for pid := range pids {
		b, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", pid))
		if err != nil {
			continue
		}
		for _, line := range strings.Split(string(b), "\n") {
			if f := strings.Fields(line); len(f) >= 2 && f[0] == "VmRSS:" {
				kb, _ := strconv.ParseInt(f[1], 10, 64)
				total += kb << 10
			}
		}
	}
	return total
}
