package sim

import (
	"context"
	"crypto/tls"
	"fmt"
	"io"
	"net"
	"strconv"
	"strings"
	"sync"
	"time"

	cosiv1alpha1 "github.com/cosi-project/runtime/api/v1alpha1"
	"github.com/siderolabs/talos/pkg/machinery/api/common"
	"github.com/siderolabs/talos/pkg/machinery/api/machine"
	"github.com/siderolabs/talos/pkg/machinery/constants"
	"github.com/siderolabs/talos/pkg/machinery/role"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/peer"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/reflect/protoreflect"
	"google.golang.org/protobuf/reflect/protoregistry"
)

// endpoint is a control plane's Talos API listener, playing apid: mutual
// TLS 1.3 with a server certificate for the machine's address and the
// client CAs of its active configuration (apidTLS), and routing of every
// call to the machine its node metadata names.
type endpoint struct {
	f    *Fleet
	m    *Machine
	tls  *tls.Config
	port int

	mu       sync.Mutex
	gs       *grpc.Server
	lis      net.Listener       // bound, not yet served (before the first boot)
	serving  net.Listener       // the listener gs serves
	endCalls context.CancelFunc // ends the calls running through gs
}

func newEndpoint(f *Fleet, m *Machine) (*endpoint, error) {
	cfg, err := apidTLS(m)
	if err != nil {
		return nil, fmt.Errorf("%s: apid TLS: %w", m.Name(), err)
	}
	// Bind now, port 0: the port is known before the machine boots and
	// stays the machine's across reboots.
	lis, err := net.Listen("tcp", net.JoinHostPort(m.addr, "0"))
	if err != nil {
		return nil, fmt.Errorf("%s: listen on %s: %w", m.Name(), m.addr, err)
	}
	return &endpoint{
		f:    f,
		m:    m,
		tls:  cfg,
		port: lis.Addr().(*net.TCPAddr).Port,
		lis:  lis,
	}, nil
}

func (e *endpoint) address() string { return net.JoinHostPort(e.m.addr, strconv.Itoa(e.port)) }

// open serves the API (again, after a reboot, on the same port).
func (e *endpoint) open() error {
	e.mu.Lock()
	defer e.mu.Unlock()
	if e.gs != nil || e.f.stopped.Load() {
		return nil
	}
	lis := e.lis
	e.lis = nil
	if lis == nil {
		var err error
		for try := 0; ; try++ {
			lis, err = net.Listen("tcp", e.address())
			if err == nil {
				break
			}
			if try == 50 {
				return fmt.Errorf("listen on %s again: %w", e.address(), err)
			}
			time.Sleep(10 * time.Millisecond)
		}
	}
	closed, endCalls := context.WithCancel(context.Background())
	gs := grpc.NewServer(
		grpc.Creds(credentials.NewTLS(e.tls)),
		grpc.ChainUnaryInterceptor(endUnary(closed), e.f.unaryRouter(e.m)),
		grpc.ChainStreamInterceptor(endStream(closed), e.f.streamRouter(e.m)),
	)
	e.endCalls = endCalls
	e.serving = lis
	machine.RegisterMachineServiceServer(gs, &machined{f: e.f})
	machine.RegisterLifecycleServiceServer(gs, &lifecycleService{})
	machine.RegisterImageServiceServer(gs, &imageService{})
	cosiv1alpha1.RegisterStateServer(gs, cosiRouter{})
	e.gs = gs
	e.f.wg.Add(1)
	go func() {
		defer e.f.wg.Done()
		_ = gs.Serve(lis) // returns when close stops it
	}()
	return nil
}

// close stops answering, as apid does when its machine goes down: the
// listener closes, the calls still running through it end (Unavailable on
// the client), and the answers already made reach their callers before the
// connections close. A Shutdown's answer is made a few milliseconds before
// its machine goes down (Durations.Stop); cutting the connections at once
// lost it whenever the answer had not been written by then. The listener
// closes first: a client whose call ended Unavailable must not find the
// port still accepting.
func (e *endpoint) close() {
	e.mu.Lock()
	defer e.mu.Unlock()
	if e.gs != nil {
		_ = e.serving.Close() // Serve returns; its connections stay
		e.endCalls()
		stopGracefully(e.gs, closeGrace)
		e.gs = nil
	}
	if e.lis != nil {
		_ = e.lis.Close()
		e.lis = nil
	}
}

// closeGrace bounds how long close waits for the answers in flight; a
// call that does not end by then is cut.
const closeGrace = time.Second

func stopGracefully(gs *grpc.Server, grace time.Duration) {
	done := make(chan struct{})
	go func() {
		gs.GracefulStop()
		close(done)
	}()
	select {
	case <-done:
	case <-time.After(grace):
		gs.Stop()
		<-done
	}
}

// errEndpointClosed is how a call cut by its endpoint's close ends: what
// the client sees when the connection goes from under it. A call that
// reached its machine and was cut by the machine going down (behind
// another control plane's apid) ends so too: it may have been acted on,
// unlike one that found the machine down (unavailable: a refused dial).
var errEndpointClosed = status.Error(codes.Unavailable, "error reading from server: EOF")

// endUnary ends a unary call when closed is done. An answer already made
// stands: only a call that fails after the close is taken as cut.
func endUnary(closed context.Context) grpc.UnaryServerInterceptor {
	return func(ctx context.Context, req any, _ *grpc.UnaryServerInfo, handler grpc.UnaryHandler) (any, error) {
		ctx, cancel := context.WithCancel(ctx)
		defer cancel()
		defer context.AfterFunc(closed, cancel)()
		resp, err := handler(ctx, req)
		if err != nil && closed.Err() != nil {
			return nil, errEndpointClosed
		}
		return resp, err
	}
}

// endStream ends a stream when closed is done.
func endStream(closed context.Context) grpc.StreamServerInterceptor {
	return func(srv any, ss grpc.ServerStream, _ *grpc.StreamServerInfo, handler grpc.StreamHandler) error {
		ctx, cancel := context.WithCancel(ss.Context())
		defer cancel()
		defer context.AfterFunc(closed, cancel)()
		if err := handler(srv, &ctxStream{ServerStream: ss, ctx: ctx}); err != nil {
			if closed.Err() != nil {
				return errEndpointClosed
			}
			return err
		}
		return nil
	}
}

type ctxKey int

const (
	calleeKey ctxKey = iota
	rolesKey
)

// callee is the machine a call was routed to.
func callee(ctx context.Context) *Machine { return ctx.Value(calleeKey).(*Machine) }

func rolesFrom(ctx context.Context) role.Set {
	r, _ := ctx.Value(rolesKey).(role.Set)
	return r
}

// peerRoles reads the roles from the client certificate's Organization, as
// apid's authz injector does (os:impersonator takes them from metadata).
func peerRoles(ctx context.Context) role.Set {
	p, ok := peer.FromContext(ctx)
	if !ok {
		return role.MakeSet()
	}
	info, ok := p.AuthInfo.(credentials.TLSInfo)
	if !ok || len(info.State.PeerCertificates) == 0 {
		return role.MakeSet()
	}
	roles, _ := role.Parse(info.State.PeerCertificates[0].Subject.Organization)
	if roles.Includes(role.Impersonator) {
		md, _ := metadata.FromIncomingContext(ctx)
		roles, _ = role.Parse(md.Get(constants.APIAuthzRoleMetadataKey))
	}
	return roles
}

type target struct {
	name  string // as the client wrote it
	m     *Machine
	owner *Machine // the control plane whose endpoint the client reached
}

// route decides where a call goes, as apid's director does: "node" is one
// machine, "nodes" fans out (only for the services Talos fans out), and no
// metadata is the endpoint's own machine.
func (f *Fleet) route(ctx context.Context, fullMethod string, owner *Machine) ([]target, bool, error) {
	md, _ := metadata.FromIncomingContext(ctx)
	nodes, okNodes := md["nodes"]
	node, okNode := md["node"]
	if okNode && len(node) != 1 {
		return nil, false, status.Error(codes.InvalidArgument, "node metadata must be single-valued")
	}
	switch {
	case okNodes:
		if !fanOutAllowed(fullMethod) {
			return nil, false, status.Errorf(codes.InvalidArgument, "one-2-many proxying is not supported for method %s", fullMethod)
		}
		var ts []target
		for _, v := range nodes {
			for _, n := range strings.Split(v, ",") {
				if n = strings.TrimSpace(n); n != "" {
					ts = append(ts, target{name: n, m: f.lookup(n), owner: owner})
				}
			}
		}
		return ts, true, nil
	case okNode:
		return []target{{name: node[0], m: f.lookup(node[0]), owner: owner}}, false, nil
	default:
		return []target{{name: owner.addr, m: owner, owner: owner}}, false, nil
	}
}

func fanOutAllowed(fullMethod string) bool {
	for _, p := range []string{"/machine.MachineService/", "/cluster.ClusterService/", "/inspect.InspectService/", "/storage.StorageService/", "/time.TimeService/"} {
		if strings.HasPrefix(fullMethod, p) {
			return true
		}
	}
	return false
}

func unavailable(name string) error {
	return status.Errorf(codes.Unavailable,
		"connection error: desc = \"transport: Error while dialing: dial tcp %s:50000: connect: connection refused\"", name)
}

// call runs one call on one machine: down machines are unreachable, then
// the hop from the endpoint's machine (proxyTrust), the role check, the faults and the handler, which sees the machine and
// the roles in its context and is cancelled if the machine goes down.
func (f *Fleet) call(ctx context.Context, t target, fullMethod string, roles role.Set, stream bool, fn func(context.Context) (any, error)) (any, error) {
	m := t.m
	if m == nil {
		return nil, status.Errorf(codes.Unavailable,
			"connection error: desc = \"transport: Error while dialing: dial tcp: lookup %s: no such host\"", t.name)
	}
	f.rec.call(m.Name(), fullMethod)
	m.mu.Lock()
	up, bootCtx := m.up, m.bootCtx
	m.mu.Unlock()
	if !up {
		return nil, unavailable(m.addr)
	}
	if err := f.proxyTrust(t.owner, m); err != nil {
		return nil, err
	}
	if !authorized(fullMethod, roles) {
		return nil, status.Error(codes.PermissionDenied, "not authorized")
	}
	callCtx, cancel := context.WithCancel(ctx)
	defer cancel()
	stop := context.AfterFunc(bootCtx, cancel)
	defer stop()
	callCtx = context.WithValue(context.WithValue(callCtx, calleeKey, m), rolesKey, roles)
	wentDown := func() bool { return bootCtx.Err() != nil && ctx.Err() == nil }
	if err := m.callFaults(callCtx, fullMethod); err != nil {
		if wentDown() {
			return nil, errEndpointClosed
		}
		return nil, err
	}
	at := time.Now()
	resp, err := fn(callCtx)
	if (err != nil || stream) && wentDown() {
		err = errEndpointClosed
	}
	f.rec.handle(m.Name(), fullMethod, at, err)
	if err != nil {
		return nil, err
	}
	if !stream {
		if err := m.lostAnswer(fullMethod); err != nil {
			return nil, err
		}
	}
	return resp, nil
}

func (f *Fleet) unaryRouter(owner *Machine) grpc.UnaryServerInterceptor {
	return func(ctx context.Context, req any, info *grpc.UnaryServerInfo, handler grpc.UnaryHandler) (any, error) {
		roles := peerRoles(ctx)
		targets, many, err := f.route(ctx, info.FullMethod, owner)
		if err != nil {
			return nil, err
		}
		if !many {
			return f.call(ctx, targets[0], info.FullMethod, roles, false, func(c context.Context) (any, error) { return handler(c, req) })
		}
		results := make([]any, len(targets))
		errs := make([]error, len(targets))
		var wg sync.WaitGroup
		for i, t := range targets {
			wg.Go(func() {
				r := proto.Clone(req.(proto.Message))
				results[i], errs[i] = f.call(ctx, t, info.FullMethod, roles, false, func(c context.Context) (any, error) { return handler(c, r) })
			})
		}
		wg.Wait()
		return aggregate(info.FullMethod, targets, results, errs)
	}
}

func (f *Fleet) streamRouter(owner *Machine) grpc.StreamServerInterceptor {
	return func(srv any, ss grpc.ServerStream, info *grpc.StreamServerInfo, handler grpc.StreamHandler) error {
		roles := peerRoles(ss.Context())
		targets, many, err := f.route(ss.Context(), info.FullMethod, owner)
		if err != nil {
			return err
		}
		if !many {
			_, err := f.call(ss.Context(), targets[0], info.FullMethod, roles, true, func(c context.Context) (any, error) {
				return nil, handler(srv, &ctxStream{ServerStream: ss, ctx: c})
			})
			return err
		}
		if info.IsClientStream {
			return status.Errorf(codes.InvalidArgument, "one-2-many proxying is not supported for client-streaming method %s", info.FullMethod)
		}
		inType, outType, err := methodTypes(info.FullMethod)
		if err != nil {
			return err
		}
		req := inType.New().Interface()
		if err := ss.RecvMsg(req); err != nil {
			return err
		}
		var sendMu sync.Mutex
		var wg sync.WaitGroup
		for _, t := range targets {
			wg.Go(func() {
				fs := &fanStream{ServerStream: ss, host: t.name, req: req, mu: &sendMu}
				_, err := f.call(ss.Context(), t, info.FullMethod, roles, true, func(c context.Context) (any, error) {
					fs.ctx = c
					return nil, handler(srv, fs)
				})
				if err != nil {
					msg := outType.New()
					setMetadata(msg, t.name, err)
					sendMu.Lock()
					_ = ss.SendMsg(msg.Interface())
					sendMu.Unlock()
				}
			})
		}
		wg.Wait()
		return nil
	}
}

type ctxStream struct {
	grpc.ServerStream
	ctx context.Context
}

func (s *ctxStream) Context() context.Context { return s.ctx }

// fanStream is one target's share of a fanned-out server stream: it hands
// the handler the request read once, and tags what it sends with the node.
type fanStream struct {
	grpc.ServerStream
	ctx   context.Context
	host  string
	req   proto.Message
	recvd bool
	mu    *sync.Mutex
}

func (s *fanStream) Context() context.Context { return s.ctx }

func (s *fanStream) RecvMsg(m any) error {
	if s.recvd {
		return io.EOF
	}
	s.recvd = true
	proto.Merge(m.(proto.Message), s.req)
	return nil
}

func (s *fanStream) SendMsg(m any) error {
	if pm, ok := m.(proto.Message); ok {
		setMetadata(pm.ProtoReflect(), s.host, nil)
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.ServerStream.SendMsg(m)
}

var methodTypeCache sync.Map // full method -> [2]protoreflect.MessageType

// methodTypes finds a method's request and response types in the registry.
func methodTypes(fullMethod string) (in, out protoreflect.MessageType, err error) {
	if v, ok := methodTypeCache.Load(fullMethod); ok {
		t := v.([2]protoreflect.MessageType)
		return t[0], t[1], nil
	}
	svc, method, _ := strings.Cut(strings.TrimPrefix(fullMethod, "/"), "/")
	d, err := protoregistry.GlobalFiles.FindDescriptorByName(protoreflect.FullName(svc))
	if err != nil {
		return nil, nil, status.Errorf(codes.Internal, "service %s: %v", svc, err)
	}
	sd, ok := d.(protoreflect.ServiceDescriptor)
	if !ok || sd.Methods().ByName(protoreflect.Name(method)) == nil {
		return nil, nil, status.Errorf(codes.Internal, "no method %s", fullMethod)
	}
	md := sd.Methods().ByName(protoreflect.Name(method))
	if in, err = protoregistry.GlobalTypes.FindMessageByName(md.Input().FullName()); err != nil {
		return nil, nil, status.Errorf(codes.Internal, "%s: %v", fullMethod, err)
	}
	if out, err = protoregistry.GlobalTypes.FindMessageByName(md.Output().FullName()); err != nil {
		return nil, nil, status.Errorf(codes.Internal, "%s: %v", fullMethod, err)
	}
	methodTypeCache.Store(fullMethod, [2]protoreflect.MessageType{in, out})
	return in, out, nil
}

// aggregate merges per-node responses into one, as apid does for nodes:
// every message carries its node in Metadata.Hostname, a node that failed
// contributes a message with Metadata.Error and Metadata.Status.
func aggregate(fullMethod string, targets []target, results []any, errs []error) (any, error) {
	_, outType, err := methodTypes(fullMethod)
	if err != nil {
		return nil, err
	}
	resp := outType.New()
	fd := resp.Descriptor().Fields().ByName("messages")
	if fd == nil || !fd.IsList() || fd.Message() == nil {
		return nil, status.Errorf(codes.Internal, "%s has no messages to aggregate", fullMethod)
	}
	list := resp.Mutable(fd).List()
	for i, t := range targets {
		if errs[i] != nil {
			el := list.NewElement()
			setMetadata(el.Message(), t.name, errs[i])
			list.Append(el)
			continue
		}
		src := results[i].(proto.Message).ProtoReflect().Get(fd).List()
		for j := 0; j < src.Len(); j++ {
			msg := src.Get(j).Message()
			setMetadata(msg, t.name, nil)
			list.Append(protoreflect.ValueOfMessage(msg))
		}
	}
	return resp.Interface(), nil
}

func setMetadata(msg protoreflect.Message, host string, err error) {
	fd := msg.Descriptor().Fields().ByName("metadata")
	if fd == nil || fd.Message() == nil || fd.Message().FullName() != "common.Metadata" {
		return
	}
	md, ok := msg.Mutable(fd).Message().Interface().(*common.Metadata)
	if !ok {
		return
	}
	md.Hostname = host
	if err != nil {
		md.Error = err.Error()
		md.Status = status.Convert(err).Proto()
	}
}

// rules are Talos's per-method roles (machined's authz rules); other
// methods need os:admin, as Talos's fallback says.
var rules = map[string]role.Set{
	"/machine.ImageService/List":   role.MakeSet(role.Admin, role.Operator, role.Reader),
	"/machine.ImageService/Pull":   role.MakeSet(role.Admin, role.Operator),
	"/machine.ImageService/Verify": role.MakeSet(role.Admin, role.Operator, role.Reader, role.ImageVerifier),

	"/machine.MachineService/ApplyConfiguration":    role.MakeSet(role.Admin, role.Reader), // reader only in maintenance, checked in the handler
	"/machine.MachineService/EtcdAlarmList":         role.MakeSet(role.Admin, role.Operator, role.Reader, role.EtcdBackup),
	"/machine.MachineService/EtcdAlarmDisarm":       role.MakeSet(role.Admin, role.Operator),
	"/machine.MachineService/EtcdDefragment":        role.MakeSet(role.Admin, role.Operator),
	"/machine.MachineService/EtcdMemberList":        role.MakeSet(role.Admin, role.Operator, role.Reader, role.EtcdBackup),
	"/machine.MachineService/EtcdSnapshot":          role.MakeSet(role.Admin, role.Operator, role.EtcdBackup),
	"/machine.MachineService/EtcdStatus":            role.MakeSet(role.Admin, role.Operator, role.Reader, role.EtcdBackup),
	"/machine.MachineService/Events":                role.MakeSet(role.Admin, role.Operator, role.Reader),
	"/machine.MachineService/Hostname":              role.MakeSet(role.Admin, role.Operator, role.Reader),
	"/machine.MachineService/ImageList":             role.MakeSet(role.Admin, role.Operator, role.Reader),
	"/machine.MachineService/ImagePull":             role.MakeSet(role.Admin, role.Operator),
	"/machine.MachineService/Reboot":                role.MakeSet(role.Admin, role.Operator),
	"/machine.MachineService/ServiceList":           role.MakeSet(role.Admin, role.Operator, role.Reader),
	"/machine.MachineService/ServiceRestart":        role.MakeSet(role.Admin, role.Operator),
	"/machine.MachineService/ServiceStart":          role.MakeSet(role.Admin, role.Operator),
	"/machine.MachineService/ServiceStop":           role.MakeSet(role.Admin, role.Operator),
	"/machine.MachineService/Shutdown":              role.MakeSet(role.Admin, role.Operator),
	"/machine.MachineService/Version":               role.MakeSet(role.Admin, role.Operator, role.Reader),
	"/machine.MachineService/Read":                  role.MakeSet(role.Admin),
	"/machine.MachineService/EtcdForfeitLeadership": role.MakeSet(role.Admin),
	"/machine.MachineService/MetaWrite":             role.MakeSet(role.Admin, role.MetaWriter),
	"/machine.MachineService/MetaDelete":            role.MakeSet(role.Admin, role.MetaWriter),

	"/cosi.resource.State/Get":   role.MakeSet(role.Admin, role.Operator, role.Reader),
	"/cosi.resource.State/List":  role.MakeSet(role.Admin, role.Operator, role.Reader),
	"/cosi.resource.State/Watch": role.MakeSet(role.Admin, role.Operator, role.Reader),
}

var fallbackRoles = role.MakeSet(role.Admin)

func authorized(fullMethod string, roles role.Set) bool {
	allowed, ok := rules[fullMethod]
	if !ok {
		allowed = fallbackRoles
	}
	return allowed.IncludesAny(roles)
}
