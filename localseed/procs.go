package localseed

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"sync"
	"syscall"
	"time"

	"github.com/tendril-net/tendril/internal/inherit"
)

// procs are the processes the runner started; stop ends them all (SIGTERM, then after a grace
// period SIGKILL) and waits for them.
type procs struct {
	ctx    context.Context
	cancel context.CancelFunc
	wg     sync.WaitGroup
	// exited receives an error for every process that ends before stop.
	exited chan error
}

func newProcs(ctx context.Context) *procs {
	ctx, cancel := context.WithCancel(ctx)
	return &procs{ctx: ctx, cancel: cancel, exited: make(chan error, 64)}
}

// start runs path with args, output to logPath; netns, when not empty, is a named network
// namespace (ip netns) to run it in. The process inherits socks (this process's copies are
// closed once it has them, and on an error). The process is running until ended is closed.
func (p *procs) start(name, logPath, netns, path string, socks []*inherit.Socket, args ...string) (ended <-chan struct{}, err error) {
	defer inherit.Close(socks...)
	lf, err := os.Create(logPath)
	if err != nil {
		return nil, err
	}
	if netns != "" {
		args = append([]string{"netns", "exec", netns, path}, args...)
		path = "ip"
	}
	cmd := exec.CommandContext(p.ctx, path, args...)
	cmd.Stdout, cmd.Stderr = lf, lf
	cmd.Cancel = func() error { return cmd.Process.Signal(syscall.SIGTERM) }
	cmd.WaitDelay = 5 * time.Second
	inherit.Pass(cmd, socks...)
	if err := cmd.Start(); err != nil {
		lf.Close()
		return nil, fmt.Errorf("start %s (run make build first): %w", name, err)
	}
	done := make(chan struct{})
	p.wg.Add(1)
	go func() {
		defer p.wg.Done()
		defer lf.Close()
		err := cmd.Wait()
		close(done)
		if p.ctx.Err() == nil {
			p.exited <- fmt.Errorf("%s exited: %v (log %s)", name, err, logPath)
		}
	}()
	return done, nil
}

// logTail is the end of a process's log (at most 2 KiB), for an error that says why it never
// became ready.
func logTail(path string) string {
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

func (p *procs) stop() {
	p.cancel()
	p.wg.Wait()
}
