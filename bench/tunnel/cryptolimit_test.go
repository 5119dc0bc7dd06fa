package tunnel

import (
	"strings"
	"testing"
	"time"
)

func TestCryptoLimit(t *testing.T) {
	lim, err := measureCryptoLimit(50 * time.Millisecond)
	if err != nil {
		t.Fatal(err)
	}
	if lim.PacketBytes != 1420 || lim.OneCoreMBps <= 0 || lim.MBps != 2*lim.OneCoreMBps {
		t.Errorf("crypto limit %+v", lim)
	}
	// One connection against it: a goal of half the limit.
	rep := &Report{CryptoLimit: &CryptoLimit{PacketBytes: 1420, OneCoreMBps: 500, MBps: 1000},
		Targets: []*TargetResult{{Name: TargetTendrilConnect, Bulk: []BulkResult{
			{Direction: ToShoot, Conns: 1, MBps: 600}, {Direction: FromShoot, Conns: 1, MBps: 400}, {Direction: FromShoot, Conns: 4, MBps: 900}}}}}
	rep.evaluate()
	met := map[string]bool{}
	for _, g := range rep.Goals {
		if g.Versus == "crypto-limit" {
			met[g.Metric] = g.Met
		}
	}
	if len(met) != 2 || !met["bulk to-shoot ×1 of the crypto limit"] || met["bulk from-shoot ×1 of the crypto limit"] {
		t.Errorf("crypto-limit goals %v: want to-shoot met (0.6×), from-shoot not (0.4×)", met)
	}
	if l := rep.CryptoLimit.line(); !strings.Contains(l, "crypto-limit: 1000 MB/s") {
		t.Errorf("line %q", l)
	}
}
