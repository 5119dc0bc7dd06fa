//go:build !unix

package peers

import "os/exec"

func setProcAttr(*exec.Cmd) {}

// terminate has no gentler option than Kill where there are no signals.
func terminate(cmd *exec.Cmd) error { return cmd.Process.Kill() }

func kill(cmd *exec.Cmd) error { return cmd.Process.Kill() }
