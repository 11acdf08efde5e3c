// Package sim starts fleets of simulated Talos machines that the real
// machinery client talks to exactly as it would to a small real cluster:
// the Talos gRPC API over mutual TLS, routed by node metadata as apid
// routes it, with each machine owning its Kubernetes Node.
//
// # Starting a fleet
//
//	spec := sim.Cluster("prod", 3, 5) // prod-cp-1..3, prod-w-1..5 on DefaultTalos
//	spec.Machines[4].Talos = "v1.13.0" // vary any machine before Start
//	f, err := sim.Start(ctx, spec, kube) // kube: a kubernetes.Interface, or nil
//	defer f.Stop()
//	c, err := client.New(ctx, client.WithConfig(f.Talosconfig()))
//	resp, err := c.Version(client.WithNode(ctx, f.Machine("prod-w-1").Address()))
//
// Spec lists the machines (name, role, Talos and Kubernetes versions,
// schematic ID, platform, secure boot, extension services) and the step
// Durations, which default to milliseconds (DefaultDurations); the sandbox
// sets seconds. Spec.Unbootstrapped starts etcd empty, waiting for
// Bootstrap. Spec.Logf receives a line per notable event.
//
// A machine marked Joins is outside the cluster until Fleet.Join: off, no
// Node, no etcd member, not an endpoint. Join boots it: a control plane
// joins etcd as a new member once etcd has a leader, the kubelet registers
// the Node NotReady, and it turns Ready Durations.NodeReady later, as a
// machine added to a Talos cluster does.
//
// # Addresses and endpoints
//
// A fleet takes a block 127.F.0.0/16 of its own (F differs between the
// fleets of a process and starts at random, so two test binaries rarely
// share one). Machine i gets 127.F.i/250.i%250+1: its Talos node address
// and its Node's InternalIP. Every control plane listens on its own address
// with port 0, picked once and kept across reboots; Fleet.Endpoints are
// those listeners and the talosconfig's endpoints. Workers do not listen:
// they are reached through a control plane with client.WithNode. Nothing
// binds or dials outside 127.0.0.0/8.
//
// # Certificates and roles
//
// Each fleet has its own Talos API CA. Fleet.Talosconfig is an os:admin
// talosconfig; Fleet.ClientConfig(roles...) mints one for other roles
// (os:reader, os:operator, os:etcd:backup...). Server certificates carry the
// control plane's IP as SAN; TLS 1.3 with client certificates is required.
// As apid, each control plane trusts what its active configuration says:
// the client CAs are machine.acceptedCAs plus machine.ca, and its server
// certificate is issued by machine.ca, both taken again at the next
// handshake after a change (connections already open stay, as on Talos),
// so a CA rotation through ApplyConfiguration is real: a client
// certificate of a CA no longer accepted is refused at the handshake. A
// call routed to another machine makes apid's hop over mutual TLS: that
// machine must accept the control plane's machine.ca and the other way
// round. GenerateClientConfiguration (control planes only) mints from the
// machine's own machine.ca.
// The role is the client certificate's Organization, checked per method with
// Talos's own table (machined's authz rules: Reboot, Shutdown,
// ServiceRestart, EtcdDefragment and ImageService.Pull need os:operator;
// Upgrade, Reset, the etcd membership calls, Bootstrap, EtcdRecover,
// ApplyConfiguration, Read and LifecycleService need os:admin; Version,
// Events, EtcdStatus, EtcdMemberList, EtcdAlarmList and COSI reads take
// os:reader; EtcdSnapshot takes os:etcd:backup). A wrong role gets
// PermissionDenied. COSI is read-only through the API, and the sensitive
// MachineConfig needs os:admin.
//
// # Routing
//
// node metadata (client.WithNode, an address or a hostname) sends a call to
// that machine; nodes metadata (client.WithNodes) fans out for
// MachineService methods and aggregates, each message's Metadata.Hostname
// set and a failing node reported in Metadata.Error, so the client's
// FilterMessages returns a *client.NodeError for it. Fan-out of
// LifecycleService, ImageService and COSI is InvalidArgument, as in apid. A
// call without metadata is answered by the endpoint's own machine. A machine
// that is down answers Unavailable (connection refused, as apid's dial to
// it fails); a call under way when its machine goes down ends Unavailable
// "error reading from server: EOF", as its connection does; a control
// plane that is down closes its listener, so its endpoint refuses
// connections.
//
// # What the machines do
//
// Version; Hostname; Read of /proc/sys/kernel/random/boot_id; Events (a hello
// event first, then SequenceEvent, TaskEvent "stopAllServices",
// MachineStatusEvent and friends of the current boot, with tail_events,
// tail_id, tail_seconds and actor filtering, so EventsWatchV2 works); Reboot
// in every mode; Shutdown (force skips the drain; the machine stays off until
// Machine.PowerOn); Reset (graceful drains and leaves etcd; wiping EPHEMERAL,
// or every system partition, empties the etcd data; with reboot it comes
// back, without it stays off; Talos's refusals of bad wipe requests);
// ServiceList, ServiceRestart (kubelet and ext-* services only: other
// services are refused as Talos refuses them, unknown ones are "not
// defined"); the legacy MachineService.Upgrade on every version (pull and
// checks before it answers, the etcd checks on a control plane unless force
// or preserve, then cordon, drain, install, reboot by itself; stage reboots
// first); ImageService.Pull and LifecycleService.Upgrade from 1.13.0-alpha.1
// and 1.13.0-beta.0 (Unimplemented below, as old nodes answer): the image
// must be pulled into the same containerd instance, the install streams
// messages, then an exit code (1 when the installer's preflight refuses the
// host version), then EOF, and does not reboot; ImagePull (deprecated);
// ApplyConfiguration in every mode, the zero value being REBOOT (Validate,
// the Kubernetes images against the running Talos version, Talos's
// CanApplyImmediate for NO_REBOOT and TRY, AUTO choosing, STAGED at the next
// boot, TRY reverting after its timeout to the configuration active when it
// came, any other request ending a pending TRY, a dry run answering with
// Talos's config diff or "No changes."; what Talos's controllers then do:
// a change of what the kubelet is built from, machine.kubelet or the
// cluster's DNS, restarts the kubelet, its Service going away and coming
// back, and the Node reports the new version; machine.nodeLabels,
// nodeAnnotations and nodeTaints are put on the Node); EtcdStatus, EtcdMemberList,
// EtcdAlarmList, EtcdAlarmDisarm, EtcdDefragment, EtcdForfeitLeadership,
// EtcdLeaveCluster, EtcdRemoveMemberByID, EtcdSnapshot, EtcdRecover and
// Bootstrap (Unimplemented on workers); MetaWrite and MetaDelete of the
// META partition's keys (os:admin or os:meta:writer; the key must fit in a
// uint8; the values share Talos's ADV budget of 256 KiB less 40 bytes,
// beyond which a write is ResourceExhausted "meta write failed"; deleting a
// missing key is NotFound; on Platform "container" FailedPrecondition, as
// Talos in a container has no META), which survive reboots and resets that
// wipe EPHEMERAL or STATE and are lost only when the reset wipes the whole
// system disk or META; GenerateClientConfiguration; COSI
// Get, List and Watch of MachineConfig (v1alpha1 and persistent),
// MachineType, MachineStatus, Version, ExtensionStatus (the "schematic"
// entry carries the schematic ID; none without a schematic), SecurityState,
// Service (apid, containerd, cri, machined, udevd, kubelet, ext-*, and etcd
// and trustd on control planes), Nodename, the local etcd Member, the META keys (MetaKey, namespace runtime,
// ID "0x0d"; not sensitive), the
// KubeletSpec (the kubelet image, its flags with machine.kubelet.extraArgs
// merged in as Talos's argsbuilder renders them, and extraConfig) and, on
// control planes, the components' APIServerConfig, ControllerManagerConfig
// and SchedulerConfig (namespace controlplane), their StaticPods (namespace
// k8s: the pod Talos renders, its command with the component's extraArgs
// merged in) and the bootstrap Manifests Talos renders (namespace
// controlplane: 10-kube-proxy with cluster.proxy.image while the proxy is
// enabled, 11-core-dns and 11-core-dns-svc while CoreDNS is, 99-<name> for
// each of cluster.inlineManifests), all rendered anew on a live
// configuration change.
//
// Disruptive sequences follow Talos's sequencer: COSI MachineStatus goes to
// the sequence's stage (rebooting, upgrading, shutting down, resetting) when
// it starts and the API keeps answering while the machine stops; while one
// runs, a Reboot takes a reboot or a reset over, Shutdown and
// ApplyConfiguration's reboot take anything over, and any other call (a
// second Reset, say) is answered but starts nothing (a NOOP SequenceEvent
// with the LOCKED error says so).
//
// An upgrade installs to the inactive slot: the version, schematic and
// installer image change at the next boot, which also brings a new boot ID.
// The simulated registry has every image tagged with a version: the
// installers (factory.talos.dev/<platform>-installer[-secureboot]/<schematic>:<v>,
// the legacy factory.talos.dev/installer/..., ghcr.io/siderolabs/installer:<v>)
// and the Kubernetes images (registry.k8s.io/kube-apiserver:<v>,
// ghcr.io/siderolabs/kubelet:<v>[-fat], ...), except the versions
// Spec.Unpublished names; anything else is not found (NotFound from
// ImageService.Pull and the deprecated ImagePull, which pulls into the CRI
// containerd, in its k8s.io or system namespace as asked). A pull of an
// image already in the store does not download it again.
//
// Talos cordons a Node itself while upgrading (legacy path), shutting down
// or resetting, only if it was schedulable, with the talos.dev/cordoned
// annotation, and uncordons at boot only a Node it cordoned. The sim does
// the same, so an operator's cordon survives every action. The sim never
// touches spec.unschedulable otherwise.
//
// # The etcd model
//
// The members are the control planes. A member is healthy while its machine
// is up, runs etcd and has no etcd-unhealthy fault. A leader exists while a
// quorum of members is healthy (re-elected when it fails); without one, the
// calls that need a leader answer Unavailable "etcdserver: no leader".
// Alarms can be raised (fault) and disarmed. Forfeit moves the leadership to
// another healthy member. Leave and remove take a member out; a machine that
// left rejoins, as a new member, only after a boot with empty data. The
// legacy Upgrade refuses two members or an unhealthy one. Snapshots end in
// their SHA-256 as etcd's do; Bootstrap with RecoverEtcd restores the
// snapshot's revision (Fleet.EtcdWrite moves the revision, to tell data
// apart). Fleet.Etcd returns the model's state.
//
// Under Spec.Hosted the model keeps the membership and the answers, and
// one real etcd process holds the data the API servers store: it serves
// while the model's cluster has a leader and stops when that quorum is
// lost (every control plane off, or two of three), starting again on the
// same data directory. EtcdSnapshot streams its maintenance snapshot; the
// data goes when the last member's data is wiped; Bootstrap makes a new
// data directory, with RecoverEtcd restored from the uploaded snapshot by
// etcdutl (snapshot status, then restore), and the API servers restart.
// Fleet.HostedEtcd says whether it serves and where.
//
// # Kubernetes
//
// With a kube client, every machine registers its Node (or adopts an
// existing one): labels kubernetes.io/hostname and FleetLabel, and what
// Talos's NodeApplyController puts there from the active configuration, at
// registration, at every boot and after every live change:
// machine.nodeLabels and node-role.kubernetes.io/control-plane on control
// planes (with its NoSchedule taint unless cluster.allowSchedulingOnControlPlanes),
// machine.nodeAnnotations, machine.nodeTaints ("value:Effect"), recorded in
// talos.dev/owned-labels, -annotations and -taints, so that what the
// configuration drops is removed and what someone else set is left alone;
// InternalIP = the machine's address; Ready, nodeInfo.osImage "Talos (vX)",
// kubeletVersion, bootID; status through the status subresource. As the
// machine goes down the Node turns NotReady (Ready False, "node is shutting
// down", as the kubelet's graceful node shutdown that Talos configures posts
// it) and Ready when it is back. With Kubelet.NodeLease the machine renews
// its Node Lease (kube-node-lease, owned by the Node) every quarter of that
// while it is up, with kwok's NodeLeaseController, and not while it is
// down: the real node-lifecycle controller then marks a machine that stays
// down Unknown and taints it unreachable. Without Leases, run no
// node-lifecycle controller.
//
// # Kubelets
//
// Each machine plays its kubelet for the pods bound to its Node (one Pod
// informer per fleet; timers only for what a container does). A pod starts
// when bound: a pod IP (10.A.B.C from the machine's index; the machine's
// address with hostNetwork), its init containers one after another, then
// its containers, Running, and Ready (with ContainersReady, Initialized and
// PodReadyToStartContainers) after Durations.PodReady. While its machine is
// down a pod is NotReady and its containers show terminated (exit 255,
// "Unknown"); after the boot they start again from the first init
// container, each with its restart count up (a restartPolicy Never pod
// whose containers died with the machine fails instead). A reset removes
// every pod bound to the machine. A pod being deleted (also after an
// eviction) gets SIGTERM and is removed once min(its grace period,
// Durations.PodGrace) has passed, or when its machine is back if it was
// down; so kubectl drain and k8s.io/kubectl/pkg/drain finish.
//
// A container whose image matches a pattern of Kubelet.Binaries runs that
// binary as a local process (in its own process group, in a directory under
// Kubelet.Dir): the container's command (whose first word must name the
// binary) and args, with $(VAR) expanded, and its environment: env and
// envFrom, the downward API (metadata.name, .namespace, .uid, .labels['k'],
// .annotations['k'], spec.nodeName, spec.serviceAccountName, status.hostIP,
// status.podIP; resourceFieldRef), ConfigMap and Secret keys; and
// KUBECONFIG, a kubeconfig for Spec.APIServer whose token the TokenRequest
// API issued for the pod's ServiceAccount, bound to the pod (one hour, not
// renewed), so the process has the pod's own RBAC; and TMPDIR, the
// container's /tmp: the pod's emptyDir volume mounted there (kept across
// the container's restarts), or else a directory of the container's own,
// never the machine's /tmp. Kubelet.Env comes before all of these, as a
// container runtime's own variables do. All
// processes share the host's network (a real pod has its own), so two
// pods on one machine that listen on one port collide. Its exit code is the
// container's (128+signal when killed; 128 "StartError" when it cannot
// start); with terminationMessagePolicy FallbackToLogsOnError the end of its
// output is the termination message. Other images run until deleted,
// except a Job's pod, which exits after Durations.JobPod. Then
// restartPolicy decides: Always restarts the container, OnFailure restarts
// it on a non-zero exit, otherwise the pod ends Succeeded (every container
// exited 0) or Failed. Annotations on a pod change this:
//
//	sim.ichor.maesh.dev/ready-after: 2s  how long its containers take to be ready (ReadyAfterAnnotation)
//	sim.ichor.maesh.dev/run-for: 30s     its containers exit after this long (RunForAnnotation)
//	sim.ichor.maesh.dev/exit-code: 3     with this exit code (ExitCodeAnnotation, default 0)
//
// Each control plane mirrors Talos's control-plane static pods into
// kube-system: kube-apiserver-<node>, kube-controller-manager-<node> and
// kube-scheduler-<node>, labelled as Talos's (k8s-app, component, tier:
// control-plane, app.kubernetes.io/*), with the image of the active
// configuration (cluster.apiServer.image and friends), the annotations
// talos.dev/config-version (the version of the COSI APIServerConfig,
// ControllerManagerConfig or SchedulerConfig, namespace controlplane, which
// the machine serves) and talos.dev/secrets-version, and the kubelet's
// mirror annotations, owned by the Node (so, as the kubelet's, made once
// the Node exists, and made again for a Node made anew). They run as the kubelet runs any
// pod; they are gone while the machine is down (Talos tears them down with
// etcd) and come back after it boots; a live change of a component's image
// or extraArgs renders a new configuration version and replaces the pod.
//
// Kubeconfig on a control plane returns, as Talos does, a tar.gz holding
// "kubeconfig": an admin kubeconfig named after the configuration's cluster
// (cluster <name>, context and user admin@<name>). On a hosted fleet it is
// Talos's: a new admin certificate from the machine's cluster.ca, trusting
// cluster.acceptedCAs then cluster.ca, for the fleet's endpoint, so it
// follows a Kubernetes CA rotation; otherwise it is for Spec.APIServer with
// its credentials. Workers answer Unimplemented. A change of cluster.ca or
// cluster.acceptedCAs restarts the kubelet (Talos's secrets.Kubelet
// changes), as a change of machine.kubelet does.
//
// # Faults
//
// Machine.Inject(faults...) sets faults until the returned func clears them;
// Machine.InjectString takes the annotation syntax. The same faults can be
// set from outside the process with the Node annotation FaultAnnotation
// (sim.ichor.maesh.dev/fault), a comma-separated list:
//
//	error:METHOD[:CODE][:once]  calls of METHOD fail with the gRPC CODE
//	                            (default Unavailable), every time or once
//	lost:METHOD[:CODE][:once]   unary calls of METHOD take effect, then
//	                            their answer is CODE (default Unavailable)
//	hang:METHOD                 calls of METHOD block until the fault is cleared
//	rollback[:once]             the next boot of a new install comes back on
//	                            the old version (Talos's A/B rollback)
//	no-return                   a machine that goes down stays down until cleared
//	etcd-unhealthy              the machine's etcd member is unhealthy
//	alarm[:NOSPACE|CORRUPT]     an etcd alarm on the machine's member
//
// METHOD is a gRPC method name ("Reboot", in any service), "Service/Method"
// ("LifecycleService/Upgrade") or "*". For example:
//
//	kubectl annotate node prod-w-1 sim.ichor.maesh.dev/fault=error:Upgrade:Unavailable:once
//	kubectl annotate node prod-w-1 sim.ichor.maesh.dev/fault-   # clear
//
// Faults apply after the role check, so a denied call is still denied. A
// once-fault from the annotation fires once per appearance in the
// annotation. A fault that fires records a Warning Event "SimulatedFault" on
// the Node; an annotation that does not parse changes nothing and records a
// Warning Event "InvalidFault" saying why.
//
// # The recorder
//
// Fleet.Recorder keeps, safe for concurrent use: the calls routed to each
// machine per method (Calls, CallCounts: every routed call, whatever its
// outcome); the calls that reached a machine's handler, past the role
// check and the faults, with their times (Handled); the largest number of
// control planes and of workers out of service at once (MaxDown: from the
// start of a reboot, legacy upgrade, shutdown or reset until the machine
// answers again); the time range of each disruptive action per machine
// (Actions: reboot, upgrade, install, shutdown, reset; Down says when the
// machine stopped answering during it); the installs that
// took effect at a boot (UpgradesApplied, and Upgrades with the version
// and time); and Overlaps, the pairs of actions on different machines
// whose time ranges intersect.
package sim
