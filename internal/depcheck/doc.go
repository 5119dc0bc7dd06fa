// Package depcheck holds the tests that enforce tendril's import rules (docs/architecture.md):
// the data plane never reaches Kubernetes or Gardener code; wire imports nothing; the connection
// edge stands on the standard library, x/sys and wire; the tunnel on the edge and the host's
// calls; only the binaries import the process plumbing; no non-test code reaches a test fixture;
// internal/ holds only its audiences' folders; and every folder a rule names exists. It has no
// code of its own.
package depcheck
