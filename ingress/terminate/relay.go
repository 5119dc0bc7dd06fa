package terminate

import (
	"bytes"
	"context"
	"crypto/tls"
	"fmt"
	"net"
	"net/http"
	"slices"
	"strings"

	"golang.org/x/net/http2/hpack"

	"github.com/tendril-net/tendril/ingress/h2relay"
)

// relayUpstream is the relay's pool of HTTP/2 connections to replica addr, made once per
// address: dials take the current state's front-proxy certificate.
func (p *Proxy) relayUpstream(addr string) *h2relay.Upstream {
	p.mu.Lock()
	defer p.mu.Unlock()
	if u := p.relayUps[addr]; u != nil {
		return u
	}
	u := p.relay.NewUpstream(func(ctx context.Context) (net.Conn, error) {
		st := p.state.Load()
		cfg := &tls.Config{Certificates: []tls.Certificate{st.shoot.FrontProxy}, RootCAs: st.shoot.UpstreamCAs,
			ServerName: st.shoot.UpstreamName, MinVersion: tls.VersionTLS12, NextProtos: []string{"h2"}}
		d := tls.Dialer{NetDialer: &net.Dialer{Timeout: p.cfg.DialTimeout}, Config: cfg}
		c, err := d.DialContext(ctx, "tcp", addr)
		if err != nil {
			return nil, err
		}
		if proto := c.(*tls.Conn).ConnectionState().NegotiatedProtocol; proto != "h2" {
			c.Close()
			return nil, fmt.Errorf("replica %s speaks %q, not h2", addr, proto)
		}
		return c, nil
	})
	p.relayUps[addr] = u
	return u
}

// retireRelayUpstreams retires the relay's pools of replicas that s no longer has, and all of
// them when the connections' TLS changed (the front-proxy certificate, kube-apiserver's CA or
// name): as the transports' idle connections, they would carry the old ones into new requests.
// Requests in flight keep their connections until they end.
func (p *Proxy) retireRelayUpstreams(old, s Shoot) {
	sameTLS := bytes.Equal(leaf(old.FrontProxy), leaf(s.FrontProxy)) && old.UpstreamName == s.UpstreamName &&
		old.UpstreamCAs.Equal(s.UpstreamCAs)
	keep := map[string]bool{}
	for _, a := range s.Upstreams {
		keep[a] = sameTLS
	}
	p.mu.Lock()
	var retired []*h2relay.Upstream
	for a, u := range p.relayUps {
		if !keep[a] {
			retired = append(retired, u)
			delete(p.relayUps, a)
		}
	}
	p.mu.Unlock()
	for _, u := range retired {
		u.Retire()
	}
}

// leaf is a certificate's leaf in DER, nil if none.
func leaf(c tls.Certificate) []byte {
	if len(c.Certificate) == 0 {
		return nil
	}
	return c.Certificate[0]
}

// relayDirector decides the requests of one HTTP/2 client connection on the relay: the same
// identity, header and balancing rules as ServeHTTP.
type relayDirector struct {
	p    *Proxy
	cs   tls.ConnectionState
	id   connIdentity
	peer string // the client's address, X-Forwarded-For
}

// headerPrefixLower is headerPrefix as HTTP/2 carries header names.
var headerPrefixLower = strings.ToLower(headerPrefix)

func (d *relayDirector) Direct(_ context.Context, h *h2relay.Head) (*h2relay.Upstream, *h2relay.Answer) {
	p := d.p
	st := p.state.Load()
	id, err := d.id.of(&d.cs, st.shoot.ClientCAs)
	if err != nil {
		p.Refused.BadCertificate.Add(1)
		p.cfg.Log.Info("Refused a client certificate", "remote", d.peer, "reason", err.Error())
		return nil, statusAnswer(http.StatusUnauthorized, "Unauthorized", "Unauthorized")
	}
	fields, stripped := h.Fields[:0], false
	for _, f := range h.Fields {
		switch {
		case strings.HasPrefix(f.Name, headerPrefixLower):
			stripped = true
		case f.Name == "forwarded", f.Name == "x-forwarded-for", f.Name == "x-forwarded-host", f.Name == "x-forwarded-proto":
		default:
			fields = append(fields, f)
		}
	}
	if stripped {
		p.Stripped.Add(1)
	}
	fields = append(fields, hpack.HeaderField{Name: "x-forwarded-for", Value: d.peer},
		hpack.HeaderField{Name: "x-forwarded-host", Value: h.Authority}, hpack.HeaderField{Name: "x-forwarded-proto", Value: "https"})
	if id.user != "" {
		fields = append(fields, hpack.HeaderField{Name: "x-remote-user", Value: id.user})
		for _, g := range id.groups {
			fields = append(fields, hpack.HeaderField{Name: "x-remote-group", Value: g})
		}
		fields = append(fields, hpack.HeaderField{Name: HeaderCredentialID, Value: id.credential})
	}
	h.Fields = fields
	// The replica with the fewest requests in flight; equals take turns (as pick). Replicas
	// whose last dial failed are left out for their backoff, unless all are: a replica that
	// refuses connections has none in flight and would draw every request.
	all := make([]*h2relay.Upstream, len(st.upstreams))
	for i, u := range st.upstreams {
		all[i] = p.relayUpstream(u.addr)
	}
	ups := slices.DeleteFunc(slices.Clone(all), (*h2relay.Upstream).Failing)
	if len(ups) == 0 {
		ups = all
	}
	best, ok := leastOutstanding(ups, func(u *h2relay.Upstream) int64 { return int64(u.Outstanding()) }, &p.next)
	if !ok {
		p.Refused.NoUpstream.Add(1)
		return nil, statusAnswer(http.StatusServiceUnavailable, "ServiceUnavailable", "no kube-apiserver replica")
	}
	return best, nil
}
