// Package procgroup runs a set of child processes that end together: each writes its output
// to a log file, a process that ends on its own is reported on Exited, and Stop signals them
// all (SIGTERM, SIGKILL after a grace period) and waits for every one. It knows nothing of
// what the processes are; it does not restart them.
package procgroup

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"sync"
	"syscall"
	"time"

	"github.com/tendril-net/tendril/internal/host/inherit"
)

// Group is the set of processes started by Start; the zero value is not usable (New).
type Group struct {
	ctx    context.Context
	cancel context.CancelFunc
	wg     sync.WaitGroup
	exited chan error
	mu     sync.Mutex
	pids   map[string]int
}

// Grace is how long a process has between SIGTERM and SIGKILL.
const Grace = 5 * time.Second

// exitedQueue bounds the reports of processes that ended early: past it a report is dropped
// (the first ones say what went wrong; a runner stops at the first).
const exitedQueue = 64

// New returns a group whose processes run until ctx ends or Stop.
func New(ctx context.Context) *Group {
	ctx, cancel := context.WithCancel(ctx)
	return &Group{ctx: ctx, cancel: cancel, exited: make(chan error, exitedQueue), pids: map[string]int{}}
}

// Context ends when the group stops.
func (g *Group) Context() context.Context { return g.ctx }

// Exited receives an error for every process that ends before Stop.
func (g *Group) Exited() <-chan error { return g.exited }

// Options are how Start runs one process; the zero value runs it as this process's child in
// this network namespace with nothing inherited.
type Options struct {
	// Netns is a named network namespace (ip netns) to run it in.
	Netns string
	// Socks are inherited (this process's copies are closed once it has them, and on an error).
	Socks []*inherit.Socket
	// Setsid puts it in a session of its own: a terminal's signals do not reach it, and Stop
	// signals it alone (it ends its children itself).
	Setsid bool
	// Env, when not nil, is its whole environment.
	Env []string
}

// Start runs path with args, output to logPath. The process is running until ended is closed.
func (g *Group) Start(name, logPath string, o Options, path string, args ...string) (ended <-chan struct{}, err error) {
	defer inherit.Close(o.Socks...)
	lf, err := os.Create(logPath)
	if err != nil {
		return nil, err
	}
	if o.Netns != "" {
		args = append([]string{"netns", "exec", o.Netns, path}, args...)
		path = "ip"
	}
	cmd := exec.CommandContext(g.ctx, path, args...)
	cmd.Stdout, cmd.Stderr = lf, lf
	cmd.Env = o.Env
	if o.Setsid {
		cmd.SysProcAttr = &syscall.SysProcAttr{Setsid: true}
	}
	cmd.Cancel = func() error { return cmd.Process.Signal(syscall.SIGTERM) }
	cmd.WaitDelay = Grace
	inherit.Pass(cmd, o.Socks...)
	if err := cmd.Start(); err != nil {
		lf.Close()
		return nil, fmt.Errorf("start %s: %w", name, err)
	}
	g.mu.Lock()
	g.pids[name] = cmd.Process.Pid
	g.mu.Unlock()
	done := make(chan struct{})
	g.wg.Add(1)
	go func() {
		defer g.wg.Done()
		defer lf.Close()
		err := cmd.Wait()
		close(done)
		if g.ctx.Err() == nil {
			select {
			case g.exited <- fmt.Errorf("%s exited: %v (log %s)", name, err, logPath):
			default: // the queue is full: the runner has its first reports
			}
		}
	}()
	return done, nil
}

// Pid is the process id of the process last started as name.
func (g *Group) Pid(name string) (int, bool) {
	g.mu.Lock()
	defer g.mu.Unlock()
	pid, ok := g.pids[name]
	return pid, ok
}

// Stop ends every process and waits for them.
func (g *Group) Stop() {
	g.cancel()
	g.wg.Wait()
}

// LogTail is the end of a process's log (at most 2 KiB), for an error that says why it never
// became ready.
func LogTail(path string) string {
	b, err := os.ReadFile(path)
	if err != nil {
		return err.Error()
	}
	const most = 2 << 10
	if len(b) > most {
		b = b[len(b)-most:]
	}
	return string(b)
}
