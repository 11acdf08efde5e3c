package commands

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"time"

	"github.com/spf13/cobra"
	coordinationv1 "k8s.io/api/coordination/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/apimachinery/pkg/util/duration"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/yaml"

	ichorv1 "maesh.dev/ichor/api/v1alpha1"
	"maesh.dev/ichor/plugin/view"
)

// LockInfo is the state of the cluster lock, as `lock -o json` prints it.
type LockInfo struct {
	// Lease is namespace/name of the Lease that is the lock.
	Lease string `json:"lease"`
	// Holder is the holder identity; empty when the lock is free.
	Holder string `json:"holder,omitempty"`
	// Since is when the holder took the lock.
	Since *time.Time `json:"since,omitempty"`
	// HolderPhase is the holding operation's phase, when an operation holds it.
	HolderPhase string `json:"holderPhase,omitempty"`
	// Removals are the control planes gone from Kubernetes whose removal
	// has not settled in etcd: each holds, or waits for, the lock.
	Removals []ichorv1.LockRemoval `json:"removals,omitempty"`
	// Waiting are the operations waiting for the lock, in the order they get it.
	Waiting []Waiter `json:"waiting"`
	// WaitingUnknown says why the waiters could not be listed.
	WaitingUnknown string `json:"waitingUnknown,omitempty"`
}

// Waiter is an operation waiting for the cluster lock.
type Waiter struct {
	Namespace string    `json:"namespace"`
	Name      string    `json:"name"`
	Kind      string    `json:"kind"`
	Created   time.Time `json:"created"`
}

// readLock reads the lock Lease and the operations waiting for it (in every
// namespace, in creation order: the order in which they get it).
func readLock(ctx context.Context, c client.Reader, controllerNS string) (*LockInfo, error) {
	info := &LockInfo{Lease: controllerNS + "/" + ichorv1.LockLeaseName, Waiting: []Waiter{}}
	lease := &coordinationv1.Lease{}
	err := c.Get(ctx, types.NamespacedName{Namespace: controllerNS, Name: ichorv1.LockLeaseName}, lease)
	switch {
	case apierrors.IsNotFound(err):
	case err != nil:
		return nil, err
	default:
		if lease.Spec.HolderIdentity != nil {
			info.Holder = *lease.Spec.HolderIdentity
		}
		if lease.Spec.AcquireTime != nil && info.Holder != "" {
			t := lease.Spec.AcquireTime.Time
			info.Since = &t
		}
		if info.Removals, err = ichorv1.LockRemovals(lease.Annotations); err != nil {
			return nil, err
		}
	}
	if h, err := ichorv1.ParseLockHolder(info.Holder); err == nil && h.Kind == ichorv1.HolderOperation {
		op := &ichorv1.TalosOperation{}
		if err := c.Get(ctx, types.NamespacedName{Namespace: h.Namespace, Name: h.Name}, op); err == nil {
			info.HolderPhase = phaseWords(op)
		} else if apierrors.IsNotFound(err) {
			info.HolderPhase = "deleted"
		}
	}
	waiting, unknown, err := lockWaiters(ctx, c)
	if err != nil {
		return nil, err
	}
	info.Waiting, info.WaitingUnknown = append(info.Waiting, waiting...), unknown
	return info, nil
}

// lockWaiters are the operations waiting for the cluster lock, in every
// namespace, in the order they get it; unknown says why they cannot be
// listed (one who may read only some namespaces still gets the rest).
func lockWaiters(ctx context.Context, c client.Reader) ([]Waiter, string, error) {
	list := &ichorv1.TalosOperationList{}
	if err := c.List(ctx, list); apierrors.IsForbidden(err) {
		return nil, "not allowed to list TalosOperations in all namespaces", nil
	} else if err != nil {
		return nil, "", err
	}
	sortByArrival(list.Items)
	var out []Waiter
	for _, op := range list.Items {
		if op.WaitingForLock() {
			out = append(out, Waiter{Namespace: op.Namespace, Name: op.Name, Kind: string(op.Spec.Kind), Created: op.CreationTimestamp.Time})
		}
	}
	return out, "", nil
}

// print writes the lock the way describe does.
func (l *LockInfo) print(w io.Writer, now time.Time, indent string) {
	if l.Holder == "" {
		fmt.Fprintf(w, "%sHolder:\t<none> (the cluster lock is free)\n", indent)
	} else {
		holder := view.Clean(l.Holder)
		if l.HolderPhase != "" {
			holder += " (" + view.Clean(l.HolderPhase) + ")"
		}
		fmt.Fprintf(w, "%sHolder:\t%s\n", indent, holder)
		if l.Since != nil {
			fmt.Fprintf(w, "%sSince:\t%s (%s ago)\n", indent, l.Since.UTC().Format(time.RFC3339), duration.HumanDuration(now.Sub(*l.Since)))
		}
	}
	for _, r := range l.Removals {
		etcd := r.Etcd
		if etcd == "" {
			etcd = "not checked yet"
		}
		fmt.Fprintf(w, "%sRemoval:\t%s, gone from Kubernetes %s ago, not yet from etcd: %s\n", indent,
			view.Clean(r.Node), duration.HumanDuration(now.Sub(r.Since.Time)), view.Clean(etcd))
	}
	if l.WaitingUnknown != "" {
		fmt.Fprintf(w, "%sWaiting:\tunknown (%s)\n", indent, l.WaitingUnknown)
		return
	}
	if len(l.Waiting) == 0 {
		fmt.Fprintf(w, "%sWaiting:\t<none>\n", indent)
		return
	}
	fmt.Fprintf(w, "%sWaiting:\t%d, in the order they get it\n", indent, len(l.Waiting))
	for i, wt := range l.Waiting {
		fmt.Fprintf(w, "%s  %d.\t%s/%s (%s, created %s ago)\n", indent, i+1, view.Clean(wt.Namespace), view.Clean(wt.Name), view.Clean(wt.Kind), duration.HumanDuration(now.Sub(wt.Created)))
	}
}

func newLockCmd(e *Env) *cobra.Command {
	var output string
	cmd := &cobra.Command{
		Use:   "lock",
		Short: "Show who holds the cluster lock, since when, and who waits for it",
		Long: fmt.Sprintf(`Show the cluster lock: the Lease %[2]s in the controller's namespace
(--controller-namespace). Disruptive work never overlaps: an operation, a
control-plane join or removal, or the Cilium Helm Job holds it; operations
that wait for it start in creation order when the holder finishes.`, e.Name, ichorv1.LockLeaseName),
		Example: fmt.Sprintf("  %[1]s lock\n  %[1]s lock -o json", e.Name),
		Args:    cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			if output != "" && output != "json" && output != "yaml" {
				return usageErrorf("unsupported --output %q: use json or yaml", output)
			}
			c, err := e.NewClient()
			if err != nil {
				return err
			}
			info, err := readLock(cmd.Context(), c, e.ControllerNamespace)
			if err != nil {
				return err
			}
			return printStructured(e.Streams.Out, output, info, func(w io.Writer) {
				tw := newTabWriter(w)
				fmt.Fprintf(tw, "Lease:\t%s\n", info.Lease)
				info.print(tw, e.Now(), "")
				_ = tw.Flush()
			})
		},
	}
	cmd.Flags().StringVarP(&output, "output", "o", "", "Output format: json or yaml (default: human-readable)")
	return cmd
}

// printStructured prints v as JSON or YAML, or calls human.
func printStructured(w io.Writer, format string, v any, human func(io.Writer)) error {
	switch format {
	case "json":
		b, err := json.MarshalIndent(v, "", "    ")
		if err != nil {
			return err
		}
		_, err = fmt.Fprintln(w, string(b))
		return err
	case "yaml":
		b, err := yaml.Marshal(v)
		if err != nil {
			return err
		}
		_, err = w.Write(b)
		return err
	}
	human(w)
	return nil
}
