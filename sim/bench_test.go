package sim_test

import (
	"cmp"
	"context"
	"fmt"
	"os"
	"sync"
	"testing"
	"time"

	"github.com/siderolabs/talos/pkg/machinery/client"
	"k8s.io/client-go/kubernetes"

	"maesh.dev/ichor/internal/proc"
	"maesh.dev/ichor/sim"
)

// BenchmarkFleet1000 starts a fleet of 1,000 machines (3 control planes)
// and asks every machine its version through the real client, once without
// a Kubernetes side and once with every Node in the test API server. It
// reports the start time, the time to serve the 1,000 Version calls, and
// the process's peak RSS (VmHWM, reset before each run; it includes the
// test binary's own API clients and informer caches).
func BenchmarkFleet1000(b *testing.B) {
	// The PKI fleets share is made once per process (about a second);
	// make it before measuring what each fleet costs.
	warm, err := sim.Start(context.Background(), sim.Cluster("warm", 1, 0), nil)
	if err != nil {
		b.Fatal(err)
	}
	warm.Stop()
	for _, bc := range []struct {
		name string
		kube kubernetes.Interface
	}{{"talos-only", nil}, {"with-nodes", env.Kube}} {
		b.Run(bc.name, func(b *testing.B) {
			b.ReportAllocs()
			var startDur, serveDur time.Duration
			var peak int64
			for b.Loop() {
				if err := proc.ResetPeak(); err != nil {
					b.Fatal(err)
				}
				spec := fleetSpec(b, 3, 997)
				spec.Logf = nil
				t0 := time.Now()
				f, err := sim.Start(context.Background(), spec, bc.kube)
				if err != nil {
					b.Fatal(err)
				}
				startDur += time.Since(t0)
				c := talos(b, f)
				t1 := time.Now()
				versionAll(b, c, f)
				serveDur += time.Since(t1)
				mem, err := proc.ReadMemory(os.Getpid())
				if err != nil {
					b.Fatal(err)
				}
				peak = max(peak, mem.Peak)
				f.Stop()
				_ = c.Close()
			}
			n := float64(b.N)
			b.ReportMetric(startDur.Seconds()/n, "start-s/op")
			b.ReportMetric(serveDur.Seconds()/n, "version-all-s/op")
			b.ReportMetric(float64(peak)/(1<<20), "peak-RSS-MiB")
		})
	}
}

// versionAll asks every machine its version, 32 calls at a time.
func versionAll(b *testing.B, c *client.Client, f *sim.Fleet) {
	machines := f.Machines()
	work := make(chan *sim.Machine)
	var wg sync.WaitGroup
	var mu sync.Mutex
	var firstErr error
	for range 32 {
		wg.Go(func() {
			for m := range work {
				resp, err := c.Version(client.WithNode(context.Background(), m.Address()))
				if err == nil && resp.Messages[0].Version.Tag != m.Version() {
					err = fmt.Errorf("%s answered %s", m.Name(), resp.Messages[0].Version.Tag)
				}
				if err != nil {
					mu.Lock()
					firstErr = cmp.Or(firstErr, err)
					mu.Unlock()
				}
			}
		})
	}
	for _, m := range machines {
		work <- m
	}
	close(work)
	wg.Wait()
	if firstErr != nil {
		b.Fatal(firstErr)
	}
	if got := f.Recorder().Calls("", "Version"); got < len(machines) {
		b.Fatalf("%d Version calls served, want %d", got, len(machines))
	}
}
