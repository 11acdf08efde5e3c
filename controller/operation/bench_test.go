package operation_test

import (
	"cmp"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"maps"
	"math"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"runtime/debug"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"google.golang.org/grpc/codes"
	appsv1 "k8s.io/api/apps/v1"
	coordinationv1 "k8s.io/api/coordination/v1"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/apimachinery/pkg/watch"
	"k8s.io/utils/ptr"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/yaml"

	ichorv1 "maesh.dev/ichor/api/v1alpha1"
	"maesh.dev/ichor/controller/executor"
	"maesh.dev/ichor/internal/proc"
	"maesh.dev/ichor/internal/testenv"
	"maesh.dev/ichor/sim"
)

// The budgets of DESIGN.md, reported as ratios (never asserted: these
// machines are shared and noisy).
const (
	writesBudget = 3.0
	// API requests per machine step, every verb, counted at the API server.
	requestsBudget = 6.0
	reactionBudget = 50 * time.Millisecond
)

// watcher follows the operations of one namespace and says when each
// condition first held. It counts status writes too, and sees when each
// stage of an operation made of stages began.
type watcher struct {
	w      watch.Interface
	writes map[string]int
	stages []stageSeen
}

// stageSeen is when a watcher first saw an operation at a stage.
type stageSeen struct {
	name string
	at   time.Time
}

func watchOps(b testing.TB, ns string) *watcher {
	b.Helper()
	wc, err := client.NewWithWatch(env.Config, client.Options{Scheme: testenv.Scheme})
	if err != nil {
		b.Fatal(err)
	}
	w, err := wc.Watch(context.Background(), &ichorv1.TalosOperationList{}, client.InNamespace(ns))
	if err != nil {
		b.Fatal(err)
	}
	b.Cleanup(w.Stop)
	return &watcher{w: w, writes: map[string]int{}}
}

// until returns when cond holds for an event of the named operation.
func (w *watcher) until(b testing.TB, name string, timeout time.Duration, cond func(*ichorv1.TalosOperation) bool) time.Time {
	b.Helper()
	deadline := time.After(timeout)
	var last *ichorv1.TalosOperation
	for {
		select {
		case ev := <-w.w.ResultChan():
			op, ok := ev.Object.(*ichorv1.TalosOperation)
			if !ok || op.Name != name {
				continue
			}
			now := time.Now()
			if ev.Type == watch.Modified {
				w.writes[name]++
			}
			if st := op.Status.Stage; st != "" && (len(w.stages) == 0 || w.stages[len(w.stages)-1].name != st) {
				w.stages = append(w.stages, stageSeen{st, now})
			}
			if cond(op) {
				return now
			}
			last = op
		case <-deadline:
			b.Fatalf("timed out after %s waiting on %s; its last status: %s", timeout, name, lastStatus(last))
		}
	}
}

// lastStatus says where an operation stands, for a timeout's message.
func lastStatus(op *ichorv1.TalosOperation) string {
	if op == nil {
		return "none seen"
	}
	st := op.Status
	out := fmt.Sprintf("phase %s, stage %q: %s", st.Phase, st.Stage, st.Message)
	for _, m := range st.Machines {
		if m.Phase == ichorv1.MachineInProgress || m.Phase == ichorv1.MachineFailed {
			out += fmt.Sprintf("; %s %s at %s: %s", m.Name, m.Phase, m.Step, m.Message)
		}
	}
	return out
}

// scheduleSizes are the fleets each schedule benchmark runs (3 control
// planes and this many workers, in batches of maxUnavailable), each with
// its budget of wall time over the ideal schedule.
var scheduleSizes = []struct {
	workers, maxUnavailable int
	budget                  float64
}{
	{30, 5, 1.02},
	{300, 30, 1.05},
}

// eachSize runs fn as a sub-benchmark per schedule size.
func eachSize(b *testing.B, fn func(b *testing.B, workers, maxUnavailable int, budget float64)) {
	for _, sz := range scheduleSizes {
		b.Run(fmt.Sprintf("workers=%d", sz.workers), func(b *testing.B) { fn(b, sz.workers, sz.maxUnavailable, sz.budget) })
	}
}

// BenchmarkUpgradeSchedule: a Talos upgrade of 3 control planes and 30
// (then 300) workers with fixed simulated step durations. It reports the
// wall time over the ideal schedule (control planes one after another,
// workers in batches of maxUnavailable, each machine taking exactly its
// simulated durations), the status writes per machine step and the API
// server's count of the controller's requests.
func BenchmarkUpgradeSchedule(b *testing.B) {
	eachSize(b, func(b *testing.B, workers, maxUnavailable int, budget float64) {
		// Scaled down from a real machine (pull ~30 s, install ~1 min, reboot
		// 2-5 min) so the benchmark takes about a minute; the controller's own
		// cost per step boundary (a status write and a reconcile, ~10-40 ms
		// here) is what the ratio measures.
		d := sim.Durations{ImagePull: 500 * time.Millisecond, Install: 1500 * time.Millisecond,
			Stop: 500 * time.Millisecond, Reboot: 5 * time.Second}
		spec := sim.Cluster("", 3, workers)
		spec.Durations = d
		for j := range spec.Machines {
			spec.Machines[j].Talos = "v1.13.2"
		}
		op := talosSpec("v1.13.7")
		op.MaxUnavailable = int32(maxUnavailable)
		benchSchedule(b, spec, op, d.ImagePull+d.Install+d.Stop+d.Reboot, budget, nil)
	})
}

// BenchmarkConfigSchedule: a config rollout (machine.env, so every machine
// reboots) of 3 control planes and 30 (then 300) workers, reported as
// BenchmarkUpgradeSchedule is.
func BenchmarkConfigSchedule(b *testing.B) {
	eachSize(b, func(b *testing.B, workers, maxUnavailable int, budget float64) {
		d := sim.Durations{Stop: 500 * time.Millisecond, Reboot: 5 * time.Second}
		spec := sim.Cluster("", 3, workers)
		spec.Durations = d
		op := configSpec(ichorv1.ConfigModeAuto, "machine:\n  env:\n    HTTP_PROXY: http://proxy.internal:3128\n")
		op.MaxUnavailable = int32(maxUnavailable)
		// Every machine rebooted: count the steps of that path (a machine that
		// is done no longer records the boot ID that selects it).
		rebooted := func(m ichorv1.MachineStatus) ichorv1.MachineStatus { m.BootID = "before"; return m }
		benchSchedule(b, spec, op, d.Stop+d.Reboot, budget, rebooted)
	})
}

// BenchmarkKubernetesSchedule: a Kubernetes upgrade (every stage: the
// pre-pull, the three control-plane components, kube-proxy's image, the
// bootstrap manifests and the kubelets) of 3 control planes and 30 (then
// 300) workers, reported as BenchmarkUpgradeSchedule is. Its ideal
// schedule is each stage's in turn: the pre-pull and the kubelets as a
// rolling kind's (control planes one at a time, workers in batches of
// maxUnavailable), a static pod's restart per control plane and component,
// and kube-proxy's rollout as the real DaemonSet controller took it (from
// the DaemonSet's new generation to its last new pod available): Ichor
// waits for that controller and cannot make it faster.
//
// The node-lifecycle controller stays on (and the Node Leases renew every
// second, as in the tests): it lifts the not-ready taint that CoreDNS's
// pods, which the sync rolls too, do not tolerate.
func BenchmarkKubernetesSchedule(b *testing.B) {
	eachSize(b, func(b *testing.B, workers, maxUnavailable int, budget float64) {
		const cps = 3
		d := sim.Durations{ImagePull: 300 * time.Millisecond, PodReady: 500 * time.Millisecond, KubeletRestart: 2 * time.Second}
		spec := sim.Cluster("", cps, workers)
		spec.KubeProxy = true
		spec.Durations = d
		op := ichorv1.TalosOperationSpec{Kind: ichorv1.KindKubernetes, Kubernetes: &ichorv1.KubernetesUpgrade{Version: "v1.35.1"}, MaxUnavailable: int32(maxUnavailable)}
		batches := time.Duration(cps + (workers+maxUnavailable-1)/maxUnavailable)
		// A control plane pulls its three components' images and the kubelet's; a worker the kubelet's.
		prePull := cps*4*d.ImagePull + (batches-cps)*d.ImagePull
		staticPods := 3 * cps * d.PodReady
		kubelets := batches * d.KubeletRestart
		for i := 0; i < b.N; i++ {
			rolledOut := watchRollout(b, "kube-proxy")
			wall := runSchedule(b, spec, op, func(c *cluster) {
				b.Cleanup(func() { removeBootstrapManifests(b) })
				waitKubeProxy(b, "registry.k8s.io/kube-proxy:v1.35.0", int32(cps+workers))
			}, nil)
			rollout := rolledOut()
			ideal := prePull + staticPods + rollout + kubelets
			b.ReportMetric(wall.Seconds()/ideal.Seconds()/budget, "wall/ideal/budget")
			b.Logf("kubernetes: wall %s, ideal %s (pre-pull %s, static pods %s, kube-proxy's rollout %s, kubelets %s): %.3f of the ideal (budget %.2f, ratio %.3f)",
				wall.Round(time.Millisecond), ideal.Round(time.Millisecond), prePull, staticPods, rollout.Round(time.Millisecond), kubelets,
				wall.Seconds()/ideal.Seconds(), budget, wall.Seconds()/ideal.Seconds()/budget)
		}
	})
}

// machineSteps counts the steps of op's machines (each as path, when set,
// says it was), stage by stage in a kind made of stages: a stage's steps
// on each machine it takes, and those of a stage run Once on one.
func machineSteps(op *ichorv1.TalosOperation, path func(ichorv1.MachineStatus) ichorv1.MachineStatus) int {
	exec := executor.Default()[op.Spec.Kind]
	stages := op.Status.Stages
	if len(stages) == 0 {
		stages = []ichorv1.StageStatus{{}}
	}
	n := 0
	for _, st := range stages {
		at := op.DeepCopy()
		at.Status.Stage = st.Name
		for _, m := range at.Status.Machines {
			if path != nil {
				m = path(m)
			}
			if len(st.Roles) > 0 && !slices.Contains(st.Roles, m.Role) {
				continue
			}
			n += len(exec.Steps(at, &m))
			if st.Order == ichorv1.StageOnce {
				break
			}
		}
	}
	return n
}

// watchRollout follows the named DaemonSet of kube-system and returns how
// long its last rollout took: from the first generation it had not
// observed to the moment its status showed every pod of that generation
// available.
func watchRollout(b testing.TB, name string) func() time.Duration {
	wc, err := client.NewWithWatch(env.Config, client.Options{Scheme: testenv.Scheme})
	if err != nil {
		b.Fatal(err)
	}
	w, err := wc.Watch(context.Background(), &appsv1.DaemonSetList{}, client.InNamespace("kube-system"))
	if err != nil {
		b.Fatal(err)
	}
	b.Cleanup(w.Stop)
	var mu sync.Mutex
	var began, ended time.Time
	var generation int64
	go func() {
		for ev := range w.ResultChan() {
			ds, ok := ev.Object.(*appsv1.DaemonSet)
			if !ok || ds.Name != name {
				continue
			}
			st, now := ds.Status, time.Now()
			mu.Lock()
			if generation != 0 && ds.Generation > generation {
				began, ended = now, time.Time{}
			}
			generation = ds.Generation
			if !began.IsZero() && ended.IsZero() && st.ObservedGeneration == ds.Generation && st.DesiredNumberScheduled > 0 &&
				st.UpdatedNumberScheduled == st.DesiredNumberScheduled && st.NumberAvailable == st.DesiredNumberScheduled {
				ended = now
			}
			mu.Unlock()
		}
	}()
	return func() time.Duration {
		mu.Lock()
		defer mu.Unlock()
		if began.IsZero() || ended.IsZero() {
			b.Fatalf("no rollout of DaemonSet kube-system/%s seen", name)
		}
		return ended.Sub(began)
	}
}

// benchSchedule runs op over a fresh fleet of spec b.N times and reports its
// wall time, from Running to Succeeded, over the ideal schedule (control
// planes one after another, workers in batches of maxUnavailable, each
// machine taking perMachine), and its status writes per machine step (the
// steps of each machine as path, when set, says they were).
func benchSchedule(b *testing.B, spec sim.Spec, op ichorv1.TalosOperationSpec, perMachine time.Duration, budget float64, path func(ichorv1.MachineStatus) ichorv1.MachineStatus) {
	cps, workers := 0, 0
	for _, m := range spec.Machines {
		if m.Role == sim.ControlPlane {
			cps++
		} else {
			workers++
		}
	}
	batch := int(op.MaxUnavailable)
	ideal := time.Duration(cps+(workers+batch-1)/batch) * perMachine
	renewAsKubelets(b, &spec)
	for i := 0; i < b.N; i++ {
		wall := runSchedule(b, spec, op, nil, path)
		b.ReportMetric(wall.Seconds()/ideal.Seconds()/budget, "wall/ideal/budget")
		b.Logf("%s: wall %s, ideal %s: %.3f of the ideal (budget %.2f, ratio %.3f)", op.Kind, wall.Round(time.Millisecond), ideal,
			wall.Seconds()/ideal.Seconds(), budget, wall.Seconds()/ideal.Seconds()/budget)
	}
}

// renewAsKubelets has the fleet of spec renew its Node Leases as a kubelet
// renews them, not every second as the tests' do (33 machines would write 30
// a second): a benchmark measures the controller, not an API server kept
// busy by the fleet. The node-lifecycle controller is off until b ends, as
// it would judge these Leases by the tests' grace period.
func renewAsKubelets(b *testing.B, spec *sim.Spec) {
	spec.Kubelet.NodeLease = kubeletLease
	if err := env.SetNodeLifecycle(false); err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() { _ = env.SetNodeLifecycle(true) })
}

// runSchedule runs op once over a fresh fleet of spec, once ready (when
// set) says the fleet is, and returns its wall time from Running to
// Succeeded. It reports the status writes per machine step (the steps of
// each machine as path, when set, says they were).
func runSchedule(b *testing.B, spec sim.Spec, op ichorv1.TalosOperationSpec, ready func(*cluster), path func(ichorv1.MachineStatus) ichorv1.MachineStatus) time.Duration {
	quiet(b, &spec)
	c := newCluster(b, spec)
	if ready != nil {
		ready(c)
	}
	// As the one user the API server's audit log records: what it counts
	// is this controller's requests.
	c.start(as(testenv.AuditedUser, "system:masters"))
	w := watchOps(b, c.ns)
	c.create("bench", op)
	// From the moment it runs: the controller's own start-up is not the schedule's.
	start := w.until(b, "bench", time.Minute, func(op *ichorv1.TalosOperation) bool {
		return op.Status.Phase == ichorv1.PhaseRunning
	})
	cpu0 := readCPU(b)
	end := w.until(b, "bench", 15*time.Minute, func(op *ichorv1.TalosOperation) bool {
		if op.Failed() {
			b.Fatalf("failed: %s", op.Status.Message)
		}
		return op.Succeeded()
	})
	cpuLoad(b, string(op.Kind), cpu0, readCPU(b), end.Sub(start))
	// One line: go test keeps only a benchmark's first ten log lines, and
	// the wall-time ratio comes after these.
	var took []string
	for i, st := range w.stages {
		to := end
		if i+1 < len(w.stages) {
			to = w.stages[i+1].at
		}
		took = append(took, fmt.Sprintf("%s %s", st.name, to.Sub(st.at).Round(time.Millisecond)))
	}
	if len(took) > 0 {
		b.Logf("%s: the stages took %s", op.Kind, strings.Join(took, ", "))
	}
	steps := machineSteps(c.get("bench"), path)
	b.ReportMetric(float64(w.writes["bench"])/float64(steps)/writesBudget, "writes/budget")
	b.Logf("%s: %d status writes over %d machine steps: %.2f per step (budget %.0f)", op.Kind, w.writes["bench"], steps,
		float64(w.writes["bench"])/float64(steps), writesBudget)
	apiLoad(b, string(op.Kind), start, end, steps)
	return end.Sub(start)
}

// cpuAt is the machine's CPU time and the API server's at one moment.
type cpuAt struct {
	machine   proc.Machine
	apiserver time.Duration
}

func readCPU(b *testing.B) cpuAt {
	m, err := proc.ReadMachine()
	if err != nil {
		b.Fatal(err)
	}
	return cpuAt{machine: m, apiserver: apiserverCPU(b)}
}

// cpuLoad reports how busy the machine's cores were over a schedule that
// took wall, from before to after (every process: the API server, etcd,
// this one's controller and fleet), and how many cores the API server
// used: a schedule whose machine is busy near 1 waits for CPU at every
// step, the controller's and the API server's alike.
func cpuLoad(b *testing.B, kind string, before, after cpuAt, wall time.Duration) {
	busy := after.machine.BusySince(before.machine)
	cores := (after.apiserver - before.apiserver).Seconds() / wall.Seconds()
	b.ReportMetric(busy, "machine-cpu-busy")
	b.ReportMetric(cores, "apiserver-cores")
	b.Logf("%s: the machine's cores were busy %.0f%% of the time, the API server using %.2f cores", kind, 100*busy, cores)
}

// apiLoad reports the controller's requests from start to end as the API
// server's audit log counted them: every verb per machine step (budget
// requestsBudget), status writes per machine step (writesBudget), and the
// list requests (budget none: the caches are synced once it runs), with the
// ten commonest verb and resource pairs.
func apiLoad(b *testing.B, kind string, start, end time.Time, steps int) {
	reqs, err := env.AuditedRequests()
	if err != nil {
		b.Fatal(err)
	}
	// The log's timestamps have microseconds; the watcher's moments are
	// this process's clock, the API server's too (one machine).
	total, statusWrites, lists := 0, 0, 0
	by, listed := map[string]int{}, map[string]int{}
	for _, r := range reqs {
		if r.At.Before(start.Add(-time.Millisecond)) || r.At.After(end) {
			continue
		}
		total++
		key := r.Verb + " " + r.Resource
		if r.Subresource != "" {
			key += "/" + r.Subresource
		}
		by[key]++
		if r.Resource == "talosoperations" && r.Subresource == "status" && (r.Verb == "update" || r.Verb == "patch") {
			statusWrites++
		}
		if r.Verb == "list" {
			lists++
			listed[r.Resource]++
		}
	}
	keys := slices.Collect(maps.Keys(by))
	slices.SortFunc(keys, func(a, b string) int { return cmp.Or(by[b]-by[a], strings.Compare(a, b)) })
	var top []string
	for _, k := range keys[:min(10, len(keys))] {
		top = append(top, fmt.Sprintf("%s %d", k, by[k]))
	}
	perStep := float64(total) / float64(steps)
	writes := float64(statusWrites) / float64(steps)
	b.ReportMetric(perStep/requestsBudget, "requests/budget")
	b.ReportMetric(writes/writesBudget, "apiserver-status-writes/budget")
	b.ReportMetric(float64(lists), "lists")
	b.Logf("%s at the API server: %d requests over %d machine steps, %.2f per step (budget %.0f, ratio %.2f); "+
		"%d status writes, %.2f per step (budget %.0f, ratio %.2f); %d lists (budget 0) %v; commonest: %s",
		kind, total, steps, perStep, requestsBudget, perStep/requestsBudget, statusWrites, writes, writesBudget, writes/writesBudget,
		lists, listed, strings.Join(top, ", "))
}

// quiet sends the controller's and the machines' logs to a file
// ($ICHOR_TEST_LOG, or one in the temporary directory that the benchmark's
// log names): go test prints only a benchmark's first log lines, and theirs
// would push out the line that sets the ratio beside its budget.
func quiet(b *testing.B, spec *sim.Spec) {
	path := os.Getenv("ICHOR_TEST_LOG")
	flags := os.O_CREATE | os.O_APPEND | os.O_WRONLY
	if path == "" {
		path = filepath.Join(os.TempDir(), "ichor-"+strings.ReplaceAll(b.Name(), "/", "_")+".log")
		flags |= os.O_TRUNC
		b.Setenv("ICHOR_TEST_LOG", path)
	}
	f, err := os.OpenFile(path, flags, 0o600)
	if err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() { _ = f.Close() })
	var mu sync.Mutex
	spec.Logf = func(format string, args ...any) {
		mu.Lock()
		defer mu.Unlock()
		fmt.Fprintf(f, "%s\t"+format+"\n", append([]any{time.Now().UTC().Format(time.RFC3339Nano)}, args...)...)
	}
	b.Logf("the controller's and the machines' logs: %s", path)
}

// BenchmarkReaction: the time from a retry annotation, a resume, and a
// cluster lock release, each as a watch sees it on the API server, to the
// same watch seeing the next step started, each sampled
// reactionSamples times and reported at the 99th percentile (budget 50 ms):
// retry and resume on an upgrade of 1 control plane and faultyWorkers
// workers, and again on an upgrade of 1,000 machines, whose status every
// turn reads and writes; lock release on a fleet of 3 (a reboot
// operation waits while another, its machine hung in Reboot, holds the lock).
// The fleets renew their Node Leases as kubelets do (renewAsKubelets): at
// the tests' pace a 1,000-machine fleet writes 1,000 Leases a second beside
// the writes each reaction waits for.
func BenchmarkReaction(b *testing.B) {
	b.Run("retry-resume/machines=26", func(b *testing.B) {
		for i := 0; i < b.N; i++ {
			retryAndResume(b, faultyWorkers)
		}
	})
	b.Run("lock-release/machines=3", func(b *testing.B) {
		for i := 0; i < b.N; i++ {
			lockRelease(b)
		}
	})
	b.Run("retry-resume/machines=1000", func(b *testing.B) {
		for i := 0; i < b.N; i++ {
			retryAndResume(b, 999)
		}
	})
}

// BenchmarkStatusWrite times what every reaction waits for once from the
// request on the API server, and a retry or a resume twice from the
// request sent (the operator's write, then the controller's): one write of
// an operation at the API server, here a status update that starts one
// more machine, at the operation sizes the other benchmarks run. It
// reports the median and the 99th percentile of 20 writes in
// milliseconds, beside the reactions' 50 ms budget, and the API server's
// CPU time per write (its own metric, its watch's decoding and its
// garbage collection included): what the machine's cores must give each
// write, however the controller writes.
func BenchmarkStatusWrite(b *testing.B) {
	for _, machines := range []int{21, 300, 1000, 5000} {
		b.Run(fmt.Sprintf("machines=%d", machines), func(b *testing.B) {
			for i := 0; i < b.N; i++ {
				statusWrites(b, machines)
			}
		})
	}
}

func statusWrites(b *testing.B, machines int) {
	ctx := context.Background()
	op := &ichorv1.TalosOperation{}
	op.Namespace, op.Name = env.Namespace(b), "writes"
	op.Spec = talosSpec("v1.13.7")
	if err := env.Client.Create(ctx, op); err != nil {
		b.Fatal(err)
	}
	// Gone before the next benchmark's controller starts: it would take
	// this operation up (no controller has put its finalizer on it).
	b.Cleanup(func() { _ = env.Client.Delete(context.Background(), op) })
	for i := range machines {
		op.Status.Machines = append(op.Status.Machines, ichorv1.MachineStatus{Name: fmt.Sprintf("sim-w-%d", i),
			Role: ichorv1.RoleWorker, Phase: ichorv1.MachinePending, From: "v1.13.2", To: "v1.13.7"})
	}
	if err := env.Client.Status().Update(ctx, op); err != nil {
		b.Fatal(err)
	}
	var took []time.Duration
	cpu0 := apiserverCPU(b)
	for i := range reactionSamples {
		m := &op.Status.Machines[i%machines]
		m.Phase, m.Step, m.Attempts = ichorv1.MachineInProgress, executor.StepInspect, m.Attempts+1
		t0 := time.Now()
		if err := env.Client.Status().Update(ctx, op); err != nil {
			b.Fatal(err)
		}
		took = append(took, time.Since(t0))
	}
	cpu := (apiserverCPU(b) - cpu0) / reactionSamples
	slices.Sort(took)
	ms := func(d time.Duration) float64 { return float64(d) / float64(time.Millisecond) }
	p50, p99 := nearestRank(took, 0.5), nearestRank(took, 0.99)
	b.ReportMetric(ms(p50), "write-p50-ms")
	b.ReportMetric(ms(p99), "write-p99-ms")
	b.ReportMetric(ms(cpu), "apiserver-cpu-ms-per-write")
	b.Logf("%d machines: a status write takes %s (median of %d), %s at the 99th percentile, and %s of the API server's CPU; a reaction's budget is %s",
		machines, p50.Round(time.Millisecond), len(took), p99.Round(time.Millisecond), cpu.Round(time.Millisecond), reactionBudget)
}

// apiserverCPU is the CPU time the API server has used, from its metric
// process_cpu_seconds_total (kept in ticks of 10 ms: read over many writes).
func apiserverCPU(b *testing.B) time.Duration {
	raw, err := env.Kube.CoreV1().RESTClient().Get().AbsPath("/metrics").DoRaw(context.Background())
	if err != nil {
		b.Fatalf("read the API server's metrics: %v", err)
	}
	for line := range strings.Lines(string(raw)) {
		if v, ok := strings.CutPrefix(strings.TrimSpace(line), "process_cpu_seconds_total "); ok {
			s, err := strconv.ParseFloat(v, 64)
			if err != nil {
				b.Fatalf("process_cpu_seconds_total %q: %v", v, err)
			}
			return time.Duration(s * float64(time.Second))
		}
	}
	b.Fatal("the API server's metrics have no process_cpu_seconds_total")
	return 0
}

// reactionSamples is how many times each reaction is measured: at least
// 20, so that the 99th percentile is a sample's and not an interpolation.
const reactionSamples = 20

// retryAndResume runs a Talos upgrade of 1 control plane and workers, one
// machine at a time, whose first workers (in the plan's order, up to
// faultyWorkers) each fail their install once, and measures each retry
// (the annotation to the failed step started again) and a resume after
// each (spec.paused lifted to the next step started), until it has
// reactionSamples of both. It reports both at the 99th percentile.
func retryAndResume(b *testing.B, workers int) {
	spec := sim.Cluster("", 1, workers)
	quiet(b, &spec)
	renewAsKubelets(b, &spec)
	c := newCluster(b, spec)
	c.start()
	w := watchOps(b, c.ns)
	op := talosSpec("v1.13.7")
	op.MaxUnavailable, op.Paused = 1, true
	c.create("upgrade", op)
	// Created paused, it shows its plan: the machines in the order they go.
	w.until(b, "upgrade", 5*time.Minute, func(op *ichorv1.TalosOperation) bool {
		return op.Status.Reason == ichorv1.ReasonPausedByOperator && len(op.Status.Machines) == workers+1
	})
	faulty := 0
	for _, m := range c.get("upgrade").Status.Machines {
		if m.Role == ichorv1.RoleWorker && faulty < faultyWorkers {
			// The fleet runs 1.12: the legacy path installs with
			// MachineService.Upgrade. Refused (Unavailable would be retried
			// by the step itself, and never fail it).
			c.fleet.Machine(m.Name).Inject(sim.Fault{Kind: sim.FaultError, Method: "Upgrade", Code: codes.PermissionDenied, Once: true})
			faulty++
		}
	}
	c.patchSpec("upgrade", `{"paused":false}`)
	// Each reaction is timed from the moment the request is seen on the API
	// server (this watch's event, as a lock release is timed from its
	// watch's): what the controller can react to. From the moment the
	// operator sent it is reported beside, which adds the operator's own
	// write of the operation.
	var retries, resumes, retriesSent, resumesSent []time.Duration
	for failed := 0; len(retries) < reactionSamples || len(resumes) < reactionSamples; failed++ {
		if failed == faulty {
			b.Fatalf("%d workers failed and were retried, and %d retries and %d resumes were measured: want %d of each", faulty, len(retries), len(resumes), reactionSamples)
		}
		// Once the last retry's annotation is gone: set again while the
		// controller has yet to remove it, it would be that request, consumed.
		w.until(b, "upgrade", 5*time.Minute, func(op *ichorv1.TalosOperation) bool {
			_, asked := op.Annotations[ichorv1.RetryAnnotation]
			return op.StepFailed() && !asked
		})
		m := c.get("upgrade").Status.FailedMachine()
		if m == nil {
			b.Fatal("the operation failed a step, but no machine entry says which")
		}
		name, attempts := m.Name, m.Attempts
		sent := time.Now()
		c.annotate("upgrade", ichorv1.RetryAnnotation, "true")
		seen := w.until(b, "upgrade", time.Minute, func(op *ichorv1.TalosOperation) bool {
			_, asked := op.Annotations[ichorv1.RetryAnnotation]
			return asked
		})
		t1 := w.until(b, "upgrade", time.Minute, func(op *ichorv1.TalosOperation) bool {
			m := entryOf(op, name)
			return m != nil && m.Phase == ichorv1.MachineInProgress && m.Attempts == attempts+1
		})
		retries = append(retries, t1.Sub(seen))
		retriesSent = append(retriesSent, t1.Sub(sent))

		// Pause between steps, then resume: running again is the moment the
		// recorded next step is started. On a large operation the pause can
		// come after the next faulty machine has failed (the retried one went
		// on while this watch caught up): then there is no quiet pause to
		// resume from, and the failure is the next retry's.
		c.patchSpec("upgrade", `{"paused":true}`)
		var pausedQuietly bool
		w.until(b, "upgrade", time.Minute, func(op *ichorv1.TalosOperation) bool {
			pausedQuietly = op.Status.Reason == ichorv1.ReasonPausedByOperator && op.Status.Message == pausedQuiet
			retried := entryOf(op, name)
			return pausedQuietly || op.StepFailed() && retried != nil && retried.Phase == ichorv1.MachineSucceeded
		})
		sent = time.Now()
		c.patchSpec("upgrade", `{"paused":false}`)
		if !pausedQuietly {
			continue
		}
		seen = w.until(b, "upgrade", time.Minute, func(op *ichorv1.TalosOperation) bool { return !op.Spec.Paused })
		t1 = w.until(b, "upgrade", time.Minute, func(op *ichorv1.TalosOperation) bool {
			return op.Status.Phase == ichorv1.PhaseRunning
		})
		resumes = append(resumes, t1.Sub(seen))
		resumesSent = append(resumesSent, t1.Sub(sent))
	}
	reportP99(b, "retry", retries[:reactionSamples])
	reportP99(b, "resume", resumes[:reactionSamples])
	reportSent(b, "retry", retriesSent[:reactionSamples])
	reportSent(b, "resume", resumesSent[:reactionSamples])
}

// faultyWorkers is how many workers retryAndResume makes fail: a few more
// than reactionSamples, for the resumes a pause that came late cost.
const faultyWorkers = reactionSamples + 5

// lockRelease measures, reactionSamples times on a fleet of 1 control
// plane and 2 workers, a reboot operation waiting for the cluster lock
// that another one holds (its machine hangs in Reboot): from the holder
// letting go (its release, or the waiting one's takeover when that comes
// first: a completed holder is taken over) to the waiting one's machine in
// progress.
func lockRelease(b *testing.B) {
	spec := sim.Cluster("", 1, 2)
	quiet(b, &spec)
	renewAsKubelets(b, &spec)
	c := newCluster(b, spec)
	c.start()
	w := watchOps(b, c.ns)
	ms := c.fleet.Machines()
	held, waiting := ms[len(ms)-1], ms[len(ms)-2].Name()
	var releases []time.Duration
	takeovers := 0
	for i := range reactionSamples {
		a, bb := fmt.Sprintf("holder-%d", i), fmt.Sprintf("waiter-%d", i)
		release := held.Inject(sim.Fault{Kind: sim.FaultHang, Method: "Reboot"})
		c.create(a, rebootSpec(held.Name()))
		w.until(b, a, time.Minute, func(op *ichorv1.TalosOperation) bool {
			m := entryOf(op, held.Name())
			return m != nil && m.Step == executor.StepReboot
		})
		c.create(bb, rebootSpec(waiting))
		w.until(b, bb, time.Minute, func(op *ichorv1.TalosOperation) bool { return op.Status.Lock == ichorv1.LockWaiting })
		left := c.watchLockLeft(b, ichorv1.OperationIdentity(c.ns, a))
		release()
		l := <-left
		if l.to != "" {
			takeovers++
		}
		t1 := w.until(b, bb, time.Minute, func(op *ichorv1.TalosOperation) bool {
			m := entryOf(op, waiting)
			return m != nil && m.Phase == ichorv1.MachineInProgress
		})
		releases = append(releases, t1.Sub(l.at))
		c.waitSucceeded(a, time.Minute)
		c.waitSucceeded(bb, time.Minute)
	}
	reportP99(b, "lock-release", releases)
	b.Logf("lock-release: in %d of %d samples the waiting operation took the lock over from the holder, which had completed but not released it yet; those are timed from the takeover", takeovers, len(releases))
}

// nearestRank is the p-th quantile of sorted samples, by nearest rank: at
// 20 samples the 99th percentile is the slowest.
func nearestRank(sorted []time.Duration, p float64) time.Duration {
	return sorted[int(math.Ceil(p*float64(len(sorted))))-1]
}

const pausedQuiet = "paused by an operator (spec.paused); `kubectl ichor operation resume` lifts it"

// reportP99 reports the 99th percentile of samples (nearest rank) against
// reactionBudget, with the median and the slowest beside it.
func reportP99(b *testing.B, what string, samples []time.Duration) {
	s := slices.Clone(samples)
	slices.Sort(s)
	p99 := nearestRank(s, 0.99)
	b.ReportMetric(float64(p99)/float64(reactionBudget), what+"-p99/budget")
	b.Logf("%s: next step started after %s at the 99th percentile of %d samples (median %s, slowest %s; budget %s, ratio %.2f)",
		what, p99.Round(time.Microsecond), len(s), nearestRank(s, 0.5).Round(time.Microsecond), s[len(s)-1].Round(time.Microsecond),
		reactionBudget, float64(p99)/float64(reactionBudget))
}

// reportSent reports the 99th percentile and the median of samples timed
// from the moment the operator sent its request, in milliseconds, beside
// reportP99's figure (from the moment it was seen on the API server).
func reportSent(b *testing.B, what string, samples []time.Duration) {
	s := slices.Clone(samples)
	slices.Sort(s)
	ms := func(d time.Duration) float64 { return float64(d) / float64(time.Millisecond) }
	p99, p50 := nearestRank(s, 0.99), nearestRank(s, 0.5)
	b.ReportMetric(ms(p99), what+"-sent-p99-ms")
	b.Logf("%s, from the operator's request sent (its own write of the operation included): %s at the 99th percentile (median %s)",
		what, p99.Round(time.Microsecond), p50.Round(time.Microsecond))
}

// lockLeft is the moment the cluster lock was seen leaving its holder, and
// to whom: "" when the holder released it, or the taker that took it over
// from a holder that had completed but not released it yet (a completed
// holder is taken over). A watch on the Lease alone would not see the
// lock leave in that case until the taker released it in turn.
type lockLeft struct {
	at time.Time
	to string
}

// watchLockLeft reports when the cluster lock Lease is first seen held by
// another than holder, or by nobody.
func (c *cluster) watchLockLeft(b *testing.B, holder string) <-chan lockLeft {
	wc, err := client.NewWithWatch(env.Config, client.Options{Scheme: testenv.Scheme})
	if err != nil {
		b.Fatal(err)
	}
	w, err := wc.Watch(context.Background(), &coordinationv1.LeaseList{}, client.InNamespace(c.ctrlNS))
	if err != nil {
		b.Fatal(err)
	}
	out := make(chan lockLeft, 1)
	go func() {
		defer w.Stop()
		for ev := range w.ResultChan() {
			if l, ok := ev.Object.(*coordinationv1.Lease); ok && l.Name == ichorv1.LockLeaseName {
				if to := ptr.Deref(l.Spec.HolderIdentity, ""); to != holder {
					out <- lockLeft{at: time.Now(), to: to}
					return
				}
			}
		}
	}()
	return out
}

func (c *cluster) annotate(name, key, value string) {
	op := &ichorv1.TalosOperation{}
	op.Namespace, op.Name = c.ns, name
	patch := fmt.Sprintf(`{"metadata":{"annotations":{%q:%q}}}`, key, value)
	if err := env.Client.Patch(context.Background(), op, client.RawPatch(types.MergePatchType, []byte(patch))); err != nil {
		c.t.Fatal(err)
	}
}

// BenchmarkLargeOperation runs the real ichor-controller binary, as its own
// process, on an upgrade of 5,000 simulated machines for a while, and
// reports its peak RSS and the size of the operation's status against the
// budgets (128 MiB, 512 KiB): once with the machines' kubelets idle (no pods,
// no Node Leases) and once with them at work (a pod on every machine, which
// each drain evicts, and Node Leases renewed as a kubelet renews them), and
// what the kubelets cost: the second run over the first, for the
// controller and for the fleet (this process).
func BenchmarkLargeOperation(b *testing.B) {
	// The node-lifecycle controller is off: at the tests' grace period it
	// would need the tests' Leases (renewed every second: 5,000 writes a
	// second would be this benchmark's load).
	if err := env.SetNodeLifecycle(false); err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() { _ = env.SetNodeLifecycle(true) })
	bin := filepath.Join(b.TempDir(), "ichor-controller")
	// Built as the Dockerfile builds the image's: without cgo, a build with
	// it links the plugin package (kustomize's loader, through Helm), which
	// exports every symbol and keeps every method, and its 159 MB binary
	// has 92 MiB resident before the controller does anything; the image's
	// 83 MB one has 46 MiB.
	build := exec.Command("go", "build", "-trimpath", "-ldflags", "-s -w", "-o", bin, "maesh.dev/ichor/controller")
	build.Env = append(os.Environ(), "CGO_ENABLED=0")
	if out, err := build.CombinedOutput(); err != nil {
		b.Fatalf("build: %v\n%s", err, out)
	}
	var idle, busy largeRun
	b.Run("kubelets=idle", func(b *testing.B) { idle = largeOperation(b, bin, false) })
	b.Run("kubelets=busy", func(b *testing.B) { busy = largeOperation(b, bin, true) })
	if idle.wall == 0 || busy.wall == 0 {
		return
	}
	ratio := func(a, b float64) float64 { return a / b }
	b.ReportMetric(ratio(float64(busy.ctrlRSS), float64(idle.ctrlRSS)), "controller-rss-busy/idle")
	b.ReportMetric(ratio(busy.ctrlCPU.Seconds(), idle.ctrlCPU.Seconds()), "controller-cpu-busy/idle")
	b.Logf("the kubelets' cost at %d machines: controller peak RSS %d MiB busy, %d MiB idle (%.2f); controller CPU %s busy, %s idle (%.2f); "+
		"fleet peak RSS %d MiB busy, %d MiB idle (+%d MiB, %.2f); fleet CPU %s busy, %s idle (+%s, %.2f); time to 400 machines done %s busy, %s idle",
		largeMachines, busy.ctrlRSS>>20, idle.ctrlRSS>>20, ratio(float64(busy.ctrlRSS), float64(idle.ctrlRSS)),
		busy.ctrlCPU.Round(time.Millisecond), idle.ctrlCPU.Round(time.Millisecond), ratio(busy.ctrlCPU.Seconds(), idle.ctrlCPU.Seconds()),
		busy.fleetRSS>>20, idle.fleetRSS>>20, (busy.fleetRSS-idle.fleetRSS)>>20, ratio(float64(busy.fleetRSS), float64(idle.fleetRSS)),
		busy.fleetCPU.Round(time.Millisecond), idle.fleetCPU.Round(time.Millisecond), (busy.fleetCPU - idle.fleetCPU).Round(time.Millisecond),
		ratio(busy.fleetCPU.Seconds(), idle.fleetCPU.Seconds()), busy.wall.Round(time.Second), idle.wall.Round(time.Second))
}

const (
	largeMachines            = 5000
	rssBudget, statusBudget  = 128 << 20, 512 << 10
	kubeletLease             = 40 * time.Second // the kubelet's default nodeLeaseDurationSeconds
	largeDone                = 400
	largePodCreateWorkers    = 16
	largeOperationRunTimeout = 10 * time.Minute
)

// largeRun is what one run of BenchmarkLargeOperation measured: the peak
// RSS of the controller and of this process (the fleet) from before the
// fleet starts until largeDone machines are done, their CPU time while the
// operation ran (the controller's: all of it), and how long the operation
// took to get there.
type largeRun struct {
	ctrlRSS, fleetRSS int64
	ctrlCPU, fleetCPU time.Duration
	wall              time.Duration
}

func largeOperation(b *testing.B, bin string, busy bool) largeRun {
	var run largeRun
	for i := 0; i < b.N; i++ {
		// What the previous run left in this process is not this one's.
		debug.FreeOSMemory()
		resetPeakRSS(b)
		spec := sim.Cluster("big", 3, largeMachines-3)
		// The machines' log would push the results out of the benchmark's
		// truncated output.
		spec.Logf = func(string, ...any) {}
		if busy {
			spec.Kubelet.NodeLease = kubeletLease
		}
		for j := range spec.Machines {
			spec.Machines[j].Talos = "v1.13.2"
		}
		c := newCluster(b, spec)
		if busy {
			c.podOnEachMachine(b)
		}
		pprofAddr := freeAddr(b)
		cmd := exec.Command(bin, "--namespace", c.ctrlNS, "--leader-elect=false", "--metrics-bind-address", "0", "--health-probe-bind-address", "127.0.0.1:0",
			"--pprof-bind-address", pprofAddr)
		// The Deployment's GOMEMLIMIT too: the budget is the controller's as it ships.
		// And a /tmp of its own, as a pod's: no other controller resumes from its hand-over file.
		cmd.Env = append(os.Environ(), "KUBECONFIG="+env.Kubeconfig, "GOMEMLIMIT="+deploymentEnv(b, "GOMEMLIMIT"), "TMPDIR="+b.TempDir())
		cmd.Stdout, cmd.Stderr = io.Discard, io.Discard
		if err := cmd.Start(); err != nil {
			b.Fatal(err)
		}
		b.Cleanup(func() { _ = cmd.Process.Kill(); _ = cmd.Wait() })
		w := watchOps(b, c.ns)
		op := talosSpec("v1.13.7")
		op.MaxUnavailable = 200
		start, cpu0 := time.Now(), cpuTime(b, os.Getpid())
		c.create("upgrade", op)
		// Run until a few hundred machines are done: every cache is full and
		// every machine has a status entry by then.
		end := w.until(b, "upgrade", largeOperationRunTimeout, func(op *ichorv1.TalosOperation) bool {
			done := 0
			for _, m := range op.Status.Machines {
				if m.Phase == ichorv1.MachineSucceeded {
					done++
				}
			}
			return done >= largeDone
		})
		// Read before the profiles below: serving them (a heap profile, and
		// its every stack symbolized) raises the controller's peak.
		run = largeRun{
			ctrlRSS: peakRSS(b, cmd.Process.Pid), ctrlCPU: cpuTime(b, cmd.Process.Pid),
			fleetRSS: peakRSS(b, os.Getpid()), fleetCPU: cpuTime(b, os.Getpid()) - cpu0,
			wall: end.Sub(start),
		}
		heapProfile(b, pprofAddr)
		memStats(b, pprofAddr, cmd.Process.Pid)
		if busy {
			n, err := c.runningPods(context.Background())
			if err != nil {
				b.Fatal(err)
			}
			b.Logf("%d of the %d pods Running when %d machines were done (the others were evicted or not started yet)", n, largeMachines, largeDone)
		}
		got := c.get("upgrade")
		size, err := json.Marshal(got)
		if err != nil {
			b.Fatal(err)
		}
		b.ReportMetric(float64(run.ctrlRSS)/rssBudget, "rss/budget")
		b.ReportMetric(float64(len(size))/statusBudget, "status/budget")
		b.Logf("%d machines: controller peak RSS %d MiB (%.2f of %d MiB, GOMEMLIMIT %s), CPU %s; operation object %d KiB (%.2f of %d KiB); %d done after %s",
			len(got.Status.Machines), run.ctrlRSS>>20, float64(run.ctrlRSS)/rssBudget, rssBudget>>20, deploymentEnv(b, "GOMEMLIMIT"),
			run.ctrlCPU.Round(time.Millisecond), len(size)>>10, float64(len(size))/statusBudget, statusBudget>>10, largeDone, run.wall.Round(time.Second))
		// What the simulated machines and their kubelets (one pod informer
		// for the fleet, and kwok's Lease controller when busy) cost: this
		// process holds them.
		b.Logf("the fleet (this process: %d machines, their kubelets and the benchmark's clients): peak RSS %d MiB, CPU %s",
			largeMachines, run.fleetRSS>>20, run.fleetCPU.Round(time.Millisecond))
	}
	return run
}

// deploymentEnv is the value the controller's Deployment
// (manifests/controller/deployment.yaml) gives its container's variable.
func deploymentEnv(b *testing.B, name string) string {
	raw, err := os.ReadFile(filepath.Join(env.Root, "manifests", "controller", "deployment.yaml"))
	if err != nil {
		b.Fatal(err)
	}
	var d appsv1.Deployment
	if err := yaml.Unmarshal(raw, &d); err != nil {
		b.Fatalf("parse the controller's Deployment: %v", err)
	}
	for _, c := range d.Spec.Template.Spec.Containers {
		for _, e := range c.Env {
			if e.Name == name {
				return e.Value
			}
		}
	}
	b.Fatalf("the controller's Deployment sets no %s", name)
	return ""
}

// freeAddr is a loopback address with a port free at the moment.
func freeAddr(b *testing.B) string {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		b.Fatal(err)
	}
	defer l.Close()
	return l.Addr().String()
}

// heapProfile saves the controller's heap profile (in use and allocated
// since it started) beside the benchmark's log and names it, for
// `go tool pprof -top -sample_index=inuse_space|alloc_space FILE`.
func heapProfile(b *testing.B, addr string) {
	resp, err := http.Get("http://" + addr + "/debug/pprof/heap")
	if err != nil {
		b.Fatalf("the controller's heap profile: %v", err)
	}
	defer resp.Body.Close()
	path := filepath.Join(os.TempDir(), "ichor-"+strings.ReplaceAll(b.Name(), "/", "_")+".heap.pb.gz")
	f, err := os.Create(path)
	if err != nil {
		b.Fatal(err)
	}
	defer f.Close()
	if _, err := io.Copy(f, resp.Body); err != nil {
		b.Fatal(err)
	}
	b.Logf("the controller's heap profile: %s", path)
}

// memStats logs where the controller's memory is at the end: its resident
// anonymous and file-backed pages (proc(5)) and the Go runtime's heap, as
// pprof's debug page prints runtime.MemStats.
func memStats(b *testing.B, addr string, pid int) {
	mem, err := proc.ReadMemory(pid)
	if err != nil {
		b.Fatal(err)
	}
	out := []string{fmt.Sprintf("VmHWM %d kB", mem.Peak>>10), fmt.Sprintf("VmRSS %d kB", mem.Resident>>10),
		fmt.Sprintf("RssAnon %d kB", mem.Anon>>10), fmt.Sprintf("RssFile %d kB", mem.File>>10)}
	resp, err := http.Get("http://" + addr + "/debug/pprof/heap?debug=1")
	if err != nil {
		b.Fatalf("the controller's memory statistics: %v", err)
	}
	defer resp.Body.Close()
	page, err := io.ReadAll(resp.Body)
	if err != nil {
		b.Fatal(err)
	}
	for _, line := range strings.Split(string(page), "\n") {
		for _, k := range []string{"HeapAlloc", "HeapSys", "HeapInuse", "HeapReleased", "Stack", "Sys", "NextGC", "NumGC"} {
			if strings.HasPrefix(line, "# "+k+" = ") {
				out = append(out, strings.TrimPrefix(line, "# "))
			}
		}
	}
	b.Logf("the controller's memory at the end: %s", strings.Join(out, ", "))
}

// podOnEachMachine binds a pod to every machine's Node, as the scheduler
// would; their kubelets start them while the operation runs.
func (c *cluster) podOnEachMachine(b *testing.B) {
	b.Helper()
	work := make(chan string)
	errs := make(chan error, largePodCreateWorkers)
	var wg sync.WaitGroup
	for range largePodCreateWorkers {
		wg.Go(func() {
			for name := range work {
				pod := &corev1.Pod{
					ObjectMeta: metav1.ObjectMeta{Namespace: c.ns, Name: "agent-" + name},
					Spec: corev1.PodSpec{
						NodeName:                     name,
						AutomountServiceAccountToken: ptr.To(false),
						Containers:                   []corev1.Container{{Name: "agent", Image: "registry.k8s.io/pause:3.10"}},
					},
				}
				if err := env.Client.Create(context.Background(), pod); err != nil {
					errs <- err
					return
				}
			}
		})
	}
	for _, m := range c.fleet.Machines() {
		work <- m.Name()
	}
	close(work)
	wg.Wait()
	close(errs)
	if err := <-errs; err != nil {
		b.Fatalf("create a pod on each machine: %v", err)
	}
	// 5,000 pods take the test cleanup's deletion longer than it waits.
	b.Cleanup(func() {
		zero := int64(0)
		testenv.Eventually(b, 10*time.Minute, "the pods on the machines to be gone", func(ctx context.Context) (bool, error) {
			err := env.Client.DeleteAllOf(ctx, &corev1.Pod{}, client.InNamespace(c.ns), client.GracePeriodSeconds(zero))
			var status apierrors.APIStatus
			if apierrors.IsTimeout(err) || apierrors.IsServerTimeout(err) || err != nil && !errors.As(err, &status) {
				// The API server goes on deleting them (a deletion past its
				// request timeout ends in a stream reset): ask again.
				return false, nil
			}
			if err != nil {
				return false, err
			}
			n, err := c.runningPods(ctx)
			return n == 0, err
		})
	})
}

// runningPods counts the pods of the test's namespace that are Running.
func (c *cluster) runningPods(ctx context.Context) (int, error) {
	var pods corev1.PodList
	err := env.Client.List(ctx, &pods, client.InNamespace(c.ns), client.MatchingFields{"status.phase": string(corev1.PodRunning)})
	return len(pods.Items), err
}

// resetPeakRSS starts this process's peak RSS (VmHWM) anew from its
// current RSS.
func resetPeakRSS(b *testing.B) {
	if err := proc.ResetPeak(); err != nil {
		b.Fatal(err)
	}
}

// cpuTime reads a process's user and system CPU time.
func cpuTime(b *testing.B, pid int) time.Duration {
	d, err := proc.CPUTime(pid)
	if err != nil {
		b.Fatal(err)
	}
	return d
}

// peakRSS reads a process's peak resident set size (VmHWM).
func peakRSS(b *testing.B, pid int) int64 {
	mem, err := proc.ReadMemory(pid)
	if err != nil {
		b.Fatal(err)
	}
	return mem.Peak
}
