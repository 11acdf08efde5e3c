package sim

import (
	"context"

	"github.com/siderolabs/talos/pkg/machinery/api/machine"
	"github.com/siderolabs/talos/pkg/machinery/resources/runtime"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
)

// metaDataLength is what one copy of Talos's ADV (the META partition's
// format) holds for its tags: 256 KiB less the header and the checksum
// (internal/pkg/meta/internal/adv/talos: DataLength = Length - 40).
const metaDataLength = 256<<10 - 40

// metaPartition is a machine's META partition: the key-values Talos keeps
// outside every other partition, so they survive reboots, upgrades and
// resets that wipe only EPHEMERAL or STATE; only a wipe of the whole system
// disk (or of META itself) loses them.
type metaPartition struct {
	tags map[uint8][]byte
}

// set is the ADV's SetTagBytes, with its size rule as Talos has it: the
// tags' values and an 8-byte header each (the new value counted without
// its own header) must fit in DataLength.
func (p *metaPartition) set(t uint8, val []byte) bool {
	size := 20 // magic + checksum
	for _, v := range p.tags {
		size += len(v) + 8
	}
	size += len(val) - len(p.tags[t])
	if size > metaDataLength {
		return false
	}
	if p.tags == nil {
		p.tags = map[uint8][]byte{}
	}
	p.tags[t] = append([]byte(nil), val...)
	return true
}

func (p *metaPartition) delete(t uint8) bool {
	_, ok := p.tags[t]
	delete(p.tags, t)
	return ok
}

// metaSupported is Talos's checkSupported(runtime.MetaKV): Talos in a
// container has no META.
func metaSupported(m *Machine) error {
	if m.spec.Platform == "container" {
		return status.Error(codes.FailedPrecondition, "method is not supported in container mode")
	}
	return nil
}

// metaKey is Talos's check that a key fits in the ADV's uint8 tag.
func metaKey(key uint32) (uint8, error) {
	if uint32(uint8(key)) != key {
		return 0, status.Errorf(codes.InvalidArgument, "key must be a uint8")
	}
	return uint8(key), nil
}

// metaCall is what MetaWrite and MetaDelete check first, in Talos's order:
// the machine keeps META at all, then the key fits its tag.
func metaCall(ctx context.Context, key uint32) (*Machine, uint8, error) {
	m := callee(ctx)
	if err := metaSupported(m); err != nil {
		return nil, 0, err
	}
	t, err := metaKey(key)
	return m, t, err
}

// MetaWrite stores a META key, durable once it answers (Talos flushes both
// ADV copies and fsyncs), and mirrors it as the COSI MetaKey resource.
func (s *machined) MetaWrite(ctx context.Context, in *machine.MetaWriteRequest) (*machine.MetaWriteResponse, error) {
	m, t, err := metaCall(ctx, in.Key)
	if err != nil {
		return nil, err
	}
	m.mu.Lock()
	ok := m.meta.set(t, in.Value)
	m.mu.Unlock()
	if !ok {
		return nil, status.Errorf(codes.ResourceExhausted, "meta write failed")
	}
	r := runtime.NewMetaKey(runtime.NamespaceName, runtime.MetaKeyTagToID(t))
	r.TypedSpec().Value = string(in.Value)
	m.put(r)
	return &machine.MetaWriteResponse{Messages: []*machine.MetaWrite{{}}}, nil
}

// MetaDelete removes a META key; a key that is not there is NotFound.
func (s *machined) MetaDelete(ctx context.Context, in *machine.MetaDeleteRequest) (*machine.MetaDeleteResponse, error) {
	m, t, err := metaCall(ctx, in.Key)
	if err != nil {
		return nil, err
	}
	m.mu.Lock()
	ok := m.meta.delete(t)
	m.mu.Unlock()
	m.destroy(runtime.NewMetaKey(runtime.NamespaceName, runtime.MetaKeyTagToID(t)).Metadata())
	if !ok {
		return nil, status.Errorf(codes.NotFound, "meta key not found")
	}
	return &machine.MetaDeleteResponse{Messages: []*machine.MetaDelete{{}}}, nil
}

// wipeMeta is a reset that wipes META (the whole system disk, or META by
// label): every key and its resource go.
func (m *Machine) wipeMeta() {
	m.mu.Lock()
	tags := m.meta.tags
	m.meta.tags = nil
	m.mu.Unlock()
	for t := range tags {
		m.destroy(runtime.NewMetaKey(runtime.NamespaceName, runtime.MetaKeyTagToID(t)).Metadata())
	}
}
