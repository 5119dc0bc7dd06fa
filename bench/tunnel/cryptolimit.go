package tunnel

import (
	"crypto/rand"
	"fmt"
	"runtime"
	"time"

	"golang.org/x/crypto/chacha20poly1305"

	"github.com/tendril-net/tendril/tunnel/netstack"
)

// CryptoLimit is the throughput WireGuard's cipher alone allows here: what no tunnel that
// encrypts each packet with ChaCha20-Poly1305 can pass, however little else it does per packet.
type CryptoLimit struct {
	// PacketBytes is the plaintext size sealed and opened: the tunnel's MTU.
	PacketBytes int `json:"packet_bytes"`
	// OneCoreMBps is seal plus open of one packet after another on one core: the MB one core
	// moves through both ends' cipher work in a second.
	OneCoreMBps float64 `json:"one_core_mb_per_sec"`
	// MBps is the limit for the two cores the stacks share (one sealing, one opening):
	// 2 × OneCoreMBps.
	MBps float64 `json:"mb_per_sec"`
}

// measureCryptoLimit seals and opens packets of the tunnel's MTU with x/crypto's
// chacha20poly1305 (what wireguard-go uses) on one goroutine locked to its thread for d.
func measureCryptoLimit(d time.Duration) (CryptoLimit, error) {
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	key := make([]byte, chacha20poly1305.KeySize)
	if _, err := rand.Read(key); err != nil {
		return CryptoLimit{}, err
	}
	aead, err := chacha20poly1305.New(key)
	if err != nil {
		return CryptoLimit{}, fmt.Errorf("crypto limit: %w", err)
	}
	size := netstack.DefaultMTU
	plain := make([]byte, size)
	sealed := make([]byte, 0, size+aead.Overhead())
	opened := make([]byte, 0, size)
	nonce := make([]byte, chacha20poly1305.NonceSize)
	var bytes int64
	start := time.Now()
	// Check the clock every 256 packets (~2 ms of work here): reading it per packet would be
	// measured too.
	for time.Since(start) < d {
		for range 256 {
			nonce[0]++
			sealed = aead.Seal(sealed[:0], nonce, plain, nil)
			if opened, err = aead.Open(opened[:0], nonce, sealed, nil); err != nil {
				return CryptoLimit{}, fmt.Errorf("crypto limit: open: %w", err)
			}
		}
		bytes += 256 * int64(size)
	}
	one := float64(bytes) / time.Since(start).Seconds() / 1e6
	return CryptoLimit{PacketBytes: size, OneCoreMBps: one, MBps: 2 * one}, nil
}

// line is the limit as the report states it, "" without one.
func (l *CryptoLimit) line() string {
	if l == nil {
		return ""
	}
	return fmt.Sprintf("crypto-limit: %.0f MB/s — ChaCha20-Poly1305 (x/crypto, as wireguard-go) seal plus open of %d-byte packets "+
		"moves %.0f MB/s on one core, two cores (one sealing, one opening) twice that; measured in this run before the stacks",
		l.MBps, l.PacketBytes, l.OneCoreMBps)
}
