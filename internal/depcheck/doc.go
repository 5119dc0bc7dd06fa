// Package depcheck holds the test that enforces tendril's dependency rule: the data plane
// (ingress, tunnel, server, agent, bench) and the xDS model and translation never import
// Kubernetes client code. It has no code of its own.
package depcheck
