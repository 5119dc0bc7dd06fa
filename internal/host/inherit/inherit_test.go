package inherit

import (
	"bufio"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"os/exec"
	"strings"
	"syscall"
	"testing"
	"time"
)

// childEnv makes the test binary the child: it listens on the addresses in it (inherited where
// the parent passed them) and answers each connection with its own pid.
const childEnv = "INHERIT_TEST_CHILD"

func TestMain(m *testing.M) {
	if addrs := os.Getenv(childEnv); addrs != "" {
		os.Exit(child(strings.Split(addrs, ",")))
	}
	os.Exit(m.Run())
}

func child(addrs []string) int {
	ls, err := Parse(os.Getenv(EnvVar))
	if err != nil {
		fmt.Println("parse:", err)
		return 2
	}
	for _, a := range addrs {
		l, err := ls.Listen("tcp", a)
		if err != nil {
			fmt.Println("listen:", err)
			return 3
		}
		go func() {
			for {
				c, err := l.Accept()
				if err != nil {
					return
				}
				fmt.Fprintf(c, "%d\n", os.Getpid())
				c.Close()
			}
		}()
	}
	fmt.Println("listening")
	_, _ = io.Copy(io.Discard, os.Stdin) // until the parent closes stdin
	return 0
}

func answer(addr string) (string, error) {
	c, err := net.DialTimeout("tcp", addr, 5*time.Second)
	if err != nil {
		return "", err
	}
	defer c.Close()
	_ = c.SetDeadline(time.Now().Add(5 * time.Second))
	line, err := bufio.NewReader(c).ReadString('\n')
	return strings.TrimSpace(line), err
}

// TestPass: the child serves the parent's sockets, which were bound before it started (a
// connection made before the child runs waits in the backlog instead of being refused), and
// once the child is gone they refuse.
func TestPass(t *testing.T) {
	a, err := Bind("127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	b, err := Bind("127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	// Dialed before the child exists: the socket is bound and listening already.
	early, err := net.Dial("tcp", a.Addr)
	if err != nil {
		t.Fatal(err)
	}
	defer early.Close()

	self, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	cmd := exec.Command(self)
	cmd.Env = append(os.Environ(), childEnv+"="+a.Addr+","+b.Addr, EnvVar+"=127.0.0.1:1=9") // a stale one: replaced
	Pass(cmd, a, b)
	stdin, _ := cmd.StdinPipe()
	stdout, _ := cmd.StdoutPipe()
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	Close(a, b)
	defer func() { stdin.Close(); _ = cmd.Wait() }()
	line, _ := bufio.NewReader(stdout).ReadString('\n')
	if line != "listening\n" {
		t.Fatalf("child: %q", line)
	}
	pid := fmt.Sprint(cmd.Process.Pid)
	_ = early.SetDeadline(time.Now().Add(5 * time.Second))
	if got, err := bufio.NewReader(early).ReadString('\n'); strings.TrimSpace(got) != pid {
		t.Errorf("connection made before the child started: %q, %v; want the child's pid %s", got, err, pid)
	}
	for _, addr := range []string{a.Addr, b.Addr} {
		if got, err := answer(addr); got != pid {
			t.Errorf("%s: %q, %v; want the child's pid %s", addr, got, err, pid)
		}
	}
	stdin.Close()
	if err := cmd.Wait(); err != nil {
		t.Fatalf("child: %v", err)
	}
	if _, err := answer(a.Addr); !errors.Is(err, syscall.ECONNREFUSED) {
		t.Errorf("after the child exited: %v, want connection refused", err)
	}
}

// TestParse: what is not a socket bound to the named address is refused.
func TestParse(t *testing.T) {
	a, err := Bind("127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer a.Close()
	r, w, err := os.Pipe()
	if err != nil {
		t.Fatal(err)
	}
	defer r.Close()
	defer w.Close()
	// Descriptors of this process stand for the child's: Parse takes over (and closes) the ones
	// it refuses, so each case gets its own duplicate.
	dup := func(f *os.File) int {
		fd, err := syscall.Dup(int(f.Fd()))
		if err != nil {
			t.Fatal(err)
		}
		return fd
	}
	for _, c := range []struct {
		name, value, want string
	}{
		{"not a pair", "127.0.0.1:1", "not address=fd"},
		{"stdio", "127.0.0.1:1=1", "not address=fd"},
		{"a pipe", fmt.Sprintf("127.0.0.1:1=%d", dup(w)), "descriptor"},
		{"another address", fmt.Sprintf("127.0.0.1:1=%d", dup(a.file)), "is bound to " + a.Addr},
	} {
		if _, err := Parse(c.value); err == nil || !strings.Contains(err.Error(), c.want) {
			t.Errorf("%s: %v, want an error with %q", c.name, err, c.want)
		}
	}
	ls, err := Parse(fmt.Sprintf(" %s=%d,", a.Addr, dup(a.file)))
	if err != nil {
		t.Fatal(err)
	}
	l, err := ls.Listen("tcp", a.Addr)
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	if l.Addr().String() != a.Addr {
		t.Errorf("inherited listener on %s, want %s", l.Addr(), a.Addr)
	}
	// The same address again is bound anew, and fails: the inherited socket holds it.
	if l2, err := ls.Listen("tcp", a.Addr); err == nil {
		l2.Close()
		t.Errorf("a second Listen of %s got a listener", a.Addr)
	}
	var none *Listeners
	l3, err := none.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatalf("nil Listeners: %v", err)
	}
	l3.Close()
	if err := ls.Close(); err != nil {
		t.Error(err)
	}
}
