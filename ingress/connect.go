package ingress

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"net/http"
	"strings"

	"github.com/tendril-net/tendril/edge/connect"
)

// serveConnect serves one request on a connect chain: a CONNECT whose destination header passes
// its route's guard is proxied to the cluster the header names, answered 200 only once the
// upstream is connected; everything else gets its status and the connection is closed.
// Status codes (design.md): missing or malformed header 400 (the route's direct response),
// unknown cluster 503, dial failure 502, dial timeout 504.
// The connection counts as pending (p) until its request is read.
func (s *server) serveConnect(ctx context.Context, d *downstream, hc *connectConfig, p *pendingConn) {
	req, r := readRequest(d, hc)
	if !s.in.pending.release(p) {
		return // evicted while its request arrived: closed and counted
	}
	if r != nil {
		s.respond(d, "", r.Outcome, r.Status, r.Body, r.Err) // status 0: closed before a request, nothing to answer
		return
	}
	route := hc.match(req)
	switch {
	case route == nil:
		s.respond(d, "", outcomeNoRoute, http.StatusNotFound, "no route\n", nil)
		return
	case route.clusterHeader == "" && route.relayCluster == "":
		s.respond(d, "", outcomeDirectResponse, route.status, route.body, fmt.Errorf("%s %q matched route %s", req.Method, req.Host, route.name))
		return
	}
	cfg := s.in.current.Load()
	name, what := route.relayCluster, "relay"
	if route.clusterHeader != "" {
		name, what = req.Header.Get(route.clusterHeader), route.clusterHeader
	}
	cl := cfg.clusters[name]
	if cl == nil {
		s.respond(d, "", outcomeUnknownRoute, http.StatusServiceUnavailable, "no upstream for this "+what+"\n", fmt.Errorf("no cluster %q", name))
		return
	}
	up, release, outcome, err := s.dial(ctx, cfg, cl, 1)
	switch outcome {
	case "":
	case outcomeDialTimeout:
		s.respond(d, cl.name, outcome, http.StatusGatewayTimeout, "upstream connect timed out\n", err)
		return
	case outcomeNoEndpoint, outcomeCircuitOpen:
		s.respond(d, cl.name, outcome, http.StatusServiceUnavailable, "upstream unavailable ("+strings.ReplaceAll(outcome, "_", " ")+")\n", err)
		return
	default:
		s.respond(d, cl.name, outcome, http.StatusBadGateway, "upstream connect failed\n", err)
		return
	}
	if route.relayCluster != "" {
		// The upstream answers the CONNECT: it goes first, and its response reaches the client
		// through the pair like any byte after it.
		s.join(d, up, release, cl.name, relayedRequest(req), hc.idleTimeout)
		return
	}
	if err := connect.Established(d.C); err != nil {
		release()
		up.Close()
		return
	}
	s.join(d, up, release, cl.name, nil, hc.idleTimeout)
}

// hopByHop are the headers of one connection (RFC 9110 7.6.1), which a proxy does not forward.
var hopByHop = []string{"Connection", "Proxy-Connection", "Keep-Alive", "Te", "Trailer", "Transfer-Encoding", "Upgrade"}

// relayedRequest is req as the ingress forwards it to a relay: its request line, Host and
// end-to-end headers (the destination header among them), as Envoy proxies a CONNECT.
func relayedRequest(req *http.Request) []byte {
	var b bytes.Buffer
	fmt.Fprintf(&b, "CONNECT %s HTTP/1.1\r\nHost: %s\r\n", req.RequestURI, req.Host)
	h := req.Header.Clone()
	for _, name := range hopByHop {
		h.Del(name)
	}
	_ = h.Write(&b) // a bytes.Buffer does not fail
	b.WriteString("\r\n")
	return b.Bytes()
}

// readRequest reads one request within the chain's time and size limits.
func readRequest(d *downstream, hc *connectConfig) (*http.Request, *connect.Refusal) {
	return d.ReadRequest(hc.maxHeaderBytes, hc.headersTimeout)
}

// match returns the first route matching req, as Envoy does: CONNECT requests only match
// connect routes, other methods only prefix routes.
func (hc *connectConfig) match(req *http.Request) *connectRoute {
	isConnect := req.Method == http.MethodConnect
	for i := range hc.routes {
		r := &hc.routes[i]
		if r.connect != isConnect {
			continue
		}
		if !r.connect && !strings.HasPrefix(req.URL.Path, r.prefix) {
			continue
		}
		ok := true
		for _, h := range r.headers {
			// A header sent twice matches nothing: which value would route?
			v := req.Header.Values(h.name)
			if len(v) != 1 || !h.regex.MatchString(v[0]) {
				ok = false
				break
			}
		}
		if ok {
			return r
		}
	}
	return nil
}

// respond answers a request the ingress does not proxy (status 0: closes it without an answer),
// counts it and closes the connection.
func (s *server) respond(d *downstream, cluster, outcome string, status int, body string, err error) {
	if err == nil {
		err = errors.New(http.StatusText(status))
	}
	s.refuse(d.Conn, cluster, outcome, err)
	r := connect.Refusal{Outcome: outcome, Status: status, Body: body, Err: err}
	r.Answer(d.C)
}
