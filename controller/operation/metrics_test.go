package operation_test

import (
	"testing"

	dto "github.com/prometheus/client_model/go"
	"sigs.k8s.io/controller-runtime/pkg/metrics"
)

// gather reads every metric of the registry, which accumulates across the
// tests of the package: a test compares what it reads with what was there
// before it began.
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

// checkMetrics: after an upgrade that failed once and was retried, the
// controller's metrics say so: each grew since before. ichor_operations,
// a gauge read from the cache at scrape time, is compared with nothing.
func checkMetrics(t *testing.T, before []*dto.MetricFamily) {
	t.Helper()
	now := gather(t)
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
		was := metric(before, tt.name, tt.labels)
		if tt.name == "ichor_operations" {
			was = 0
		}
		if v := metric(now, tt.name, tt.labels); v <= was {
			t.Errorf("metric %s%v = %v, want more than the %v before the test", tt.name, tt.labels, v, was)
		}
	}
}
