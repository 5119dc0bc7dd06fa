//go:build !linux

package h2relay

import "errors"

// canPark: no epoll here, so connections are not parked.
const canPark = false

type lot struct{ r *Relay }

func (l *lot) add(*peer) error { return errors.New("h2relay: no parking on this system") }
func (l *lot) take(*peer) bool { return false }
func (l *lot) count() int      { return 0 }
