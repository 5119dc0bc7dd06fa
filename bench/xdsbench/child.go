package xdsbench

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/netip"
	"os"
	"os/signal"
	"runtime"
	"runtime/pprof"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/go-logr/logr"
	"github.com/prometheus/client_golang/prometheus"
	dto "github.com/prometheus/client_model/go"

	"github.com/tendril-net/tendril/ingress"
	"github.com/tendril-net/tendril/ingress/xdsclient"
	"github.com/tendril-net/tendril/xds/model"
	"github.com/tendril-net/tendril/xds/server"
	"github.com/tendril-net/tendril/xds/translate"
)

// ChildEnv names the role of a child process of the benchmark: the
// benchmark starts its own executable again with this variable set, to run
// the control plane (and, without a tendril-ingress binary, the ingress
// replicas) in processes of their own whose memory can be read alone.
const ChildEnv = "TENDRIL_XDSBENCH_CHILD"

// ProfileEnv, if set in the control plane child, names the file for a CPU
// profile of it (Config.CPUProfile).
const ProfileEnv = "TENDRIL_XDSBENCH_CPUPROFILE"

const (
	roleControlPlane = "control-plane"
	roleIngress      = "ingress"
)

// IsChild reports whether this process was started as a child of the
// benchmark; the executable's main (and a test's TestMain) then calls
// ChildMain and exits with its status, before anything else.
func IsChild() bool { return os.Getenv(ChildEnv) != "" }

// ChildMain runs the child's role until its parent closes stdin (control
// plane) or stops it (ingress), and returns the exit status.
func ChildMain() int {
	var err error
	switch role := os.Getenv(ChildEnv); role {
	case roleControlPlane:
		if path := os.Getenv(ProfileEnv); path != "" {
			f, ferr := os.Create(path)
			if ferr != nil {
				err = ferr
				break
			}
			defer f.Close()
			if err = pprof.StartCPUProfile(f); err != nil {
				break
			}
			defer pprof.StopCPUProfile()
		}
		err = controlPlane(os.Stdin, os.Stdout)
	case roleIngress:
		err = ingressChild(os.Args[1:])
	default:
		err = fmt.Errorf("unknown role %q", role)
	}
	if err != nil {
		fmt.Fprintln(os.Stderr, "xdsbench child:", err)
		return 1
	}
	return 0
}

// ingressChild runs the ingress package as tendril-ingress does (delta ADS,
// the SNI listener on a free loopback port), without the metrics server:
// args are the xDS address and the node id.
func ingressChild(args []string) error {
	if len(args) != 2 {
		return fmt.Errorf("ingress child: want <xds address> <node id>, got %q", args)
	}
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	in := ingress.New(ingress.Config{Listeners: map[string]string{"sni": "127.0.0.1:0"}, Log: logr.Discard()})
	return in.Run(ctx, xdsclient.Config{Address: args[0], NodeID: args[1]})
}

// request is one command of the parent to the control plane, a JSON line.
type request struct {
	Op       string `json:"op"` // load, sync, change, mem
	Shoots   int    `json:"shoots,omitempty"`
	Replicas int    `json:"replicas,omitempty"`
	Kind     string `json:"kind,omitempty"`
	Seq      int    `json:"seq,omitempty"`
	// TimeoutMS bounds a wait for acknowledgements.
	TimeoutMS int64 `json:"timeout_ms,omitempty"`
}

// reply is the control plane's answer, a JSON line.
type reply struct {
	Error   string  `json:"error,omitempty"`
	Addr    string  `json:"addr,omitempty"`
	ApplyMS float64 `json:"apply_ms,omitempty"`
	// AckMS is the time from just before Apply to the acknowledgement by
	// every replica (change), or from the sync command to every shoot
	// programmed on every replica (sync).
	AckMS float64 `json:"ack_ms,omitempty"`
	// Bytes are the bytes the server wrote to all its connections during the
	// operation.
	Bytes     int64       `json:"bytes,omitempty"`
	Resources int         `json:"resources,omitempty"`
	Stats     model.Stats `json:"stats"`
	Memory    memory      `json:"memory"`
}

// countingListener counts the bytes written to every accepted connection:
// what the server sends on the wire (gRPC and HTTP/2 framing included; no
// TLS here).
type countingListener struct {
	net.Listener
	written *atomic.Int64
}

func (l countingListener) Accept() (net.Conn, error) {
	c, err := l.Listener.Accept()
	if err != nil {
		return nil, err
	}
	return countingConn{Conn: c, written: l.written}, nil
}

type countingConn struct {
	net.Conn
	written *atomic.Int64
}

func (c countingConn) Write(p []byte) (int, error) {
	n, err := c.Conn.Write(p)
	c.written.Add(int64(n))
	return n, err
}

// cp is the control plane child's state.
type cp struct {
	s       *server.Server
	reg     *prometheus.Registry
	written atomic.Int64
	set     []model.Shoot
	index   map[string]int // name → position in set
	// toggled counts endpoint changes per shoot, to alternate the port.
	toggled map[int]int
	added   []string // shoots added by "add" changes, removed again by "remove"
}

// controlPlane serves one xds/server.Server on a loopback port and runs the
// parent's commands against it, one JSON line each.
func controlPlane(in io.Reader, out io.Writer) error {
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	c := &cp{reg: prometheus.NewRegistry(), index: map[string]int{}, toggled: map[int]int{}}
	c.s = server.New(server.Config{Log: logr.Discard(), Registry: c.reg})
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return err
	}
	served := make(chan error, 1)
	go func() { served <- c.s.Serve(ctx, countingListener{Listener: l, written: &c.written}) }()

	enc := json.NewEncoder(out)
	if err := enc.Encode(reply{Addr: l.Addr().String()}); err != nil {
		return err
	}
	sc := bufio.NewScanner(in)
	for sc.Scan() {
		var req request
		var rep reply
		if err := json.Unmarshal(sc.Bytes(), &req); err != nil {
			rep.Error = err.Error()
		} else if err := c.do(req, &rep); err != nil {
			rep.Error = err.Error()
		}
		if err := enc.Encode(rep); err != nil {
			return err
		}
	}
	cancel()
	return errors.Join(sc.Err(), <-served)
}

func (c *cp) do(req request, rep *reply) error {
	timeout := time.Duration(req.TimeoutMS) * time.Millisecond
	if timeout <= 0 {
		timeout = time.Minute
	}
	switch req.Op {
	case "load":
		c.set = make([]model.Shoot, req.Shoots)
		for i := range c.set {
			c.set[i] = Shoot(i)
			c.index[c.set[i].Name] = i
		}
		start := time.Now()
		st, err := c.s.Apply(c.set)
		rep.ApplyMS = ms(time.Since(start))
		rep.Stats = st
		rep.Resources = st.Updated
		return err
	case "sync":
		start, before := time.Now(), c.written.Load()
		deadline := start.Add(timeout)
		for _, sh := range c.set {
			if err := c.waitProgrammed(sh.Name, req.Replicas, deadline); err != nil {
				return fmt.Errorf("initial load: %w", err)
			}
		}
		rep.AckMS = ms(time.Since(start))
		rep.Bytes = c.written.Load() - before
		c.s.TakeStatusChanges()
		return nil
	case "change":
		return c.change(req, rep, timeout)
	case "mem":
		var ok bool
		if rep.Memory, ok = readMemory(os.Getpid()); !ok {
			return errors.New("cannot read /proc/self/status")
		}
		var ms runtime.MemStats
		runtime.ReadMemStats(&ms)
		rep.Memory.HeapInuse = int64(ms.HeapInuse)
		return nil
	}
	return fmt.Errorf("unknown op %q", req.Op)
}

// change makes one single-shoot change, applies the whole set as a source
// would, and waits until every replica acknowledged it.
func (c *cp) change(req request, rep *reply, timeout time.Duration) error {
	if len(c.set) == 0 {
		return errors.New("change before load")
	}
	var name string
	var removed *model.Shoot
	switch req.Kind {
	case KindEndpoint:
		// Only the loaded shoots, never one an add change put in.
		i := req.Seq % (len(c.set) - len(c.added))
		c.toggled[i]++
		port := uint16(443)
		if c.toggled[i]%2 == 1 {
			port = 6443
		}
		sh := c.set[i]
		sh.APIServers = []netip.AddrPort{netip.AddrPortFrom(sh.APIServers[0].Addr(), port)}
		c.set[i] = sh
		name = sh.Name
	case KindAdd:
		sh := Shoot(addedBase + req.Seq)
		c.index[sh.Name] = len(c.set)
		c.set = append(c.set, sh)
		c.added = append(c.added, sh.Name)
		name = sh.Name
	case KindRemove:
		if len(c.added) == 0 {
			return errors.New("remove without an added shoot")
		}
		name = c.added[len(c.added)-1]
		c.added = c.added[:len(c.added)-1]
		i := c.index[name]
		sh := c.set[i]
		removed = &sh
		// The added shoots are at the end and removed last in, first out.
		c.set = append(c.set[:i], c.set[i+1:]...)
		delete(c.index, name)
	default:
		return fmt.Errorf("unknown change %q", req.Kind)
	}
	c.s.TakeStatusChanges()
	var acksBefore float64
	var wantAcks int
	if removed != nil {
		// A removed shoot has no status any more (ShootStatus says Unknown at
		// once): its removal is acknowledged when every replica answered a
		// response of every type the shoot had resources of.
		r := translate.Shoot(*removed)
		for _, n := range []int{len(r.Clusters), len(r.Endpoints), len(r.Listeners)} {
			if n > 0 {
				wantAcks += req.Replicas
			}
		}
		acksBefore = c.answered()
	}
	before := c.written.Load()
	start := time.Now()
	st, err := c.s.Apply(c.set)
	rep.ApplyMS = ms(time.Since(start))
	rep.Stats = st
	if err != nil {
		return err
	}
	deadline := start.Add(timeout)
	if removed != nil {
		err = c.waitAnswered(acksBefore+float64(wantAcks), deadline)
	} else {
		err = c.waitProgrammed(name, req.Replicas, deadline)
	}
	rep.AckMS = ms(time.Since(start))
	rep.Bytes = c.written.Load() - before
	return err
}

// waitProgrammed waits until shoot name is programmed on replicas clients,
// woken by the server's StatusChanges (and a short timer as a backstop).
func (c *cp) waitProgrammed(name string, replicas int, deadline time.Time) error {
	for {
		st := c.s.ShootStatus(name)
		if st.State == model.StateProgrammed && st.Clients >= replicas {
			return nil
		}
		if st.State == model.StateRejected {
			return fmt.Errorf("shoot %s rejected: %s", name, st.Detail)
		}
		if !c.wake(deadline) {
			return fmt.Errorf("shoot %s: %s on %d of %d replicas after the timeout", name, st.State, st.Clients, replicas)
		}
	}
}

// waitAnswered waits until the delta ACKs and NACKs the server counted reach
// want.
func (c *cp) waitAnswered(want float64, deadline time.Time) error {
	for {
		got := c.answered()
		if got >= want {
			return nil
		}
		if !c.wake(deadline) {
			return fmt.Errorf("removal: %v of %v answers after the timeout", got, want)
		}
	}
}

// wake waits for a status change or 200 µs, and reports false after
// deadline.
func (c *cp) wake(deadline time.Time) bool {
	if time.Now().After(deadline) {
		return false
	}
	t := time.NewTimer(200 * time.Microsecond)
	defer t.Stop()
	select {
	case <-c.s.StatusChanges():
		c.s.TakeStatusChanges()
	case <-t.C:
	}
	return true
}

// answered is the server's count of client answers (ACK and NACK) to its
// responses, from tendril_xds_acks_total.
func (c *cp) answered() float64 {
	mfs, err := c.reg.Gather()
	if err != nil {
		return 0
	}
	var sum float64
	for _, mf := range mfs {
		if mf.GetName() != "tendril_xds_acks_total" {
			continue
		}
		for _, m := range mf.GetMetric() {
			sum += counterValue(m)
		}
	}
	return sum
}

func counterValue(m *dto.Metric) float64 { return m.GetCounter().GetValue() }

func ms(d time.Duration) float64 { return float64(d) / float64(time.Millisecond) }
