package sim

import (
	"context"
	"errors"
	"fmt"
	"sort"
	"strings"

	"github.com/siderolabs/talos/pkg/machinery/api/machine"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
)

// FaultAnnotation on a machine's Node sets that machine's faults from
// outside the process; see the package documentation for the syntax.
const FaultAnnotation = "sim.ichor.maesh.dev/fault"

// FaultKind names a kind of fault.
type FaultKind string

// The faults a machine can be given.
const (
	// FaultError makes calls of Method fail with Code (once, or always).
	FaultError FaultKind = "error"
	// FaultLost lets unary calls of Method take effect, then loses their
	// answer: the caller gets Code (once, or always), as when a connection
	// breaks after the machine acted. A caller must not take it for "not
	// done".
	FaultLost FaultKind = "lost"
	// FaultHang makes calls of Method block until the fault is cleared, the
	// caller gives up or the machine goes down.
	FaultHang FaultKind = "hang"
	// FaultRollback makes a boot that would start a newly installed version
	// come back on the old one, as Talos's A/B rollback does.
	FaultRollback FaultKind = "rollback"
	// FaultNoReturn keeps a machine that goes down (reboot, upgrade, reset
	// with reboot, power-on after shutdown) down until the fault is cleared.
	FaultNoReturn FaultKind = "no-return"
	// FaultEtcdUnhealthy makes the machine's etcd member unhealthy: it
	// fails quorum reads, reports an error in EtcdStatus and cannot lead.
	FaultEtcdUnhealthy FaultKind = "etcd-unhealthy"
	// FaultEtcdAlarm raises an etcd alarm (NOSPACE unless Alarm says
	// CORRUPT) on the machine's member while the fault is set, until an
	// EtcdAlarmDisarm clears it.
	FaultEtcdAlarm FaultKind = "alarm"
)

// Fault is one injected fault.
type Fault struct {
	Kind FaultKind
	// Method, for FaultError, FaultLost and FaultHang: a gRPC method name ("Reboot"
	// matches it in any service), "Service/Method"
	// ("LifecycleService/Upgrade"), or "*" for every method.
	Method string
	// Code, for FaultError and FaultLost; zero means codes.Unavailable.
	Code codes.Code
	// Once makes a FaultError, FaultLost or FaultRollback fire once only.
	Once bool
	// Alarm, for FaultEtcdAlarm; zero (NONE) means NOSPACE.
	Alarm machine.EtcdMemberAlarm_AlarmType
}

// String renders f in the annotation syntax; ParseFaults reads it back.
func (f Fault) String() string {
	switch f.Kind {
	case FaultError, FaultLost:
		s := fmt.Sprintf("%s:%s:%s", f.Kind, f.Method, f.code())
		if f.Once {
			s += ":once"
		}
		return s
	case FaultHang:
		return "hang:" + f.Method
	case FaultRollback:
		if f.Once {
			return "rollback:once"
		}
		return "rollback"
	case FaultEtcdAlarm:
		return "alarm:" + f.alarm().String()
	default:
		return string(f.Kind)
	}
}

func (f Fault) code() codes.Code {
	if f.Code == codes.OK {
		return codes.Unavailable
	}
	return f.Code
}

func (f Fault) alarm() machine.EtcdMemberAlarm_AlarmType {
	if f.Alarm == machine.EtcdMemberAlarm_NONE {
		return machine.EtcdMemberAlarm_NOSPACE
	}
	return f.Alarm
}

const faultSyntax = "error:METHOD[:CODE][:once], lost:METHOD[:CODE][:once], hang:METHOD, rollback[:once], no-return, etcd-unhealthy, alarm[:NOSPACE|CORRUPT]"

// ParseFaults reads a comma-separated fault list in the annotation syntax:
//
//	error:METHOD[:CODE][:once]  lost:METHOD[:CODE][:once]  hang:METHOD
//	rollback[:once]  no-return  etcd-unhealthy  alarm[:NOSPACE|CORRUPT]
//
// CODE is a gRPC code name such as Unavailable or PermissionDenied. An
// empty string is no faults.
func ParseFaults(s string) ([]Fault, error) {
	var out []Fault
	var errs []error
	for _, tok := range strings.Split(s, ",") {
		tok = strings.TrimSpace(tok)
		if tok == "" {
			continue
		}
		f, err := parseFault(tok)
		if err != nil {
			errs = append(errs, err)
			continue
		}
		out = append(out, f)
	}
	if len(errs) > 0 {
		return nil, fmt.Errorf("%w (faults are: %s)", errors.Join(errs...), faultSyntax)
	}
	return out, nil
}

func parseFault(tok string) (Fault, error) {
	parts := strings.Split(tok, ":")
	kind, args := FaultKind(strings.ToLower(parts[0])), parts[1:]
	f := Fault{Kind: kind}
	bad := func(why string) (Fault, error) { return Fault{}, fmt.Errorf("fault %q: %s", tok, why) }
	switch kind {
	case FaultError, FaultLost:
		if len(args) == 0 || args[0] == "" {
			return bad(fmt.Sprintf("name the method, e.g. %s:Reboot", kind))
		}
		f.Method, args = args[0], args[1:]
		if n := len(args); n > 0 && strings.EqualFold(args[n-1], "once") {
			f.Once, args = true, args[:n-1]
		}
		if len(args) > 0 {
			c, ok := codeByName(args[0])
			if !ok {
				return bad(fmt.Sprintf("unknown gRPC code %q", args[0]))
			}
			f.Code, args = c, args[1:]
		}
	case FaultHang:
		if len(args) == 0 || args[0] == "" {
			return bad("name the method, e.g. hang:Upgrade")
		}
		f.Method, args = args[0], args[1:]
	case FaultRollback:
		if len(args) == 1 && strings.EqualFold(args[0], "once") {
			f.Once, args = true, nil
		}
	case FaultEtcdAlarm:
		if len(args) == 1 {
			v, ok := machine.EtcdMemberAlarm_AlarmType_value[strings.ToUpper(args[0])]
			if !ok || v == int32(machine.EtcdMemberAlarm_NONE) {
				return bad("the alarm is NOSPACE or CORRUPT")
			}
			f.Alarm, args = machine.EtcdMemberAlarm_AlarmType(v), nil
		}
	case FaultNoReturn, FaultEtcdUnhealthy:
	default:
		return bad("unknown fault")
	}
	if len(args) > 0 {
		return bad("unexpected " + strings.Join(args, ":"))
	}
	return f, nil
}

var codeNames = func() map[string]codes.Code {
	m := map[string]codes.Code{}
	for c := codes.OK; c <= codes.Unauthenticated; c++ {
		m[strings.ToLower(c.String())] = c
	}
	return m
}()

func codeByName(s string) (codes.Code, bool) {
	c, ok := codeNames[strings.ToLower(s)]
	return c, ok && c != codes.OK
}

// activeFault is an injected fault and its state.
type activeFault struct {
	Fault
	fired   bool
	cleared chan struct{} // closed when the fault is cleared
}

// Inject gives the machine faults until the returned clear is called (it is
// idempotent). Faults from Inject and from the Node annotation add up.
func (m *Machine) Inject(faults ...Fault) (clear func()) {
	m.mu.Lock()
	var added []*activeFault
	for _, f := range faults {
		af := &activeFault{Fault: f, cleared: make(chan struct{})}
		m.faults = append(m.faults, af)
		added = append(added, af)
	}
	m.faultsChangedLocked()
	m.mu.Unlock()
	m.faultsApplied(added, nil)
	return func() { m.removeFaults(added) }
}

// InjectString is Inject with faults in the annotation syntax.
func (m *Machine) InjectString(spec string) (clear func(), err error) {
	faults, err := ParseFaults(spec)
	if err != nil {
		return nil, err
	}
	return m.Inject(faults...), nil
}

// ClearFaults clears every fault given with Inject (annotation faults stay
// until the annotation changes).
func (m *Machine) ClearFaults() {
	m.mu.Lock()
	all := append([]*activeFault(nil), m.faults...)
	m.mu.Unlock()
	m.removeFaults(all)
}

// Faults lists the machine's faults (injected and from the annotation).
func (m *Machine) Faults() []Fault {
	m.mu.Lock()
	defer m.mu.Unlock()
	var out []Fault
	for _, af := range m.allFaultsLocked() {
		out = append(out, af.Fault)
	}
	return out
}

func (m *Machine) removeFaults(list []*activeFault) {
	m.mu.Lock()
	var removed []*activeFault
	for _, af := range list {
		for i, have := range m.faults {
			if have == af {
				m.faults = append(m.faults[:i], m.faults[i+1:]...)
				close(af.cleared)
				removed = append(removed, af)
				break
			}
		}
	}
	m.faultsChangedLocked()
	m.mu.Unlock()
	m.faultsApplied(nil, removed)
}

// setAnnotationFaults replaces the faults that came from the Node
// annotation. Faults present before and after keep their state (a fired
// once-fault stays fired until it is removed from the annotation).
func (m *Machine) setAnnotationFaults(faults []Fault) {
	want := map[string]Fault{}
	for _, f := range faults {
		want[f.String()] = f
	}
	m.mu.Lock()
	var added, removed []*activeFault
	for key, af := range m.annFaults {
		if _, ok := want[key]; !ok {
			delete(m.annFaults, key)
			close(af.cleared)
			removed = append(removed, af)
		}
	}
	keys := make([]string, 0, len(want))
	for k := range want {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	for _, key := range keys {
		if _, ok := m.annFaults[key]; !ok {
			af := &activeFault{Fault: want[key], cleared: make(chan struct{})}
			m.annFaults[key] = af
			added = append(added, af)
		}
	}
	if len(added)+len(removed) > 0 {
		m.faultsChangedLocked()
	}
	m.mu.Unlock()
	if len(added)+len(removed) > 0 {
		m.f.logf("%s: faults from annotation: %q", m.Name(), faultList(faults))
		m.faultsApplied(added, removed)
	}
}

func faultList(faults []Fault) string {
	s := make([]string, len(faults))
	for i, f := range faults {
		s[i] = f.String()
	}
	return strings.Join(s, ",")
}

// faultsApplied carries the side effects of faults that act on the etcd
// model rather than on calls.
func (m *Machine) faultsApplied(added, removed []*activeFault) {
	etcdChanged := false
	for _, af := range added {
		switch af.Kind {
		case FaultEtcdAlarm:
			m.f.etcd.raiseAlarm(m, af.alarm())
		case FaultEtcdUnhealthy:
			etcdChanged = true
		}
	}
	for _, af := range removed {
		switch af.Kind {
		case FaultEtcdAlarm:
			m.f.etcd.clearAlarm(m, af.alarm())
		case FaultEtcdUnhealthy:
			etcdChanged = true
		}
	}
	if etcdChanged {
		m.f.etcd.update()
	}
}

func (m *Machine) faultsChangedLocked() {
	close(m.faultsChanged)
	m.faultsChanged = make(chan struct{})
}

func (m *Machine) allFaultsLocked() []*activeFault {
	all := append([]*activeFault(nil), m.faults...)
	keys := make([]string, 0, len(m.annFaults))
	for k := range m.annFaults {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	for _, k := range keys {
		all = append(all, m.annFaults[k])
	}
	return all
}

// hasFault reports whether a fault of kind is set (and, with consume, marks
// a once-fault fired).
func (m *Machine) hasFault(kind FaultKind, consume bool) bool {
	m.mu.Lock()
	defer m.mu.Unlock()
	return m.hasFaultLocked(kind, consume)
}

func (m *Machine) hasFaultLocked(kind FaultKind, consume bool) bool {
	for _, af := range m.allFaultsLocked() {
		if af.Kind != kind || (af.Once && af.fired) {
			continue
		}
		if consume && af.Once {
			af.fired = true
		}
		return true
	}
	return false
}

// lostAnswer is the error that replaces the answer of a unary call that
// took effect, when a lost fault matches it (nil when none does).
func (m *Machine) lostAnswer(fullMethod string) error {
	m.mu.Lock()
	for _, af := range m.allFaultsLocked() {
		if af.Kind != FaultLost || !methodMatches(af.Method, fullMethod) || af.Once && af.fired {
			continue
		}
		af.fired = true
		m.mu.Unlock()
		m.f.logf("%s: fault %s lost the answer of %s, which took effect", m.Name(), af, shortMethod(fullMethod))
		return status.Errorf(af.code(), "simulated fault %s on %s", af, m.Name())
	}
	m.mu.Unlock()
	return nil
}

// callFaults applies the error and hang faults for one call: it returns the
// injected error, or blocks while a hang fault matches.
func (m *Machine) callFaults(ctx context.Context, fullMethod string) error {
	for {
		m.mu.Lock()
		var hang *activeFault
		for _, af := range m.allFaultsLocked() {
			if !methodMatches(af.Method, fullMethod) {
				continue
			}
			switch af.Kind {
			case FaultError:
				if af.Once && af.fired {
					continue
				}
				af.fired = true
				m.mu.Unlock()
				m.f.logf("%s: fault %s fired on %s", m.Name(), af, shortMethod(fullMethod))
				m.f.kube.event(m, "Warning", "SimulatedFault", fmt.Sprintf("fault %s failed a %s call", af, shortMethod(fullMethod)))
				return status.Errorf(af.code(), "simulated fault %s on %s", af, m.Name())
			case FaultHang:
				if hang == nil {
					hang = af
				}
			}
		}
		m.mu.Unlock()
		if hang == nil {
			return nil
		}
		m.f.logf("%s: %s hangs (fault %s)", m.Name(), shortMethod(fullMethod), hang)
		select {
		case <-hang.cleared:
		case <-ctx.Done():
			return status.FromContextError(ctx.Err()).Err()
		}
	}
}
