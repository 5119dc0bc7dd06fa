// Command tendril-pause is the pod sandbox's process of the real local seed (make seed): the
// "pause" container that holds a pod's namespaces. As PID 1 of the sandbox it reaps the
// orphans that end up with it and exits on SIGTERM or SIGINT. The real seed packs it into the
// sandbox image it serves from its registry; a seed on a cloud uses its distribution's pause.
package main

import (
	"fmt"
	"os"
	"os/signal"
	"syscall"

	"github.com/tendril-net/tendril/internal/proc/buildinfo"
)

func main() {
	if len(os.Args) > 1 && os.Args[1] == "--version" {
		fmt.Println(buildinfo.String("tendril-pause"))
		return
	}
	sig := make(chan os.Signal, 4)
	signal.Notify(sig, syscall.SIGTERM, syscall.SIGINT, syscall.SIGCHLD)
	for s := range sig {
		if s != syscall.SIGCHLD {
			return
		}
		for {
			var ws syscall.WaitStatus
			if pid, err := syscall.Wait4(-1, &ws, syscall.WNOHANG, nil); pid <= 0 || err != nil {
				break
			}
		}
	}
}
