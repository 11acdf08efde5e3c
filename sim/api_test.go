package sim_test

import (
	"bytes"
	"context"
	"errors"
	"io"
	"sort"
	"strings"
	"testing"

	"github.com/cosi-project/runtime/pkg/resource"
	"github.com/cosi-project/runtime/pkg/safe"
	"github.com/cosi-project/runtime/pkg/state"
	"github.com/hashicorp/go-multierror"
	"github.com/siderolabs/talos/pkg/machinery/api/common"
	"github.com/siderolabs/talos/pkg/machinery/api/machine"
	"github.com/siderolabs/talos/pkg/machinery/client"
	configres "github.com/siderolabs/talos/pkg/machinery/resources/config"
	"github.com/siderolabs/talos/pkg/machinery/resources/runtime"
	"github.com/siderolabs/talos/pkg/machinery/resources/v1alpha1"
	"github.com/siderolabs/talos/pkg/machinery/role"
	"google.golang.org/grpc/codes"
)

// TestRouting: a call goes to the machine its node metadata names (by
// address or hostname), to the endpoint's own machine without metadata,
// and to every named machine with nodes, as apid routes.
func TestRouting(t *testing.T) {
	f := start(t, fleetSpec(t, 3, 2))
	c := talos(t, f)
	ctx, cancel := timeout()
	defer cancel()

	for _, m := range f.Machines() {
		if v, err := version(t, c, m); err != nil || v != "v1.12.4" {
			t.Fatalf("%s: Version = %q, %v", m.Name(), v, err)
		}
	}
	w := f.Machine(f.Machines()[3].Name())
	if _, err := c.Version(client.WithNode(ctx, w.Name())); err != nil {
		t.Fatalf("node metadata by hostname: %v", err)
	}
	if got := f.Recorder().Calls(w.Name(), "Version"); got != 2 {
		t.Fatalf("%s served %d Version calls, want 2", w.Name(), got)
	}

	// No metadata: the endpoint's own machine answers.
	cp2 := f.ControlPlanes()[1]
	one, err := client.New(ctx, client.WithConfig(f.Talosconfig()), client.WithEndpoints(cp2.Endpoint()))
	if err != nil {
		t.Fatal(err)
	}
	defer one.Close()
	before := f.Recorder().Calls(cp2.Name(), "Version")
	if _, err := one.Version(ctx); err != nil {
		t.Fatal(err)
	}
	if got := f.Recorder().Calls(cp2.Name(), "Version"); got != before+1 {
		t.Fatalf("call without node metadata went elsewhere: %s served %d, want %d", cp2.Name(), got, before+1)
	}

	// Fan-out: one message per node, each with its hostname.
	var addrs []string
	for _, m := range f.Machines() {
		addrs = append(addrs, m.Address())
	}
	resp, err := c.Version(client.WithNodes(ctx, addrs...))
	if err != nil {
		t.Fatal(err)
	}
	var hosts []string
	for _, msg := range resp.Messages {
		hosts = append(hosts, msg.Metadata.Hostname)
	}
	sort.Strings(hosts)
	sort.Strings(addrs)
	if strings.Join(hosts, ",") != strings.Join(addrs, ",") {
		t.Fatalf("fan-out hostnames %v, want %v", hosts, addrs)
	}

	// A node nobody has: Unavailable, alone or as one NodeError of many.
	_, err = c.Version(client.WithNode(ctx, "127.0.0.99"))
	wantCode(t, err, codes.Unavailable, "no such host")
	resp, err = c.Version(client.WithNodes(ctx, w.Address(), "127.0.0.99"))
	var nodeErr *client.NodeError
	if !errors.As(err, &nodeErr) || nodeErr.Node != "127.0.0.99" || len(resp.Messages) != 1 {
		t.Fatalf("want one message and a NodeError for 127.0.0.99, got %v, %v", resp, err)
	}
	var merr *multierror.Error
	if !errors.As(err, &merr) || len(merr.Errors) != 1 {
		t.Fatalf("want a multierror of one node error, got %v", err)
	}

	// Fan-out is for MachineService (and the other apid fan-out services) only.
	_, err = safe.StateGetByID[*runtime.MachineStatus](client.WithNodes(ctx, addrs...), c.COSI, runtime.MachineStatusID)
	wantCode(t, err, codes.InvalidArgument, "one-2-many proxying is not supported")
}

// TestRoles: each method accepts the roles TALOS_API.md lists and denies
// the rest with PermissionDenied. A fault on every method stands in for the
// handler, so an authorised call ends in Aborted without side effects.
func TestRoles(t *testing.T) {
	spec := fleetSpec(t, 1, 0)
	spec.Machines[0].Talos = "v1.13.0"
	f := start(t, spec)
	cp := f.ControlPlanes()[0]
	if _, err := cp.InjectString("error:*:Aborted"); err != nil {
		t.Fatal(err)
	}
	ci := &common.ContainerdInstance{Driver: common.ContainerDriver_CRI, Namespace: common.ContainerdNamespace_NS_SYSTEM}
	drain := func(rc io.ReadCloser, err error) error {
		if err != nil {
			return err
		}
		defer rc.Close()
		_, err = io.ReadAll(rc)
		return err
	}
	calls := map[string]struct {
		allowed []role.Role
		call    func(context.Context, *client.Client) error
	}{
		"Version": {[]role.Role{role.Admin, role.Operator, role.Reader}, func(ctx context.Context, c *client.Client) error {
			_, err := c.Version(ctx)
			return err
		}},
		"Read": {[]role.Role{role.Admin}, func(ctx context.Context, c *client.Client) error {
			return drain(c.Read(ctx, "/proc/sys/kernel/random/boot_id"))
		}},
		"Events": {[]role.Role{role.Admin, role.Operator, role.Reader}, func(ctx context.Context, c *client.Client) error {
			return c.EventsWatchV2(ctx, make(chan client.EventResult, 10))
		}},
		"Reboot": {[]role.Role{role.Admin, role.Operator}, func(ctx context.Context, c *client.Client) error {
			return c.Reboot(ctx)
		}},
		"Shutdown": {[]role.Role{role.Admin, role.Operator}, func(ctx context.Context, c *client.Client) error {
			return c.Shutdown(ctx)
		}},
		"Reset": {[]role.Role{role.Admin}, func(ctx context.Context, c *client.Client) error {
			return c.ResetGeneric(ctx, &machine.ResetRequest{Graceful: true})
		}},
		"Upgrade": {[]role.Role{role.Admin}, func(ctx context.Context, c *client.Client) error {
			_, err := c.UpgradeWithOptions(ctx, client.WithUpgradeImage("ghcr.io/siderolabs/installer:v1.13.1"))
			return err
		}},
		"ServiceRestart": {[]role.Role{role.Admin, role.Operator}, func(ctx context.Context, c *client.Client) error {
			_, err := c.ServiceRestart(ctx, "kubelet")
			return err
		}},
		"EtcdDefragment": {[]role.Role{role.Admin, role.Operator}, func(ctx context.Context, c *client.Client) error {
			_, err := c.EtcdDefragment(ctx)
			return err
		}},
		"EtcdForfeitLeadership": {[]role.Role{role.Admin}, func(ctx context.Context, c *client.Client) error {
			_, err := c.EtcdForfeitLeadership(ctx, &machine.EtcdForfeitLeadershipRequest{})
			return err
		}},
		"EtcdLeaveCluster": {[]role.Role{role.Admin}, func(ctx context.Context, c *client.Client) error {
			return c.EtcdLeaveCluster(ctx, &machine.EtcdLeaveClusterRequest{})
		}},
		"EtcdRemoveMemberByID": {[]role.Role{role.Admin}, func(ctx context.Context, c *client.Client) error {
			return c.EtcdRemoveMemberByID(ctx, &machine.EtcdRemoveMemberByIDRequest{MemberId: 1})
		}},
		"EtcdStatus": {[]role.Role{role.Admin, role.Operator, role.Reader, role.EtcdBackup}, func(ctx context.Context, c *client.Client) error {
			_, err := c.EtcdStatus(ctx)
			return err
		}},
		"EtcdMemberList": {[]role.Role{role.Admin, role.Operator, role.Reader, role.EtcdBackup}, func(ctx context.Context, c *client.Client) error {
			_, err := c.EtcdMemberList(ctx, &machine.EtcdMemberListRequest{})
			return err
		}},
		"EtcdAlarmList": {[]role.Role{role.Admin, role.Operator, role.Reader, role.EtcdBackup}, func(ctx context.Context, c *client.Client) error {
			_, err := c.EtcdAlarmList(ctx)
			return err
		}},
		"EtcdSnapshot": {[]role.Role{role.Admin, role.Operator, role.EtcdBackup}, func(ctx context.Context, c *client.Client) error {
			return drain(c.EtcdSnapshot(ctx, &machine.EtcdSnapshotRequest{}))
		}},
		"EtcdRecover": {[]role.Role{role.Admin}, func(ctx context.Context, c *client.Client) error {
			_, err := c.EtcdRecover(ctx, bytes.NewReader([]byte("x")))
			return err
		}},
		"Bootstrap": {[]role.Role{role.Admin}, func(ctx context.Context, c *client.Client) error {
			return c.Bootstrap(ctx, &machine.BootstrapRequest{})
		}},
		"ImageService/Pull": {[]role.Role{role.Admin, role.Operator}, func(ctx context.Context, c *client.Client) error {
			s, err := c.ImageClient.Pull(ctx, &machine.ImageServicePullRequest{Containerd: ci, ImageRef: "ghcr.io/siderolabs/installer:v1.13.1"})
			if err != nil {
				return err
			}
			_, err = s.Recv()
			return err
		}},
		"LifecycleService/Upgrade": {[]role.Role{role.Admin}, func(ctx context.Context, c *client.Client) error {
			s, err := c.LifecycleClient.Upgrade(ctx, &machine.LifecycleServiceUpgradeRequest{Containerd: ci, Source: &machine.InstallArtifactsSource{ImageName: "x:v1.13.1"}})
			if err != nil {
				return err
			}
			_, err = s.Recv()
			return err
		}},
		"COSI Get": {[]role.Role{role.Admin, role.Operator, role.Reader}, func(ctx context.Context, c *client.Client) error {
			_, err := safe.StateGetByID[*runtime.MachineStatus](ctx, c.COSI, runtime.MachineStatusID)
			return err
		}},
	}
	roles := []role.Role{role.Admin, role.Operator, role.Reader, role.EtcdBackup, ""}
	clients := map[role.Role]*client.Client{}
	for _, r := range roles {
		if r == "" {
			clients[r] = talos(t, f, role.ImageVerifier) // a role no method above accepts
		} else {
			clients[r] = talos(t, f, r)
		}
	}
	for name, tc := range calls {
		for _, r := range roles {
			allowed := false
			for _, a := range tc.allowed {
				allowed = allowed || a == r
			}
			ctx, cancel := timeout()
			err := tc.call(client.WithNode(ctx, cp.Address()), clients[r])
			cancel()
			want := codes.PermissionDenied
			if allowed {
				want = codes.Aborted
			}
			if got := client.StatusCode(err); got != want {
				t.Errorf("%s as %q: got %v, want %s", name, r, err, want)
			}
		}
	}
}

// TestReadVersionCOSI: the boot ID file, the version and the COSI resources
// Ichor reads, and the COSI refusals.
func TestReadVersionCOSI(t *testing.T) {
	spec := fleetSpec(t, 1, 1)
	spec.Machines[1].SecureBoot = true
	spec.Machines[1].Platform = "aws"
	spec.Machines[1].Schematic = "abc123"
	spec.Machines[1].ExtensionServices = []string{"ext-iscsid"}
	f := start(t, spec)
	c := talos(t, f)
	w := f.Machines()[1]
	ctx, cancel := timeout()
	defer cancel()
	nctx := client.WithNode(ctx, w.Address())

	rc, err := c.Read(nctx, "/proc/sys/kernel/random/boot_id")
	if err != nil {
		t.Fatal(err)
	}
	b, err := io.ReadAll(rc)
	if err != nil || strings.TrimSpace(string(b)) != w.BootID() {
		t.Fatalf("boot_id = %q, %v; want %q", b, err, w.BootID())
	}
	_, err = io.ReadAll(must(c.Read(nctx, "/etc/shadow")))
	wantCode(t, err, codes.NotFound, "no such file")

	v, err := c.Version(nctx)
	if err != nil {
		t.Fatal(err)
	}
	if got := v.Messages[0]; got.Version.Tag != "v1.12.4" || got.Platform.Name != "aws" || !got.Features.Rbac {
		t.Fatalf("Version = %v", got)
	}

	exts, err := safe.StateListAll[*runtime.ExtensionStatus](nctx, c.COSI)
	if err != nil {
		t.Fatal(err)
	}
	found := false
	for e := range exts.All() {
		found = found || e.TypedSpec().Metadata.Name == "schematic" && e.TypedSpec().Metadata.Version == "abc123"
	}
	if !found {
		t.Fatal("no schematic extension with the schematic ID")
	}
	sec, err := safe.StateGetByID[*runtime.SecurityState](nctx, c.COSI, runtime.SecurityStateID)
	if err != nil || !sec.TypedSpec().SecureBoot {
		t.Fatalf("SecurityState = %v, %v", sec, err)
	}
	ms, err := safe.StateGetByID[*runtime.MachineStatus](nctx, c.COSI, runtime.MachineStatusID)
	if err != nil || ms.TypedSpec().Stage != runtime.MachineStageRunning || !ms.TypedSpec().Status.Ready {
		t.Fatalf("MachineStatus = %v, %v", ms, err)
	}
	for _, id := range []string{"kubelet", "ext-iscsid"} {
		svc, err := safe.StateGetByID[*v1alpha1.Service](nctx, c.COSI, id)
		if err != nil || !svc.TypedSpec().Running || !svc.TypedSpec().Healthy {
			t.Fatalf("Service %s = %v, %v", id, svc, err)
		}
	}
	cp := f.ControlPlanes()[0]
	etcd, err := safe.StateGetByID[*v1alpha1.Service](client.WithNode(ctx, cp.Address()), c.COSI, "etcd")
	if err != nil || !etcd.TypedSpec().Running {
		t.Fatalf("etcd Service on %s = %v, %v", cp.Name(), etcd, err)
	}
	if _, err := safe.StateGetByID[*v1alpha1.Service](nctx, c.COSI, "etcd"); !state.IsNotFoundError(err) {
		t.Fatalf("a worker has no etcd service, got %v", err)
	}
	mc, err := safe.StateGetByID[*configres.MachineConfig](nctx, c.COSI, configres.ActiveID)
	if err != nil {
		t.Fatal(err)
	}
	if img := mc.Config().Machine().Install().Image(); img != "factory.talos.dev/aws-installer-secureboot/abc123:v1.12.4" {
		t.Fatalf("install image %q", img)
	}

	// MachineConfig is sensitive: a reader may not read it.
	reader := talos(t, f, role.Reader)
	_, err = safe.StateGetByID[*configres.MachineConfig](client.WithNode(ctx, w.Address()), reader.COSI, configres.ActiveID)
	wantText(t, err, "code = PermissionDenied")
	if _, err := safe.StateGetByID[*runtime.MachineStatus](client.WithNode(ctx, w.Address()), reader.COSI, runtime.MachineStatusID); err != nil {
		t.Fatalf("a reader reads MachineStatus: %v", err)
	}
	// Writes are refused through the API, as are types Talos does not serve here.
	// (The COSI client wraps the status, so the code is read from the text.)
	err = c.COSI.Create(nctx, runtime.NewMachineStatus())
	wantText(t, err, "code = PermissionDenied desc = write access is not allowed")
	_, err = c.COSI.Get(nctx, resource.NewMetadata("runtime", "Unknowns.talos.dev", "x", resource.VersionUndefined))
	wantText(t, err, "code = PermissionDenied desc = resource type \"Unknowns.talos.dev\" is not supported")
}

func must[T any](v T, err error) T {
	if err != nil {
		panic(err)
	}
	return v
}

func wantText(t testing.TB, err error, text string) {
	t.Helper()
	if err == nil || !strings.Contains(err.Error(), text) {
		t.Fatalf("want an error containing %q, got %v", text, err)
	}
}

// TestServiceRestart: the kubelet and extension services restart (the
// Service resource goes away and comes back running, as Talos's helpers
// wait for); other services are refused as Talos refuses them.
func TestServiceRestart(t *testing.T) {
	spec := fleetSpec(t, 1, 1)
	spec.Machines[1].ExtensionServices = []string{"ext-iscsid"}
	f := start(t, spec)
	cp, w := f.Machines()[0], f.Machines()[1]
	c := talos(t, f)
	ctx, cancel := timeout()
	defer cancel()
	nctx := client.WithNode(ctx, w.Address())

	events := make(chan safe.WrappedStateEvent[*v1alpha1.Service], 10)
	if err := safe.StateWatch(nctx, c.COSI, v1alpha1.NewService("kubelet").Metadata(), events); err != nil {
		t.Fatal(err)
	}
	if ev := <-events; ev.Type() != state.Created {
		t.Fatalf("first watch event %v, want the current state", ev.Type())
	}
	resp, err := c.ServiceRestart(nctx, "kubelet")
	if err != nil || resp.Messages[0].Resp != `Service "kubelet" restarted` {
		t.Fatalf("restart kubelet: %v, %v", resp, err)
	}
	for _, want := range []state.EventType{state.Destroyed, state.Created} {
		select {
		case ev := <-events:
			if ev.Type() != want {
				t.Fatalf("watch event %v, want %v", ev.Type(), want)
			}
			if want == state.Created {
				svc, err := ev.Resource()
				if err != nil || !svc.TypedSpec().Running || !svc.TypedSpec().Healthy {
					t.Fatalf("kubelet after restart: %v, %v", svc, err)
				}
			}
		case <-ctx.Done():
			t.Fatalf("no %v event", want)
		}
	}
	if _, err := c.ServiceRestart(nctx, "ext-iscsid"); err != nil {
		t.Fatalf("restart an extension service: %v", err)
	}
	_, err = c.ServiceRestart(client.WithNode(ctx, cp.Address()), "etcd")
	wantText(t, err, `service "etcd" doesn't support restart operation via API`)
	_, err = c.ServiceRestart(nctx, "nginx")
	wantText(t, err, `service "nginx" not defined`)
	list, err := c.ServiceList(nctx)
	if err != nil || len(list.Messages[0].Services) == 0 {
		t.Fatalf("service list: %v, %v", list, err)
	}
}

// TestStreamFanOut: a server stream with nodes metadata interleaves every
// node's messages, each tagged with its node, as apid does. (EventsWatch,
// not V2: V2 expects one hello, and every node sends one.)
func TestStreamFanOut(t *testing.T) {
	f := start(t, fleetSpec(t, 1, 2))
	w1, w2 := f.Machines()[1], f.Machines()[2]
	c := talos(t, f)
	ctx, cancel := timeout()
	defer cancel()
	seen := map[string]bool{}
	err := c.EventsWatch(client.WithNodes(ctx, w1.Address(), w2.Address()), func(ch <-chan client.Event) {
		for ev := range ch {
			seen[ev.Node] = true
			if len(seen) == 2 {
				cancel()
			}
		}
	}, client.WithTailEvents(-1))
	if err != nil {
		t.Fatal(err)
	}
	if !seen[w1.Address()] || !seen[w2.Address()] {
		t.Fatalf("events from %v", seen)
	}
}
