package sim

import (
	"context"
	"errors"
	"sync/atomic"
	"testing"
	"time"

	coordinationv1 "k8s.io/api/coordination/v1"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/client-go/kubernetes/fake"
	k8stesting "k8s.io/client-go/testing"
)

// TestLeaseRenewerAfterARace: a machine goes down and boots again while
// a renewal of its Lease is in flight (a control plane's reboot takes the
// API server away under it). Afterwards its Lease is renewed once per
// interval, not once per renewer each race left behind. A fake clientset
// holds the renewal in flight: the race cannot be timed against a real
// API server; TestNodeLeases has the renewals against one.
func TestLeaseRenewerAfterARace(t *testing.T) {
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	lease := &coordinationv1.Lease{ObjectMeta: metav1.ObjectMeta{Namespace: corev1.NamespaceNodeLease, Name: "m"}}
	cs := fake.NewClientset(lease)
	inFlight, release := make(chan struct{}), make(chan struct{})
	var updates atomic.Int32
	cs.PrependReactor("update", "leases", func(k8stesting.Action) (bool, runtime.Object, error) {
		if updates.Add(1) == 1 {
			close(inFlight)
			<-release
			return true, nil, errors.New("connection reset by peer")
		}
		return false, nil, nil
	})
	f := &Fleet{spec: Spec{Kubelet: Kubelet{NodeLease: 2 * time.Second}}, ctx: ctx, byName: map[string]*Machine{}}
	k := &kube{f: f, cs: cs, stopCh: make(chan struct{})}
	defer close(k.stopCh)
	l, err := startLeases(ctx, k)
	if err != nil {
		t.Fatal(err)
	}
	m := &Machine{spec: MachineSpec{Name: "m"}}
	l.up(m)
	<-inFlight
	l.down(m)
	l.up(m)
	close(release)
	// Renewed every 500ms: six in 3s; twice that is a second renewer.
	start := updates.Load()
	time.Sleep(3 * time.Second) // the span the renewals are counted over
	switch n := updates.Load() - start; {
	case n > 9:
		t.Errorf("the Lease was renewed %d times in 3s, every 500ms is 6: a second renewer", n)
	case n < 3:
		t.Errorf("the Lease was renewed %d times in 3s, every 500ms is 6: the boot did not resume its renewals", n)
	}
}
