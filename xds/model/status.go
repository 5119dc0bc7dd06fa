package model

// State is how far one shoot's current resources have got to the connected data planes.
type State int

const (
	// StateUnknown: the shoot is not in the applied route set.
	StateUnknown State = iota
	// StatePending: a connected data plane has not yet acknowledged the shoot's current
	// resources, an expected one (the ads server's SetExpectedNodes) is not connected and synced, or none is
	// connected.
	StatePending
	// StateProgrammed: every connected data plane, and every expected one, holds the shoot's
	// current resources.
	StateProgrammed
	// StateRejected: a data plane refused (NACKed) a response carrying the shoot's current
	// resources; it keeps serving what it had before.
	StateRejected
)

func (st State) String() string {
	switch st {
	case StatePending:
		return "Pending"
	case StateProgrammed:
		return "Programmed"
	case StateRejected:
		return "Rejected"
	default:
		return "Unknown"
	}
}

// ShootStatus is the acknowledgement state of one shoot's current resources.
//
// Only delta clients count: both data planes (Envoy in tendril's chart and tendril-ingress) use
// delta, and a state-of-the-world ACK names a cache version, not resources. A client counts once
// it has answered its first response of every type (it is "synced"): a replica that connects
// later does not turn programmed shoots back to pending while it loads the full set, which would
// cost a status write per shoot and replica, but its refusal of a shoot's resources does count.
type ShootStatus struct {
	Name  string
	State State
	// Model is the applied model this status describes; a consumer compares it with the model it
	// applied to know the status is about that route version.
	Model Shoot
	// Clients is the number of synced delta clients counted.
	Clients int
	// Missing are the expected nodes (the ads server's SetExpectedNodes) with no synced stream, sorted.
	Missing []string
	// Detail says which client refused the resources and why (StateRejected only).
	Detail string
}

// Stats says what one Apply of a route set changed.
type Stats struct {
	// Translated counts the shoots whose model changed (translated again).
	Translated int
	// Updated and Removed count resources written and deleted.
	Updated, Removed int
}
