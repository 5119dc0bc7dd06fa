package wg

import (
	"bytes"
	"encoding/hex"
	"fmt"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"github.com/go-logr/logr"
	"golang.zx2c4.com/wireguard/device"
)

// parsePeers reads the peer sections of a UAPI "get" answer
// (https://www.wireguard.com/xplatform/#configuration-protocol) into peers, which it clears
// first. It ignores the interface section, private key included, and keys it does not know. It
// allocates only the endpoints' strings: tendril-server reads the state 8 times a second, idle
// or not (TestPeersAllocatesLittle).
func parsePeers(uapi []byte, peers map[Key]PeerStatus) error {
	clear(peers)
	var cur PeerStatus
	var have bool
	var sec, nsec int64
	flush := func() {
		if !have {
			return
		}
		if sec != 0 || nsec != 0 {
			cur.LastHandshake = time.Unix(sec, nsec)
		}
		peers[cur.PublicKey] = cur
		cur, have, sec, nsec = PeerStatus{}, false, 0, 0
	}
	for len(uapi) > 0 {
		line := uapi
		if i := bytes.IndexByte(uapi, '\n'); i >= 0 {
			line, uapi = uapi[:i], uapi[i+1:]
		} else {
			uapi = nil
		}
		key, value, ok := bytes.Cut(line, []byte("="))
		if !ok {
			continue
		}
		var err error
		switch k := string(key); k {
		case "public_key":
			flush()
			if n := hex.DecodedLen(len(value)); n != KeySize {
				err = fmt.Errorf("%d bytes", n)
			} else if _, err = hex.Decode(cur.PublicKey[:], value); err == nil {
				have = true
			}
		case "endpoint", "last_handshake_time_sec", "last_handshake_time_nsec", "rx_bytes", "tx_bytes":
			if !have {
				return fmt.Errorf("wg: parse device state: %s before any public_key", k)
			}
			switch k {
			case "endpoint":
				cur.Endpoint = string(value)
			case "last_handshake_time_sec":
				sec, err = strconv.ParseInt(string(value), 10, 64)
			case "last_handshake_time_nsec":
				nsec, err = strconv.ParseInt(string(value), 10, 64)
			case "rx_bytes":
				cur.RxBytes, err = strconv.ParseUint(string(value), 10, 64)
			case "tx_bytes":
				cur.TxBytes, err = strconv.ParseUint(string(value), 10, 64)
			}
		}
		if err != nil {
			return fmt.Errorf("wg: parse device state: %s: %w", key, err)
		}
	}
	flush()
	return nil
}

// deviceLogger adapts logr to wireguard-go's two printf functions; nothing is logged once
// muted is set.
func deviceLogger(l logr.Logger, muted *atomic.Bool) *device.Logger {
	lim := &limiter{burst: 10, every: time.Second}
	return &device.Logger{
		Verbosef: func(format string, args ...any) {
			if v := l.V(2); v.Enabled() && !muted.Load() {
				v.Info(fmt.Sprintf(format, args...), "source", "wireguard")
			}
		},
		Errorf: func(format string, args ...any) {
			if !l.Enabled() || muted.Load() {
				return
			}
			ok, suppressed := lim.allow(time.Now())
			if !ok {
				return
			}
			kv := []any{"source", "wireguard"}
			if suppressed > 0 {
				kv = append(kv, "suppressed", suppressed)
			}
			l.Info(fmt.Sprintf(format, args...), kv...)
		},
	}
}

// limiter is a token bucket for log lines: burst lines at once, then one per every; it counts
// the lines it refused so that the next line says how many were dropped.
type limiter struct {
	burst int
	every time.Duration

	mu         sync.Mutex
	tokens     float64
	last       time.Time
	suppressed int
}

func (l *limiter) allow(now time.Time) (ok bool, suppressed int) {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.last.IsZero() {
		l.tokens = float64(l.burst)
	} else {
		l.tokens += float64(now.Sub(l.last)) / float64(l.every)
		if l.tokens > float64(l.burst) {
			l.tokens = float64(l.burst)
		}
	}
	l.last = now
	if l.tokens < 1 {
		l.suppressed++
		return false, 0
	}
	l.tokens--
	suppressed, l.suppressed = l.suppressed, 0
	return true, suppressed
}
