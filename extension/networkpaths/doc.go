// Package networkpaths proves, with Gardener's own NetworkPolicy controllers running against a
// real kube-apiserver, that every network path tendril needs on a Gardener seed is admitted and
// that no path crosses from one shoot to another. gardenlet's seed NetworkPolicy controller puts
// deny-all (and its allow-to-… policies) into the garden, extension and shoot namespaces; the
// resource manager's NetworkPolicy controller derives the allowing policies from tendril's
// Services (the rendered tendril-seed chart and extension/manifest's per-shoot objects) and
// Gardener's kube-apiserver Service; the kube-apiserver pods carry the egress webhook's label.
// internal/kube/netpoleval then judges every path.
//
// World builds the objects (namespaces labelled as gardenlet labels them, pods standing for the
// Deployments: envtest runs no controller-manager), NewControllers runs Gardener's two
// controllers, Settle waits for their policies and judges SeedPaths. The test (envtest) writes
// the table to docs/network-paths.md (go test ./extension/networkpaths -update); the local seed
// (package localseed, `make run`) builds the same world over its own objects and prints it.
package networkpaths
