package operation_test

import (
	"testing"

	dto "github.com/prometheus/client_model/go"
	"sigs.k8s.io/controller-runtime/pkg/metrics"
)

// metric sums the samples of a metric family whose labels include want.
func metric(t *testing.T, name string, want map[string]string) float64 {
	t.Helper()
	families, err := metrics.Registry.Gather()
	if err != nil {
		t.Fatal(err)
	}
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

// checkMetrics: after an upgrade that failed once and was retried, the
// controller's metrics say so.
func checkMetrics(t *testing.T) {
	t.Helper()
	for _, tt := range []struct {
		name   string
		labels map[string]string
	}{
		{"ichor_step_failures_total", map[string]string{"kind": "talos", "step": "install", "reason": "InstallFailed"}},
		{"ichor_step_duration_seconds", map[string]string{"kind": "talos", "step": "install"}},
		{"ichor_operations", map[string]string{"kind": "talos", "phase": "Succeeded"}},
		{"ichor_cluster_lock_held_seconds_total", nil},
		{"ichor_status_writes_total", nil},
	} {
		if v := metric(t, tt.name, tt.labels); v <= 0 {
			t.Errorf("metric %s%v = %v, want > 0", tt.name, tt.labels, v)
		}
	}
}
