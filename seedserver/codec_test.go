package seedserver

import (
	"bytes"
	"testing"

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
