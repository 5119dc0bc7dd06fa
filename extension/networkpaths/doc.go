// Package networkpaths holds only a test: it proves, with Gardener's own NetworkPolicy
// controllers running against a real kube-apiserver (envtest), that every network path tendril
// needs on a Gardener seed is admitted and that no path crosses from one shoot to another.
// gardenlet's seed NetworkPolicy controller puts deny-all (and its allow-to-… policies) into
// the garden, extension and shoot namespaces; the resource manager's NetworkPolicy controller
// derives the allowing policies from tendril's Services (the rendered tendril-seed chart and
// extension/manifest's per-shoot objects) and Gardener's kube-apiserver Service; the
// kube-apiserver pods carry the egress webhook's label. internal/netpoleval then judges every
// path. The table is docs/network-paths.md (go test ./extension/networkpaths -update).
package networkpaths
