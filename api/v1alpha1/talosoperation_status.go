package v1alpha1

import (
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
)

// Phase is where an operation stands.
// +kubebuilder:validation:Enum=Pending;Refused;Running;Paused;Succeeded;Cancelled
type Phase string

// Operation phases.
const (
	// PhasePending: not checked yet.
	PhasePending Phase = "Pending"
	// PhaseRefused: preflight said no; nothing ran. Terminal unless override is set.
	PhaseRefused Phase = "Refused"
	PhaseRunning Phase = "Running"
	// PhasePaused: see Reason for why.
	PhasePaused    Phase = "Paused"
	PhaseSucceeded Phase = "Succeeded"
	// PhaseCancelled: an operator cancelled it (CancelAnnotation); it stops
	// for good once the steps in flight have settled, its cordons lifted
	// and the cluster lock let go. The record stays.
	PhaseCancelled Phase = "Cancelled"
)

// Reasons an operation is Paused, in status.reason.
const (
	// ReasonClusterLockHeld: another holder has the cluster lock; status.lockHolder names it.
	ReasonClusterLockHeld = "ClusterLockHeld"
	// ReasonPausedByOperator: spec.paused is true.
	ReasonPausedByOperator = "PausedByOperator"
	// ReasonStepFailed: a step failed; status.failureReason says why.
	ReasonStepFailed = "StepFailed"
	// ReasonPlanChanged: a plan was approved (PlanApprovedAnnotation), and
	// the plan made again before the start, as the cluster changed,
	// differs from it; nothing has started.
	ReasonPlanChanged = "PlanChanged"
)

// LockState says what an operation has to do with the cluster lock.
type LockState string

// Lock states.
const (
	LockHeld    LockState = "Held"
	LockWaiting LockState = "Waiting"
)

// Condition types, each with observedGeneration so `kubectl wait` cannot be
// satisfied by a stale condition.
const (
	// ConditionReady is True once the operation has succeeded.
	ConditionReady = "Ready"
	// ConditionProgressing is True while machines are being worked on.
	ConditionProgressing = "Progressing"
	// ConditionPaused is True while the operation is Paused, for any reason.
	ConditionPaused = "Paused"
	// ConditionReconciling is True while the operation still moves by
	// itself: pending, running, waiting for the lock, paused by an
	// operator, or settling the steps in flight after a failure. kstatus
	// (Flux, kpt) reads it as InProgress.
	ConditionReconciling = "Reconciling"
	// ConditionStalled is True while only a person can move the operation
	// on: it was refused, or a step failed and nothing is in flight any
	// more. Its reason is the failure's. kstatus reads it as Failed.
	ConditionStalled = "Stalled"
	// ConditionClusterBack is set on an operation that took the API away
	// (a shutdown) once the cluster has come back: its lastTransitionTime
	// is when the controller found the API answering again, its message
	// which machines are back.
	ConditionClusterBack = "ClusterBack"
)

// MachineRole is a machine's role in the cluster.
// +kubebuilder:validation:Enum=controlplane;worker
type MachineRole string

// Machine roles.
const (
	RoleControlPlane MachineRole = "controlplane"
	RoleWorker       MachineRole = "worker"
)

// MachinePhase is where one machine stands within an operation.
// +kubebuilder:validation:Enum=Pending;Skipped;InProgress;Succeeded;Failed
type MachinePhase string

// Machine phases.
const (
	MachinePending    MachinePhase = "Pending"
	MachineSkipped    MachinePhase = "Skipped"
	MachineInProgress MachinePhase = "InProgress"
	MachineSucceeded  MachinePhase = "Succeeded"
	MachineFailed     MachinePhase = "Failed"
)

// StageOrder is the order in which a stage works on its machines.
// +kubebuilder:validation:Enum=Rolling;OneAtATime;Once
type StageOrder string

// Stage orders.
const (
	// StageRolling: control planes one at a time, then workers in batches
	// within maxUnavailable (the order of the kinds without stages).
	StageRolling StageOrder = "Rolling"
	// StageOneAtATime: one machine at a time, control planes first.
	StageOneAtATime StageOrder = "OneAtATime"
	// StageOnce: cluster-wide steps, run once as the steps of the stage's
	// first machine that is not skipped.
	StageOnce StageOrder = "Once"
)

// StageStatus is one stage of an operation made of stages: which machines
// take part, in which order, and when it ran. A stage starts only when the
// one before has finished on every machine that takes part in it.
type StageStatus struct {
	// Name names the stage (status.stage names the one in progress).
	Name string `json:"name"`
	// Roles are the roles of the machines that take part; none means every
	// machine in scope.
	// +optional
	// +listType=atomic
	Roles []MachineRole `json:"roles,omitempty"`
	// Order is Rolling, OneAtATime or Once.
	Order StageOrder `json:"order"`
	// StartedAt is when the stage began.
	// +optional
	StartedAt *metav1.Time `json:"startedAt,omitempty"`
	// FinishedAt is when every machine of the stage was done.
	// +optional
	FinishedAt *metav1.Time `json:"finishedAt,omitempty"`
	// Progress is, once the stage has finished, its machines done over its
	// machines (status.progress says it of the stage in progress).
	// +optional
	Progress string `json:"progress,omitempty"`
}

// MachineStatus is one machine's part of an operation. Entries are kept
// compact (empty fields are omitted) so an operation over 5,000 machines stays
// far below etcd's object size limit.
type MachineStatus struct {
	// Name is the machine's Node name.
	Name string `json:"name"`
	// Role is controlplane or worker.
	Role MachineRole `json:"role"`
	// Phase is Pending, Skipped, InProgress, Succeeded or Failed.
	Phase MachinePhase `json:"phase"`
	// Step is the step in progress (or the one that failed).
	// +optional
	Step string `json:"step,omitempty"`
	// Attempts counts how often work on the machine was started (in the
	// current stage, for a kind made of stages): 1, plus one for each retry
	// of its failed step.
	// +optional
	Attempts int32 `json:"attempts,omitempty"`
	// StartedAt is when work on the machine began.
	// +optional
	StartedAt *metav1.Time `json:"startedAt,omitempty"`
	// FinishedAt is when the machine succeeded, failed or was skipped.
	// +optional
	FinishedAt *metav1.Time `json:"finishedAt,omitempty"`
	// From is the version the machine ran before the operation, for the
	// kinds and steps that record it.
	// +optional
	From string `json:"from,omitempty"`
	// To is the version the machine runs once the operation is done with it
	// (kind config: the fingerprint of the patched configuration).
	// +optional
	To string `json:"to,omitempty"`
	// BootID is the boot ID recorded before a reboot, so that a restarted
	// controller can tell whether the reboot has happened. Cleared once the
	// machine is done, except on the machines of a call that ended the
	// operation (a shutdown of every control plane), which keep the boot
	// they ran before it: whether the call reached them.
	// +optional
	BootID string `json:"bootID,omitempty"`
	// Stopped is true while work on the machine has stopped between two
	// steps because the operation was paused, failed elsewhere or deleted:
	// Step is the next step and has not begun. Resuming or a retry begins it.
	// +optional
	Stopped bool `json:"stopped,omitempty"`
	// Calls counts, for a step that makes an irreversible call (a reboot,
	// an upgrade that reboots, a shutdown, a reset), the runs of that step
	// that set out to make it since its last recorded result. It is
	// written before each run starts, so more than one means an earlier
	// run may have made the call: the step then decides from the machine
	// (its stage, its boot ID), and a machine that no longer answers counts
	// as having received it. Cleared when the step's result is recorded.
	// +optional
	Calls int32 `json:"calls,omitempty"`
	// Message says what is happening or what went wrong.
	// +optional
	Message string `json:"message,omitempty"`
}

// MachineMessageMax is the most a machine's message holds, in bytes: the
// controller cuts a longer one (its Event keeps it whole), so that the
// messages of 5,000 machines fit in one object. A step that lists things
// (the pods a key rotation restarts) says what fits within it.
const MachineMessageMax = 256

// TalosOperationStatus is the operation's whole state machine: nothing lives
// only in the controller's memory.
type TalosOperationStatus struct {
	// Phase is Pending, Refused, Running, Paused or Succeeded.
	// +optional
	Phase Phase `json:"phase,omitempty"`
	// Reason says why the operation is Paused: ClusterLockHeld,
	// PausedByOperator or StepFailed.
	// +optional
	Reason string `json:"reason,omitempty"`
	// Lock is Held while the operation holds the cluster lock and Waiting while
	// it waits for it.
	// +optional
	Lock LockState `json:"lock,omitempty"`
	// LockHolder names the holder of the cluster lock while this operation waits for it.
	// +optional
	LockHolder string `json:"lockHolder,omitempty"`
	// FailureReason is set only while a failed step holds the operation, and
	// says which step failed and why.
	// +optional
	FailureReason string `json:"failureReason,omitempty"`
	// Message is a human-readable account of the current state.
	// +optional
	Message string `json:"message,omitempty"`
	// Stage is the stage in progress of a kind made of stages: the
	// machines' phases and steps are theirs within it.
	// +optional
	Stage string `json:"stage,omitempty"`
	// Stages are the stages of a kind made of stages, in the order they
	// run: those before status.stage have finished, those after have not
	// begun.
	// +optional
	// +listType=atomic
	Stages []StageStatus `json:"stages,omitempty"`
	// Target summarises what the operation moves to, like "talos v1.13.7".
	// +optional
	Target string `json:"target,omitempty"`
	// Progress is machines done over machines in scope, like 3/7.
	// +optional
	Progress string `json:"progress,omitempty"`
	// Current names the machine (or machines) being worked on.
	// +optional
	Current string `json:"current,omitempty"`
	// Machines has one entry per machine in scope, in execution order.
	// +optional
	// +listType=atomic
	Machines []MachineStatus `json:"machines,omitempty"`
	// LastRetry is when the controller last acted on a retry request.
	// +optional
	LastRetry *metav1.Time `json:"lastRetry,omitempty"`
	// RetryCount counts the retry requests acted on.
	// +optional
	RetryCount int32 `json:"retryCount,omitempty"`
	// RetryConsumed is true from the moment the controller acts on a retry
	// request until it has removed the request's annotation: while it is
	// true, the annotation is that same request, consumed by the failure it
	// was made for, and never acted on again.
	// +optional
	RetryConsumed bool `json:"retryConsumed,omitempty"`
	// StartTime is when the operation first started running.
	// +optional
	StartTime *metav1.Time `json:"startTime,omitempty"`
	// CompletionTime is when the operation succeeded or was refused.
	// +optional
	CompletionTime *metav1.Time `json:"completionTime,omitempty"`
	// ObservedGeneration is the spec generation this status reflects.
	// +optional
	ObservedGeneration int64 `json:"observedGeneration,omitempty"`
	// Conditions are Ready, Progressing and Paused (and preflight checks when refused).
	// +optional
	// +listType=map
	// +listMapKey=type
	Conditions []metav1.Condition `json:"conditions,omitempty"`
}

// TalosOperation is the record of one disruptive action on a Talos cluster
// (an upgrade, a rotation, a reboot, a shutdown, a restore) while it is
// carried out, machine by machine, by ichor-controller.
//
// +kubebuilder:object:root=true
// +kubebuilder:subresource:status
// +kubebuilder:resource:scope=Namespaced,shortName=talosop,categories=ichor
// +kubebuilder:printcolumn:name="Kind",type=string,JSONPath=`.spec.kind`
// +kubebuilder:printcolumn:name="Phase",type=string,JSONPath=`.status.phase`
// +kubebuilder:printcolumn:name="Progress",type=string,JSONPath=`.status.progress`
// +kubebuilder:printcolumn:name="Current",type=string,JSONPath=`.status.current`
// +kubebuilder:printcolumn:name="Reason",type=string,JSONPath=`.status.reason`
// +kubebuilder:printcolumn:name="Failure",type=string,JSONPath=`.status.failureReason`
// +kubebuilder:printcolumn:name="Age",type=date,JSONPath=`.metadata.creationTimestamp`
// +kubebuilder:printcolumn:name="Target",type=string,JSONPath=`.status.target`,priority=1
// +kubebuilder:printcolumn:name="Lock",type=string,JSONPath=`.status.lock`,priority=1
// +kubebuilder:validation:XValidation:rule="!has(oldSelf.status) || !has(oldSelf.status.phase) || oldSelf.status.phase == 'Pending' || (self.spec.kind == oldSelf.spec.kind && (has(self.spec.talos) ? has(oldSelf.spec.talos) && self.spec.talos == oldSelf.spec.talos : !has(oldSelf.spec.talos)) && (has(self.spec.kubernetes) ? has(oldSelf.spec.kubernetes) && self.spec.kubernetes == oldSelf.spec.kubernetes : !has(oldSelf.spec.kubernetes)) && (has(self.spec.ichor) ? has(oldSelf.spec.ichor) && self.spec.ichor == oldSelf.spec.ichor : !has(oldSelf.spec.ichor)) && (has(self.spec.cni) ? has(oldSelf.spec.cni) && self.spec.cni == oldSelf.spec.cni : !has(oldSelf.spec.cni)) && (has(self.spec.config) ? has(oldSelf.spec.config) && self.spec.config == oldSelf.spec.config : !has(oldSelf.spec.config)) && (has(self.spec.node) ? has(oldSelf.spec.node) && self.spec.node == oldSelf.spec.node : !has(oldSelf.spec.node)) && (has(self.spec.shutdown) ? has(oldSelf.spec.shutdown) && self.spec.shutdown == oldSelf.spec.shutdown : !has(oldSelf.spec.shutdown)) && (has(self.spec.caRotation) ? has(oldSelf.spec.caRotation) && self.spec.caRotation == oldSelf.spec.caRotation : !has(oldSelf.spec.caRotation)) && (has(self.spec.keyRotation) ? has(oldSelf.spec.keyRotation) && self.spec.keyRotation == oldSelf.spec.keyRotation : !has(oldSelf.spec.keyRotation)) && (has(self.spec.etcdRestore) ? has(oldSelf.spec.etcdRestore) && self.spec.etcdRestore == oldSelf.spec.etcdRestore : !has(oldSelf.spec.etcdRestore)) && (has(self.spec.maxUnavailable) ? has(oldSelf.spec.maxUnavailable) && self.spec.maxUnavailable == oldSelf.spec.maxUnavailable : !has(oldSelf.spec.maxUnavailable)) && (has(self.spec.machines) ? has(oldSelf.spec.machines) && self.spec.machines == oldSelf.spec.machines : !has(oldSelf.spec.machines)) && (has(self.spec.drain) ? has(oldSelf.spec.drain) && self.spec.drain == oldSelf.spec.drain : !has(oldSelf.spec.drain)))",message="spec is immutable once the operation has left Pending: only spec.paused and spec.override may change; create a new operation instead",fieldPath=".spec"
type TalosOperation struct {
	metav1.TypeMeta   `json:",inline"`
	metav1.ObjectMeta `json:"metadata,omitempty"`

	// +required
	Spec TalosOperationSpec `json:"spec"`
	// +optional
	Status TalosOperationStatus `json:"status,omitempty"`
}

// TalosOperationList is a list of TalosOperations.
//
// +kubebuilder:object:root=true
type TalosOperationList struct {
	metav1.TypeMeta `json:",inline"`
	metav1.ListMeta `json:"metadata,omitempty"`
	Items           []TalosOperation `json:"items"`
}
