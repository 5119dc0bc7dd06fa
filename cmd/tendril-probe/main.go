// Command tendril-probe is the real local seed's network probe (make seed): its pods stand in
// for a component on a network path and tell whether a connection passes. `tendril-probe
// serve PORT...` listens on the TCP ports, greets and holds what connects and logs each
// connection (a probe pod's main process: the source or destination of a path, a shoot's
// workload for kubectl logs -f and port-forward); `tendril-probe dial ADDRESS` exits 0 when a TCP
// connection to ADDRESS opens within --timeout and 1 when it does not, saying why (run in a
// probe pod with kubectl exec); `tendril-probe webhook --cert F --key F` serves validating
// admission calls over TLS and denies each with a message naming itself (a shoot's webhook,
// which kube-apiserver calls through the tunnel). It is a developer tool; nothing of a seed or
// a shoot runs it.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"net"
	"os"
	"os/signal"
	"sync"
	"syscall"
	"time"

	"github.com/tendril-net/tendril/internal/proc/buildinfo"
)

func main() {
	if len(os.Args) < 2 {
		fmt.Fprintln(os.Stderr, "usage: tendril-probe serve PORT... | dial [--timeout 2s] ADDRESS | webhook [--listen :9443] --cert F --key F | --version")
		os.Exit(2)
	}
	switch os.Args[1] {
	case "--version":
		fmt.Println(buildinfo.String("tendril-probe"))
	case "serve":
		ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM, os.Interrupt)
		defer stop()
		if err := serve(ctx, os.Args[2:]); err != nil {
			fmt.Fprintln(os.Stderr, "tendril-probe:", err)
			os.Exit(1)
		}
	case "webhook":
		fs := flag.NewFlagSet("webhook", flag.ExitOnError)
		listen := fs.String("listen", ":9443", "the TLS address kube-apiserver calls")
		cert := fs.String("cert", "", "the serving certificate (PEM)")
		key := fs.String("key", "", "its key (PEM)")
		_ = fs.Parse(os.Args[2:])
		if *cert == "" || *key == "" {
			fmt.Fprintln(os.Stderr, "usage: tendril-probe webhook [--listen :9443] --cert F --key F")
			os.Exit(2)
		}
		ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM, os.Interrupt)
		defer stop()
		if err := webhook(ctx, *listen, *cert, *key); err != nil {
			fmt.Fprintln(os.Stderr, "tendril-probe:", err)
			os.Exit(1)
		}
	case "dial":
		fs := flag.NewFlagSet("dial", flag.ExitOnError)
		timeout := fs.Duration("timeout", 2*time.Second, "how long the connection may take to open")
		_ = fs.Parse(os.Args[2:])
		if fs.NArg() != 1 {
			fmt.Fprintln(os.Stderr, "usage: tendril-probe dial [--timeout 2s] ADDRESS")
			os.Exit(2)
		}
		c, err := net.DialTimeout("tcp", fs.Arg(0), *timeout)
		if err != nil {
			fmt.Println("closed:", err)
			os.Exit(1)
		}
		c.Close()
		fmt.Println("open")
	default:
		fmt.Fprintf(os.Stderr, "tendril-probe: unknown command %q\n", os.Args[1])
		os.Exit(2)
	}
}

// serve accepts on every port until ctx ends; each connection gets a line naming the probe's
// address and is held until its peer closes it, and each is logged to stdout.
func serve(ctx context.Context, ports []string) error {
	if len(ports) == 0 {
		return errors.New("serve: no port")
	}
	var wg sync.WaitGroup
	defer wg.Wait()
	var lns []net.Listener
	defer func() {
		for _, l := range lns {
			l.Close()
		}
	}()
	for _, p := range ports {
		l, err := net.Listen("tcp", net.JoinHostPort("", p))
		if err != nil {
			return err
		}
		lns = append(lns, l)
		fmt.Printf("serving %s\n", l.Addr())
		wg.Add(1)
		go func() {
			defer wg.Done()
			for {
				c, err := l.Accept()
				if err != nil {
					return
				}
				wg.Add(1)
				go func() {
					defer wg.Done()
					defer c.Close()
					stop := context.AfterFunc(ctx, func() { c.Close() })
					defer stop()
					// A line in the pod's log and one to the peer: kubectl logs -f and
					// port-forward through a shoot's tunnel see each other's connection.
					fmt.Printf("accepted %s on %s\n", c.RemoteAddr(), c.LocalAddr())
					_ = c.SetWriteDeadline(time.Now().Add(time.Second))
					_, _ = fmt.Fprintf(c, "tendril-probe on %s\n", c.LocalAddr())
					_, _ = c.Read(make([]byte, 1))
				}()
			}
		}()
	}
	<-ctx.Done()
	for _, l := range lns {
		l.Close()
	}
	return nil
}
