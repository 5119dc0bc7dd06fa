package v1alpha1

import (
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
)

// ConditionProgrammed is true once every ingress replica (each Pod behind a ready endpoint of
// the ingress Service, and any other connected one) has acknowledged the resources generated
// from the Route's current generation.
const ConditionProgrammed = "Programmed"

// Reasons of the Programmed condition.
const (
	// ReasonProgrammed: every ingress replica ACKed the route's resources.
	ReasonProgrammed = "Programmed"
	// ReasonPending: the control plane has the route but not every replica has ACKed it yet.
	ReasonPending = "Pending"
	// ReasonInvalid: the route (or what its references resolve to) cannot be translated.
	ReasonInvalid = "Invalid"
	// ReasonRejected: an ingress replica NACKed the route's resources.
	ReasonRejected = "Rejected"
	// ReasonNoEndpoints: the kube-apiserver Service has no ready endpoint yet.
	ReasonNoEndpoints = "NoEndpoints"
)

// Route is the ingress route of one shoot: the TLS server names and advertised address that
// reach its kube-apiserver and the Service behind its reversed tunnel. The extension writes one
// per shoot namespace; the xDS control plane reads it together with the referenced Services'
// EndpointSlices. The shoot namespace is the route's identity: a Route's name is not used
// for routing, and a namespace holds at most one Route the control plane programs (the
// oldest; others get Programmed=False).
//
// +kubebuilder:object:root=true
// +kubebuilder:subresource:status
// +kubebuilder:resource:scope=Namespaced,shortName=tr
// +kubebuilder:printcolumn:name="Hosts",type=string,JSONPath=`.spec.hostnames`
// +kubebuilder:printcolumn:name="Programmed",type=string,JSONPath=`.status.conditions[?(@.type=="Programmed")].status`
// +kubebuilder:printcolumn:name="Age",type=date,JSONPath=`.metadata.creationTimestamp`
type Route struct {
	metav1.TypeMeta   `json:",inline"`
	metav1.ObjectMeta `json:"metadata,omitempty"`

	Spec   RouteSpec   `json:"spec"`
	Status RouteStatus `json:"status,omitempty"`
}

// RouteSpec says where a shoot's control-plane traffic goes.
type RouteSpec struct {
	// Hostnames are the TLS server names (SNI) routed to the kube-apiserver, lower case.
	//
	// +kubebuilder:validation:MinItems=1
	// +kubebuilder:validation:MaxItems=16
	// +listType=set
	Hostnames []string `json:"hostnames"`

	// APIServer is the kube-apiserver Service in the Route's namespace; its ready endpoints
	// are the upstream of the SNI and PROXY listeners.
	APIServer ServiceReference `json:"apiServer"`

	// AdvertisedAddress is kube-apiserver's advertised IP address, which in-cluster clients
	// of the shoot reach through the PROXY-protocol listener. Empty means none.
	//
	// +optional
	AdvertisedAddress string `json:"advertisedAddress,omitempty"`

	// TunnelServer is the tendril-server Service the shoot's vpn agent reaches through the
	// CONNECT listeners. Unset means the shoot has no tunnel route.
	//
	// +optional
	TunnelServer *ServiceReference `json:"tunnelServer,omitempty"`

	// Termination opts the Route into the terminating mode of the SNI listener: the ingress
	// ends the TLS of Hostnames with kube-apiserver's serving certificate and balances each
	// request over the kube-apiserver endpoints. Unset: connections are passed through.
	//
	// +optional
	Termination *RouteTermination `json:"termination,omitempty"`
}

// Keys of a termination Secret, all PEM.
const (
	TerminationServingCert    = "serving.crt"
	TerminationServingKey     = "serving.key"
	TerminationClientCA       = "client-ca.crt"
	TerminationFrontProxyCert = "front-proxy.crt"
	TerminationFrontProxyKey  = "front-proxy.key"
	TerminationAPIServerCA    = "kube-apiserver-ca.crt"
)

// RouteTermination names what the terminating mode needs.
type RouteTermination struct {
	// SecretName is a Secret in the Route's namespace, labelled TerminationSecretLabel=true
	// (the control plane caches only those), with the keys Termination*: kube-apiserver's
	// serving certificate and key, the client CA bundle, the front-proxy client certificate and
	// key, and the CA that verifies kube-apiserver.
	//
	// +kubebuilder:validation:MinLength=1
	SecretName string `json:"secretName"`
	// APIServerName is the name kube-apiserver's serving certificate is verified for.
	//
	// +kubebuilder:validation:MinLength=1
	APIServerName string `json:"apiServerName"`
}

// ServiceReference names a Service port in the Route's namespace.
type ServiceReference struct {
	// Name of the Service.
	//
	// +kubebuilder:validation:MinLength=1
	Name string `json:"name"`
	// Port is the Service port; the endpoint port is looked up in its EndpointSlices by
	// the port's name, as kube-proxy does.
	//
	// +kubebuilder:validation:Minimum=1
	// +kubebuilder:validation:Maximum=65535
	Port int32 `json:"port"`
}

// RouteStatus is what the control plane observed of a Route.
type RouteStatus struct {
	// ObservedGeneration is the generation the conditions describe.
	//
	// +optional
	ObservedGeneration int64 `json:"observedGeneration,omitempty"`
	// Conditions: Programmed.
	//
	// +optional
	// +listType=map
	// +listMapKey=type
	Conditions []metav1.Condition `json:"conditions,omitempty"`
}

// RouteList is a list of Routes.
//
// +kubebuilder:object:root=true
type RouteList struct {
	metav1.TypeMeta `json:",inline"`
	metav1.ListMeta `json:"metadata,omitempty"`
	Items           []Route `json:"items"`
}
