package seedserver

import (
	"sync"

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
// tunnel's soft memory limit that garbage kept the collector running (tendril-bench tunnel,
// tendril-grpc, four connections from the shoot: 150 collections and 330 MB allocated a second
// for 79 MB/s moved), and every collection emptied the buffer pools. Here the packet is a few
// bytes of protobuf header and the reader's buffer itself, which gRPC returns to dataChunks once
// written. Everything else, and every packet received, goes through gRPC's protobuf codec.
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

func (c packetCodec) Unmarshal(data mem.BufferSlice, v any) error { return c.proto.Unmarshal(data, v) }

// dataOut is a DATA packet to kube-apiserver: connection id and the bytes read, in a buffer
// from dataChunks. Sending it hands the buffer to gRPC: the sender must not touch it again.
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
	if n == 0 {
		dataChunks.Put(d.buf)
		return mem.BufferSlice{mem.SliceBuffer(hdr)}
	}
	hdr = protowire.AppendTag(hdr, dataDataField, protowire.BytesType)
	hdr = protowire.AppendVarint(hdr, uint64(n))
	return mem.BufferSlice{mem.SliceBuffer(hdr), mem.NewBuffer(d.buf, dataChunks)}
}

// chunkPool is a pool of dataChunk-sized read buffers that gRPC can return buffers to
// (mem.BufferPool). Pooled because allocating and zeroing 128 KiB per dial cost 2.77–3.00
// against 2.37–2.80 CPU ms per dial (tendril-bench tunnel, tendril-grpc, 32 dial workers, 3
// alternating pairs). Bound: one per connection being read, plus those gRPC has not written yet
// (a stream's send quota, 64 KiB, lets at most two wait); what a load leaves goes with the next two
// GCs (internal/idlemem).
type chunkPool struct{ sync.Pool }

var dataChunks = &chunkPool{Pool: sync.Pool{New: func() any {
	b := make([]byte, dataChunk)
	return &b
}}}

// Get returns a buffer of length n (at most dataChunk).
func (p *chunkPool) Get(n int) *[]byte {
	b := p.Pool.Get().(*[]byte)
	*b = (*b)[:n]
	return b
}

// Put takes a buffer back (gRPC calls it once a sent packet is written).
func (p *chunkPool) Put(b *[]byte) {
	*b = (*b)[:cap(*b)]
	p.Pool.Put(b)
}
