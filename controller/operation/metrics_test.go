package operation_test

import (
	"context"
	"fmt"
	"testing"
	"time"

	dto "github.com/prometheus/client_model/go"
	"sigs.k8s.io/controller-runtime/pkg/metrics"

	ichorv1 "maesh.dev/ichor/api/v1alpha1"
	"maesh.dev/ichor/internal/testenv"
)

// gather reads every metric of the registry, which accumulates across the
// tests of the package: a test compares what it reads with what was there
// before it began (see checkMetrics).
func gather(t *testing.T) []*dto.MetricFamily {
	t.Helper()
	families, err := metrics.Registry.Gather()
	if err != nil {
		t.Fatal(err)
	}
	return families
}

// metric sums the samples of a metric family whose labels include want.
func metric(families []*dto.MetricFamily, name string, want map[string]string) float64 {
	sum := 0.0
	for _, f := range families {
		if f.GetName() != name {
			continue
		}
		for _, m := range f.GetMetric() {
			if !hasLabels(m, want) {
				continue
			}
			switch {
			case m.Counter != nil:
				sum += m.Counter.GetValue()
			case m.Gauge != nil:
				sum += m.Gauge.GetValue()
			case m.Histogram != nil:
				sum += float64(m.Histogram.GetSampleCount())
			}
		}
	}
	return sum
}

func hasLabels(m *dto.Metric, want map[string]string) bool {
	got := map[string]string{}
	for _, l := range m.GetLabel() {
		got[l.GetName()] = l.GetValue()
	}
	for k, v := range want {
		if got[k] != v {
			return false
		}
	}
	return true
}

// checkMetrics: after an upgrade of four machines whose install failed
// once on one of them and was retried, the controller's metrics say so. The
// registry is the process's, shared by every test of the package (they run
// one after another), so a counter is judged by how much it grew during
// this test, and ichor_operations, a gauge read from the cache at scrape
// time, against the operations the API server holds now.
func checkMetrics(t *testing.T, before []*dto.MetricFamily) {
	t.Helper()
	now := gather(t)
	for _, tt := range []struct {
		name   string
		labels map[string]string
		grew   float64 // exactly; 0: by any amount
	}{
		{"ichor_step_failures_total", map[string]string{"kind": "talos", "step": "install", "reason": "InstallFailed"}, 1},
		{"ichor_step_duration_seconds", map[string]string{"kind": "talos", "step": "install"}, 4},
		{"ichor_cluster_lock_held_seconds_total", nil, 0},
		{"ichor_status_writes_total", nil, 0},
	} {
		grew := metric(now, tt.name, tt.labels) - metric(before, tt.name, tt.labels)
		if tt.grew != 0 && grew != tt.grew || grew <= 0 {
			t.Errorf("metric %s%v grew by %v during the test, want %v", tt.name, tt.labels, grew, tt.grew)
		}
	}
	succeeded := map[string]string{"kind": "talos", "phase": "Succeeded"}
	testenv.Eventually(t, 30*time.Second, fmt.Sprintf("ichor_operations%v to count the succeeded talos operations", succeeded), func(ctx context.Context) (bool, error) {
		var ops ichorv1.TalosOperationList
		if err := env.Client.List(ctx, &ops); err != nil {
			return false, err
		}
		want := 0.0
		for _, op := range ops.Items {
			if op.Spec.Kind == ichorv1.KindTalos && op.Status.Phase == ichorv1.PhaseSucceeded {
				want++
			}
		}
		return metric(gather(t), "ichor_operations", succeeded) == want, nil
	})
}
