package peers

import (
	"fmt"
	"io"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/tendril-net/tendril/internal/host/inherit"
)

// stopGrace is how long a peer gets to exit after SIGTERM before it is
// killed: HAProxy and nginx stop at once on SIGTERM (no draining), tendril
// shuts its listeners and gRPC streams down in well under a second.
const stopGrace = 5 * time.Second

// Process is one child process whose output goes to a log file. The peers
// here and the tunnel mode's stacks run their programs as Processes. A
// command that starts with "ip netns exec NS" runs in namespace NS: ip execs
// the program in place, so the PID and the process group are the program's.
type Process struct {
	name    string
	cmd     *exec.Cmd
	logPath string
	started time.Time // just before the fork

	done    chan struct{} // closed by wait when the process has exited
	waitErr error         // cmd.Wait's result, valid once done is closed

	// KillAtOnce makes Stop kill the process group at once rather than
	// send SIGTERM first (for programs that ignore it, such as
	// konnectivity's proxy-agent). Set it before Stop.
	KillAtOnce bool

	stopOnce sync.Once
}

// StartProcess starts bin with args, stdout and stderr appended to logPath.
// The child gets its own process group (see setProcAttr), so a Ctrl-C in the
// terminal reaches only the benchmark, which then stops its children in
// order.
func StartProcess(name, logPath, bin string, args ...string) (*Process, error) {
	return StartWithSockets(name, logPath, nil, bin, args...)
}

// StartWithSockets is StartProcess handing the process socks, which it serves (tendril's
// binaries take an inherited socket for its address, internal/host/inherit): they were bound by
// Bind, so no other process can take their ports first. This process's copies are closed once
// the child has them (and on a failed start).
func StartWithSockets(name, logPath string, socks []*inherit.Socket, bin string, args ...string) (*Process, error) {
	defer inherit.Close(socks...)
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
	inherit.Pass(cmd, socks...)
	p := &Process{name: name, cmd: cmd, logPath: logPath, done: make(chan struct{}), started: time.Now()}
	if err := cmd.Start(); err != nil {
		return nil, fmt.Errorf("%s: start %s: %w", name, bin, err)
	}
	// Owned by p: Stop waits for done.
	go p.wait()
	return p, nil
}

func (p *Process) wait() {
	p.waitErr = p.cmd.Wait()
	close(p.done)
}

// Name is the name the process was started with, for messages.
func (p *Process) Name() string { return p.name }

// PID is the process's ID.
func (p *Process) PID() int { return p.cmd.Process.Pid }

// Started is the time just before the process was forked.
func (p *Process) Started() time.Time { return p.started }

// Exited returns an error describing the exit if the process has exited,
// else nil.
func (p *Process) Exited() error {
	select {
	case <-p.done:
		status := "with status 0"
		if p.waitErr != nil {
			status = p.waitErr.Error()
		}
		return fmt.Errorf("%s exited early (%s); log %s: %s", p.name, status, p.logPath, p.LogTail())
	default:
		return nil
	}
}

// Stop terminates the process (SIGTERM, and after stopGrace SIGKILL to its
// process group; SIGKILL at once with KillAtOnce) and waits for it. An exit
// caused by our signal is not an error.
func (p *Process) Stop() error {
	var err error
	p.stopOnce.Do(func() {
		select {
		case <-p.done:
			return // exited on its own; Exited() reports that where it matters
		default:
		}
		if p.KillAtOnce {
			if e := kill(p.cmd); e != nil {
				err = fmt.Errorf("%s: kill: %w", p.name, e)
			}
			<-p.done
			return
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

// LogContains is a condition to wait for: nil once the log file at path holds text.
func LogContains(path, text string) func() error {
	return func() error {
		b, err := os.ReadFile(path)
		if err != nil {
			return err
		}
		if !strings.Contains(string(b), text) {
			return fmt.Errorf("no %q in %s yet", text, path)
		}
		return nil
	}
}

// LogTail returns the end of the log file on one line, for error messages.
func (p *Process) LogTail() string {
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

// Memory is a process's resident set: now (VmRSS) and its peak (VmHWM).
type Memory struct {
	RSS, Peak int64 // bytes
}

// ReadMemory reads VmRSS and VmHWM of process pid from /proc; false if it
// cannot (the process is gone, or there is no /proc).
func ReadMemory(pid int) (Memory, bool) {
	b, err := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/status")
	if err != nil {
		return Memory{}, false
	}
	var m Memory
	for l := range strings.Lines(string(b)) {
		k, v, ok := strings.Cut(l, ":")
		f := strings.Fields(v)
		if !ok || len(f) < 1 {
			continue
		}
		kb, err := strconv.ParseInt(f[0], 10, 64)
		if err != nil {
			continue
		}
		switch k {
		case "VmRSS":
			m.RSS = kb << 10
		case "VmHWM":
			m.Peak = kb << 10
		}
	}
	return m, m.RSS > 0
}
