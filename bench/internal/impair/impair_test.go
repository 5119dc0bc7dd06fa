package impair

import (
	"context"
	"encoding/binary"
	"io"
	"sync"
	"testing"
	"time"
)

// feed is a packet reader: each Read returns the next packet sent on it, io.EOF once closed.
type feed chan []byte

func (f feed) Read(p []byte) (int, error) {
	b, ok := <-f
	if !ok {
		return 0, io.EOF
	}
	return copy(p, b), nil
}

// sink records each packet written with its time.
type sink struct {
	mu   sync.Mutex
	got  [][]byte
	when []time.Time
}

func (s *sink) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.got = append(s.got, append([]byte(nil), p...))
	s.when = append(s.when, time.Now())
	return len(p), nil
}

func (s *sink) count() int { s.mu.Lock(); defer s.mu.Unlock(); return len(s.got) }

// start runs a Direction from a new feed to a new sink; stop closes the feed, waits until
// want packets arrived or 5 s passed, and ends the Direction.
func start(t *testing.T, cfg Config) (feed, *sink, *Direction, func(want int)) {
	t.Helper()
	f, s := make(feed), &sink{}
	d, err := NewDirection(cfg, f, s)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- d.Run(ctx) }()
	stopped := false
	stop := func(want int) {
		if stopped {
			return
		}
		stopped = true
		for deadline := time.Now().Add(5 * time.Second); s.count() < want && time.Now().Before(deadline); {
			time.Sleep(time.Millisecond)
		}
		close(f) // Run ends at the feed's EOF...
		select {
		case err := <-done:
			if err != nil {
				t.Errorf("Run: %v", err)
			}
		case <-time.After(5 * time.Second):
			t.Error("Run did not end at the reader's EOF")
		}
		cancel()
	}
	t.Cleanup(func() { stop(0) })
	return f, s, d, stop
}

func seq(i, size int) []byte {
	b := make([]byte, size)
	binary.BigEndian.PutUint32(b, uint32(i))
	return b
}

func TestDelayKeepsOrder(t *testing.T) {
	const n, delay, jitter = 200, 30 * time.Millisecond, 20 * time.Millisecond
	f, s, d, stop := start(t, Config{Delay: delay, Jitter: jitter, Seed: 1})
	sent := make([]time.Time, n)
	for i := range n {
		sent[i] = time.Now()
		f <- seq(i, 100)
		if i%20 == 0 {
			time.Sleep(time.Millisecond)
		}
	}
	stop(n)
	if s.count() != n {
		t.Fatalf("delivered %d of %d packets; stats %+v", s.count(), n, d.Stats())
	}
	var early time.Duration
	for i, p := range s.got {
		if got := int(binary.BigEndian.Uint32(p)); got != i {
			t.Fatalf("packet %d arrived as number %d: reordered", got, i)
		}
		// Each packet waits at least Delay-Jitter (less the writer's slack).
		if took := s.when[i].Sub(sent[i]); took < delay-jitter-slack {
			early = max(early, delay-jitter-took)
		}
	}
	if early > 0 {
		t.Errorf("a packet arrived %v before its least delay of %v", early, delay-jitter)
	}
	if st := d.Stats(); st.Packets != n || st.Bytes != n*100 || len(st.Dropped) != 0 {
		t.Errorf("stats %+v, want %d packets of 100 bytes, none dropped", st, n)
	}
}

func TestZeroConfigCarriesEverything(t *testing.T) {
	const n = 5000
	f, s, d, stop := start(t, Config{})
	for i := range n {
		f <- seq(i, 1400)
	}
	stop(n)
	if st := d.Stats(); st.Packets != n || len(st.Dropped) != 0 || s.count() != n {
		t.Errorf("stats %+v, %d delivered; want all %d, none dropped", st, s.count(), n)
	}
}

func TestLoss(t *testing.T) {
	const n, loss = 20000, 0.1
	f, s, d, stop := start(t, Config{Loss: loss, Seed: 7})
	for i := range n {
		f <- seq(i, 64)
	}
	lost := func() uint64 { return d.Stats().Dropped[ReasonLoss] }
	for deadline := time.Now().Add(5 * time.Second); uint64(s.count())+lost() < n && time.Now().Before(deadline); {
		time.Sleep(time.Millisecond)
	}
	stop(0)
	st := d.Stats()
	if st.Packets+st.Dropped[ReasonLoss] != n {
		t.Fatalf("stats %+v: delivered and lost do not add up to %d", st, n)
	}
	// Binomial: mean 2,000, standard deviation √(n·p·(1-p)) ≈ 42; ±300 is 7 of them.
	if l := st.Dropped[ReasonLoss]; l < 1700 || l > 2300 {
		t.Errorf("lost %d of %d at %v, want about %v", l, n, loss, loss*n)
	}
	// Losses are spread, not a run at the start: each half of the sequence lost some.
	var firstHalf int
	for _, p := range s.got {
		if binary.BigEndian.Uint32(p) < n/2 {
			firstHalf++
		}
	}
	if firstHalf > n/2-700 || firstHalf < n/2-1300 {
		t.Errorf("%d of the first %d packets delivered, want about 9,000", firstHalf, n/2)
	}
}

func TestRate(t *testing.T) {
	// 100 packets of 1,000 bytes at 1 MB/s take 100 ms to leave the bottleneck.
	const n, size, rate = 100, 1000, 1_000_000
	f, s, d, stop := start(t, Config{Rate: rate, Buffer: n * size})
	begin := time.Now()
	for i := range n {
		f <- seq(i, size)
	}
	stop(n)
	if s.count() != n {
		t.Fatalf("delivered %d of %d; stats %+v", s.count(), n, d.Stats())
	}
	// The last packet leaves n·size/rate after the first read, less one packet and the slack.
	least := time.Duration(n-1)*size*time.Second/rate - slack
	if took := s.when[n-1].Sub(begin); took < least {
		t.Errorf("%d bytes at %d B/s delivered in %v, want at least %v", n*size, rate, took, least)
	}
}

func TestBufferTailDrop(t *testing.T) {
	// 100 kB/s with a 5,000-byte buffer: of 20 packets of 1,000 bytes sent at once, the
	// bottleneck holds the first and 4 behind it (5,000 bytes), and drops the rest.
	const n = 20
	f, _, d, stop := start(t, Config{Rate: 100_000, Buffer: 5000})
	for i := range n {
		f <- seq(i, 1000)
	}
	stop(0)
	st := d.Stats()
	full := st.Dropped[ReasonQueueFull]
	if full < n-7 || full > n-4 {
		t.Errorf("%d of %d dropped at the buffer, want about %d; stats %+v", full, n, n-5, st)
	}
}

func TestLineFull(t *testing.T) {
	// A delay line of 4 packets, each held a second: the writer holds one more; of 10 sent
	// at once, 5 or 6 find it full.
	f, _, d, stop := start(t, Config{Delay: time.Second, Line: 4})
	for i := range 10 {
		f <- seq(i, 100)
	}
	for deadline := time.Now().Add(time.Second); d.Stats().Dropped[ReasonLineFull] < 5 && time.Now().Before(deadline); {
		time.Sleep(time.Millisecond)
	}
	if full := d.Stats().Dropped[ReasonLineFull]; full < 5 || full > 6 {
		t.Errorf("line_full %d, want 5 or 6", full)
	}
	stop(0)
}

func TestOversize(t *testing.T) {
	f, s, d, stop := start(t, Config{MTU: 100})
	f <- seq(0, 200)
	f <- seq(1, 100)
	stop(1)
	if st := d.Stats(); st.Dropped[ReasonOversize] != 1 || st.Packets != 1 || s.count() != 1 {
		t.Errorf("stats %+v, want the 200-byte packet dropped as oversize and the other delivered", st)
	}
}

func TestValidate(t *testing.T) {
	for _, c := range []Config{{Delay: -1}, {Jitter: -1}, {Loss: -0.1}, {Loss: 1.5}, {Rate: -1}, {Buffer: -1}} {
		if _, err := NewDirection(c, feed(nil), &sink{}); err == nil {
			t.Errorf("NewDirection(%+v) accepted", c)
		}
	}
	if _, err := NewDirection(Config{Loss: 1, Delay: time.Second}, feed(nil), &sink{}); err != nil {
		t.Errorf("a valid config refused: %v", err)
	}
}

func TestSet(t *testing.T) {
	// Everything lost, then nothing: the change applies to the packets read after it.
	f, s, d, stop := start(t, Config{Loss: 1})
	for i := range 10 {
		f <- seq(i, 100)
	}
	// The feed hands a packet over before the reader decides it: wait for the decisions.
	for deadline := time.Now().Add(5 * time.Second); d.Stats().Dropped[ReasonLoss] < 10 && time.Now().Before(deadline); {
		time.Sleep(time.Millisecond)
	}
	if err := d.Set(Config{Loss: 2}); err == nil {
		t.Error("Set accepted a loss of 2")
	}
	if err := d.Set(Config{}); err != nil {
		t.Fatal(err)
	}
	for i := range 10 {
		f <- seq(10+i, 100)
	}
	stop(10)
	st := d.Stats()
	if st.Dropped[ReasonLoss] != 10 || st.Packets != 10 || binary.BigEndian.Uint32(s.got[0]) != 10 {
		t.Errorf("stats %+v, want the first 10 lost and the last 10 delivered", st)
	}
}
