package v1alpha1

import (
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
)

// OperationKind names the action an operation carries out.
// +kubebuilder:validation:Enum=talos;kubernetes;ichor;cni;config;node;shutdown;ca-rotation;key-rotation;etcd-restore
type OperationKind string

// The ten kinds of the specification.
const (
	KindTalos       OperationKind = "talos"
	KindKubernetes  OperationKind = "kubernetes"
	KindIchor       OperationKind = "ichor"
	KindCNI         OperationKind = "cni"
	KindConfig      OperationKind = "config"
	KindNode        OperationKind = "node"
	KindShutdown    OperationKind = "shutdown"
	KindCARotation  OperationKind = "ca-rotation"
	KindKeyRotation OperationKind = "key-rotation"
	KindEtcdRestore OperationKind = "etcd-restore"
)

// Kinds lists every kind, in the order the specification's table gives them.
var Kinds = []OperationKind{
	KindTalos, KindKubernetes, KindIchor, KindCNI, KindConfig,
	KindNode, KindShutdown, KindCARotation, KindKeyRotation, KindEtcdRestore,
}

// TalosOperationSpec says which action to carry out and how. Exactly the block
// named by kind may be set. Once the operation has left Pending only paused and
// override may change, so what runs is what was checked.
//
// +kubebuilder:validation:XValidation:rule="!has(self.talos) || self.kind == 'talos'",message="spec.talos may only be set when spec.kind is talos",fieldPath=".talos"
// +kubebuilder:validation:XValidation:rule="!has(self.kubernetes) || self.kind == 'kubernetes'",message="spec.kubernetes may only be set when spec.kind is kubernetes",fieldPath=".kubernetes"
// +kubebuilder:validation:XValidation:rule="!has(self.ichor) || self.kind == 'ichor'",message="spec.ichor may only be set when spec.kind is ichor",fieldPath=".ichor"
// +kubebuilder:validation:XValidation:rule="!has(self.cni) || self.kind == 'cni'",message="spec.cni may only be set when spec.kind is cni",fieldPath=".cni"
// +kubebuilder:validation:XValidation:rule="!has(self.config) || self.kind == 'config'",message="spec.config may only be set when spec.kind is config",fieldPath=".config"
// +kubebuilder:validation:XValidation:rule="!has(self.node) || self.kind == 'node'",message="spec.node may only be set when spec.kind is node",fieldPath=".node"
// +kubebuilder:validation:XValidation:rule="!has(self.shutdown) || self.kind == 'shutdown'",message="spec.shutdown may only be set when spec.kind is shutdown",fieldPath=".shutdown"
// +kubebuilder:validation:XValidation:rule="!has(self.caRotation) || self.kind == 'ca-rotation'",message="spec.caRotation may only be set when spec.kind is ca-rotation",fieldPath=".caRotation"
// +kubebuilder:validation:XValidation:rule="!has(self.keyRotation) || self.kind == 'key-rotation'",message="spec.keyRotation may only be set when spec.kind is key-rotation",fieldPath=".keyRotation"
// +kubebuilder:validation:XValidation:rule="!has(self.etcdRestore) || self.kind == 'etcd-restore'",message="spec.etcdRestore may only be set when spec.kind is etcd-restore",fieldPath=".etcdRestore"
// +kubebuilder:validation:XValidation:rule="self.kind != 'talos' || has(self.talos)",message="spec.talos is required when spec.kind is talos (set spec.talos.version)",fieldPath=".talos"
// +kubebuilder:validation:XValidation:rule="self.kind != 'kubernetes' || has(self.kubernetes)",message="spec.kubernetes is required when spec.kind is kubernetes (set spec.kubernetes.version)",fieldPath=".kubernetes"
// +kubebuilder:validation:XValidation:rule="self.kind != 'ichor' || has(self.ichor)",message="spec.ichor is required when spec.kind is ichor (set spec.ichor.version)",fieldPath=".ichor"
// +kubebuilder:validation:XValidation:rule="self.kind != 'config' || has(self.config)",message="spec.config is required when spec.kind is config (set spec.config.patches)",fieldPath=".config"
// +kubebuilder:validation:XValidation:rule="self.kind != 'node' || has(self.node)",message="spec.node is required when spec.kind is node (set spec.node.machine and spec.node.action)",fieldPath=".node"
// +kubebuilder:validation:XValidation:rule="self.kind != 'etcd-restore' || has(self.etcdRestore)",message="spec.etcdRestore is required when spec.kind is etcd-restore (set spec.etcdRestore.snapshot)",fieldPath=".etcdRestore"
type TalosOperationSpec struct {
	// Kind names the action: talos, kubernetes, ichor, cni, config, node,
	// shutdown, ca-rotation, key-rotation or etcd-restore.
	// +required
	Kind OperationKind `json:"kind"`

	// Talos upgrades Talos Linux (and the installer schematic), one node at a time.
	// +optional
	Talos *TalosUpgrade `json:"talos,omitempty"`
	// Kubernetes upgrades control-plane components, kube-proxy, then kubelets.
	// +optional
	Kubernetes *KubernetesUpgrade `json:"kubernetes,omitempty"`
	// Ichor upgrades Ichor itself through an installer Job.
	// +optional
	Ichor *IchorUpgrade `json:"ichor,omitempty"`
	// CNI moves Cilium to the chart this Ichor embeds, or switches the kube-proxy mode.
	// +optional
	CNI *CNIChange `json:"cni,omitempty"`
	// Config rolls out machine-configuration patches, rebooting only where
	// needed in mode auto.
	// +optional
	Config *ConfigRollout `json:"config,omitempty"`
	// Node is one action on one machine.
	// +optional
	Node *NodeAction `json:"node,omitempty"`
	// Shutdown stops the whole cluster for planned downtime.
	// +optional
	Shutdown *ClusterShutdown `json:"shutdown,omitempty"`
	// CARotation replaces the cluster CAs.
	// +optional
	CARotation *CARotation `json:"caRotation,omitempty"`
	// KeyRotation replaces the service-account signing key and the secretbox key.
	// +optional
	KeyRotation *KeyRotation `json:"keyRotation,omitempty"`
	// EtcdRestore rewinds the cluster to a stored etcd snapshot.
	// +optional
	EtcdRestore *EtcdRestore `json:"etcdRestore,omitempty"`

	// Paused stops the operation between two steps. It keeps the cluster lock.
	// +optional
	Paused bool `json:"paused,omitempty"`
	// MaxUnavailable is how many workers may be disrupted at once, counting
	// workers that are already NotReady or cordoned. Control planes always go
	// one at a time.
	// +kubebuilder:default=1
	// +kubebuilder:validation:Minimum=1
	// +optional
	MaxUnavailable int32 `json:"maxUnavailable,omitempty"`
	// Override runs the operation although preflight refused it. Setting it
	// needs the override verb on talosoperations; the controller leaves a
	// Warning Event naming each bypassed check.
	// +optional
	Override bool `json:"override,omitempty"`
	// Machines narrows the machines in scope to the Nodes this selector matches.
	// +kubebuilder:validation:XValidation:rule="!has(self.matchExpressions) || self.matchExpressions.all(e, e.operator in ['In', 'NotIn', 'Exists', 'DoesNotExist'] && ((e.operator in ['In', 'NotIn']) == (has(e.values) && size(e.values) > 0)))",message="spec.machines.matchExpressions: operator must be In, NotIn, Exists or DoesNotExist; In and NotIn need values, Exists and DoesNotExist take none"
	// +optional
	Machines *metav1.LabelSelector `json:"machines,omitempty"`
	// Drain says how workloads are moved off a machine before it is disrupted.
	// +optional
	Drain *Drain `json:"drain,omitempty"`
}

// TalosUpgrade is the block of kind talos.
type TalosUpgrade struct {
	// Version is the Talos version to install, like v1.13.7.
	// +required
	// +kubebuilder:validation:MaxLength=64
	// +kubebuilder:validation:XValidation:rule="self.matches('^v[0-9]+[.][0-9]+[.][0-9]+(-[0-9A-Za-z.-]+)?([+][0-9A-Za-z.-]+)?$')",message="must be a version like v1.13.7 (with the leading v)"
	Version string `json:"version"`
	// Schematic is the Image Factory schematic ID to install. Empty keeps each
	// machine's current schematic.
	// +optional
	// +kubebuilder:validation:MaxLength=64
	// +kubebuilder:validation:XValidation:rule="self.matches('^[0-9a-f]{64}$')",message="must be an Image Factory schematic ID: 64 lower-case hex digits"
	Schematic string `json:"schematic,omitempty"`
	// ImageRepository is the registry serving installer images.
	// +kubebuilder:default="factory.talos.dev"
	// +kubebuilder:validation:MaxLength=253
	// +optional
	ImageRepository string `json:"imageRepository,omitempty"`
	// RebootMode is how machines reboot into the new version: default (kexec
	// where possible) or powercycle.
	// +kubebuilder:validation:Enum=default;powercycle
	// +kubebuilder:default=default
	// +optional
	RebootMode RebootMode `json:"rebootMode,omitempty"`
}

// RebootMode is how a machine reboots.
type RebootMode string

// Reboot modes.
const (
	RebootModeDefault    RebootMode = "default"
	RebootModePowercycle RebootMode = "powercycle"
)

// KubernetesUpgrade is the block of kind kubernetes.
type KubernetesUpgrade struct {
	// Version is the Kubernetes version to run, like v1.36.2.
	// +required
	// +kubebuilder:validation:MaxLength=64
	// +kubebuilder:validation:XValidation:rule="self.matches('^v[0-9]+[.][0-9]+[.][0-9]+(-[0-9A-Za-z.-]+)?([+][0-9A-Za-z.-]+)?$')",message="must be a version like v1.36.2 (with the leading v)"
	Version string `json:"version"`
	// PrePullImages pulls the new images on every machine before any component moves.
	// +kubebuilder:default=true
	// +optional
	PrePullImages *bool `json:"prePullImages,omitempty"`
}

// IchorUpgrade is the block of kind ichor.
type IchorUpgrade struct {
	// Version is the Ichor version to install, like v0.2.0.
	// +required
	// +kubebuilder:validation:MaxLength=64
	// +kubebuilder:validation:XValidation:rule="self.matches('^v[0-9]+[.][0-9]+[.][0-9]+(-[0-9A-Za-z.-]+)?([+][0-9A-Za-z.-]+)?$')",message="must be a version like v0.2.0 (with the leading v)"
	Version string `json:"version"`
	// Image overrides the controller image; empty uses the release image of Version.
	// +kubebuilder:validation:MaxLength=512
	// +optional
	Image string `json:"image,omitempty"`
}

// CNIChange is the block of kind cni.
type CNIChange struct {
	// ChartVersion is the Cilium chart to move to; empty means the chart this
	// Ichor embeds.
	// +kubebuilder:validation:MaxLength=64
	// +kubebuilder:validation:XValidation:rule="self.matches('^v?[0-9]+[.][0-9]+[.][0-9]+(-[0-9A-Za-z.-]+)?$')",message="must be a chart version like 1.18.4"
	// +optional
	ChartVersion string `json:"chartVersion,omitempty"`
	// KubeProxyReplacement switches the kube-proxy mode: true lets Cilium
	// replace kube-proxy, false brings kube-proxy back. Unset keeps the mode.
	// +optional
	KubeProxyReplacement *bool `json:"kubeProxyReplacement,omitempty"`
}

// ConfigRollout is the block of kind config.
type ConfigRollout struct {
	// Patches are Talos machine-config patches, each a YAML strategic merge
	// patch (one or more documents; $patch: delete removes one) or an RFC
	// 6902 JSON patch (written as JSON or YAML, its paths in the v1alpha1
	// document; the other documents are kept), applied in order.
	// +required
	// +kubebuilder:validation:MinItems=1
	// +kubebuilder:validation:MaxItems=32
	// +kubebuilder:validation:items:MinLength=1
	// +kubebuilder:validation:items:MaxLength=65536
	Patches []string `json:"patches"`
	// Mode is reboot (always reboot each machine after applying) or auto
	// (reboot only the machines where the change cannot apply live).
	// +kubebuilder:validation:Enum=reboot;auto
	// +kubebuilder:default=reboot
	// +optional
	Mode ConfigMode `json:"mode,omitempty"`
}

// ConfigMode is how configuration changes are applied.
type ConfigMode string

// Config modes.
const (
	ConfigModeReboot ConfigMode = "reboot"
	ConfigModeAuto   ConfigMode = "auto"
)

// NodeActionType is one action on one machine.
// +kubebuilder:validation:Enum=reboot;shutdown;restart-service;etcd-defrag;etcd-forfeit-leadership;reset
type NodeActionType string

// Node actions.
const (
	NodeReboot                NodeActionType = "reboot"
	NodeShutdown              NodeActionType = "shutdown"
	NodeRestartService        NodeActionType = "restart-service"
	NodeEtcdDefrag            NodeActionType = "etcd-defrag"
	NodeEtcdForfeitLeadership NodeActionType = "etcd-forfeit-leadership"
	NodeReset                 NodeActionType = "reset"
)

// NodeAction is the block of kind node.
//
// +kubebuilder:validation:XValidation:rule="self.action == 'restart-service' ? has(self.service) : !has(self.service)",message="spec.node.service is required exactly when spec.node.action is restart-service",fieldPath=".service"
// +kubebuilder:validation:XValidation:rule="!has(self.reset) || self.action == 'reset'",message="spec.node.reset may only be set when spec.node.action is reset",fieldPath=".reset"
type NodeAction struct {
	// Machine is the Node name of the machine to act on.
	// +required
	// +kubebuilder:validation:MinLength=1
	// +kubebuilder:validation:MaxLength=253
	Machine string `json:"machine"`
	// Action is reboot, shutdown, restart-service, etcd-defrag,
	// etcd-forfeit-leadership or reset.
	// +required
	Action NodeActionType `json:"action"`
	// Service is the service to restart (kubelet or an extension service).
	// +kubebuilder:validation:MinLength=1
	// +kubebuilder:validation:MaxLength=128
	// +optional
	Service string `json:"service,omitempty"`
	// Reset says how to reset the machine.
	// +optional
	Reset *ResetOptions `json:"reset,omitempty"`
}

// WipeMode is what a reset wipes.
// +kubebuilder:validation:Enum=all;system-disk;ephemeral
type WipeMode string

// Wipe modes.
const (
	WipeAll        WipeMode = "all"
	WipeSystemDisk WipeMode = "system-disk"
	WipeEphemeral  WipeMode = "ephemeral"
)

// ResetOptions says how a machine is reset.
type ResetOptions struct {
	// Graceful cordons and drains the machine and, on a control plane, leaves
	// etcd first.
	// +kubebuilder:default=true
	// +optional
	Graceful *bool `json:"graceful,omitempty"`
	// Wipe is all (every disk Talos manages), system-disk, or ephemeral (only
	// the EPHEMERAL volume).
	// +kubebuilder:default=all
	// +optional
	Wipe WipeMode `json:"wipe,omitempty"`
	// Reboot reboots the machine after the reset instead of shutting it down.
	// +optional
	Reboot bool `json:"reboot,omitempty"`
}

// ClusterShutdown is the block of kind shutdown.
type ClusterShutdown struct {
	// Force skips draining and stops the machines straight away: each
	// worker is cordoned, and only the controller's own pod moves off it.
	// +optional
	Force bool `json:"force,omitempty"`
	// Snapshot is where the shutdown first saves a snapshot of etcd, before
	// any machine stops, to restore from (kind etcd-restore) if the cluster
	// does not come back whole: a file:// URL (a path the controller writes,
	// such as a mounted volume) or s3://bucket/key. Empty takes none.
	// +kubebuilder:validation:MaxLength=2048
	// +kubebuilder:validation:XValidation:rule="self.matches('^(file|s3)://.+')",message="must be a file:// or s3:// URL"
	// +optional
	Snapshot string `json:"snapshot,omitempty"`
	// Secret names a Secret in the controller's namespace with the
	// credentials of an s3:// snapshot, as spec.etcdRestore.secret does.
	// +kubebuilder:validation:MaxLength=253
	// +optional
	Secret string `json:"secret,omitempty"`
}

// CARotation is the block of kind ca-rotation.
//
// +kubebuilder:validation:XValidation:rule="self.talos || self.kubernetes",message="at least one of spec.caRotation.talos and spec.caRotation.kubernetes must be true"
type CARotation struct {
	// Talos rotates the Talos API CA.
	// +kubebuilder:default=true
	// +optional
	Talos *bool `json:"talos,omitempty"`
	// Kubernetes rotates the Kubernetes API CA.
	// +kubebuilder:default=true
	// +optional
	Kubernetes *bool `json:"kubernetes,omitempty"`
}

// Rotates says which CAs the rotation replaces: each unless set false, as
// the API's defaults (a nil block rotates both).
func (c *CARotation) Rotates() (talos, kubernetes bool) {
	if c == nil {
		return true, true
	}
	return c.Talos == nil || *c.Talos, c.Kubernetes == nil || *c.Kubernetes
}

// KeyRotation is the block of kind key-rotation.
//
// +kubebuilder:validation:XValidation:rule="self.serviceAccount || self.secretbox",message="at least one of spec.keyRotation.serviceAccount and spec.keyRotation.secretbox must be true"
type KeyRotation struct {
	// ServiceAccount rotates the service-account signing key.
	// +kubebuilder:default=true
	// +optional
	ServiceAccount *bool `json:"serviceAccount,omitempty"`
	// Secretbox rotates the secretbox encryption key of Secrets at rest
	// (and migrates a cluster that encrypts with aescbc to secretbox).
	// +kubebuilder:default=true
	// +optional
	Secretbox *bool `json:"secretbox,omitempty"`
	// RestartWorkloads restarts, after a service-account key rotation, the
	// pods whose projected ServiceAccount tokens the old key signed: evicted
	// machine by machine, one pod of a workload at a time, within their
	// PodDisruptionBudgets.
	// +kubebuilder:default=true
	// +optional
	RestartWorkloads *bool `json:"restartWorkloads,omitempty"`
}

// Rotates says which keys the rotation replaces: each unless set false, as
// the API's defaults (a nil block rotates both).
func (k *KeyRotation) Rotates() (serviceAccount, secretbox bool) {
	if k == nil {
		return true, true
	}
	return k.ServiceAccount == nil || *k.ServiceAccount, k.Secretbox == nil || *k.Secretbox
}

// Restarts says whether a service-account key rotation restarts the
// workloads (unless set false, as the API's default).
func (k *KeyRotation) Restarts() bool {
	sa, _ := k.Rotates()
	return sa && (k == nil || k.RestartWorkloads == nil || *k.RestartWorkloads)
}

// EtcdRestore is the block of kind etcd-restore.
type EtcdRestore struct {
	// Snapshot is where the etcd snapshot is: a file:// or s3:// URL.
	// +required
	// +kubebuilder:validation:MaxLength=2048
	// +kubebuilder:validation:XValidation:rule="self.matches('^(file|s3)://.+')",message="must be a file:// or s3:// URL"
	Snapshot string `json:"snapshot"`
	// Machine is the control plane that recovers etcd; empty picks the first one.
	// +kubebuilder:validation:MaxLength=253
	// +optional
	Machine string `json:"machine,omitempty"`
	// Secret names a Secret in the controller's namespace with the credentials
	// of an s3:// snapshot: AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, and
	// optionally AWS_SESSION_TOKEN, AWS_REGION and AWS_ENDPOINT_URL (an
	// S3-compatible server). Without it the object is read anonymously. The
	// controller may read ichor-etcd-snapshot (the Role
	// ichor-controller-etcd-restore); another name must be added there.
	// +kubebuilder:validation:MaxLength=253
	// +optional
	Secret string `json:"secret,omitempty"`
}

// DrainTimeoutAction is what happens when a drain does not finish in time.
// +kubebuilder:validation:Enum=fail;force
type DrainTimeoutAction string

// Drain timeout actions.
const (
	DrainFail  DrainTimeoutAction = "fail"
	DrainForce DrainTimeoutAction = "force"
)

// Drain says how workloads leave a machine before it is disrupted.
type Drain struct {
	// Timeout bounds the drain of one machine.
	// +kubebuilder:default="5m"
	// +optional
	Timeout *metav1.Duration `json:"timeout,omitempty"`
	// OnTimeout is fail (the step fails and the operation pauses) or force
	// (remaining pods are deleted, ignoring PodDisruptionBudgets).
	// +kubebuilder:default=fail
	// +optional
	OnTimeout DrainTimeoutAction `json:"onTimeout,omitempty"`
	// Disabled skips cordon and drain.
	// +optional
	Disabled bool `json:"disabled,omitempty"`
}
