package seedserver

import (
	"sync"
	"sync/atomic"

	"google.golang.org/grpc/encoding"
	_ "google.golang.org/grpc/encoding/proto" // registers the "proto" codec packetCodec falls back to
	"google.golang.org/grpc/mem"
	"google.golang.org/protobuf/encoding/protowire"
	"sigs.k8s.io/apiserver-network-proxy/konnectivity-client/proto/client"
)

// packetCodec is the gRPC front-end's codec: konnectivity's protobuf packets, where a DATA
// packet from the shoot (a dataOut) is encoded around the buffer its bytes were read into.
// Through gRPC's protobuf codec each such packet cost two copies and two allocations of its
// size: the Data field copied out of the reader's buffer (gRPC may keep a message until it is
// written), and the marshalled packet in a buffer from gRPC's pool, zeroed first. Under the
// tunnel's soft memory limit that garbage kept the collector running, and every collection
// emptied the buffer pools (docs/performance.md, "Several bulk connections: the collector under
// the soft limit"). Here the packet is a few bytes of protobuf header and the reader's buffer
// itself, which gRPC returns to dataChunks once written. DATA packets received are taken apart
// here too (Unmarshal); every other packet goes through gRPC's protobuf codec.
type packetCodec struct{ proto encoding.CodecV2 }

func newPacketCodec() packetCodec { return packetCodec{proto: encoding.GetCodecV2("proto")} }

// Name is the protobuf codec's, so the content-type both ends see stays application/grpc+proto.
func (packetCodec) Name() string { return "proto" }

func (c packetCodec) Marshal(v any) (mem.BufferSlice, error) {
	if d, ok := v.(*dataOut); ok {
		return d.encode(), nil
	}
	return c.proto.Marshal(v)
}

// Unmarshal decodes a packet from kube-apiserver into a packetIn: a DATA packet laid out as
// proto.Marshal writes it (konnectivity-client's) has its bytes copied once, into a buffer from
// dataChunks; anything else is decoded by gRPC's protobuf codec. Through that codec alone each
// DATA packet is copied twice and allocated twice (gRPC's received frames joined into one
// buffer, then the Data field copied out of it): several bytes allocated for every byte moved
// (docs/performance.md, "Several bulk connections: the collector under the soft limit").
func (c packetCodec) Unmarshal(data mem.BufferSlice, v any) error {
	in, ok := v.(*packetIn)
	if !ok {
		return c.proto.Unmarshal(data, v)
	}
	if id, at, ok := dataLayout(data); ok {
		in.id, in.buf = id, dataChunks.Get(data.Len()-at)
		copyFrom(*in.buf, data, at)
		return nil
	}
	in.pkt = new(client.Packet)
	return c.proto.Unmarshal(data, in.pkt)
}

// packetIn is a packet from kube-apiserver: a DATA packet's connection id and bytes (buf, from
// dataChunks: the receiver puts it back), or any other packet (pkt).
type packetIn struct {
	id  int64
	buf *[]byte
	pkt *client.Packet
}

// dataHeaderMax is the longest header dataLayout reads: type (2 bytes), the Data field's tag
// and length (1 + 5), the connection id's (1 + 10) and the bytes' tag and length (1 + 5).
const dataHeaderMax = 2 + 6 + 11 + 6

// dataLayout reports whether a received packet is Packet{Type: DATA, Data: {ConnectID, Data}}
// in proto.Marshal's layout with its bytes last and at most dataChunk of them, and where they
// start. Other packets, and DATA with an error or in another field order, are not.
func dataLayout(data mem.BufferSlice) (id int64, at int, ok bool) {
	var hdr [dataHeaderMax]byte
	total := data.Len()
	prefix := hdr[:copyFrom(hdr[:], data, 0)]
	b := prefix
	field := func(num protowire.Number, typ protowire.Type) bool {
		n, t, l := protowire.ConsumeTag(b)
		if l < 0 || n != num || t != typ {
			return false
		}
		b = b[l:]
		return true
	}
	varint := func() (uint64, bool) {
		v, l := protowire.ConsumeVarint(b)
		if l < 0 {
			return 0, false
		}
		b = b[l:]
		return v, true
	}
	// rest is how many bytes of the packet follow what has been consumed.
	rest := func() uint64 { return uint64(total - (len(prefix) - len(b))) }
	if !field(packetTypeField, protowire.VarintType) {
		return 0, 0, false
	}
	if typ, ok := varint(); !ok || typ != uint64(client.PacketType_DATA) || !field(packetDataField, protowire.BytesType) {
		return 0, 0, false
	}
	if inner, ok := varint(); !ok || inner != rest() {
		return 0, 0, false // the Data field is not last
	}
	if field(dataIDField, protowire.VarintType) {
		v, ok := varint()
		if !ok {
			return 0, 0, false
		}
		id = int64(v)
	}
	if !field(dataDataField, protowire.BytesType) {
		return 0, 0, false
	}
	if n, ok := varint(); !ok || n != rest() || n > dataChunk {
		return 0, 0, false
	}
	return id, len(prefix) - len(b), true
}

// copyFrom copies data's bytes from offset skip on into dst, and returns how many it copied.
func copyFrom(dst []byte, data mem.BufferSlice, skip int) int {
	n := 0
	for _, buf := range data {
		d := buf.ReadOnlyData()
		if skip >= len(d) {
			skip -= len(d)
			continue
		}
		n += copy(dst[n:], d[skip:])
		skip = 0
		if n == len(dst) {
			break
		}
	}
	return n
}

// dataOut is a DATA packet to kube-apiserver: connection id and the bytes read (never none),
// in a buffer from dataChunks. Sending it hands the buffer to gRPC: the sender must not touch it again.
type dataOut struct {
	id  int64
	buf *[]byte
}

// Field numbers of konnectivity's Packet and Data messages (konnectivity-client/proto/client).
const (
	packetTypeField = 1
	packetDataField = 4
	dataIDField     = 1
	dataDataField   = 3
)

// encode is the protobuf encoding of Packet{Type: DATA, Data: {ConnectID: id, Data: buf}}, as
// proto.Marshal writes it (fields in number order, zero values left out): the header, then
// the buffer, not copied.
func (d *dataOut) encode() mem.BufferSlice {
	n := len(*d.buf)
	inner := protowire.SizeTag(dataIDField) + protowire.SizeVarint(uint64(d.id)) +
		protowire.SizeTag(dataDataField) + protowire.SizeBytes(n)
	// At most 2 + 1 + 3 (the Data message's length) + 1 + 10 + 1 + 3 = 21 bytes.
	hdr := make([]byte, 0, 24)
	hdr = protowire.AppendTag(hdr, packetTypeField, protowire.VarintType)
	hdr = protowire.AppendVarint(hdr, uint64(client.PacketType_DATA))
	hdr = protowire.AppendTag(hdr, packetDataField, protowire.BytesType)
	hdr = protowire.AppendVarint(hdr, uint64(inner))
	if d.id != 0 {
		hdr = protowire.AppendTag(hdr, dataIDField, protowire.VarintType)
		hdr = protowire.AppendVarint(hdr, uint64(d.id))
	}
	hdr = protowire.AppendTag(hdr, dataDataField, protowire.BytesType)
	hdr = protowire.AppendVarint(hdr, uint64(n))
	return mem.BufferSlice{mem.SliceBuffer(hdr), mem.NewBuffer(d.buf, dataChunks)}
}

// chunkPool is a pool of dataChunk-sized read buffers that gRPC can return buffers to
// (mem.BufferPool). Pooled because allocating and zeroing 128 KiB per dial is a measurable part
// of a dial's CPU (docs/performance.md, "Reversed tunnel", what changed on 2026-11-23). Bound:
// one per connection whose bytes are being read (an idle one waits without: pipe.WaitReadable),
// plus those gRPC has not written yet (a stream's send quota, 64 KiB, lets at most two wait);
// what a load leaves goes with the next two GCs (internal/host/idlemem).
type chunkPool struct {
	sync.Pool
	held atomic.Int64 // taken and not put back: tendril_server_grpc_buffers
}

var dataChunks = &chunkPool{Pool: sync.Pool{New: func() any {
	b := make([]byte, dataChunk)
	return &b
}}}

// Get returns a buffer of length n (at most dataChunk).
func (p *chunkPool) Get(n int) *[]byte {
	b := p.Pool.Get().(*[]byte)
	*b = (*b)[:n]
	p.held.Add(1)
	return b
}

// Put takes a buffer back (gRPC calls it once a sent packet is written).
func (p *chunkPool) Put(b *[]byte) {
	*b = (*b)[:cap(*b)]
	p.held.Add(-1)
	p.Pool.Put(b)
}
