package tundev

import (
	"encoding/binary"
	"fmt"
	"net/netip"
	"slices"

	"github.com/google/nftables"
	"github.com/google/nftables/expr"
	"golang.org/x/sys/unix"
)

// rules is the Stack's nftables table, "tendril-<device>" (family inet):
//
//	chain input (filter, input hook):
//	    iifname <dev> ct state established,related accept
//	    iifname <dev> tcp dport @tcp_ports accept
//	    iifname <dev> udp dport @udp_ports accept
//	    iifname <dev> counter drop
//	chain forward (filter, forward hook):
//	    iifname <dev> ip daddr <prefix> accept        (one rule per Config.Forward prefix)
//	    iifname <dev> counter drop
//	chain postrouting (nat, postrouting hook; only with Config.Forward):
//	    iifname <dev> masquerade
//	chain prerouting (nat, prerouting hook; only with Config.Handler):
//	    iifname <dev> meta l4proto tcp ip daddr <prefix> redirect to :<port of the family>
//
// With a Handler, TCP into the prefixes so ends at this end's listener (and is admitted by the
// port rule) and the forward chain passes the rest (UDP, ICMP) on, masqueraded.
//
// A peer (for the server: a shoot's agent, which the shoot's owner controls) so reaches
// nothing in this end's namespace but the ports the Stack listens on, and, at the agent, the
// forwarded prefixes; replies to this end's own connections come back through the first rule.
type rules struct {
	cc                 *nftables.Conn
	table              *nftables.Table
	input, forward     *nftables.Chain
	tcpPorts, udpPorts *nftables.Set
	admitted           map[[2]uint16]bool
}

// installRules installs the table. redirect, if not empty, is the forwarder's listening port
// per family (unix.NFPROTO_IPV4, unix.NFPROTO_IPV6), and admitted.
func installRules(nsFd int, cfg Config, redirect map[int]uint16) (*rules, error) {
	cc, err := nftables.New(nftables.AsLasting(), nftables.WithNetNSFd(nsFd))
	if err != nil {
		return nil, err
	}
	r := &rules{cc: cc, admitted: make(map[[2]uint16]bool)}
	// Add, delete, add, in one batch: a table of the same name that a killed process left (its
	// chains, rules and admitted ports) goes, and the new one starts empty.
	t := &nftables.Table{Name: "tendril-" + cfg.Name, Family: nftables.TableFamilyINet}
	cc.AddTable(t)
	cc.DelTable(t)
	r.table = cc.AddTable(t)
	r.tcpPorts = &nftables.Set{Table: r.table, Name: "tcp_ports", KeyType: nftables.TypeInetService}
	r.udpPorts = &nftables.Set{Table: r.table, Name: "udp_ports", KeyType: nftables.TypeInetService}
	for _, set := range []*nftables.Set{r.tcpPorts, r.udpPorts} {
		if err := cc.AddSet(set, nil); err != nil {
			cc.CloseLasting()
			return nil, err
		}
	}
	accept := policy(nftables.ChainPolicyAccept)
	r.input = cc.AddChain(&nftables.Chain{Name: "input", Table: r.table, Type: nftables.ChainTypeFilter,
		Hooknum: nftables.ChainHookInput, Priority: nftables.ChainPriorityFilter, Policy: accept})
	r.forward = cc.AddChain(&nftables.Chain{Name: "forward", Table: r.table, Type: nftables.ChainTypeFilter,
		Hooknum: nftables.ChainHookForward, Priority: nftables.ChainPriorityFilter, Policy: accept})

	dev := fromDevice(cfg.Name)
	established := binary.NativeEndian.AppendUint32(nil, expr.CtStateBitESTABLISHED|expr.CtStateBitRELATED)
	r.add(r.input, dev, &expr.Ct{Register: 1, Key: expr.CtKeySTATE},
		&expr.Bitwise{SourceRegister: 1, DestRegister: 1, Len: 4, Mask: established, Xor: make([]byte, 4)},
		&expr.Cmp{Op: expr.CmpOpNeq, Register: 1, Data: make([]byte, 4)}, verdict(expr.VerdictAccept))
	for _, p := range []struct {
		proto byte
		set   *nftables.Set
	}{{unix.IPPROTO_TCP, r.tcpPorts}, {unix.IPPROTO_UDP, r.udpPorts}} {
		r.add(r.input, slices.Concat(dev, isProto(p.proto)),
			// The destination port: the transport header's bytes 2–3, in TCP and UDP alike.
			&expr.Payload{DestRegister: 1, Base: expr.PayloadBaseTransportHeader, Offset: 2, Len: 2},
			&expr.Lookup{SourceRegister: 1, SetName: p.set.Name, SetID: p.set.ID}, verdict(expr.VerdictAccept))
	}
	r.add(r.input, dev, &expr.Counter{}, verdict(expr.VerdictDrop))

	for _, p := range cfg.Forward {
		r.add(r.forward, slices.Concat(dev, toPrefix(p)), verdict(expr.VerdictAccept))
	}
	r.add(r.forward, dev, &expr.Counter{}, verdict(expr.VerdictDrop))

	if len(cfg.Forward) > 0 {
		post := cc.AddChain(&nftables.Chain{Name: "postrouting", Table: r.table, Type: nftables.ChainTypeNAT,
			Hooknum: nftables.ChainHookPostrouting, Priority: nftables.ChainPriorityNATSource, Policy: accept})
		r.add(post, dev, &expr.Masq{})
	}
	if len(redirect) > 0 {
		pre := cc.AddChain(&nftables.Chain{Name: "prerouting", Table: r.table, Type: nftables.ChainTypeNAT,
			Hooknum: nftables.ChainHookPrerouting, Priority: nftables.ChainPriorityNATDest, Policy: accept})
		for _, p := range cfg.Forward {
			family := unix.NFPROTO_IPV6
			if p.Addr().Is4() {
				family = unix.NFPROTO_IPV4
			}
			r.add(pre, slices.Concat(dev, isProto(unix.IPPROTO_TCP), toPrefix(p)),
				&expr.Immediate{Register: 1, Data: binary.BigEndian.AppendUint16(nil, redirect[family])},
				&expr.Redir{RegisterProtoMin: 1, RegisterProtoMax: 1, Flags: unix.NF_NAT_RANGE_PROTO_SPECIFIED})
		}
		for _, port := range redirect {
			r.admitted[[2]uint16{unix.IPPROTO_TCP, port}] = true
			if err := cc.SetAddElements(r.tcpPorts, []nftables.SetElement{{Key: binary.BigEndian.AppendUint16(nil, port)}}); err != nil {
				cc.CloseLasting()
				return nil, err
			}
		}
	}
	if err := cc.Flush(); err != nil {
		cc.CloseLasting()
		return nil, err
	}
	return r, nil
}

func (r *rules) add(c *nftables.Chain, match []expr.Any, then ...expr.Any) {
	r.cc.AddRule(&nftables.Rule{Table: r.table, Chain: c, Exprs: append(append([]expr.Any(nil), match...), then...)})
}

// admit lets new connections (datagrams) from the device reach port.
func (r *rules) admit(proto byte, port uint16) error {
	k := [2]uint16{uint16(proto), port}
	if r.admitted[k] {
		return nil
	}
	set := r.tcpPorts
	if proto == unix.IPPROTO_UDP {
		set = r.udpPorts
	}
	if err := r.cc.SetAddElements(set, []nftables.SetElement{{Key: binary.BigEndian.AppendUint16(nil, port)}}); err != nil {
		return err
	}
	if err := r.cc.Flush(); err != nil {
		return err
	}
	r.admitted[k] = true
	return nil
}

// dropped sums the drop rules' counters.
func (r *rules) dropped() uint64 {
	var n uint64
	for _, c := range []*nftables.Chain{r.input, r.forward} {
		rs, err := r.cc.GetRules(r.table, c)
		if err != nil {
			continue
		}
		for _, rule := range rs {
			for _, e := range rule.Exprs {
				if ctr, ok := e.(*expr.Counter); ok {
					n += ctr.Packets
				}
			}
		}
	}
	return n
}

func (r *rules) remove() error {
	r.cc.DelTable(r.table)
	err := r.cc.Flush()
	if cerr := r.cc.CloseLasting(); err == nil {
		err = cerr
	}
	if err != nil {
		return fmt.Errorf("tundev: remove table %s: %w", r.table.Name, err)
	}
	return nil
}

// fromDevice matches packets that came in through the device.
func fromDevice(name string) []expr.Any {
	ifname := make([]byte, unix.IFNAMSIZ)
	copy(ifname, name)
	return []expr.Any{
		&expr.Meta{Key: expr.MetaKeyIIFNAME, Register: 1},
		&expr.Cmp{Op: expr.CmpOpEq, Register: 1, Data: ifname},
	}
}

func isProto(proto byte) []expr.Any {
	return []expr.Any{
		&expr.Meta{Key: expr.MetaKeyL4PROTO, Register: 1},
		&expr.Cmp{Op: expr.CmpOpEq, Register: 1, Data: []byte{proto}},
	}
}

// toPrefix matches packets of p's family whose destination is inside p.
func toPrefix(p netip.Prefix) []expr.Any {
	p = p.Masked()
	// The destination address: bytes 16–19 of an IPv4 header, 24–39 of an IPv6 one.
	family, offset := byte(unix.NFPROTO_IPV4), uint32(16)
	if p.Addr().Is6() {
		family, offset = unix.NFPROTO_IPV6, 24
	}
	size := uint32(p.Addr().BitLen() / 8)
	mask := ipNet(p).Mask
	return []expr.Any{
		&expr.Meta{Key: expr.MetaKeyNFPROTO, Register: 1},
		&expr.Cmp{Op: expr.CmpOpEq, Register: 1, Data: []byte{family}},
		&expr.Payload{DestRegister: 1, Base: expr.PayloadBaseNetworkHeader, Offset: offset, Len: size},
		&expr.Bitwise{SourceRegister: 1, DestRegister: 1, Len: size, Mask: mask, Xor: make([]byte, size)},
		&expr.Cmp{Op: expr.CmpOpEq, Register: 1, Data: p.Addr().AsSlice()},
	}
}

func verdict(k expr.VerdictKind) *expr.Verdict { return &expr.Verdict{Kind: k} }

func policy(p nftables.ChainPolicy) *nftables.ChainPolicy { return &p }
