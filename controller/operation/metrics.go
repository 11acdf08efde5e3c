package operation

import (
	"context"
	"sync/atomic"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/metrics"

	ichorv1 "maesh.dev/ichor/api/v1alpha1"
)

var (
	stepDuration = prometheus.NewHistogramVec(prometheus.HistogramOpts{
		Name:    "ichor_step_duration_seconds",
		Help:    "How long machine steps took, by operation kind and step.",
		Buckets: prometheus.ExponentialBuckets(0.01, 3, 12),
	}, []string{"kind", "step"})
	stepFailures = prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "ichor_step_failures_total",
		Help: "Machine steps that failed, by operation kind, step and failure reason.",
	}, []string{"kind", "step", "reason"})
	lockHeldSeconds = prometheus.NewCounter(prometheus.CounterOpts{
		Name: "ichor_cluster_lock_held_seconds_total",
		Help: "Seconds the cluster lock was held by operations of this controller, counted when released.",
	})
	lockHeld = prometheus.NewGauge(prometheus.GaugeOpts{
		Name: "ichor_cluster_lock_held",
		Help: "1 while an operation of this controller holds the cluster lock.",
	})
	statusWrites = prometheus.NewCounter(prometheus.CounterOpts{
		Name: "ichor_status_writes_total",
		Help: "Status updates written to TalosOperations.",
	})
)

func init() {
	metrics.Registry.MustRegister(stepDuration, stepFailures, lockHeldSeconds, lockHeld, statusWrites, phases)
}

// observeStep records how long a step that succeeded took (failures are
// counted where they are recorded, in fail).
func observeStep(kind ichorv1.OperationKind, step string, took time.Duration) {
	stepDuration.WithLabelValues(string(kind), step).Observe(took.Seconds())
}

// phaseCollector reports operations by kind and phase from the cache at
// scrape time, so the gauge can never drift from the objects. It reads
// through the latest manager's cache (tests start several in one process).
type phaseCollector struct {
	client atomic.Pointer[client.Reader]
	desc   *prometheus.Desc
}

var phases = &phaseCollector{desc: prometheus.NewDesc("ichor_operations",
	"TalosOperations by kind and phase.", []string{"kind", "phase"}, nil)}

func (p *phaseCollector) Describe(ch chan<- *prometheus.Desc) { ch <- p.desc }

func (p *phaseCollector) Collect(ch chan<- prometheus.Metric) {
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	r := p.client.Load()
	if r == nil {
		return
	}
	var ops ichorv1.TalosOperationList
	if err := (*r).List(ctx, &ops, client.UnsafeDisableDeepCopy); err != nil {
		return
	}
	counts := map[[2]string]int{}
	for _, op := range ops.Items {
		phase := string(op.Status.Phase)
		if phase == "" {
			phase = string(ichorv1.PhasePending)
		}
		counts[[2]string{string(op.Spec.Kind), phase}]++
	}
	for k, n := range counts {
		ch <- prometheus.MustNewConstMetric(p.desc, prometheus.GaugeValue, float64(n), k[0], k[1])
	}
}
