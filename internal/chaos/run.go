package chaos

import (
	"bytes"
	"context"
	"fmt"
	"math/rand/v2"
	"slices"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	batchv1 "k8s.io/api/batch/v1"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/utils/ptr"
	"sigs.k8s.io/controller-runtime/pkg/client"

	ichorv1 "maesh.dev/ichor/api/v1alpha1"
	"maesh.dev/ichor/controller/app"
	"maesh.dev/ichor/controller/executor"
	"maesh.dev/ichor/controller/lockcmd"
	"maesh.dev/ichor/controller/machine"
	"maesh.dev/ichor/controller/operation"
	"maesh.dev/ichor/internal/testcluster"
	"maesh.dev/ichor/internal/testenv"
	"maesh.dev/ichor/sim"
)

// Config is one run of a campaign.
type Config struct {
	Seed   int64
	Params Params
	// Gaps kills the leader in every gap between an irreversible call
	// (reboot, install, reset, shutdown) and its status write, once per
	// step and attempt.
	Gaps bool
	// Settle bounds the final phase: faults cleared, failures retried,
	// until every operation has succeeded.
	Settle time.Duration
	// Logf receives the simulator's lines (nil: dropped).
	Logf func(format string, args ...any)
}

// Result is what one run did and found.
type Result struct {
	Seed int64
	// Kills counts every kill; GapKills those in the gap after an
	// irreversible call, Lost the replicas that lost their leader election
	// by themselves.
	Kills, GapKills, Lost int
	LeaderChanges         int
	Faults                int
	OperatorActions       int
	Jobs, Joins           int
	Operations            int
	Succeeded, Deleted    int
	Violations            []Violation
	// Histories holds, per violation, the events that led to it.
	Histories []string
	// Start is when the run began; Took how long it took.
	Start time.Time
	Took  time.Duration
}

// target is the version every upgrade of a run moves to.
const target = "v1.13.7"

// irreversibleSteps are the steps whose Talos call cannot be taken back.
var irreversibleSteps = []string{executor.StepInstall, executor.StepReboot, executor.StepReset, executor.StepShutdown}

// groupLabel on a Node names the upgrade group it belongs to.
const groupLabel = "chaos.ichor.maesh.dev/group"

// Spec is the fleet of every run: three control planes and four workers,
// half on Talos 1.12 (the legacy upgrade, which reboots by itself) and
// half on 1.13 (install, then reboot), and a fourth control plane that
// joins during the run. Durations are short but long enough to overlap; a
// drain waits a second for the workload's pod to go.
func Spec() sim.Spec {
	spec := sim.Cluster("chaos", 4, 4)
	for i := range spec.Machines {
		if i%2 == 1 {
			spec.Machines[i].Talos = "v1.13.2"
		}
	}
	joiner := &spec.Machines[3]
	joiner.Joins, joiner.Talos = true, target
	spec.Durations = sim.Durations{
		Stop: 30 * time.Millisecond, Reboot: 200 * time.Millisecond, Install: 30 * time.Millisecond,
		ImagePull: 10 * time.Millisecond, PodGrace: time.Second, NodeReady: 500 * time.Millisecond,
		DrainTimeout: 5 * time.Second,
	}
	return spec
}

// Layout is the fleet a schedule sees: the machines of Spec, split at
// random (from seed) into upgrade groups a and b, each with a control plane.
func Layout(seed int64, spec sim.Spec) Fleet {
	rng := rand.New(rand.NewPCG(uint64(seed), 0x9a0b))
	f := Fleet{Groups: map[string][]string{}}
	for _, m := range spec.Machines {
		switch {
		case m.Joins:
			f.Joiner = m.Name
			continue
		case m.Role == sim.ControlPlane:
			f.ControlPlanes = append(f.ControlPlanes, m.Name)
		default:
			f.Workers = append(f.Workers, m.Name)
		}
	}
	for i, m := range append(append([]string(nil), f.ControlPlanes...), f.Workers...) {
		g := []string{"a", "b"}[rng.IntN(2)]
		if i < 2 {
			g = []string{"a", "b"}[i] // each group has a control plane
		}
		f.Groups[g] = append(f.Groups[g], m)
	}
	return f
}

// run is one run: a fleet, two controller replicas, a schedule, watches.
type run struct {
	t      *testing.T
	env    *testenv.Env
	cfg    Config
	rng    *rand.Rand
	start  time.Time
	fleet  *sim.Fleet
	layout Fleet
	roles  map[string]sim.Role
	// ns holds the operations and Jobs; ctrlNS the controller's Leases and Secret.
	ns, ctrlNS string
	tl         *timeline
	obs        *observer
	ctx        context.Context

	mu        sync.Mutex
	replicas  []*replica
	gapsDone  map[string]bool
	created   []string
	deleted   map[string]bool
	cordoned  map[string]bool
	res       Result
	unhealthy []Interval
	seen      map[string]bool
	jobs      sync.WaitGroup
	rotation  int
	workloads int
}

type replica struct {
	id     int
	ctl    *testcluster.Controller
	killed atomic.Bool
}

// Execute runs one run of cfg against env and returns what it found.
func Execute(t *testing.T, env *testenv.Env, cfg Config) Result {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	r := &run{
		t: t, env: env, cfg: cfg, ctx: ctx,
		rng:      rand.New(rand.NewPCG(uint64(cfg.Seed), 0x5eed)),
		tl:       &timeline{},
		gapsDone: map[string]bool{}, deleted: map[string]bool{}, cordoned: map[string]bool{}, seen: map[string]bool{},
		roles: map[string]sim.Role{},
	}
	r.res.Seed = cfg.Seed
	r.obs = newObserver(r.tl)
	r.setUp()
	schedule := Plan(cfg.Seed, r.layout, cfg.Params)
	r.start = time.Now()
	r.res.Start = r.start
	r.tl.add(r.start, "run %d starts: %d actions scheduled", cfg.Seed, len(schedule))
	r.keepReplicas()

	for _, a := range schedule {
		r.waitUntil(r.start.Add(a.At))
		r.do(a)
	}
	r.settle()
	h := r.history()
	h.End = r.end()
	r.record(Check(h), h)
	r.res.LeaderChanges = r.obs.leaderChanges()
	r.res.Took = time.Since(r.start)
	for _, name := range r.created {
		if o, ok := h.last(name); ok && !o.Gone && o.Phase == string(ichorv1.PhaseSucceeded) {
			r.res.Succeeded++
		}
	}
	r.res.Operations, r.res.Deleted = len(r.created), len(r.deleted)
	return r.res
}

// setUp starts the fleet, labels the upgrade groups, writes the
// talosconfig and starts watching.
func (r *run) setUp() {
	t, env := r.t, r.env
	r.ns, r.ctrlNS = env.Namespace(t), env.Namespace(t)
	spec := Spec()
	spec.Logf = r.cfg.Logf
	if spec.Logf == nil {
		spec.Logf = func(string, ...any) {}
	}
	for _, m := range spec.Machines {
		r.roles[m.Name] = m.Role
	}
	r.fleet = testcluster.StartFleet(t, env, spec, r.ns)
	r.layout = Layout(r.cfg.Seed, spec)
	for g, machines := range r.layout.Groups {
		for _, m := range machines {
			r.patchNode(m, fmt.Sprintf(`{"metadata":{"labels":{%q:%q}}}`, groupLabel, g))
		}
	}
	testcluster.WriteTalosconfig(t, env, r.fleet, r.ctrlNS)
	wc, err := client.NewWithWatch(env.Config, client.Options{Scheme: testenv.Scheme})
	if err != nil {
		t.Fatal(err)
	}
	if err := r.obs.watchLeases(r.ctx, env.Kube, r.ctrlNS); err != nil {
		t.Fatal(err)
	}
	if err := r.obs.watchOps(r.ctx, wc, r.ns); err != nil {
		t.Fatal(err)
	}
	if err := r.obs.watchNodes(r.ctx, env.Kube, spec.Name); err != nil {
		t.Fatal(err)
	}
}

// keepReplicas keeps two replicas alive: a killed one, or one that lost
// its leader election by itself, is replaced.
func (r *run) keepReplicas() {
	r.mu.Lock()
	var alive int
	for _, rep := range r.replicas {
		select {
		case <-rep.ctl.Exited():
			if !rep.killed.Swap(true) {
				r.res.Lost++
				r.tl.add(time.Now(), "replica %d stopped by itself: %v", rep.id, rep.ctl.Err())
			}
		default:
			if !rep.killed.Load() {
				alive++
			}
		}
	}
	r.mu.Unlock()
	for ; alive < 2; alive++ {
		r.startReplica()
	}
}

func (r *run) startReplica() {
	r.mu.Lock()
	rep := &replica{id: len(r.replicas) + 1}
	r.mu.Unlock()
	o := app.Options{
		Namespace: r.ctrlNS, LeaderElection: true,
		LeaseDuration: 2 * time.Second, RenewDeadline: 1500 * time.Millisecond, RetryPeriod: 200 * time.Millisecond,
		TestHookAfterRun: func(s operation.StepRun) { r.afterRun(rep, s) },
	}
	ctl := testcluster.StartKillable(r.t, r.env.Config, o)
	r.mu.Lock()
	rep.ctl = ctl
	r.replicas = append(r.replicas, rep)
	r.mu.Unlock()
	r.tl.add(time.Now(), "replica %d started", rep.id)
}

// afterRun kills the replica in the gap between an irreversible call and
// its status write, once per step and attempt.
func (r *run) afterRun(rep *replica, s operation.StepRun) {
	if !r.cfg.Gaps || !slices.Contains(irreversibleSteps, s.Step) {
		return
	}
	key := fmt.Sprintf("%s/%s/%s/%d", s.UID, s.Machine, s.Step, s.Attempt)
	r.mu.Lock()
	done := r.gapsDone[key]
	r.gapsDone[key] = true
	r.mu.Unlock()
	if done {
		return
	}
	if r.kill(rep, fmt.Sprintf("after %s's %s on %s (attempt %d) returned %v, before status records it", s.Operation.Name, s.Step, s.Machine, s.Attempt, orOK(s.Err))) {
		r.mu.Lock()
		r.res.GapKills++
		r.mu.Unlock()
	}
}

func orOK(err error) string {
	if err == nil {
		return "ok"
	}
	return err.Error()
}

// kill kills rep hard, once.
func (r *run) kill(rep *replica, why string) bool {
	if rep.killed.Swap(true) {
		return false
	}
	r.mu.Lock()
	ctl := rep.ctl
	r.res.Kills++
	r.mu.Unlock()
	ctl.Kill()
	r.tl.add(time.Now(), "KILL replica %d %s", rep.id, why)
	return true
}

// leader is the replica that leads, or any live one while none does.
func (r *run) leader() *replica {
	r.mu.Lock()
	defer r.mu.Unlock()
	var live []*replica
	for _, rep := range r.replicas {
		if rep.killed.Load() {
			continue
		}
		select {
		case <-rep.ctl.Elected():
			return rep
		default:
			live = append(live, rep)
		}
	}
	if len(live) == 0 {
		return nil
	}
	return live[r.rng.IntN(len(live))]
}

// waitUntil keeps the replicas and the workload up and checks the
// invariants until t.
func (r *run) waitUntil(t time.Time) {
	lastCheck := time.Now()
	for {
		r.keepReplicas()
		if time.Since(lastCheck) > 500*time.Millisecond {
			r.workload()
			r.check()
			lastCheck = time.Now()
		}
		left := time.Until(t)
		if left <= 0 {
			return
		}
		time.Sleep(min(left, 50*time.Millisecond))
	}
}

// workload keeps a pod on every machine that is Ready and schedulable, as
// a ReplicaSet and the scheduler would, so that every drain has a pod to
// evict and waits for its grace period (Durations.PodGrace).
func (r *run) workload() {
	ctx := r.ctx
	var pods corev1.PodList
	var nodes corev1.NodeList
	if r.env.Client.List(ctx, &pods, client.InNamespace(r.ns)) != nil || r.env.Client.List(ctx, &nodes) != nil {
		return
	}
	has := map[string]bool{}
	for _, p := range pods.Items {
		if p.DeletionTimestamp.IsZero() {
			has[p.Spec.NodeName] = true
		}
	}
	for _, n := range nodes.Items {
		if has[n.Name] || n.Spec.Unschedulable || !machine.Ready(&n) {
			continue
		}
		r.workloads++
		pod := &corev1.Pod{
			ObjectMeta: metav1.ObjectMeta{Namespace: r.ns, Name: fmt.Sprintf("work-%d", r.workloads),
				OwnerReferences: []metav1.OwnerReference{{APIVersion: "apps/v1", Kind: "ReplicaSet", Name: "work", UID: "chaos-work", Controller: ptr.To(true)}}},
			Spec: corev1.PodSpec{
				NodeName: n.Name, TerminationGracePeriodSeconds: ptr.To[int64](30),
				Tolerations: []corev1.Toleration{{Operator: corev1.TolerationOpExists}},
				Containers:  []corev1.Container{{Name: "work", Image: "registry.example/work:1"}},
			},
		}
		_ = r.env.Client.Create(ctx, pod)
	}
}

// check runs the invariants on the history so far.
func (r *run) check() {
	h := r.history()
	r.record(Check(h), h)
}

func (r *run) record(vs []Violation, h *History) {
	r.mu.Lock()
	defer r.mu.Unlock()
	for _, v := range vs {
		key := v.Invariant + "\x00" + v.What
		if r.seen[key] {
			continue
		}
		r.seen[key] = true
		r.res.Violations = append(r.res.Violations, v)
		r.res.Histories = append(r.res.Histories, r.tl.upTo(h, v.At.Add(200*time.Millisecond), 250))
	}
}

// history is what the run saw so far.
func (r *run) history() *History {
	h := &History{Start: r.start, Roles: r.roles}
	rec := r.fleet.Recorder()
	h.Actions = rec.Actions("")
	for _, c := range rec.Handled("", "*") {
		if slices.Contains(irreversible, c.Method) || c.Method == "LifecycleService/Upgrade" {
			h.Calls = append(h.Calls, c)
		}
	}
	h.Upgrades = rec.Upgrades("")
	r.obs.snapshot(h)
	r.mu.Lock()
	h.Unhealthy = append([]Interval(nil), r.unhealthy...)
	r.mu.Unlock()
	h.Now = time.Now()
	return h
}

// end is how the run ended, read live.
func (r *run) end() *End {
	e := &End{Created: append([]string(nil), r.created...), Deleted: map[string]bool{}, CordonedBy: map[string]string{}}
	for k := range r.deleted {
		e.Deleted[k] = true
	}
	var nodes corev1.NodeList
	if err := r.env.Client.List(context.Background(), &nodes); err == nil {
		for _, n := range nodes.Items {
			if by := n.Annotations[executor.CordonedByAnnotation]; by != "" {
				e.CordonedBy[n.Name] = by
			}
		}
	}
	if st, err := r.lockHolder(); err == nil {
		e.Holder = st
	}
	return e
}

func (r *run) lockHolder() (string, error) {
	l, err := r.env.Kube.CoordinationV1().Leases(r.ctrlNS).Get(context.Background(), ichorv1.LockLeaseName, metav1.GetOptions{})
	if apierrors.IsNotFound(err) {
		return "", nil
	}
	if err != nil {
		return "", err
	}
	return ptr.Deref(l.Spec.HolderIdentity, ""), nil
}

// do carries out one scheduled action. What the API refuses (an
// operation not created yet, or gone) is noted, as an operator would see it.
func (r *run) do(a Action) {
	now := time.Now()
	r.tl.add(now, "do: %s", a)
	if a.Kind.operator() {
		r.mu.Lock()
		r.res.OperatorActions++
		r.mu.Unlock()
	}
	var err error
	switch a.Kind {
	case CreateUpgrade:
		err = r.create(a.Op, ichorv1.TalosOperationSpec{Kind: ichorv1.KindTalos, Talos: &ichorv1.TalosUpgrade{Version: target},
			MaxUnavailable: int32(a.MaxUnavailable), Machines: &metav1.LabelSelector{MatchLabels: map[string]string{groupLabel: a.Group}}})
	case CreateNodeOp:
		spec := ichorv1.TalosOperationSpec{Kind: ichorv1.KindNode, Node: &ichorv1.NodeAction{Machine: a.Machine, Action: ichorv1.NodeActionType(a.NodeAction)}}
		if a.NodeAction == string(ichorv1.NodeReset) {
			spec.Node.Reset = &ichorv1.ResetOptions{Graceful: ptr.To(a.Graceful), Reboot: a.Reboot}
		}
		if a.NoDrain {
			spec.Drain = &ichorv1.Drain{Disabled: true}
		}
		err = r.create(a.Op, spec)
	case Kill:
		if rep := r.leader(); rep != nil {
			r.kill(rep, "at random")
		}
	case Fault:
		err = r.inject(a)
	case PowerOn:
		if m := r.fleet.Machine(a.Machine); m.Off() {
			err = m.PowerOn()
		}
	case Join:
		err = r.fleet.Join(r.ctx, a.Machine)
		r.mu.Lock()
		r.res.Joins++
		r.mu.Unlock()
	case Job:
		err = r.job(a)
	case Pause, Resume:
		err = r.patchOp(a.Op, fmt.Sprintf(`{"spec":{"paused":%v}}`, a.Kind == Pause))
	case Retry:
		err = r.patchOp(a.Op, fmt.Sprintf(`{"metadata":{"annotations":{%q:"true"}}}`, ichorv1.RetryAnnotation))
	case Delete:
		err = r.env.Client.Delete(r.ctx, &ichorv1.TalosOperation{ObjectMeta: metav1.ObjectMeta{Namespace: r.ns, Name: a.Op}})
		if err == nil {
			r.mu.Lock()
			r.deleted[a.Op] = true
			r.mu.Unlock()
		}
	case Hold:
		err = r.patchNode(a.Machine, fmt.Sprintf(`{"metadata":{"annotations":{%q:"chaos"}}}`, ichorv1.UpgradeHoldAnnotation))
	case Cordon:
		err = r.patchNode(a.Machine, `{"spec":{"unschedulable":true}}`)
		if err == nil {
			r.mu.Lock()
			r.cordoned[a.Machine] = true
			r.mu.Unlock()
			time.AfterFunc(a.For, func() { r.uncordon(a.Machine) })
		}
	case Rotate:
		err = r.rotate(a.How)
	}
	if err != nil {
		r.tl.add(time.Now(), "  -> %v", err)
	}
}

func (r *run) create(name string, spec ichorv1.TalosOperationSpec) error {
	op := &ichorv1.TalosOperation{ObjectMeta: metav1.ObjectMeta{Namespace: r.ns, Name: name}, Spec: spec}
	if err := r.env.Client.Create(r.ctx, op); err != nil {
		return err
	}
	r.mu.Lock()
	r.created = append(r.created, name)
	r.mu.Unlock()
	return nil
}

func (r *run) patchOp(name, patch string) error {
	op := &ichorv1.TalosOperation{ObjectMeta: metav1.ObjectMeta{Namespace: r.ns, Name: name}}
	return r.env.Client.Patch(r.ctx, op, client.RawPatch(types.MergePatchType, []byte(patch)))
}

func (r *run) patchNode(name, patch string) error {
	_, err := r.env.Kube.CoreV1().Nodes().Patch(context.Background(), name, types.MergePatchType, []byte(patch), metav1.PatchOptions{})
	return err
}

// uncordon lifts an operator's cordon, unless Ichor has made the cordon its own since.
func (r *run) uncordon(name string) {
	n, err := r.env.Kube.CoreV1().Nodes().Get(context.Background(), name, metav1.GetOptions{})
	if err != nil || !n.Spec.Unschedulable || n.Annotations[executor.CordonedByAnnotation] != "" {
		return
	}
	if err := r.patchNode(name, `{"spec":{"unschedulable":false}}`); err == nil {
		r.tl.add(time.Now(), "operator uncordons %s", name)
	}
}

func (r *run) inject(a Action) error {
	m := r.fleet.Machine(a.Machine)
	clear, err := m.InjectString(a.Fault)
	if err != nil {
		return err
	}
	r.mu.Lock()
	r.res.Faults++
	unhealthy := -1
	if a.Fault == string(sim.FaultEtcdUnhealthy) {
		unhealthy = len(r.unhealthy)
		r.unhealthy = append(r.unhealthy, Interval{Machine: a.Machine, From: time.Now()})
	}
	r.mu.Unlock()
	time.AfterFunc(a.For, func() {
		clear()
		r.healed(unhealthy)
		r.tl.add(time.Now(), "fault %s cleared on %s", a.Fault, a.Machine)
	})
	return nil
}

// healed ends the unhealthy interval i (none when i < 0).
func (r *run) healed(i int) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if i >= 0 && r.unhealthy[i].To.IsZero() {
		r.unhealthy[i].To = time.Now()
	}
}

// rotate changes the talosconfig Secret: a label only (a new
// resourceVersion, as an external-secrets refresh makes), or a new client
// certificate from the same CA.
func (r *run) rotate(how string) error {
	r.mu.Lock()
	r.rotation++
	n := r.rotation
	r.mu.Unlock()
	secret := &corev1.Secret{ObjectMeta: metav1.ObjectMeta{Namespace: r.ctrlNS, Name: ichorv1.TalosconfigSecret}}
	if how == "relabel" {
		patch := fmt.Sprintf(`{"metadata":{"labels":{"chaos.ichor.maesh.dev/rotation":"%d"}}}`, n)
		return r.env.Client.Patch(r.ctx, secret, client.RawPatch(types.MergePatchType, []byte(patch)))
	}
	data, err := r.fleet.Talosconfig().Bytes()
	if err != nil {
		return err
	}
	if err := r.env.Client.Get(r.ctx, client.ObjectKeyFromObject(secret), secret); err != nil {
		return err
	}
	secret.Data[ichorv1.TalosconfigKey] = data
	return r.env.Client.Update(r.ctx, secret)
}

// job creates a Job that takes the cluster lock as the Cilium Helm Job's
// init container does (`ichor-controller lock acquire --wait`, run
// in-process), holds it for a while, then releases it, or only finishes,
// or is deleted.
func (r *run) job(a Action) error {
	job := &batchv1.Job{
		ObjectMeta: metav1.ObjectMeta{Namespace: r.ns, Name: a.Op},
		Spec: batchv1.JobSpec{Template: corev1.PodTemplateSpec{Spec: corev1.PodSpec{
			RestartPolicy: corev1.RestartPolicyNever,
			Containers:    []corev1.Container{{Name: "helm", Image: "ghcr.io/maesh-dev/ichor-controller:chaos"}},
		}}},
	}
	if err := r.env.Client.Create(r.ctx, job); err != nil {
		return err
	}
	r.mu.Lock()
	r.res.Jobs++
	r.mu.Unlock()
	id := ichorv1.JobIdentity(r.ns, a.Op)
	r.jobs.Add(1)
	go func() {
		defer r.jobs.Done()
		out, err := r.lockCommand("acquire", "--identity", id, "--wait", "--timeout", "3m")
		r.tl.add(time.Now(), "job %s: lock acquire: %s%v", a.Op, out, errOrNil(err))
		if err != nil {
			return
		}
		time.Sleep(a.For) // the Job's work: holding the lock is what it does here
		switch a.How {
		case "release":
			out, err := r.lockCommand("release", "--identity", id)
			r.tl.add(time.Now(), "job %s: lock release: %s%v", a.Op, out, errOrNil(err))
			err = r.finishJob(job)
			r.tl.add(time.Now(), "job %s: complete %v", a.Op, errOrNil(err))
		case "complete":
			err := r.finishJob(job)
			r.tl.add(time.Now(), "job %s: complete without releasing %v", a.Op, errOrNil(err))
		case "delete":
			err := r.env.Client.Delete(context.Background(), job, client.PropagationPolicy(metav1.DeletePropagationBackground))
			r.tl.add(time.Now(), "job %s: deleted without releasing %v", a.Op, errOrNil(err))
		}
	}()
	return nil
}

func errOrNil(err error) string {
	if err == nil {
		return ""
	}
	return "error: " + err.Error()
}

// lockCommand runs `ichor-controller lock ARGS` against the campaign's API
// server (KUBECONFIG, set by TestMain), in the controller's namespace.
func (r *run) lockCommand(args ...string) (string, error) {
	cmd := lockcmd.New()
	var out bytes.Buffer
	cmd.SetOut(&out)
	cmd.SetErr(&out)
	cmd.SetArgs(append(args, "--namespace", r.ctrlNS))
	err := cmd.ExecuteContext(r.ctx)
	return out.String(), err
}

// finishJob marks a Job Complete, as the Job controller would.
func (r *run) finishJob(job *batchv1.Job) error {
	now := metav1.Now()
	cur := &batchv1.Job{}
	if err := r.env.Client.Get(context.Background(), client.ObjectKeyFromObject(job), cur); err != nil {
		return err
	}
	cur.Status.StartTime, cur.Status.CompletionTime, cur.Status.Succeeded = &now, &now, 1
	cur.Status.Conditions = []batchv1.JobCondition{
		{Type: batchv1.JobSuccessCriteriaMet, Status: corev1.ConditionTrue, LastTransitionTime: now},
		{Type: batchv1.JobComplete, Status: corev1.ConditionTrue, LastTransitionTime: now},
	}
	return r.env.Client.Status().Update(context.Background(), cur)
}

// settle clears every fault, powers machines back on, resumes what is
// paused and retries what failed, until every operation has succeeded (or
// Settle has passed).
func (r *run) settle() {
	r.tl.add(time.Now(), "settle: faults cleared, failures retried from here on")
	deadline := time.Now().Add(r.cfg.Settle)
	jobsDone := make(chan struct{})
	go func() { r.jobs.Wait(); close(jobsDone) }()
	for time.Now().Before(deadline) {
		for _, m := range r.fleet.Machines() {
			m.ClearFaults()
		}
		for i := range r.unhealthy {
			r.healed(i)
		}
		busy := r.settleOps()
		r.mu.Lock()
		cordoned := sortedKeys(r.cordoned)
		r.mu.Unlock()
		for _, n := range cordoned {
			r.uncordon(n)
		}
		select {
		case <-jobsDone:
		default:
			busy = true
		}
		if !busy {
			if h, err := r.lockHolder(); err == nil && !r.settledHolder(h) {
				return
			}
		}
		r.waitUntil(time.Now().Add(300 * time.Millisecond))
	}
	r.tl.add(time.Now(), "settle: gave up after %s", r.cfg.Settle)
}

// settleOps resumes, retries and powers on what the operations need, and
// says whether any is still going.
func (r *run) settleOps() bool {
	var ops ichorv1.TalosOperationList
	if err := r.env.Client.List(r.ctx, &ops, client.InNamespace(r.ns)); err != nil {
		return true
	}
	busy := false
	offWanted := map[string]bool{} // machines a shutdown or reset in progress leaves off
	for i := range ops.Items {
		op := &ops.Items[i]
		if op.Succeeded() && op.DeletionTimestamp.IsZero() {
			continue
		}
		busy = true
		if n := op.Spec.Node; n != nil && (n.Action == ichorv1.NodeShutdown || n.Action == ichorv1.NodeReset) {
			offWanted[n.Machine] = true
		}
		if !op.DeletionTimestamp.IsZero() {
			continue
		}
		if op.Spec.Paused {
			r.settleAction("resume", op.Name, r.patchOp(op.Name, `{"spec":{"paused":false}}`))
		}
		if op.Status.FailureReason != "" && op.Annotations[ichorv1.RetryAnnotation] != ichorv1.RetryRequested {
			r.settleAction("retry", op.Name, r.patchOp(op.Name, fmt.Sprintf(`{"metadata":{"annotations":{%q:"true"}}}`, ichorv1.RetryAnnotation)))
		}
	}
	for _, m := range r.fleet.Machines() {
		if m.Off() && !offWanted[m.Name()] {
			r.settleAction("power on", m.Name(), m.PowerOn())
		}
		if m.Off() {
			busy = true
		}
	}
	return busy
}

func (r *run) settleAction(what, name string, err error) {
	r.tl.add(time.Now(), "settle: %s %s %s", what, name, errOrNil(err))
}

// settledHolder says whether the lock names an operation that is over.
func (r *run) settledHolder(holder string) bool {
	id, err := ichorv1.ParseLockHolder(holder)
	if err != nil || id.Kind != ichorv1.HolderOperation {
		return false
	}
	op := &ichorv1.TalosOperation{}
	err = r.env.Client.Get(r.ctx, client.ObjectKey{Namespace: id.Namespace, Name: id.Name}, op)
	return apierrors.IsNotFound(err) || (err == nil && op.Succeeded())
}
