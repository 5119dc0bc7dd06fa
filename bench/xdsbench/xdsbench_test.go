package xdsbench

import (
	"bytes"
	"context"
	"encoding/json"
	"os"
	"strings"
	"testing"
	"time"
)

// TestMain runs the control plane and ingress children when the test
// binary is started as one (Run starts its own executable again).
func TestMain(m *testing.M) {
	if IsChild() {
		os.Exit(ChildMain())
	}
	os.Exit(m.Run())
}

// TestRunMini runs the whole benchmark at a tiny size: two set sizes, two
// replicas of the ingress package, a few changes of every kind. It checks
// that everything was measured, not how fast.
func TestRunMini(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	var progress bytes.Buffer
	rep, err := Run(ctx, Config{Shoots: []int{3, 20}, Replicas: 2, Changes: 6, Warmup: 3, Timeout: 30 * time.Second, Progress: &progress})
	if err != nil {
		t.Fatalf("%v\nprogress:\n%s", err, progress.String())
	}
	if rep.Partial || len(rep.Sizes) != 2 {
		t.Fatalf("partial %v, %d sizes", rep.Partial, len(rep.Sizes))
	}
	for _, s := range rep.Sizes {
		if s.Resources == 0 || s.BuildMS <= 0 || s.SyncMS <= 0 || s.SyncBytesPerReplica == 0 {
			t.Errorf("%d shoots: %+v", s.Shoots, s)
		}
		if len(s.Changes) != len(Kinds)+1 {
			t.Fatalf("%d shoots: changes %+v", s.Shoots, s.Changes)
		}
		for _, c := range s.Changes {
			if c.Count == 0 || c.P50MS <= 0 || c.P99MS < c.P50MS || c.BytesPerReplica <= 0 {
				t.Errorf("%d shoots, %s: %+v", s.Shoots, c.Kind, c)
			}
		}
		if s.ControlPlane.Loaded.RSS == 0 || s.ControlPlane.Peak() == 0 || s.Ingress.Loaded.RSS == 0 {
			t.Errorf("%d shoots: memory %+v %+v", s.Shoots, s.ControlPlane, s.Ingress)
		}
	}
	// No size reaches the goals' size: the goals say so rather than judge.
	if len(rep.Goals) != 1 || rep.Goals[0].Met {
		t.Errorf("goals: %+v", rep.Goals)
	}
	var table, md, js bytes.Buffer
	if err := rep.WriteTable(&table); err != nil {
		t.Fatal(err)
	}
	if err := rep.WriteMarkdown(&md); err != nil {
		t.Fatal(err)
	}
	if err := rep.WriteJSON(&js); err != nil {
		t.Fatal(err)
	}
	for _, out := range []string{table.String(), md.String()} {
		for _, want := range []string{"endpoint", "add", "remove", "all", "20"} {
			if !strings.Contains(out, want) {
				t.Errorf("output lacks %q:\n%s", want, out)
			}
		}
	}
	var back Report
	if err := json.Unmarshal(js.Bytes(), &back); err != nil || len(back.Sizes) != 2 {
		t.Errorf("JSON round trip: %v", err)
	}
	t.Log("\n" + table.String())
}

func TestGoals(t *testing.T) {
	rep := &Report{Sizes: []*SizeResult{{Shoots: 10000, Changes: []ChangeResult{
		{Kind: "add", BytesPerReplica: 20 << 10}, {Kind: "all", P99MS: 50, BytesPerReplica: 5 << 10},
	}, ControlPlane: Memories{After: memory{Peak: 300 << 20}}}}}
	rep.finish(false)
	if len(rep.Goals) != 3 || !rep.Goals[0].Met || rep.Goals[1].Met || rep.Goals[2].Met {
		t.Fatalf("goals: %+v", rep.Goals)
	}
	if rep.Goals[1].Miss != "10 KiB over (2.00×)" || rep.Goals[2].Miss != "44 MiB over (1.17×)" {
		t.Errorf("misses: %q, %q", rep.Goals[1].Miss, rep.Goals[2].Miss)
	}
}
