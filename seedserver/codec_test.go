package seedserver

import (
	"bytes"
	"testing"

	"google.golang.org/grpc/mem"
	"google.golang.org/protobuf/encoding/protowire"
	"google.golang.org/protobuf/proto"
	"sigs.k8s.io/apiserver-network-proxy/konnectivity-client/proto/client"
)

// TestDataOutEncodesAsProto: a DATA packet encoded around its buffer is byte for byte what
// proto.Marshal writes for the same packet, and decodes to it; the buffer goes back to the
// pool once gRPC frees what it sent.
func TestDataOutEncodesAsProto(t *testing.T) {
	for _, id := range []int64{1, 127, 128, 300, 1 << 40} {
		for _, n := range []int{1, 127, 128, 200, 16383, 16384, dataChunk} {
			data := bytes.Repeat([]byte{byte(n), byte(id)}, n)[:n]
			buf := dataChunks.Get(n)
			copy(*buf, data)
			enc := (&dataOut{id: id, buf: buf}).encode()
			got := enc.Materialize()
			want, err := proto.Marshal(&client.Packet{Type: client.PacketType_DATA, Payload: &client.Packet_Data{
				Data: &client.Data{ConnectID: id, Data: data}}})
			if err != nil {
				t.Fatal(err)
			}
			if !bytes.Equal(got, want) {
				t.Fatalf("id %d, %d bytes: encoded %x…, proto.Marshal %x…", id, n, got[:min(len(got), 24)], want[:min(len(want), 24)])
			}
			var pkt client.Packet
			if err := proto.Unmarshal(got, &pkt); err != nil || pkt.GetData().GetConnectID() != id || !bytes.Equal(pkt.GetData().GetData(), data) {
				t.Fatalf("id %d, %d bytes: decodes to %v (%v)", id, n, pkt.GetData().GetConnectID(), err)
			}
			enc.Free()
			if len(*buf) != dataChunk {
				t.Fatalf("id %d, %d bytes: the buffer was not put back after Free (length %d)", id, n, len(*buf))
			}
		}
	}
}

// split cuts b into a BufferSlice of pieces of at most size bytes, as gRPC hands over a
// message that came in several HTTP/2 frames.
func split(b []byte, size int) mem.BufferSlice {
	var bs mem.BufferSlice
	for len(b) > size {
		bs = append(bs, mem.SliceBuffer(b[:size]))
		b = b[size:]
	}
	return append(bs, mem.SliceBuffer(b))
}

// checkUnmarshal decodes b (in pieces of size) with packetCodec and compares the result with
// proto.Unmarshal's: a DATA packet must come back as id and bytes or as the same packet.
func checkUnmarshal(t *testing.T, b []byte, size int) (taken bool) {
	t.Helper()
	var want client.Packet
	werr := proto.Unmarshal(b, &want)
	var in packetIn
	err := newPacketCodec().Unmarshal(split(b, size), &in)
	if (err != nil) != (werr != nil) {
		t.Fatalf("%x in pieces of %d: error %v, proto.Unmarshal's %v", b, size, err, werr)
	}
	if err != nil {
		return false
	}
	if in.buf != nil {
		defer dataChunks.Put(in.buf)
		if want.GetType() != client.PacketType_DATA || want.GetData().GetConnectID() != in.id ||
			!bytes.Equal(want.GetData().GetData(), *in.buf) || want.GetData().GetError() != "" {
			t.Fatalf("%x in pieces of %d: taken as DATA %d with %d bytes, proto.Unmarshal says %v", b[:min(len(b), 32)], size, in.id, len(*in.buf), &want)
		}
		return true
	}
	if !proto.Equal(in.pkt, &want) {
		t.Fatalf("%x in pieces of %d: decoded %v, proto.Unmarshal %v", b, size, in.pkt, &want)
	}
	return false
}

// TestPacketInDecodesAsProto: DATA packets as konnectivity-client sends them are taken apart
// by packetCodec, split into frames anywhere; anything else (other packets, DATA with an
// error, with more than dataChunk bytes, or with its fields in another order) decodes as
// proto.Unmarshal decodes it.
func TestPacketInDecodesAsProto(t *testing.T) {
	marshal := func(p *client.Packet) []byte {
		b, err := proto.Marshal(p)
		if err != nil {
			t.Fatal(err)
		}
		return b
	}
	data := func(id int64, n int, errText string) []byte {
		return marshal(&client.Packet{Type: client.PacketType_DATA, Payload: &client.Packet_Data{
			Data: &client.Data{ConnectID: id, Data: bytes.Repeat([]byte{7}, n), Error: errText}}})
	}
	for _, id := range []int64{0, 1, 300, 1 << 40} {
		for _, n := range []int{1, 127, 128, 16384, dataChunk} {
			for _, size := range []int{1, 3, 16384, 1 << 20} {
				if !checkUnmarshal(t, data(id, n, ""), size) {
					t.Errorf("DATA id %d, %d bytes, pieces of %d: not taken apart", id, n, size)
				}
			}
		}
	}
	// Field order reversed (bytes before the id), and a packet type after the payload.
	reordered := protowire.AppendTag(nil, packetTypeField, protowire.VarintType)
	reordered = protowire.AppendVarint(reordered, uint64(client.PacketType_DATA))
	inner := protowire.AppendTag(nil, dataDataField, protowire.BytesType)
	inner = protowire.AppendBytes(inner, []byte("hello"))
	inner = protowire.AppendTag(inner, dataIDField, protowire.VarintType)
	inner = protowire.AppendVarint(inner, 9)
	reordered = protowire.AppendTag(reordered, packetDataField, protowire.BytesType)
	reordered = protowire.AppendBytes(reordered, inner)
	typeLast := append(protowire.AppendBytes(protowire.AppendTag(nil, packetDataField, protowire.BytesType), inner),
		reordered[:2]...)
	others := [][]byte{
		data(3, 10, "broken"),
		data(3, dataChunk+1, ""),
		reordered,
		typeLast,
		marshal(&client.Packet{Type: client.PacketType_DIAL_REQ, Payload: &client.Packet_DialRequest{
			DialRequest: &client.DialRequest{Protocol: "tcp", Address: "10.0.0.1:443", Random: 42}}}),
		marshal(&client.Packet{Type: client.PacketType_CLOSE_REQ, Payload: &client.Packet_CloseRequest{
			CloseRequest: &client.CloseRequest{ConnectID: 5}}}),
		{0xff},
		data(3, 10, "")[:12],
	}
	for i, b := range others {
		for _, size := range []int{1, 7, 1 << 20} {
			if checkUnmarshal(t, b, size) {
				t.Errorf("packet %d, pieces of %d: taken apart as DATA", i, size)
			}
		}
	}
}

// FuzzPacketIn: packetCodec decodes any bytes, in any two pieces, as proto.Unmarshal does.
func FuzzPacketIn(f *testing.F) {
	f.Add([]byte{0x08, 0x04, 0x22, 0x05, 0x08, 0x01, 0x1a, 0x01, 0x41}, 3)
	f.Add([]byte{0x08, 0x00, 0x12, 0x02, 0x0a, 0x00}, 1)
	f.Fuzz(func(t *testing.T, b []byte, size int) {
		if size <= 0 {
			size = 1
		}
		checkUnmarshal(t, b, size)
	})
}
