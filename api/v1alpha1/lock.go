package v1alpha1

import (
	"encoding/json"
	"fmt"
	"strings"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/apimachinery/pkg/util/resourceversion"
)

// The cluster lock as the controller, `ichor-controller lock` and the plugin
// all read it: the Lease LockLeaseName, whose spec.holderIdentity is one of
// the identities below, and its annotations, which say precisely who holds
// it and which Jobs wait for it.

// Annotations on the cluster lock Lease.
const (
	// LockHolderUIDAnnotation is the UID of the object that holds the lock.
	// Several holders can share an identity (two resets of one control
	// plane, or a reset and a removal of it, all hold it as the machine), so
	// only the UID says whether a holder is the one that took it.
	LockHolderUIDAnnotation = "ichor.maesh.dev/holder-uid"
	// LockHolderObjectAnnotation names that object (LockObject.String).
	LockHolderObjectAnnotation = "ichor.maesh.dev/holder-object"
	// LockWaitingJobsAnnotation lists, as JSON, the Jobs that wait for the
	// lock in the queue (LockWaiter). Waiting operations are not listed:
	// every taker lists the operations themselves.
	LockWaitingJobsAnnotation = "ichor.maesh.dev/waiting-jobs"
	// LockMembershipBaselineAnnotation records when the membership
	// reconciler first ran in the cluster, having marked every control
	// plane that existed then as joined: only a Node created after it can be
	// a join.
	LockMembershipBaselineAnnotation = "ichor.maesh.dev/membership-baseline"
	// LockRemovalsAnnotation lists, as JSON, the control planes whose Node
	// is gone while their removal has not settled in etcd yet (LockRemoval).
	LockRemovalsAnnotation = "ichor.maesh.dev/removals"
)

// ArrivalAnnotation on an operation is the resourceVersion at which the
// controller first saw it, recorded with its finalizer. Unless the operation
// changed before the controller saw it, that is the revision the API server
// created it at; it orders operations created within one second.
const ArrivalAnnotation = "ichor.maesh.dev/arrival-revision"

// HolderKind is what holds the cluster lock.
type HolderKind string

// Kinds of cluster lock holders.
const (
	HolderOperation HolderKind = "operation"
	HolderMachine   HolderKind = "machine"
	HolderJob       HolderKind = "job"
)

// LockHolder is a parsed cluster lock holder identity.
type LockHolder struct {
	Kind HolderKind
	// Namespace is empty for a machine.
	Namespace string
	// Name is the operation's, the Node's or the Job's name.
	Name string
}

// String is the holder's identity, as OperationIdentity, MachineIdentity
// and JobIdentity write it.
func (h LockHolder) String() string {
	switch h.Kind {
	case HolderOperation:
		return OperationIdentity(h.Namespace, h.Name)
	case HolderMachine:
		return MachineIdentity(h.Name)
	case HolderJob:
		return JobIdentity(h.Namespace, h.Name)
	}
	return ""
}

// Object is the object an identity stands for when the Lease names none (a
// Lease written before holders' objects were recorded): the operation, the
// machine's Node, the Job.
func (h LockHolder) Object() LockObject {
	switch h.Kind {
	case HolderOperation:
		return LockObject{Kind: ObjectOperation, Namespace: h.Namespace, Name: h.Name}
	case HolderMachine:
		return LockObject{Kind: ObjectNode, Name: h.Name}
	case HolderJob:
		return LockObject{Kind: ObjectJob, Namespace: h.Namespace, Name: h.Name}
	}
	return LockObject{}
}

// ParseLockHolder reads a cluster lock holder identity written by
// OperationIdentity, MachineIdentity or JobIdentity.
func ParseLockHolder(identity string) (LockHolder, error) {
	nsName := func(kind HolderKind, rest string) (LockHolder, error) {
		ns, name, ok := strings.Cut(rest, "/")
		if !ok || ns == "" || name == "" || strings.Contains(name, "/") {
			return LockHolder{}, fmt.Errorf("lock holder %q: want %s<namespace>/<name>", identity, strings.TrimSuffix(identity, rest))
		}
		return LockHolder{Kind: kind, Namespace: ns, Name: name}, nil
	}
	switch {
	case strings.HasPrefix(identity, opIdentityPrefix):
		return nsName(HolderOperation, strings.TrimPrefix(identity, opIdentityPrefix))
	case strings.HasPrefix(identity, machineIdentity):
		node := strings.TrimPrefix(identity, machineIdentity)
		if node == "" || strings.Contains(node, "/") {
			return LockHolder{}, fmt.Errorf("lock holder %q: want %s<node>", identity, machineIdentity)
		}
		return LockHolder{Kind: HolderMachine, Name: node}, nil
	case strings.HasPrefix(identity, jobIdentityPrefix):
		return nsName(HolderJob, strings.TrimPrefix(identity, jobIdentityPrefix))
	}
	return LockHolder{}, fmt.Errorf("lock holder %q: not an operation (%s), machine (%s) or job (%s) identity", identity, opIdentityPrefix, machineIdentity, jobIdentityPrefix)
}

// Kinds of objects that hold the cluster lock.
const (
	// ObjectOperation holds it for an operation, also for a control-plane
	// reset, which holds it under the machine's identity.
	ObjectOperation = "TalosOperation"
	// ObjectNode holds it for a control-plane join or removal.
	ObjectNode = "Node"
	// ObjectJob holds it for a Job (the Cilium Helm Job).
	ObjectJob = "Job"
)

// LockObject is the object a hold of the cluster lock belongs to: the hold
// lasts as long as that object's work.
type LockObject struct {
	// Kind is ObjectOperation, ObjectNode or ObjectJob.
	Kind string
	// Namespace is empty for a Node.
	Namespace string
	Name      string
}

// String is the form LockHolderObjectAnnotation takes: Kind/namespace/name,
// or Node/name.
func (o LockObject) String() string {
	if o.Kind == "" {
		return ""
	}
	if o.Namespace == "" {
		return o.Kind + "/" + o.Name
	}
	return o.Kind + "/" + o.Namespace + "/" + o.Name
}

// ParseLockObject reads what LockObject.String writes.
func ParseLockObject(s string) (LockObject, error) {
	parts := strings.Split(s, "/")
	switch {
	case len(parts) == 2 && parts[0] == ObjectNode && parts[1] != "":
		return LockObject{Kind: ObjectNode, Name: parts[1]}, nil
	case len(parts) == 3 && (parts[0] == ObjectOperation || parts[0] == ObjectJob) && parts[1] != "" && parts[2] != "":
		return LockObject{Kind: parts[0], Namespace: parts[1], Name: parts[2]}, nil
	}
	return LockObject{}, fmt.Errorf("lock holder object %q: want %s/<namespace>/<name>, %s/<name> or %s/<namespace>/<name>", s, ObjectOperation, ObjectNode, ObjectJob)
}

// QueuePlace is a waiter's place in the queue for the cluster lock. Waiters
// get the lock in the order the API server created them: by creation time,
// and within one second (the resolution of creationTimestamp) by the
// revision at which they were first seen, which resourceVersions order as
// integers (KEP-5504); a waiter whose revision cannot be compared comes
// after those whose can, then by name.
type QueuePlace struct {
	// Created is the object's creationTimestamp.
	Created metav1.Time `json:"created"`
	// Revision is the resourceVersion at which the object was first seen.
	Revision string `json:"revision,omitempty"`
	// Name is namespace/name, the last resort.
	Name string `json:"name"`
}

// Before reports whether p gets the lock before q.
func (p QueuePlace) Before(q QueuePlace) bool {
	if !p.Created.Equal(&q.Created) {
		return p.Created.Before(&q.Created)
	}
	c, err := resourceversion.CompareResourceVersion(p.Revision, q.Revision)
	if err == nil && c != 0 {
		return c < 0
	}
	if okP, okQ := wellFormed(p.Revision), wellFormed(q.Revision); okP != okQ {
		return okP
	}
	return p.Name < q.Name
}

func wellFormed(rv string) bool {
	_, err := resourceversion.CompareResourceVersion(rv, rv)
	return err == nil
}

// QueuePlace is the operation's place in the queue for the cluster lock: its
// arrival revision, or, before the controller has recorded one, its
// resourceVersion now, which is what the controller will record.
func (o *TalosOperation) QueuePlace() QueuePlace {
	rev := o.Annotations[ArrivalAnnotation]
	if rev == "" {
		rev = o.ResourceVersion
	}
	return QueuePlace{Created: o.CreationTimestamp, Revision: rev, Name: o.Namespace + "/" + o.Name}
}

// WantsLock reports whether the operation holds or waits for the cluster
// lock: it is not being deleted, not paused by an operator, not held for a
// person to approve its changed plan, and not Finished.
func (o *TalosOperation) WantsLock() bool {
	return o.DeletionTimestamp.IsZero() && !o.PausedByOperator() && !o.PlanChanged() && !o.Finished()
}

// LockWaiter is a Job waiting in the queue for the cluster lock, as
// LockWaitingJobsAnnotation lists it.
type LockWaiter struct {
	// Identity is the Job's holder identity, job/<namespace>/<name>.
	Identity string `json:"identity"`
	// UID is the Job's.
	UID types.UID `json:"uid"`
	// Place is where the Job waits: its creation time, and the Job's
	// resourceVersion when it first asked for the lock.
	Place QueuePlace `json:"place"`
}

// LockWaitingJobs reads the Jobs a lock Lease's annotations list as waiting.
func LockWaitingJobs(annotations map[string]string) ([]LockWaiter, error) {
	return lockList[LockWaiter](annotations, LockWaitingJobsAnnotation)
}

// lockList reads the JSON list in the lock Lease's annotation key.
func lockList[T any](annotations map[string]string, key string) ([]T, error) {
	s := annotations[key]
	if s == "" {
		return nil, nil
	}
	var list []T
	if err := json.Unmarshal([]byte(s), &list); err != nil {
		return nil, fmt.Errorf("annotation %s of the cluster lock: %w", key, err)
	}
	return list, nil
}

// LockRemoval is a control plane whose Node is gone and whose removal has
// not settled in etcd, as LockRemovalsAnnotation lists it. It holds (or
// waits for) the lock as ichor-controller/machine/<node>, with the gone
// Node's UID.
type LockRemoval struct {
	// Node is the gone Node's name, UID its UID.
	Node string    `json:"node"`
	UID  types.UID `json:"uid"`
	// Addresses are the Node's addresses when it went: how its etcd member
	// is recognised beside its hostname.
	Addresses []string `json:"addresses,omitempty"`
	// Since is when the controller saw the Node go.
	Since metav1.Time `json:"since"`
	// Etcd is what the last check of etcd found (empty before the first).
	Etcd string `json:"etcd,omitempty"`
	// Overdue is set once the removal has not settled within the bound the
	// controller gives it (an Event said so).
	Overdue bool `json:"overdue,omitempty"`
}

// LockRemovals reads the removals a lock Lease's annotations list.
func LockRemovals(annotations map[string]string) ([]LockRemoval, error) {
	return lockList[LockRemoval](annotations, LockRemovalsAnnotation)
}
