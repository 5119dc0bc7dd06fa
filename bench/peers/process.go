package peers

import (
	"fmt"
	"io"
	"os"
	"os/exec"
	"strings"
	"sync"
	"time"
)

// stopGrace is how long a peer gets to exit after SIGTERM before it is
// killed: HAProxy and nginx stop at once on SIGTERM (no draining), tendril
// shuts its listeners and gRPC streams down in well under a second.
const stopGrace = 5 * time.Second

// process is one child process whose output goes to a log file.
type process struct {
	name    string
	cmd     *exec.Cmd
	logPath string

	done    chan struct{} // closed by wait when the process has exited
	waitErr error         // cmd.Wait's result, valid once done is closed

	stopOnce sync.Once
}

// startProcess starts bin with args, stdout and stderr appended to logPath.
// The child gets its own process group (see setProcAttr), so a Ctrl-C in the
// terminal reaches only the benchmark, which then stops its peers in order.
func startProcess(name, logPath, bin string, args ...string) (*process, error) {
	f, err := os.OpenFile(logPath, os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o644)
	if err != nil {
		return nil, fmt.Errorf("%s: open log: %w", name, err)
	}
	// The child holds its own copy of the descriptor; ours is not needed
	// once it has started. Writing to a file rather than a pipe means no
	// goroutine copies output, and a chatty peer never blocks on us.
	defer f.Close()
	cmd := exec.Command(bin, args...)
	cmd.Stdout, cmd.Stderr = f, f
	setProcAttr(cmd)
	if err := cmd.Start(); err != nil {
		return nil, fmt.Errorf("%s: start %s: %w", name, bin, err)
	}
	p := &process{name: name, cmd: cmd, logPath: logPath, done: make(chan struct{})}
	// Owned by p: stop waits for done.
	go p.wait()
	return p, nil
}

func (p *process) wait() {
	p.waitErr = p.cmd.Wait()
	close(p.done)
}

// exited returns an error describing the exit if the process has exited,
// else nil.
func (p *process) exited() error {
	select {
	case <-p.done:
		status := "with status 0"
		if p.waitErr != nil {
			status = p.waitErr.Error()
		}
		return fmt.Errorf("%s exited early (%s); log %s: %s", p.name, status, p.logPath, p.logTail())
	default:
		return nil
	}
}

// stop terminates the process and waits for it. An exit caused by our signal
// is not an error.
func (p *process) stop() error {
	var err error
	p.stopOnce.Do(func() {
		select {
		case <-p.done:
			return // exited on its own; exited() reports that where it matters
		default:
		}
		if e := terminate(p.cmd); e != nil {
			err = fmt.Errorf("%s: terminate: %w", p.name, e)
		}
		select {
		case <-p.done:
		case <-time.After(stopGrace):
			if e := kill(p.cmd); e != nil {
				err = fmt.Errorf("%s: kill after %v: %w", p.name, stopGrace, e)
			}
			<-p.done
		}
	})
	return err
}

// logTail returns the end of the log file on one line, for error messages.
func (p *process) logTail() string {
	const n = 1500
	f, err := os.Open(p.logPath)
	if err != nil {
		return "(no log)"
	}
	defer f.Close()
	if st, err := f.Stat(); err == nil && st.Size() > n {
		if _, err := f.Seek(st.Size()-n, io.SeekStart); err != nil {
			return "(unreadable log)"
		}
	}
	b, _ := io.ReadAll(f)
	s := strings.Join(strings.Fields(string(b)), " ")
	if s == "" {
		return "(empty log)"
	}
	return s
}
