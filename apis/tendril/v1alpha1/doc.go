// Package v1alpha1 holds tendril's own API types in the group
// tendril.extensions.gardener.cloud: the Route object the extension writes per
// shoot and the xDS control plane reads, and the providerConfig a shoot owner
// puts into the Extension. It holds types, defaults and validation only; no
// client code and no controllers.
//
// +kubebuilder:object:generate=true
// +groupName=tendril.extensions.gardener.cloud
package v1alpha1
