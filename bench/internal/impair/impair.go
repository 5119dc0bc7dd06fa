// Package impair is a userspace stand-in for netem, which this kernel does not have: it
// carries IP packets between two TUN devices and delays, jitters, drops and rate-limits them
// on the way, for the benchmark's carrier link (a tunnel measured under loss and latency).
//
// Each direction of a Link is a Direction: one goroutine reads a packet, decides its fate
// (random loss, the bottleneck's buffer) and its release time (the rate's serialisation, the
// delay, the jitter), and queues it in a bounded delay line; another writes it out at its
// release time. Packets leave in the order they came, each at its release time or right after
// the one before it, so jitter does not reorder them (netem reorders with jitter unless told
// otherwise; a path that reorders is a different test). Every
// packet that is not delivered is counted under its reason.
//
// It does not model a link's duplication, corruption or reordering, and it adds no delay to the
// kernel's own hops: a Config's zero value carries every packet as it came, at the pump's own
// cost (two system calls a packet), the same for every tunnel measured across it.
package impair

import (
	"context"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"os"
	"sync"
	"sync/atomic"
	"time"
)

// Config is one direction's impairment. The zero value impairs nothing.
type Config struct {
	// Delay is added to every packet: half the round-trip time it stands for.
	Delay time.Duration
	// Jitter is the spread of the delay: each packet's is Delay plus a uniform draw from
	// [-Jitter, +Jitter] (never below 0); a packet never leaves before the one ahead of it.
	Jitter time.Duration
	// Loss is the fraction of packets dropped at random, 0 to 1.
	Loss float64
	// Rate, if not 0, is the bottleneck's bandwidth in bytes per second: a packet leaves it
	// len/Rate after the one before it.
	Rate int64
	// Buffer is the bottleneck's buffer in bytes: a packet that would wait behind more than
	// Buffer bytes is dropped (queue_full), as a router's tail drop. 0 means 100 ms of Rate.
	Buffer int64
	// Line bounds the packets held (the delay line and the bottleneck's queue together);
	// 0 means DefaultLine.
	Line int
	// MTU is the largest packet carried; 0 means 1500. A larger one is dropped (oversize).
	MTU int
	// Seed seeds the random draws, so that a run's losses can be repeated.
	Seed uint64
}

// DefaultLine is the delay line's default bound in packets: 32,768 packets of 1,500 bytes are
// 49 MB, the window of eight connections at Linux's largest default receive buffer (6 MiB,
// net.ipv4.tcp_rmem) in flight at once, so that the line is not what limits a long fat path.
const DefaultLine = 1 << 15

// slack is how early a packet may be written before its release time: the writer then sends
// everything due within it in one wake-up rather than sleeping once per packet (a timer fires
// tens of microseconds late anyway).
const slack = 50 * time.Microsecond

// Drop reasons, as Stats counts them.
const (
	ReasonLoss       = "loss"        // the random draw (Config.Loss)
	ReasonQueueFull  = "queue_full"  // the bottleneck's buffer is full (Config.Buffer)
	ReasonLineFull   = "line_full"   // the delay line is full (Config.Line)
	ReasonOversize   = "oversize"    // larger than Config.MTU
	ReasonWriteError = "write_error" // the far side refused it
)

// Stats counts one direction's packets.
type Stats struct {
	Packets, Bytes uint64            // delivered
	Dropped        map[string]uint64 // by reason; only reasons that occurred
}

func (c Config) withDefaults() Config {
	if c.Line <= 0 {
		c.Line = DefaultLine
	}
	if c.MTU <= 0 {
		c.MTU = 1500
	}
	if c.Rate > 0 && c.Buffer <= 0 {
		c.Buffer = c.Rate / 10 // 100 ms of the rate
	}
	return c
}

// Validate says what is wrong with c.
func (c Config) Validate() error {
	switch {
	case c.Delay < 0 || c.Jitter < 0:
		return fmt.Errorf("impair: delay %v and jitter %v must not be negative", c.Delay, c.Jitter)
	case c.Loss < 0 || c.Loss > 1:
		return fmt.Errorf("impair: loss %v is not a fraction from 0 to 1", c.Loss)
	case c.Rate < 0 || c.Buffer < 0:
		return fmt.Errorf("impair: rate %d and buffer %d must not be negative", c.Rate, c.Buffer)
	}
	return nil
}

// String is c as a report shows it.
func (c Config) String() string {
	s := fmt.Sprintf("delay %v", c.Delay)
	if c.Jitter > 0 {
		s += fmt.Sprintf(" ±%v", c.Jitter)
	}
	s += fmt.Sprintf(", loss %g %%", c.Loss*100)
	if c.Rate > 0 {
		s += fmt.Sprintf(", rate %.1f MB/s", float64(c.Rate)/1e6)
	}
	return s
}

// Direction carries packets from one packet reader to one packet writer: each Read of src
// returns one packet, each Write to dst takes one (a TUN device's file descriptor does both).
type Direction struct {
	cfg      atomic.Pointer[Config]
	src      io.Reader
	dst      io.Writer
	line     chan packet
	pool     sync.Pool
	rng      *rand.Rand
	departed time.Time // when the last packet left the bottleneck (reader only)

	packets, bytes                              atomic.Uint64
	loss, queueFull, lineFull, oversize, writes atomic.Uint64
}

type packet struct {
	buf     *[]byte
	n       int
	release time.Time
}

// NewDirection is a Direction from src to dst under cfg. Run starts it.
func NewDirection(cfg Config, src io.Reader, dst io.Writer) (*Direction, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	cfg = cfg.withDefaults()
	d := &Direction{src: src, dst: dst, line: make(chan packet, cfg.Line),
		rng: rand.New(rand.NewPCG(cfg.Seed, cfg.Seed^0x9e3779b97f4a7c15))}
	d.cfg.Store(&cfg)
	size := cfg.MTU + 1 // one byte more: a read that fills it was larger than the MTU
	d.pool.New = func() any { b := make([]byte, size); return &b }
	return d, nil
}

// Set changes the impairment of the packets read from now on; those held keep their release
// times. Line, MTU and Seed stay as NewDirection set them.
func (d *Direction) Set(cfg Config) error {
	if err := cfg.Validate(); err != nil {
		return err
	}
	old := d.cfg.Load()
	cfg.Line, cfg.MTU, cfg.Seed = old.Line, old.MTU, old.Seed
	cfg = cfg.withDefaults()
	d.cfg.Store(&cfg)
	return nil
}

// Run carries packets until src fails (closing it ends Run) or ctx is done, then waits for
// its writer. It returns nil when src was closed or ctx ended, and src's error otherwise.
func (d *Direction) Run(ctx context.Context) error {
	ctx, cancel := context.WithCancel(ctx)
	var wg sync.WaitGroup
	wg.Add(1)
	go func() { defer wg.Done(); d.write(ctx) }()
	err := d.read(ctx)
	cancel()
	wg.Wait()
	if err == nil || errors.Is(err, io.EOF) || errors.Is(err, context.Canceled) || isClosed(err) {
		return nil
	}
	return err
}

func (d *Direction) read(ctx context.Context) error {
	for ctx.Err() == nil {
		b := d.pool.Get().(*[]byte)
		n, err := d.src.Read(*b)
		if err != nil {
			d.pool.Put(b)
			return err
		}
		now := time.Now()
		release, reason := d.admit(now, n)
		if reason != nil {
			reason.Add(1)
			d.pool.Put(b)
			continue
		}
		select {
		case d.line <- packet{buf: b, n: n, release: release}:
		default:
			d.lineFull.Add(1)
			d.pool.Put(b)
		}
	}
	return ctx.Err()
}

// admit decides a packet of n bytes read at now: its release time, or the counter of the
// reason it is dropped for.
func (d *Direction) admit(now time.Time, n int) (time.Time, *atomic.Uint64) {
	c := d.cfg.Load()
	if n > c.MTU {
		return time.Time{}, &d.oversize
	}
	if c.Loss > 0 && d.rng.Float64() < c.Loss {
		return time.Time{}, &d.loss
	}
	leave := now
	if c.Rate > 0 {
		start := now
		if d.departed.After(now) {
			// Waiting behind d.departed-now of the rate's bytes.
			if backlog := int64(d.departed.Sub(now).Seconds() * float64(c.Rate)); backlog+int64(n) > c.Buffer {
				return time.Time{}, &d.queueFull
			}
			start = d.departed
		}
		leave = start.Add(time.Duration(float64(n) / float64(c.Rate) * float64(time.Second)))
		d.departed = leave
	}
	delay := c.Delay
	if c.Jitter > 0 {
		delay += time.Duration((d.rng.Float64()*2 - 1) * float64(c.Jitter))
		delay = max(delay, 0)
	}
	return leave.Add(delay), nil
}

func (d *Direction) write(ctx context.Context) {
	timer := time.NewTimer(time.Hour)
	defer timer.Stop()
	for {
		var p packet
		select {
		case p = <-d.line:
		case <-ctx.Done():
			return
		}
		if wait := time.Until(p.release); wait > slack {
			timer.Reset(wait)
			select {
			case <-timer.C:
			case <-ctx.Done():
				return
			}
		}
		if _, err := d.dst.Write((*p.buf)[:p.n]); err != nil {
			d.writes.Add(1)
		} else {
			d.packets.Add(1)
			d.bytes.Add(uint64(p.n))
		}
		d.pool.Put(p.buf)
	}
}

// Stats is what d has carried and dropped so far.
func (d *Direction) Stats() Stats {
	s := Stats{Packets: d.packets.Load(), Bytes: d.bytes.Load(), Dropped: map[string]uint64{}}
	for reason, c := range map[string]*atomic.Uint64{ReasonLoss: &d.loss, ReasonQueueFull: &d.queueFull,
		ReasonLineFull: &d.lineFull, ReasonOversize: &d.oversize, ReasonWriteError: &d.writes} {
		if v := c.Load(); v > 0 {
			s.Dropped[reason] = v
		}
	}
	return s
}

func isClosed(err error) bool { return errors.Is(err, os.ErrClosed) }
