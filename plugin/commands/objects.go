package commands

import (
	"context"
	"fmt"
	"sort"
	"strings"

	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/types"
	utilruntime "k8s.io/apimachinery/pkg/util/runtime"
	clientgoscheme "k8s.io/client-go/kubernetes/scheme"
	"sigs.k8s.io/controller-runtime/pkg/client"

	ichorv1 "maesh.dev/ichor/api/v1alpha1"
)

// Scheme knows the built-in types and TalosOperation.
var Scheme = runtime.NewScheme()

func init() {
	utilruntime.Must(clientgoscheme.AddToScheme(Scheme))
	utilruntime.Must(ichorv1.AddToScheme(Scheme))
}

// FieldManager attributes the plugin's writes in managedFields.
const FieldManager = "kubectl-ichor"

// qualified is how kubectl names a TalosOperation in messages.
const qualified = ichorv1.Resource + "." + "ichor.maesh.dev"

// ref is "talosoperation.ichor.maesh.dev/NAME", as kubectl prints it.
func ref(name string) string { return "talosoperation.ichor.maesh.dev/" + name }

// operationName accepts NAME and the TYPE/NAME forms that `-o name` prints
// (talosoperation.ichor.maesh.dev/NAME, talosop/NAME, ...), so output can be
// piped back in.
func operationName(arg string) (string, error) {
	name := arg
	if typ, n, ok := strings.Cut(arg, "/"); ok {
		switch strings.ToLower(typ) {
		case "talosoperation", "talosoperations", "talosop", "talosoperation.ichor.maesh.dev", "talosoperations.ichor.maesh.dev", "talosop.ichor.maesh.dev":
			name = n
		default:
			return "", usageErrorf("%q is not a TalosOperation: give NAME or talosoperation/NAME", arg)
		}
	}
	if name == "" || strings.Contains(name, "/") {
		return "", usageErrorf("%q is not a TalosOperation name", arg)
	}
	return name, nil
}

func operationNames(args []string) ([]string, error) {
	names := make([]string, 0, len(args))
	for _, a := range args {
		n, err := operationName(a)
		if err != nil {
			return nil, err
		}
		names = append(names, n)
	}
	return names, nil
}

func getOperation(ctx context.Context, c client.Reader, ns, name string) (*ichorv1.TalosOperation, error) {
	op := &ichorv1.TalosOperation{}
	if err := c.Get(ctx, types.NamespacedName{Namespace: ns, Name: name}, op); err != nil {
		return nil, err // unwrapped: kubectl's error printer formats API errors
	}
	return op, nil
}

// latestOperation is the newest operation in the namespace: the one that
// arrived last in the order the controller records (sortByArrival), so
// that of operations created within one second it is the last one created.
func latestOperation(ctx context.Context, c client.Reader, ns string) (*ichorv1.TalosOperation, error) {
	list := &ichorv1.TalosOperationList{}
	if err := c.List(ctx, list, client.InNamespace(ns)); err != nil {
		return nil, err
	}
	if len(list.Items) == 0 {
		return nil, fmt.Errorf("no TalosOperations in namespace %q", ns)
	}
	sortByArrival(list.Items)
	return &list.Items[len(list.Items)-1], nil
}

// sortByArrival sorts oldest first, in the order in which waiters get the
// cluster lock: by creation time, and within one second by the arrival
// revision the controller records (ichorv1.QueuePlace), which
// creationTimestamp's one-second resolution cannot tell apart.
func sortByArrival(ops []ichorv1.TalosOperation) {
	sort.SliceStable(ops, func(i, j int) bool { return ops[i].QueuePlace().Before(ops[j].QueuePlace()) })
}
