package model

import (
	"errors"
	"fmt"
	"net/netip"
)

// Claims records which shoot holds each server name and advertised address. Two shoots sharing
// either would route one shoot's clients to the other, so a shoot is admitted only if every one of
// its claims is free or already its own. This is the one claim check: ValidateSet checks a whole
// set with it, the xDS server the changed shoots of an update against the claims of the shoots
// that stay, and the Kubernetes source admits Routes oldest first with it. The zero value holds
// no claims. Not safe for concurrent use.
type Claims struct {
	hosts      map[string]string
	advertised map[netip.Addr]string
}

// Conflict is a claim Admit refused: a server name (Host) or an advertised address (Advertised,
// when Host is empty) that Holder holds and Shoot asked for.
type Conflict struct {
	Shoot, Holder string
	Host          string
	Advertised    netip.Addr
}

func (c *Conflict) Error() string {
	if c.Host != "" {
		return fmt.Sprintf("host %q claimed by both %s and %s", c.Host, c.Holder, c.Shoot)
	}
	return fmt.Sprintf("advertised address %s claimed by both %s and %s", c.Advertised, c.Holder, c.Shoot)
}

// Admit records sh as the holder of its server names and advertised address, unless another
// shoot holds one of them: then it records nothing and returns a *Conflict for each such claim,
// joined, server names first in sh's order. Claims sh already holds are no conflict, so a shoot
// listing a name twice conflicts with nobody (Validate refuses that).
func (c *Claims) Admit(sh Shoot) error {
	var errs []error
	for _, h := range sh.Hosts {
		if other, ok := c.hosts[h]; ok && other != sh.Name {
			errs = append(errs, &Conflict{Shoot: sh.Name, Holder: other, Host: h})
		}
	}
	a := sh.AdvertisedAddress
	if a.IsValid() {
		if other, ok := c.advertised[a]; ok && other != sh.Name {
			errs = append(errs, &Conflict{Shoot: sh.Name, Holder: other, Advertised: a})
		}
	}
	if len(errs) > 0 {
		return errors.Join(errs...)
	}
	if c.hosts == nil {
		c.hosts = make(map[string]string, len(sh.Hosts))
		c.advertised = make(map[netip.Addr]string)
	}
	for _, h := range sh.Hosts {
		c.hosts[h] = sh.Name
	}
	if a.IsValid() {
		c.advertised[a] = sh.Name
	}
	return nil
}

// Release forgets the claims of sh that sh holds; a claim another shoot holds stays.
func (c *Claims) Release(sh Shoot) {
	for _, h := range sh.Hosts {
		if c.hosts[h] == sh.Name {
			delete(c.hosts, h)
		}
	}
	if a := sh.AdvertisedAddress; a.IsValid() && c.advertised[a] == sh.Name {
		delete(c.advertised, a)
	}
}
