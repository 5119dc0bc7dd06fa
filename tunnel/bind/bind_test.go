package bind

import (
	"bytes"
	"errors"
	"net"
	"sync"
	"testing"
	"time"

	"go.uber.org/goleak"
	"golang.zx2c4.com/wireguard/conn"

	"github.com/tendril-net/tendril/internal/testing/testnet"
	"github.com/tendril-net/tendril/internal/testing/testwait"
	"github.com/tendril-net/tendril/tunnel/frame"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

// tcpPair returns both ends of a real loopback TCP connection.
func tcpPair(t *testing.T) (client, server net.Conn) {
	t.Helper()
	return testnet.TCPPair(t)
}

// attach attaches c to b and returns the stream's endpoint.
func attach(t *testing.T, b *Bind, c net.Conn) *Endpoint {
	t.Helper()
	ep, err := b.Attach(c)
	if err != nil {
		t.Fatal(err)
	}
	return ep
}

// openBind returns an open Bind, closed at cleanup, and its ReceiveFunc.
func openBind(t *testing.T, cfg Config) (*Bind, conn.ReceiveFunc) {
	t.Helper()
	b := New(cfg)
	fns, _, err := b.Open(0)
	if err != nil {
		t.Fatal(err)
	}
	if len(fns) != 1 {
		t.Fatalf("Open returned %d ReceiveFuncs, want 1", len(fns))
	}
	t.Cleanup(func() { b.Close() })
	return b, fns[0]
}

// receive calls fn once with a batch of bs buffers and returns the packets with their endpoints.
func receive(t *testing.T, fn conn.ReceiveFunc, bs int) ([][]byte, []conn.Endpoint) {
	t.Helper()
	packets := make([][]byte, bs)
	for i := range packets {
		packets[i] = make([]byte, frame.MaxSize)
	}
	sizes := make([]int, bs)
	eps := make([]conn.Endpoint, bs)
	n, err := fn(packets, sizes, eps)
	if err != nil {
		t.Fatalf("ReceiveFunc: %v", err)
	}
	var out [][]byte
	for i := range n {
		out = append(out, packets[i][:sizes[i]])
	}
	return out, eps[:n]
}

// TestStreamToStream runs two Binds over one TCP connection, as the seed server and an agent
// do, and sends a batch each way.
func TestStreamToStream(t *testing.T) {
	a, b := tcpPair(t)
	bindA, recvA := openBind(t, Config{})
	bindB, recvB := openBind(t, Config{})
	epA := attach(t, bindA, a)
	epB := attach(t, bindB, b)
	batch := [][]byte{bytes.Repeat([]byte{1}, 148), bytes.Repeat([]byte{2}, 60032), {3}}
	if err := bindA.Send(batch, epA); err != nil {
		t.Fatal(err)
	}
	var got [][]byte
	for len(got) < len(batch) {
		ps, eps := receive(t, recvB, 2)
		for i, p := range ps {
			if eps[i] != epB {
				t.Fatalf("packet from %v, want %v", eps[i], epB)
			}
			got = append(got, bytes.Clone(p))
		}
	}
	for i := range batch {
		if !bytes.Equal(got[i], batch[i]) {
			t.Fatalf("packet %d: got %d bytes, want %d identical bytes", i, len(got[i]), len(batch[i]))
		}
	}
	if err := bindB.Send([][]byte{{9, 9}}, epB); err != nil {
		t.Fatal(err)
	}
	if ps, _ := receive(t, recvA, 8); len(ps) != 1 || !bytes.Equal(ps[0], []byte{9, 9}) {
		t.Fatalf("reply: got %v", ps)
	}
	// The writer counts a write after it returned, which may be after the peer read it.
	testwait.Until(t, "A's writer to count the batch", func() bool { return bindA.Stats().PacketsOut == 3 })
	sa, sb := bindA.Stats(), bindB.Stats()
	if sa.PacketsOut != 3 || sa.BytesOut != 148+60032+1 || sb.PacketsIn != 3 || sb.BytesIn != 148+60032+1 {
		t.Fatalf("counters: A out %d/%d, B in %d/%d", sa.PacketsOut, sa.BytesOut, sb.PacketsIn, sb.BytesIn)
	}

	// ParseEndpoint maps the printed name back to the live stream.
	ep, err := bindB.ParseEndpoint(epB.DstToString())
	if err != nil || ep != epB {
		t.Fatalf("ParseEndpoint(%q) = %v, %v", epB.DstToString(), ep, err)
	}
}

func TestDetachOnEOF(t *testing.T) {
	a, b := tcpPair(t)
	bindB, _ := openBind(t, Config{})
	ep := attach(t, bindB, b)
	a.Close()
	select {
	case <-ep.Done():
	case <-time.After(5 * time.Second):
		t.Fatal("stream not detached after the peer closed it")
	}
	if reason, err := ep.Err(); reason != DetachEOF || err != nil {
		t.Fatalf("Err() = %v, %v; want eof, nil", reason, err)
	}
	err := bindB.Send([][]byte{{1}}, ep)
	if !errors.Is(err, ErrDetached) {
		t.Fatalf("Send to a detached stream: got %v, want ErrDetached", err)
	}
	if _, err := bindB.ParseEndpoint(ep.DstToString()); !errors.Is(err, ErrUnknownEndpoint) {
		t.Fatalf("ParseEndpoint of a detached stream: got %v, want ErrUnknownEndpoint", err)
	}
	st := bindB.Stats()
	if st.StreamsActive != 0 || st.StreamsDetached[DetachEOF] != 1 || st.SendDropped[SendDropDetached] != 1 {
		t.Fatalf("stats: %+v", st)
	}
}

func TestBadFrameDetaches(t *testing.T) {
	for _, tc := range []struct {
		name string
		in   []byte
	}{
		{"zero length", []byte{0, 0}},
		{"over max", []byte{0x05, 0xdd}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			a, b := tcpPair(t)
			bindB, _ := openBind(t, Config{MaxFrameSize: 1500})
			ep := attach(t, bindB, b)
			if _, err := a.Write(tc.in); err != nil {
				t.Fatal(err)
			}
			<-ep.Done()
			if reason, _ := ep.Err(); reason != DetachBadFrame {
				t.Fatalf("detached for %v, want bad-frame", reason)
			}
			if st := bindB.Stats(); st.FramesRejected != 1 || st.StreamsDetached[DetachBadFrame] != 1 {
				t.Fatalf("stats: %+v", st)
			}
		})
	}
}

// TestBackpressure checks that a stream whose packets WireGuard does not take stops reading
// after StreamBuffers frames instead of dropping, and that nothing is lost once it resumes.
func TestBackpressure(t *testing.T) {
	a, b := tcpPair(t)
	bindB, recvB := openBind(t, Config{StreamBuffers: 4})
	attach(t, bindB, b)
	const frames = 200
	w := frame.NewWriter(a, 0)
	for i := range frames {
		if err := w.WriteFrame([]byte{byte(i), byte(i >> 8)}); err != nil {
			t.Fatal(err)
		}
	}
	if err := w.Flush(); err != nil {
		t.Fatal(err)
	}
	testwait.Until(t, "4 queued packets", func() bool { return len(bindB.queue) == 4 })
	time.Sleep(20 * time.Millisecond) // would the reader queue a fifth?
	if n := len(bindB.queue); n != 4 {
		t.Fatalf("%d packets queued with 4 buffers per stream", n)
	}
	for next := 0; next < frames; {
		ps, _ := receive(t, recvB, 3)
		for _, p := range ps {
			if got := int(p[0]) | int(p[1])<<8; got != next {
				t.Fatalf("got packet %d, want %d", got, next)
			}
			next++
		}
	}
}

// TestStalledStreamDoesNotBlockOthers checks that one stream holding all of its buffers leaves
// another stream's packets flowing.
func TestStalledStreamDoesNotBlockOthers(t *testing.T) {
	a1, b1 := tcpPair(t)
	a2, b2 := tcpPair(t)
	bindB, recvB := openBind(t, Config{StreamBuffers: 2})
	attach(t, bindB, b1)
	ep2 := attach(t, bindB, b2)
	// Stream 1 sends a header and then stalls inside the frame; stream 2 keeps sending.
	if _, err := a1.Write([]byte{0, 100, 1, 2, 3}); err != nil {
		t.Fatal(err)
	}
	w := frame.NewWriter(a2, 0)
	for i := range 50 {
		if err := w.WriteFrames([][]byte{{byte(i)}}); err != nil {
			t.Fatal(err)
		}
		ps, eps := receive(t, recvB, 4)
		if len(ps) != 1 || ps[0][0] != byte(i) || eps[0] != ep2 {
			t.Fatalf("round %d: got %v from %v", i, ps, eps)
		}
	}
}

func TestMaxStreams(t *testing.T) {
	bindB, _ := openBind(t, Config{MaxStreams: 1})
	_, b1 := tcpPair(t)
	_, b2 := tcpPair(t)
	ep1 := attach(t, bindB, b1)
	ep1.MarkAuthenticated(time.Now())
	if _, err := bindB.Attach(b2); !errors.Is(err, ErrTooManyStreams) {
		t.Fatalf("second stream with MaxStreams 1 and the first authenticated: got %v, want ErrTooManyStreams", err)
	}
	if st := bindB.Stats(); st.AttachRefused[RefuseFull] != 1 || st.StreamsActive != 1 {
		t.Fatalf("stats: %+v", st)
	}
}

// junkSender writes a frame of junk to c every interval until the test ends, as a stranger who
// knows only where the listener is would, to keep its stream looking alive.
func junkSender(t *testing.T, c net.Conn, interval time.Duration) {
	t.Helper()
	done := make(chan struct{})
	stopped := make(chan struct{})
	junk, err := frame.AppendFrame(nil, []byte("junk"), frame.MaxSize)
	if err != nil {
		t.Fatal(err)
	}
	go func() {
		defer close(stopped)
		tick := time.NewTicker(interval)
		defer tick.Stop()
		for {
			if _, err := c.Write(junk); err != nil {
				return
			}
			select {
			case <-done:
				return
			case <-tick.C:
			}
		}
	}()
	t.Cleanup(func() { close(done); c.Close(); <-stopped })
}

// TestJunkStreamsCannotHoldSlots fills every slot with streams that send junk frames and never
// authenticate: a new stream (an agent's) still attaches, displacing the oldest junk stream, and
// once marked authenticated it is not displaced by newer junk; junk streams end at AuthTimeout
// however often they send; each ending is counted by reason.
func TestJunkStreamsCannotHoldSlots(t *testing.T) {
	const slots = 4
	bindB, recv := openBind(t, Config{MaxStreams: slots, AuthTimeout: 500 * time.Millisecond})
	// Drain what the junk streams deliver, as WireGuard would (and drop it, as it would).
	drained := make(chan struct{})
	go func() {
		defer close(drained)
		packets, sizes, eps := make([][]byte, 8), make([]int, 8), make([]conn.Endpoint, 8)
		for i := range packets {
			packets[i] = make([]byte, frame.MaxSize)
		}
		for {
			if _, err := recv(packets, sizes, eps); err != nil {
				return
			}
		}
	}()
	t.Cleanup(func() { bindB.Close(); <-drained })

	var junk []*Endpoint
	for range slots {
		a, b := tcpPair(t)
		ep := attach(t, bindB, b)
		junkSender(t, a, 50*time.Millisecond)
		junk = append(junk, ep)
	}
	_, agentConn := tcpPair(t)
	agent, err := bindB.Attach(agentConn)
	if err != nil {
		t.Fatalf("an agent's stream with every slot held by junk: %v", err)
	}
	<-junk[0].Done()
	if reason, _ := junk[0].Err(); reason != DetachEvicted {
		t.Fatalf("the oldest junk stream ended with %v, want evicted", reason)
	}
	agent.MarkAuthenticated(time.Now())
	// More junk than there are slots: each displaces an older junk stream, never the agent's.
	for range 2 * slots {
		a, b := tcpPair(t)
		attach(t, bindB, b)
		junkSender(t, a, 50*time.Millisecond)
	}
	if reason, err := agent.Err(); reason != 0 || err != nil {
		t.Fatalf("the agent's authenticated stream ended: %v %v", reason, err)
	}
	// Junk streams end at AuthTimeout, although they keep sending; the agent's stays.
	testwait.Until(t, "junk streams to time out", func() bool { return bindB.Stats().StreamsActive == 1 })
	eps := bindB.Endpoints()
	if len(eps) != 1 || eps[0] != agent {
		t.Fatalf("attached after the deadline: %v, want only %v", eps, agent)
	}
	// Each of the 3 × slots junk streams ended once, evicted or timed out (which of the two
	// depends on how fast the attaches above ran against the deadline), none was refused.
	st := bindB.Stats()
	if ev, un := st.StreamsDetached[DetachEvicted], st.StreamsDetached[DetachUnauthenticated]; ev+un != 3*slots || ev == 0 || st.AttachRefused[RefuseFull] != 0 {
		t.Fatalf("evicted %d + unauthenticated %d, want %d; refused %v", ev, un, 3*slots, st.AttachRefused)
	}
	// With every slot authenticated, a new stream is refused, not let in at an agent's cost.
	for range slots - 1 {
		_, b := tcpPair(t)
		ep := attach(t, bindB, b)
		ep.MarkAuthenticated(time.Now())
	}
	_, b := tcpPair(t)
	if _, err := bindB.Attach(b); !errors.Is(err, ErrTooManyStreams) {
		t.Fatalf("a stream with every slot authenticated: got %v, want ErrTooManyStreams", err)
	}
	if st := bindB.Stats(); st.AttachRefused[RefuseFull] != 1 {
		t.Fatalf("refused: %v", st.AttachRefused)
	}
}

// TestClose checks the conn.Bind contract: after Close the ReceiveFunc returns net.ErrClosed,
// streams are detached and closed, and the Bind opens again.
func TestClose(t *testing.T) {
	a, b := tcpPair(t)
	bnd := New(Config{})
	fns, _, err := bnd.Open(0)
	if err != nil {
		t.Fatal(err)
	}
	if _, _, err := bnd.Open(0); !errors.Is(err, conn.ErrBindAlreadyOpen) {
		t.Fatalf("second Open: got %v, want ErrBindAlreadyOpen", err)
	}
	ep := attach(t, bnd, b)
	errc := make(chan error, 1)
	go func() {
		_, err := fns[0]([][]byte{make([]byte, 100)}, make([]int, 1), make([]conn.Endpoint, 1))
		errc <- err
	}()
	if err := bnd.Close(); err != nil {
		t.Fatal(err)
	}
	if err := <-errc; !errors.Is(err, net.ErrClosed) {
		t.Fatalf("ReceiveFunc after Close: got %v, want net.ErrClosed", err)
	}
	if reason, _ := ep.Err(); reason != DetachClosed {
		t.Fatalf("stream detached for %v, want closed", reason)
	}
	// The peer sees the stream end.
	a.SetReadDeadline(time.Now().Add(5 * time.Second))
	if _, err := a.Read(make([]byte, 1)); err == nil {
		t.Fatal("peer can still read from a stream of a closed Bind")
	}
	_, b2 := tcpPair(t)
	if _, err := bnd.Attach(b2); !errors.Is(err, net.ErrClosed) {
		t.Fatalf("Attach to a closed Bind: got %v, want net.ErrClosed", err)
	}
	if _, _, err := bnd.Open(0); err != nil {
		t.Fatalf("reopen: %v", err)
	}
	if err := bnd.Close(); err != nil {
		t.Fatal(err)
	}
}

func TestWriteTimeoutDetaches(t *testing.T) {
	_, b := tcpPair(t) // the peer never reads
	bindB, _ := openBind(t, Config{WriteTimeout: 100 * time.Millisecond})
	ep := attach(t, bindB, b)
	big := make([]byte, frame.MaxSize)
	var sendErr error
	for range 100000 { // until the writer times out; loopback buffers hold a few MiB
		if sendErr = bindB.Send([][]byte{big}, ep); sendErr != nil {
			break
		}
	}
	// Send only queues; the writer's timeout detaches the stream, and the Sends after it fail.
	if !errors.Is(sendErr, ErrDetached) {
		t.Fatalf("Send to a stream nobody reads: got %v, want ErrDetached", sendErr)
	}
	var ne net.Error
	if reason, err := ep.Err(); reason != DetachWriteError || !errors.As(err, &ne) || !ne.Timeout() {
		t.Fatalf("detached for %v (%v), want write-error with a timeout", reason, err)
	}
	if st := bindB.Stats(); st.SendDropped[SendDropWriteError] == 0 {
		t.Fatalf("the timed-out write is not counted: %+v", st)
	}
}

func TestParseEndpoint(t *testing.T) {
	bnd, _ := openBind(t, Config{})
	for _, s := range []string{"", "stream/", "stream/x", "1.2.3.4:51820", "stream/-1"} {
		if _, err := bnd.ParseEndpoint(s); err == nil {
			t.Errorf("ParseEndpoint(%q) succeeded", s)
		}
	}
	if _, err := bnd.ParseEndpoint("stream/42"); !errors.Is(err, ErrUnknownEndpoint) {
		t.Errorf("ParseEndpoint of a stream never attached: got %v, want ErrUnknownEndpoint", err)
	}
}

// gatedConn counts writes and holds the first one until gate is closed.
type gatedConn struct {
	net.Conn
	gate   chan struct{}
	mu     sync.Mutex
	writes int
}

func (c *gatedConn) Write(p []byte) (int, error) {
	c.mu.Lock()
	c.writes++
	first := c.writes == 1
	c.mu.Unlock()
	if first {
		<-c.gate
	}
	return c.Conn.Write(p)
}

func (c *gatedConn) count() int {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.writes
}

// TestSendCoalesces checks that packets sent while a write is in progress go out together in
// the next write, in order.
func TestSendCoalesces(t *testing.T) {
	a, b := tcpPair(t)
	gc := &gatedConn{Conn: a, gate: make(chan struct{})}
	bindA, _ := openBind(t, Config{})
	ep := attach(t, bindA, gc)
	const packets = 100
	for i := range packets {
		if err := bindA.Send([][]byte{{byte(i)}}, ep); err != nil {
			t.Fatal(err)
		}
		if i == 0 {
			// The writer took packet 0 and is now held in its first write.
			testwait.Until(t, "the first write", func() bool { return gc.count() == 1 })
		}
	}
	close(gc.gate)
	fr := frame.NewReader(b, 0)
	buf := make([]byte, frame.MaxSize)
	for i := range packets {
		n, err := fr.ReadFrame(buf)
		if err != nil || n != 1 || buf[0] != byte(i) {
			t.Fatalf("frame %d: got (%d, %v, %d)", i, n, err, buf[0])
		}
	}
	testwait.Until(t, "all packets counted", func() bool { return bindA.Stats().PacketsOut == packets })
	if w := gc.count(); w != 2 {
		t.Fatalf("%d packets took %d writes, want 2 (one held, then the other 99 together)", packets, w)
	}
}

// TestSendWaitsForRoom checks that Send blocks while the pending buffer is full and returns
// ErrDetached when the stream ends meanwhile.
func TestSendWaitsForRoom(t *testing.T) {
	a, _ := tcpPair(t)
	gc := &gatedConn{Conn: a, gate: make(chan struct{})}
	defer close(gc.gate)
	bindA, _ := openBind(t, Config{})
	ep := attach(t, bindA, gc)
	big := make([]byte, frame.MaxSize)
	errc := make(chan error, 1)
	go func() {
		// The held write carries what was pending when the writer woke (at most four 64 KiB
		// frames, maxPending), the next four wait in pending, and then Send has to wait.
		for range 20 {
			if err := bindA.Send([][]byte{big}, ep); err != nil {
				errc <- err
				return
			}
		}
		errc <- nil
	}()
	select {
	case err := <-errc:
		t.Fatalf("twenty 64 KiB Sends to a stuck stream all returned (%v)", err)
	case <-time.After(100 * time.Millisecond):
	}
	ep.s.wmu.Lock()
	pending := len(ep.s.pending)
	ep.s.wmu.Unlock()
	if pending > maxPending {
		t.Fatalf("%d bytes pending, more than maxPending (%d)", pending, maxPending)
	}
	ep.Close()
	if err := <-errc; !errors.Is(err, ErrDetached) {
		t.Fatalf("waiting Send after the stream ended: got %v, want ErrDetached", err)
	}
}

// TestReceivedBuffersGoBack: once WireGuard has taken a stream's packets, the stream holds no
// buffers: its slots are empty and the memory is the pools' (which the garbage collector
// empties). Streams used to keep each slot's largest buffer for as long as they lived, 1.9 MB
// per stream after a load at MTU 60,000.
func TestReceivedBuffersGoBack(t *testing.T) {
	// The sender below ends at the latest when A closes (at cleanup, which runs this one after it).
	var wg sync.WaitGroup
	t.Cleanup(wg.Wait)
	a, b := tcpPair(t)
	// No authentication deadline: nothing marks these streams, and moving 3 × DefaultStreamBuffers
	// frames of 60 KB under -race on a loaded 2-core machine took over DefaultAuthTimeout once
	// (the stream was detached as unauthenticated mid-test).
	bindA, _ := openBind(t, Config{AuthTimeout: -1})
	bindB, recvB := openBind(t, Config{AuthTimeout: -1})
	epA := attach(t, bindA, a)
	epB := attach(t, bindB, b)
	const n = 3 * DefaultStreamBuffers // every slot used, more than once
	// Sent while received: 96 frames of 60 KB (5.8 MB) are more than B's slots and the two
	// sockets' buffers hold on some machines, and a sender that waits for the receiver to start
	// runs into WriteTimeout (CI saw the stream detached at 30 s).
	sent := make(chan error, 1)
	wg.Go(func() {
		for i := range n {
			if err := bindA.Send([][]byte{bytes.Repeat([]byte{byte(i)}, 60032)}, epA); err != nil {
				sent <- err
				return
			}
		}
		sent <- nil
	})
	for got := 0; got < n; {
		ps, _ := receive(t, recvB, DefaultBatchSize)
		for _, p := range ps {
			if len(p) != 60032 || p[0] != byte(got) {
				t.Fatalf("packet %d: %d bytes of %d", got, len(p), p[0])
			}
			got++
		}
	}
	if err := <-sent; err != nil {
		t.Fatal(err)
	}
	s := epB.s
	testwait.Until(t, "every slot back", func() bool { return len(s.free) == DefaultStreamBuffers })
	for range DefaultStreamBuffers {
		p := <-s.free
		if p.buf != nil || p.pooled != nil {
			t.Fatalf("an idle slot holds a buffer of %d bytes", cap(p.buf))
		}
		s.free <- p
	}
}

func TestBufClass(t *testing.T) {
	for _, tc := range []struct{ n, size int }{{1, 2048}, {2048, 2048}, {2049, 4096}, {60032, 65536}, {frame.MaxSize, 65536}} {
		if b := getBuf(tc.n); cap(*b) != tc.size {
			t.Errorf("getBuf(%d): %d bytes, want %d", tc.n, cap(*b), tc.size)
		} else {
			putBuf(b)
		}
	}
}

// TestIdleStreamDropsLargeWriteBuffers: after a load, two small writes leave the stream's writer
// without its large buffers (each maxPending plus a frame, or a larger batch: 549 KB here).
func TestIdleStreamDropsLargeWriteBuffers(t *testing.T) {
	// The receiver below ends when B closes (at cleanup, which runs this one after it).
	var wg sync.WaitGroup
	t.Cleanup(wg.Wait)
	a, b := tcpPair(t)
	bindA, _ := openBind(t, Config{})
	bindB, recvB := openBind(t, Config{})
	epA := attach(t, bindA, a)
	attach(t, bindB, b)
	// B's receiver takes everything, so A's writes never wait.
	wg.Go(func() {
		packets := make([][]byte, DefaultBatchSize)
		for i := range packets {
			packets[i] = make([]byte, frame.MaxSize)
		}
		sizes := make([]int, DefaultBatchSize)
		eps := make([]conn.Endpoint, DefaultBatchSize)
		for {
			if _, err := recvB(packets, sizes, eps); err != nil {
				return
			}
		}
	})
	big := make([][]byte, 8)
	for i := range big {
		big[i] = bytes.Repeat([]byte{byte(i)}, 60032)
	}
	sent := uint64(0)
	for range 20 {
		if err := bindA.Send(big, epA); err != nil {
			t.Fatal(err)
		}
		sent += uint64(len(big))
	}
	for range 2 {
		if err := bindA.Send([][]byte{{1, 2, 3}}, epA); err != nil {
			t.Fatal(err)
		}
		sent++
		testwait.Until(t, "the small write", func() bool { return bindA.Stats().PacketsOut == sent })
	}
	s := epA.s
	s.wmu.Lock()
	c := cap(s.pending)
	s.wmu.Unlock()
	if c > keepWriteBuf {
		t.Fatalf("after two small writes the pending buffer holds %d bytes", c)
	}
}
