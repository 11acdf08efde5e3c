package sim

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync"
	"time"

	coordinationv1 "k8s.io/api/coordination/v1"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/informers"
	"k8s.io/client-go/tools/cache"
	kwok "sigs.k8s.io/kwok/pkg/kwok/controllers"
	kwoklog "sigs.k8s.io/kwok/pkg/log"
)

// leases renews each running machine's Node Lease in kube-node-lease, as
// its kubelet does, with kwok's NodeLeaseController: every quarter of
// Spec.NodeLease while the machine is up, not at all while it is down, so
// that the node-lifecycle controller marks a machine that stays down
// Unknown and taints it unreachable.
type leases struct {
	ctl    *kwok.NodeLeaseController
	leases cache.SharedIndexInformer
	// stopped are the machines whose Lease is not renewed now. The hold in
	// kwok's controller is taken once per machine and kept: a renewal of a
	// down machine fails before it is sent (MutateLeaseFunc) and is tried
	// again an interval later. Releasing the hold at each shutdown and
	// taking it at each boot raced with a renewal in flight, which then
	// queued itself again beside the boot's: every such race added a
	// renewer for good (CI's sandbox log: one machine's Lease renewed
	// about 1,500 times a second after a dozen reboots).
	stopped sync.Map
}

// errDown is a down machine's renewal, which is not sent.
var errDown = errors.New("the machine is down")

func startLeases(ctx context.Context, k *kube) (*leases, error) {
	d := k.f.spec.Kubelet.NodeLease
	seconds := uint((d + time.Second - 1) / time.Second) // a Lease counts in whole seconds
	factory := informers.NewSharedInformerFactoryWithOptions(k.cs, 0, informers.WithNamespace(corev1.NamespaceNodeLease))
	l := &leases{leases: factory.Coordination().V1().Leases().Informer()}
	ctl, err := kwok.NewNodeLeaseController(kwok.NodeLeaseControllerConfig{
		TypedClient:          k.cs,
		LeaseDurationSeconds: seconds,
		LeaseParallelism:     4,
		GetLease: func(name string) (*coordinationv1.Lease, bool) {
			obj, ok, _ := l.leases.GetIndexer().GetByKey(corev1.NamespaceNodeLease + "/" + name)
			if !ok {
				return nil, false
			}
			return obj.(*coordinationv1.Lease), true
		},
		RenewInterval:       time.Duration(seconds) * time.Second / 4,
		RenewIntervalJitter: 0.04,
		// The kubelet's Lease is owned by its Node, so it goes with it.
		MutateLeaseFunc: func(lease *coordinationv1.Lease) error {
			if _, down := l.stopped.Load(lease.Name); down {
				return errDown
			}
			if len(lease.OwnerReferences) == 0 {
				if m := k.f.byName[lease.Name]; m != nil {
					if uid := k.nodeUID(m); uid != "" {
						lease.OwnerReferences = []metav1.OwnerReference{{APIVersion: "v1", Kind: "Node", Name: lease.Name, UID: uid}}
					}
				}
			}
			return nil
		},
		// A kubelet holds its Lease under its Node's name; kwok's controller
		// has one identity for every Lease it holds: the fleet's.
		HolderIdentity: "ichor-sim/" + k.f.spec.Name,
	})
	if err != nil {
		return nil, fmt.Errorf("node lease controller: %w", err)
	}
	l.ctl = ctl
	factory.Start(k.stopCh)
	if !cache.WaitForCacheSync(ctx.Done(), l.leases.HasSynced) {
		return nil, fmt.Errorf("sync the Lease informer: %w", ctx.Err())
	}
	// A down machine's renewal failing is how it is not sent: not logged.
	quiet := logfWriter(func(format string, args ...any) {
		if line := fmt.Sprintf(format, args...); !strings.Contains(line, errDown.Error()) {
			k.f.logf("%s", line)
		}
	})
	runCtx := kwoklog.NewContext(k.f.ctx, kwoklog.NewLogger(quiet, kwoklog.LevelError))
	if err := ctl.Start(runCtx); err != nil {
		return nil, err
	}
	return l, nil
}

// up and down start and stop renewing the machine's Lease. A nil leases
// (Spec.NodeLease zero) does nothing.
func (l *leases) up(m *Machine) {
	if l != nil {
		l.stopped.Delete(m.Name())
		l.ctl.TryHold(m.Name()) // once: a held Lease is not queued again
	}
}

func (l *leases) down(m *Machine) {
	if l != nil {
		l.stopped.Store(m.Name(), true)
	}
}

// logfWriter turns writes into Spec.Logf lines.
type logfWriter func(format string, args ...any)

func (w logfWriter) Write(p []byte) (int, error) {
	w("%s", strings.TrimRight(string(p), "\n"))
	return len(p), nil
}
