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
