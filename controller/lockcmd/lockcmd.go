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
	coordinationv1 "k8s.io/api/coordination/v1"
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
			_, released, err := o.lock().Release(cmd.Context(), o.identity)
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
	if _, err := ichorv1.ParseLockHolder(o.identity); err != nil {
		return fmt.Errorf("--identity: %w", err)
	}
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
	return &lock.Lock{Client: o.client, Namespace: o.namespace, Judge: lock.ClusterJudge{Client: o.client}}
}

func (o *options) acquire(ctx context.Context, cmd *cobra.Command) error {
	l := o.lock()
	if o.wait {
		var cancel context.CancelFunc
		ctx, cancel = context.WithTimeout(ctx, o.timeout)
		defer cancel()
	}
	announced := ""
	for {
		res, err := l.Acquire(ctx, o.identity)
		if err != nil && !errors.Is(err, lock.ErrConflict) {
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
		if !o.wait {
			return fmt.Errorf("the cluster lock is held by %s; use --wait to wait for it", res.Holder)
		}
		if res.Holder != announced && res.Holder != "" {
			fmt.Fprintf(cmd.ErrOrStderr(), "waiting for the cluster lock, held by %s\n", res.Holder)
			announced = res.Holder
		}
		if err := o.waitForChange(ctx); err != nil {
			return fmt.Errorf("waiting for the cluster lock (held by %s): %w", res.Holder, err)
		}
	}
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
