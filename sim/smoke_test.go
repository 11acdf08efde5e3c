package sim_test

import (
	"testing"
)

func TestSmoke(t *testing.T) {
	f := start(t, fleetSpec(t, 3, 2))
	c := talos(t, f)
	for _, m := range f.Machines() {
		v, err := version(t, c, m)
		if err != nil {
			t.Fatalf("%s: %v", m.Name(), err)
		}
		t.Logf("%s %s %s", m.Name(), m.Address(), v)
		n := node(t, m)
		t.Logf("node %s ready=%v info=%+v", n.Name, nodeReady(n), n.Status.NodeInfo)
	}
}
