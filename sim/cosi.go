package sim

import (
	"context"
	"fmt"
	"strings"

	cosiv1alpha1 "github.com/cosi-project/runtime/api/v1alpha1"
	"github.com/cosi-project/runtime/pkg/resource"
	"github.com/cosi-project/runtime/pkg/resource/meta"
	"github.com/cosi-project/runtime/pkg/state"
	"github.com/cosi-project/runtime/pkg/state/impl/inmem"
	"github.com/cosi-project/runtime/pkg/state/impl/namespaced"
	cosiserver "github.com/cosi-project/runtime/pkg/state/protobuf/server"
	"github.com/siderolabs/talos/pkg/machinery/resources/config"
	"github.com/siderolabs/talos/pkg/machinery/resources/etcd"
	"github.com/siderolabs/talos/pkg/machinery/resources/k8s"
	"github.com/siderolabs/talos/pkg/machinery/resources/runtime"
	"github.com/siderolabs/talos/pkg/machinery/resources/v1alpha1"
	"github.com/siderolabs/talos/pkg/machinery/role"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
)

// cosiTypes are the resource types a simulated machine serves, with their
// sensitivity (a sensitive type needs os:admin, as Talos's access policy
// says). Other types are refused as Talos refuses unknown ones.
var cosiTypes = func() map[resource.Type]bool {
	types := map[resource.Type]bool{}
	for _, r := range []resource.Resource{
		config.NewMachineConfig(nil), config.NewMachineType(),
		runtime.NewMachineStatus(), runtime.NewVersion(), runtime.NewExtensionStatus(runtime.NamespaceName, "0"),
		runtime.NewSecurityStateSpec(runtime.NamespaceName), v1alpha1.NewService("x"),
		k8s.NewNodename(k8s.NamespaceName, k8s.NodenameID), etcd.NewMember(etcd.NamespaceName, etcd.LocalMemberID),
		runtime.NewMetaKey(runtime.NamespaceName, runtime.MetaKeyTagToID(0)),
	} {
		rd := r.(meta.ResourceDefinitionProvider).ResourceDefinition()
		types[r.Metadata().Type()] = rd.Sensitivity == meta.Sensitive
	}
	return types
}()

var cosiNamespaces = map[resource.Namespace]bool{
	config.NamespaceName: true, runtime.NamespaceName: true, k8s.NamespaceName: true, etcd.NamespaceName: true,
}

// newCOSI builds a machine's resource state and the read-only, role-checked
// view of it that the API serves.
func newCOSI() (state.State, *cosiserver.State) {
	build := inmem.NewStateWithOptions(inmem.WithHistoryInitialCapacity(4), inmem.WithHistoryMaxCapacity(64), inmem.WithHistoryGap(4))
	st := state.WrapCore(namespaced.NewState(func(ns resource.Namespace) state.CoreState { return build(ns) }))
	return st, cosiserver.NewState(state.Filter(st, accessPolicy))
}

// accessPolicy is Talos's resources.AccessPolicy over the types served here.
func accessPolicy(ctx context.Context, access state.Access) error {
	if !access.Verb.Readonly() {
		return status.Error(codes.PermissionDenied, "write access is not allowed")
	}
	sensitive, ok := cosiTypes[access.ResourceType]
	if !ok {
		return status.Error(codes.PermissionDenied, fmt.Sprintf("resource type %q is not supported", access.ResourceType))
	}
	if sensitive && !rolesFrom(ctx).Includes(role.Admin) {
		return status.Error(codes.PermissionDenied, "not authorized")
	}
	if !cosiNamespaces[access.ResourceNamespace] {
		return status.Error(codes.PermissionDenied, fmt.Sprintf("namespace %q is not supported", access.ResourceNamespace))
	}
	return nil
}

// cosiRouter serves cosi.resource.State for whichever machine the call was
// routed to (the interceptors put it in the context).
type cosiRouter struct {
	cosiv1alpha1.UnimplementedStateServer
}

func (cosiRouter) Get(ctx context.Context, req *cosiv1alpha1.GetRequest) (*cosiv1alpha1.GetResponse, error) {
	return callee(ctx).cosiAPI.Get(ctx, req)
}

func (cosiRouter) List(req *cosiv1alpha1.ListRequest, srv cosiv1alpha1.State_ListServer) error {
	return callee(srv.Context()).cosiAPI.List(req, srv)
}

func (cosiRouter) Watch(req *cosiv1alpha1.WatchRequest, srv cosiv1alpha1.State_WatchServer) error {
	return callee(srv.Context()).cosiAPI.Watch(req, srv)
}

func (cosiRouter) Create(ctx context.Context, req *cosiv1alpha1.CreateRequest) (*cosiv1alpha1.CreateResponse, error) {
	return callee(ctx).cosiAPI.Create(ctx, req)
}

func (cosiRouter) Update(ctx context.Context, req *cosiv1alpha1.UpdateRequest) (*cosiv1alpha1.UpdateResponse, error) {
	return callee(ctx).cosiAPI.Update(ctx, req)
}

func (cosiRouter) Destroy(ctx context.Context, req *cosiv1alpha1.DestroyRequest) (*cosiv1alpha1.DestroyResponse, error) {
	return callee(ctx).cosiAPI.Destroy(ctx, req)
}

// put creates r or replaces the existing resource with the same ID.
func (m *Machine) put(r resource.Resource) {
	ctx := context.Background()
	cur, err := m.cosi.Get(ctx, r.Metadata())
	switch {
	case state.IsNotFoundError(err):
		err = m.cosi.Create(ctx, r)
	case err == nil:
		r.Metadata().SetVersion(cur.Metadata().Version())
		err = m.cosi.Update(ctx, r)
	}
	if err != nil {
		m.f.logf("%s: store %s: %v", m.Name(), r.Metadata().ID(), err)
	}
}

func (m *Machine) destroy(md *resource.Metadata) {
	if err := m.cosi.Destroy(context.Background(), md); err != nil && !state.IsNotFoundError(err) {
		m.f.logf("%s: destroy %s: %v", m.Name(), md.ID(), err)
	}
}

// publish writes the resources that describe the machine's current boot.
func (m *Machine) publish() {
	m.mu.Lock()
	version, schematic, secureBoot := m.version, m.schematic, m.spec.SecureBoot
	active, persisted := m.cfg, m.persisted
	cp := m.spec.Role == ControlPlane
	exts := m.spec.ExtensionServices
	m.mu.Unlock()

	v := runtime.NewVersion()
	v.TypedSpec().Version = strings.TrimPrefix(version, "v")
	v.TypedSpec().Name = "Talos"
	m.put(v)

	// The schematic is a virtual extension; without one there is no entry.
	ext := runtime.NewExtensionStatus(runtime.NamespaceName, "0")
	if schematic == "" {
		m.destroy(ext.Metadata())
	} else {
		ext.TypedSpec().Image = "0.sqsh"
		ext.TypedSpec().Metadata.Name = "schematic"
		ext.TypedSpec().Metadata.Version = schematic
		ext.TypedSpec().Metadata.Description = "Image Factory schematic (simulated)"
		m.put(ext)
	}

	sec := runtime.NewSecurityStateSpec(runtime.NamespaceName)
	sec.TypedSpec().SecureBoot = secureBoot
	sec.TypedSpec().BootedWithUKI = secureBoot
	m.put(sec)

	mt := config.NewMachineType()
	if cp {
		mt.SetMachineType(machineTypeControlPlane)
	} else {
		mt.SetMachineType(machineTypeWorker)
	}
	m.put(mt)

	m.put(config.NewMachineConfigWithID(active, config.ActiveID))
	m.put(config.NewMachineConfigWithID(persisted, config.PersistentID))

	nn := k8s.NewNodename(k8s.NamespaceName, k8s.NodenameID)
	nn.TypedSpec().Nodename = m.Name()
	nn.TypedSpec().HostnameVersion = "1"
	m.put(nn)

	for _, svc := range append([]string{"apid", "containerd", "cri", "machined", "udevd", "kubelet"}, exts...) {
		m.putService(svc, true)
	}
	if cp {
		m.putService("trustd", true)
		m.refreshEtcdService()
	}
	m.renderConfigured()
}

// renderConfigured renders the resources Talos's controllers derive from
// the active configuration: the KubeletSpec and, on a control plane, the
// static pods and bootstrap manifests.
func (m *Machine) renderConfigured() {
	m.renderKubeletSpec()
	m.renderStaticPods()
	m.renderManifests()
}

func (m *Machine) putService(id string, running bool) {
	s := v1alpha1.NewService(id)
	s.TypedSpec().Running = running
	s.TypedSpec().Healthy = running
	m.put(s)
}

// refreshEtcdService mirrors the etcd model into the etcd Service and the
// local Member resources.
func (m *Machine) refreshEtcdService() {
	m.mu.Lock()
	running, id, up := m.etcdRunning, m.memberID, m.up
	m.mu.Unlock()
	if !up {
		return
	}
	m.putService("etcd", running)
	mem := etcd.NewMember(etcd.NamespaceName, etcd.LocalMemberID)
	if id == 0 {
		m.destroy(mem.Metadata())
		return
	}
	mem.TypedSpec().MemberID = etcd.FormatMemberID(id)
	m.put(mem)
}

func (m *Machine) setMachineStatus(stage runtime.MachineStage, ready bool) {
	ms := runtime.NewMachineStatus()
	ms.TypedSpec().Stage = stage
	ms.TypedSpec().Status.Ready = ready
	m.put(ms)
}

func serviceMetadata(id string) *resource.Metadata { return v1alpha1.NewService(id).Metadata() }
