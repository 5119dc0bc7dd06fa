package tunnel

import (
	"fmt"
	"io"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"syscall"
	"time"
)

// proc is one child process of a stack, output appended to a log file, in a
// process group of its own (a Ctrl-C in the terminal reaches only the
// benchmark, which then stops its children in order). A command that starts
// with "ip netns exec NS" runs in namespace NS: ip execs the program in
// place, so the PID and the group are the program's. (bench/peers has the
// same for the TLS modes' peers; the tunnel's stacks also need the start
// time, SIGKILL-only stops and the processes' memory.)
type proc struct {
	name    string
	cmd     *exec.Cmd
	logPath string
	started time.Time // just before the fork
	done    chan struct{}
	waitErr error
	killed  bool // stop with SIGKILL at once (proxy-agent ignores SIGTERM)
}

// stopGrace is how long a process gets to exit after SIGTERM.
const stopGrace = 5 * time.Second

func startProc(name, logPath string, argv []string) (*proc, error) {
	f, err := os.OpenFile(logPath, os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o644)
	if err != nil {
		return nil, fmt.Errorf("%s: open log: %w", name, err)
	}
	defer f.Close()
	cmd := exec.Command(argv[0], argv[1:]...)
	cmd.Stdout, cmd.Stderr = f, f
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	p := &proc{name: name, cmd: cmd, logPath: logPath, done: make(chan struct{}), started: time.Now()}
	if err := cmd.Start(); err != nil {
		return nil, fmt.Errorf("%s: start %s: %w", name, argv[0], err)
	}
	go func() {
		p.waitErr = cmd.Wait()
		close(p.done)
	}()
	return p, nil
}

func (p *proc) pid() int { return p.cmd.Process.Pid }

// exited describes the exit if the process has exited, else nil.
func (p *proc) exited() error {
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

// stop ends the process (SIGTERM, SIGKILL to its group after stopGrace or at
// once for a killed one) and waits for it.
func (p *proc) stop() error {
	select {
	case <-p.done:
		return nil
	default:
	}
	if !p.killed {
		_ = p.cmd.Process.Signal(syscall.SIGTERM)
		select {
		case <-p.done:
			return nil
		case <-time.After(stopGrace):
		}
	}
	if err := syscall.Kill(-p.pid(), syscall.SIGKILL); err != nil {
		_ = p.cmd.Process.Kill()
	}
	<-p.done
	return nil
}

// logTail returns the end of the log on one line, for error messages.
func (p *proc) logTail() string {
	const n = 1200
	f, err := os.Open(p.logPath)
	if err != nil {
		return "(no log)"
	}
	defer f.Close()
	if st, err := f.Stat(); err == nil && st.Size() > n {
		_, _ = f.Seek(st.Size()-n, io.SeekStart)
	}
	b, _ := io.ReadAll(f)
	s := strings.Join(strings.Fields(string(b)), " ")
	if s == "" {
		return "(empty log)"
	}
	return s
}

// memory is a process's resident set: now and its peak.
type memory struct {
	RSS, Peak int64 // bytes
}

// readMemory reads VmRSS and VmHWM of pid.
func readMemory(pid int) (memory, bool) {
	b, err := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/status")
	if err != nil {
		return memory{}, false
	}
	var m memory
	for l := range strings.Lines(string(b)) {
		k, v, ok := strings.Cut(l, ":")
		if !ok {
			continue
		}
		f := strings.Fields(v)
		if len(f) < 1 {
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
