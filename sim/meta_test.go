package sim_test

import (
	"bytes"
	"context"
	"testing"

	"github.com/cosi-project/runtime/pkg/safe"
	"github.com/cosi-project/runtime/pkg/state"
	"github.com/siderolabs/talos/pkg/machinery/api/machine"
	"github.com/siderolabs/talos/pkg/machinery/client"
	"github.com/siderolabs/talos/pkg/machinery/constants"
	"github.com/siderolabs/talos/pkg/machinery/meta"
	"github.com/siderolabs/talos/pkg/machinery/resources/runtime"
	"github.com/siderolabs/talos/pkg/machinery/role"
	"google.golang.org/grpc/codes"

	"maesh.dev/ichor/sim"
)

// metaValue reads META key t of m through COSI ("" and false when absent).
func metaValue(t *testing.T, c *client.Client, m *sim.Machine, key uint8) (string, bool) {
	t.Helper()
	r, err := safe.StateGetByID[*runtime.MetaKey](on(m), c.COSI, runtime.MetaKeyTagToID(key))
	if state.IsNotFoundError(err) {
		return "", false
	}
	if err != nil {
		t.Fatalf("read META 0x%02x on %s: %v", key, m.Name(), err)
	}
	return r.TypedSpec().Value, true
}

// TestMeta: MetaWrite and MetaDelete as Talos answers them (roles, the
// uint8 key, the shared size budget, a missing key, container mode), read
// through COSI MetaKeys, and what survives: a reboot and an EPHEMERAL
// reset keep META, a reset of the whole system disk wipes it.
func TestMeta(t *testing.T) {
	spec := fleetSpec(t, 2, 0)
	spec.Machines[1].Platform = "container"
	f := start(t, spec)
	cp, docker := f.Machines()[0], f.Machines()[1]
	c := talos(t, f)
	ctx, cancel := timeout()
	defer cancel()
	at := func(m *sim.Machine) context.Context { return client.WithNode(ctx, m.Address()) }

	if err := c.MetaWrite(at(cp), meta.UserReserved2, []byte(`{"op":"x"}`)); err != nil {
		t.Fatal(err)
	}
	if v, ok := metaValue(t, c, cp, meta.UserReserved2); !ok || v != `{"op":"x"}` {
		t.Fatalf("0x0d = %q, %v", v, ok)
	}
	// A reader reads META but may not write it; os:meta:writer may.
	reader := talos(t, f, role.Reader)
	if v, _ := metaValue(t, reader, cp, meta.UserReserved2); v != `{"op":"x"}` {
		t.Fatalf("reader reads %q", v)
	}
	wantCode(t, reader.MetaWrite(at(cp), meta.UserReserved3, []byte("y")), codes.PermissionDenied, "")
	writer := talos(t, f, role.MetaWriter)
	if err := writer.MetaWrite(at(cp), meta.UserReserved3, []byte("y")); err != nil {
		t.Fatalf("meta writer: %v", err)
	}
	if err := writer.MetaDelete(at(cp), meta.UserReserved3); err != nil {
		t.Fatalf("meta writer delete: %v", err)
	}
	if _, ok := metaValue(t, c, cp, meta.UserReserved3); ok {
		t.Fatal("0x0e still there after MetaDelete")
	}

	_, err := c.MachineClient.MetaWrite(at(cp), &machine.MetaWriteRequest{Key: 256, Value: []byte("x")})
	wantCode(t, err, codes.InvalidArgument, "key must be a uint8")
	wantCode(t, c.MetaDelete(at(cp), meta.UserReserved1), codes.NotFound, "meta key not found")
	// The budget is shared: one key can take it all, then another write
	// that grows the total fails and changes nothing.
	big := bytes.Repeat([]byte("a"), 256<<10-40-20-8-10)
	if err := c.MetaWrite(at(cp), meta.UserReserved1, big); err != nil {
		t.Fatalf("a write that fits: %v", err)
	}
	wantCode(t, c.MetaWrite(at(cp), meta.UserReserved3, []byte("0123456789a")), codes.ResourceExhausted, "meta write failed")
	if _, ok := metaValue(t, c, cp, meta.UserReserved3); ok {
		t.Fatal("an overflowing write was stored")
	}
	if err := c.MetaDelete(at(cp), meta.UserReserved1); err != nil {
		t.Fatal(err)
	}
	wantCode(t, c.MetaWrite(at(docker), meta.UserReserved2, []byte("x")), codes.FailedPrecondition, "not supported in container mode")

	// A reboot and a reset of EPHEMERAL keep META.
	before := cp.BootID()
	if err := c.Reboot(at(cp)); err != nil {
		t.Fatal(err)
	}
	waitRebooted(t, cp, before)
	if _, ok := metaValue(t, c, cp, meta.UserReserved2); !ok {
		t.Fatal("META lost in a reboot")
	}
	reset := func(req *machine.ResetRequest) {
		t.Helper()
		before := cp.BootID()
		if err := c.ResetGeneric(at(cp), req); err != nil {
			t.Fatal(err)
		}
		waitRebooted(t, cp, before)
	}
	reset(&machine.ResetRequest{Reboot: true, SystemPartitionsToWipe: []*machine.ResetPartitionSpec{{Label: constants.EphemeralPartitionLabel, Wipe: true}}})
	if _, ok := metaValue(t, c, cp, meta.UserReserved2); !ok {
		t.Fatal("META lost in a reset of EPHEMERAL")
	}
	reset(&machine.ResetRequest{Reboot: true})
	if v, ok := metaValue(t, c, cp, meta.UserReserved2); ok {
		t.Fatalf("META kept through a reset of the system disk: %q", v)
	}
}
