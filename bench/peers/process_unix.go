//go:build unix

package peers

import (
	"os/exec"
	"syscall"
)

// setProcAttr puts the child into its own process group: the terminal's
// SIGINT then goes to the benchmark only, and kill can reach the child's own
// children (nginx workers) through the group.
func setProcAttr(cmd *exec.Cmd) {
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
}

func terminate(cmd *exec.Cmd) error { return cmd.Process.Signal(syscall.SIGTERM) }

// kill kills the whole process group, workers included.
func kill(cmd *exec.Cmd) error { return syscall.Kill(-cmd.Process.Pid, syscall.SIGKILL) }
