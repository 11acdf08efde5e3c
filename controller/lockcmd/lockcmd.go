// Package lockcmd is `ichor-controller lock`: the cluster lock for
// processes that are not the controller, such as the Cilium Helm Job's init
// container, which takes the lock under its own identity (job/<ns>/<name>)
// before the chart changes anything.
package lockcmd

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/spf13/cobra"
	batchv1 "k8s.io/api/batch/v1"
	coordinationv1 "k8s.io/api/coordination/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/fields"
	"k8s.io/apimachinery/pkg/watch"
	ctrl "sigs.k8s.io/controller-runtime"
	"sigs.k8s.io/controller-runtime/pkg/client"

	ichorv1 "maesh.dev/ichor/api/v1alpha1"
	"maesh.dev/ichor/controller/app"
	"maesh.dev/ichor/controller/lock"
)

// options of `lock acquire` and `lock release`.
type options struct {
	namespace string
	identity  string
	wait      bool
	timeout   time.Duration
	// recheck is how often a waiter judges the holder again even if the
	// Lease did not change: a holder can go stale (its operation fails)
	// without touching the Lease.
	recheck time.Duration
	client  client.WithWatch
	// job is the parsed identity, jobObj the Job it names.
	job    ichorv1.LockHolder
	jobObj *batchv1.Job
}

// New returns the `lock` command.
func New() *cobra.Command { return newCommand(&options{recheck: 5 * time.Second}) }

// newCommand builds the command around o; tests hand in a client.
func newCommand(o *options) *cobra.Command {
	cmd := &cobra.Command{Use: "lock", Short: "Take, release or show the cluster lock"}
	acquire := &cobra.Command{
		Use:   "acquire --identity job/<namespace>/<name>",
		Short: "Take the cluster lock (with --wait, wait until it is free)",
		Args:  cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			if err := o.complete(); err != nil {
				return err
			}
			return o.acquire(cmd.Context(), cmd)
		},
	}
	release := &cobra.Command{
		Use:   "release --identity job/<namespace>/<name>",
		Short: "Release the cluster lock if this identity holds it",
		Args:  cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			if err := o.complete(); err != nil {
				return err
			}
			h, err := o.holder(cmd.Context())
			if err != nil {
				return err
			}
			_, released, err := o.lock().Release(cmd.Context(), h)
			if err != nil {
				return err
			}
			if released {
				fmt.Fprintf(cmd.OutOrStdout(), "cluster lock released by %s\n", o.identity)
			} else {
				fmt.Fprintf(cmd.OutOrStdout(), "%s does not hold the cluster lock; nothing to release\n", o.identity)
			}
			return nil
		},
	}
	for _, c := range []*cobra.Command{acquire, release} {
		c.Flags().StringVar(&o.namespace, "namespace", ichorv1.DefaultNamespace, "namespace of the cluster lock Lease")
		c.Flags().StringVar(&o.identity, "identity", "", "holder identity: job/<namespace>/<name> for a Job")
		_ = c.MarkFlagRequired("identity")
	}
	acquire.Flags().BoolVar(&o.wait, "wait", false, "wait until the lock can be taken")
	acquire.Flags().DurationVar(&o.timeout, "timeout", 30*time.Minute, "with --wait, how long to wait")
	cmd.AddCommand(acquire, release)
	return cmd
}

func (o *options) complete() error {
	id, err := ichorv1.ParseLockHolder(o.identity)
	if err != nil {
		return fmt.Errorf("--identity: %w", err)
	}
	if id.Kind != ichorv1.HolderJob {
		return fmt.Errorf("--identity %s: only a Job takes the lock with this command (job/<namespace>/<name>, its own Job's); the controller takes it for operations and control planes", o.identity)
	}
	o.job = id
	if o.client != nil {
		return nil
	}
	cfg, err := ctrl.GetConfig()
	if err != nil {
		return fmt.Errorf("kubeconfig: %w", err)
	}
	o.client, err = client.NewWithWatch(cfg, client.Options{Scheme: app.Scheme})
	return err
}

func (o *options) lock() *lock.Lock {
	judge := lock.ClusterJudge{Client: o.client}
	return &lock.Lock{Client: o.client, Namespace: o.namespace, Judge: judge,
		Queue: lock.ClusterQueue{Operations: o.client, Judge: judge}}
}

// holder reads the Job the identity names: the lock is held by that Job (its
// UID), and only as long as it runs.
func (o *options) holder(ctx context.Context) (lock.Holder, error) {
	job := &batchv1.Job{}
	if err := o.client.Get(ctx, client.ObjectKey{Namespace: o.job.Namespace, Name: o.job.Name}, job); err != nil {
		if apierrors.IsNotFound(err) {
			return lock.Holder{}, fmt.Errorf("--identity %s: Job %s/%s not found: name the Job this runs in", o.identity, o.job.Namespace, o.job.Name)
		}
		return lock.Holder{}, fmt.Errorf("read Job %s/%s: %w", o.job.Namespace, o.job.Name, err)
	}
	o.jobObj = job
	return lock.ForJob(job), nil
}

func (o *options) acquire(ctx context.Context, cmd *cobra.Command) error {
	l := o.lock()
	h, err := o.holder(ctx)
	if err != nil {
		return err
	}
	if o.wait {
		var cancel context.CancelFunc
		ctx, cancel = context.WithTimeout(ctx, o.timeout)
		defer cancel()
	}
	place, err := o.place(ctx, l, h)
	if err != nil {
		return err
	}
	announced := ""
	for {
		// With --wait the Job queues in the Lease, so the operations created
		// after it wait for it in turn.
		res, err := l.Acquire(ctx, lock.Request{Holder: h, Place: &place, Queue: o.wait})
		if err != nil && !errors.Is(err, lock.ErrConflict) {
			if ctx.Err() != nil && announced != "" {
				return o.giveUp(l, h, fmt.Errorf("waiting for the cluster lock (%s): %w", announced, ctx.Err()))
			}
			return err
		}
		if err == nil && res.Acquired {
			msg := "cluster lock taken by " + o.identity
			if res.TookOver != "" {
				msg += ", over from " + res.TookOver
			}
			fmt.Fprintln(cmd.OutOrStdout(), msg)
			return nil
		}
		why := waitingFor(res)
		if !o.wait {
			return fmt.Errorf("the cluster lock is not free: %s; use --wait to wait for it", why)
		}
		if why != announced && err == nil {
			fmt.Fprintf(cmd.ErrOrStderr(), "waiting for the cluster lock: %s\n", why)
			announced = why
		}
		if err := o.waitForChange(ctx); err != nil {
			return o.giveUp(l, h, fmt.Errorf("waiting for the cluster lock (%s): %w", announced, err))
		}
	}
}

// waitingFor says why a taker waits: the holder, or the waiter that goes
// before it.
func waitingFor(res lock.Result) string {
	switch {
	case res.Ahead != "" && res.Holder != "":
		return "held by " + res.Holder + ", and " + res.Ahead + " goes first"
	case res.Ahead != "":
		return res.Ahead + " goes first"
	}
	return "held by " + res.Holder
}

// place is the Job's place in the queue: where the Lease records it, or,
// the first time it asks, its creation time and its resourceVersion now.
func (o *options) place(ctx context.Context, l *lock.Lock, h lock.Holder) (ichorv1.QueuePlace, error) {
	st, err := l.Get(ctx)
	if err != nil {
		return ichorv1.QueuePlace{}, err
	}
	if p, ok := st.Place(h); ok {
		return p, nil
	}
	return ichorv1.QueuePlace{Created: o.jobObj.CreationTimestamp, Revision: o.jobObj.ResourceVersion,
		Name: o.jobObj.Namespace + "/" + o.jobObj.Name}, nil
}

// giveUp takes a Job that stops waiting out of the queue, so that nobody
// waits for it, and returns err.
func (o *options) giveUp(l *lock.Lock, h lock.Holder, err error) error {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if werr := l.Withdraw(ctx, h); werr != nil {
		return fmt.Errorf("%w (and leaving the queue: %v)", err, werr)
	}
	return err
}

// waitForChange returns when the Lease changes or the recheck period ends.
func (o *options) waitForChange(ctx context.Context) error {
	ctx2, cancel := context.WithTimeout(ctx, o.recheck)
	defer cancel()
	w, err := o.client.Watch(ctx2, &coordinationv1.LeaseList{}, client.InNamespace(o.namespace),
		client.MatchingFieldsSelector{Selector: fields.OneTermEqualSelector("metadata.name", ichorv1.LockLeaseName)})
	if err != nil {
		return ctxErr(ctx, err)
	}
	defer w.Stop()
	for {
		select {
		case <-ctx2.Done():
			return ctx.Err()
		case ev, ok := <-w.ResultChan():
			if !ok || ev.Type == watch.Modified || ev.Type == watch.Deleted || ev.Type == watch.Error {
				return ctx.Err()
			}
		}
	}
}

func ctxErr(ctx context.Context, err error) error {
	if ctx.Err() != nil {
		return ctx.Err()
	}
	return err
}
