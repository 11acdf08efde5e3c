package chaos

import (
	"context"
	"fmt"
	"maps"
	"math/rand/v2"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/metadata"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/utils/ptr"
	"sigs.k8s.io/controller-runtime/pkg/client"

	ichorv1 "maesh.dev/ichor/api/v1alpha1"
	"maesh.dev/ichor/controller/app"
	"maesh.dev/ichor/controller/executor"
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
	// Rerun is the run made again from the same seed after this one found
	// violations (nil if it found none, or the campaign does not rerun):
	// whether they come back says whether the seed reproduces them.
	Rerun *Result
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
	byAddr    map[string]string // Talos node address -> machine
	created   []string
	deleted   map[string]bool
	cordoned  map[string]bool
	jobsOver  map[string]time.Time
	res       Result
	unhealthy []Interval
	seen      map[string]int // violation key -> index in res.Violations
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
		gapsDone: map[string]bool{}, byAddr: map[string]string{}, deleted: map[string]bool{}, cordoned: map[string]bool{}, jobsOver: map[string]time.Time{}, seen: map[string]int{},
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
	for _, m := range r.fleet.Machines() {
		r.byAddr[m.Address()] = m.Name()
	}
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
		TalosDialOptions: []grpc.DialOption{grpc.WithChainUnaryInterceptor(r.afterCall(rep))},
	}
	ctl := testcluster.StartKillable(r.t, r.env.Config, o)
	r.mu.Lock()
	rep.ctl = ctl
	r.replicas = append(r.replicas, rep)
	r.mu.Unlock()
	r.tl.add(time.Now(), "replica %d started", rep.id)
}

// afterCall kills the replica right after a machine has accepted an
// irreversible call from it, before anything is written about it: the gap
// in which a controller that dies leaves a call its successor cannot see
// in status. It kills once per lock holder, machine, call and attempt (as
// far as the campaign has seen it): a controller that sends the call again
// after each restart would otherwise never get past it.
func (r *run) afterCall(rep *replica) grpc.UnaryClientInterceptor {
	return func(ctx context.Context, method string, req, reply any, cc *grpc.ClientConn, invoker grpc.UnaryInvoker, opts ...grpc.CallOption) error {
		err := invoker(ctx, method, req, reply, cc, opts...)
		short := shortMethod(method)
		if err != nil || !r.cfg.Gaps || !slices.Contains(irreversible, short) {
			return err
		}
		md, _ := metadata.FromOutgoingContext(ctx)
		node := strings.Join(md.Get("node"), ",")
		if m := r.byAddr[node]; m != "" {
			node = m
		}
		holder, attempt := r.obs.holderAttempt(node)
		key := fmt.Sprintf("call %s %s %s %d", holder, node, short, attempt)
		r.mu.Lock()
		done := r.gapsDone[key]
		r.gapsDone[key] = true
		r.mu.Unlock()
		if !done && r.kill(rep, fmt.Sprintf("right after %s accepted %s, before status records it", node, short)) {
			r.mu.Lock()
			r.res.GapKills++
			r.mu.Unlock()
		}
		return err
	}
}

// shortMethod turns "/machine.MachineService/Reboot" into "MachineService/Reboot",
// as the simulator's recorder names calls.
func shortMethod(full string) string {
	svc, method, _ := strings.Cut(strings.TrimPrefix(full, "/"), "/")
	return svc[strings.LastIndex(svc, ".")+1:] + "/" + method
}

// afterRun kills the replica in the gap between an irreversible step's end
// and its status write, once per step and attempt: after afterCall, or
// when the step decided it had nothing to send.
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
		if i, ok := r.seen[v.key()]; ok {
			r.res.Violations[i].What = v.What // what it says now is the fuller
			continue
		}
		r.seen[v.key()] = len(r.res.Violations)
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
	h.JobsOver = maps.Clone(r.jobsOver)
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
