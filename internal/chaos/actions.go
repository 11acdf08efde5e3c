package chaos

import (
	"bytes"
	"context"
	"fmt"
	"time"

	batchv1 "k8s.io/api/batch/v1"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/utils/ptr"
	"sigs.k8s.io/controller-runtime/pkg/client"

	ichorv1 "maesh.dev/ichor/api/v1alpha1"
	"maesh.dev/ichor/controller/executor"
	"maesh.dev/ichor/controller/lockcmd"
	"maesh.dev/ichor/sim"
)

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
			r.jobOver(a.Op, err)
			r.tl.add(time.Now(), "job %s: complete %v", a.Op, errOrNil(err))
		case "complete":
			err := r.finishJob(job)
			r.jobOver(a.Op, err)
			r.tl.add(time.Now(), "job %s: complete without releasing %v", a.Op, errOrNil(err))
		case "delete":
			err := r.env.Client.Delete(context.Background(), job, client.PropagationPolicy(metav1.DeletePropagationBackground))
			r.jobOver(a.Op, err)
			r.tl.add(time.Now(), "job %s: deleted without releasing %v", a.Op, errOrNil(err))
		}
	}()
	return nil
}

// jobOver notes when a Job completed or was deleted (unless that failed).
func (r *run) jobOver(name string, err error) {
	if err != nil {
		return
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	r.jobsOver[name] = time.Now()
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
