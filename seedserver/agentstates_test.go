package seedserver

import (
	"maps"
	"testing"
)

func TestAgentStates(t *testing.T) {
	got := AgentStates(`# HELP tendril_server_agent_live 1 while ...
# TYPE tendril_server_agent_live gauge
tendril_server_agent_live{agent="a+/="} 1
tendril_server_agent_live{agent="b"} 0
tendril_server_agent_active{agent="a+/="} 0
tendril_server_agent_active{agent="b"} 1
tendril_server_agent_failovers_total 3
`)
	want := map[string]AgentState{"a+/=": {Live: true}, "b": {Active: true}}
	if !maps.Equal(got, want) {
		t.Fatalf("AgentStates = %v, want %v", got, want)
	}
}

func TestActiveAgent(t *testing.T) {
	const m = `tendril_server_agent_live{agent="a"} 1
tendril_server_agent_live{agent="b"} 1
tendril_server_agent_live{agent="c"} 0
tendril_server_agent_active{agent="a"} 0
tendril_server_agent_active{agent="b"} 1
tendril_server_agent_active{agent="c"} 0
`
	for _, tc := range []struct {
		keys   []string
		active int
		err    string
	}{
		{[]string{"a", "b"}, 1, ""},
		{[]string{"a", "c"}, -1, "agent 1 not live"},
		{[]string{"a"}, -1, "no active agent"},
	} {
		active, err := ActiveAgent(m, tc.keys)
		if active != tc.active || (err == nil) != (tc.err == "") || err != nil && err.Error() != tc.err {
			t.Errorf("ActiveAgent(%v) = %d, %v; want %d, %q", tc.keys, active, err, tc.active, tc.err)
		}
	}
}
