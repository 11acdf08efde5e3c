package commands

import (
	"bufio"
	"context"
	"fmt"
	"regexp"
	"strings"

	"github.com/spf13/cobra"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/types"
	utilrand "k8s.io/apimachinery/pkg/util/rand"
	"k8s.io/cli-runtime/pkg/genericclioptions"
	cmdutil "k8s.io/kubectl/pkg/cmd/util"
	"sigs.k8s.io/controller-runtime/pkg/client"

	ichorv1 "maesh.dev/ichor/api/v1alpha1"
)

// createOptions are the flags every command that starts an operation shares,
// and what the kind's own command fills in.
type createOptions struct {
	e *Env

	name           string
	maxUnavailable int32
	paused         bool
	override       bool
	selector       string
	yes            bool
	plan           bool
	follow         followFlags
	printFlags     *genericclioptions.PrintFlags

	// Set by each kind's command.
	generateName string
	kind         ichorv1.OperationKind
	// build fills in the kind's block of the spec from the arguments.
	build func(spec *ichorv1.TalosOperationSpec, args []string) error
	// danger, for kinds that can take the cluster down, says what will happen
	// in the confirmation prompt.
	danger func(spec *ichorv1.TalosOperationSpec) string

	namespace string
	maxSet    bool
	dryRun    cmdutil.DryRunStrategy
	op        *ichorv1.TalosOperation
}

// newCreateCmd builds the command of one kind. flags adds the kind's own flags.
func newCreateCmd(e *Env, o *createOptions, cmd *cobra.Command, flags func(*cobra.Command)) *cobra.Command {
	o.e = e
	o.printFlags = genericclioptions.NewPrintFlags("created").WithTypeSetter(Scheme)
	cmd.SilenceUsage = true
	cmd.RunE = runE(o)
	if flags != nil {
		flags(cmd)
	}
	f := cmd.Flags()
	f.StringVar(&o.name, "name", "", "Name of the TalosOperation (default: generated, like "+o.generateName+"7fk2q)")
	f.Int32Var(&o.maxUnavailable, "max-unavailable", 0, "Workers disrupted at once, counting workers already NotReady or cordoned (default 1; control planes always go one at a time)")
	f.BoolVar(&o.paused, "paused", false, "Create the operation paused; start it with 'operation resume'")
	f.BoolVar(&o.override, "override", false, "Run although preflight refuses (needs the override verb; leaves a Warning Event)")
	f.StringVarP(&o.selector, "selector", "l", "", "Only the machines (Nodes) matching this label selector, like 'topology.kubernetes.io/zone=a'")
	f.BoolVarP(&o.yes, "yes", "y", false, "Do not ask for confirmation (with --plan: run the plan without asking)")
	f.BoolVar(&o.plan, "plan", false, "Create the operation paused, print ichor-controller's plan (checks, machines in order with batches, from -> to, reboots) and ask whether to run it; without a terminal it stays paused")
	cmdutil.AddDryRunFlag(cmd)
	o.printFlags.AddFlags(cmd)
	o.follow.addFlags(cmd, true)
	return cmd
}

func (o *createOptions) Complete(cmd *cobra.Command, args []string) error {
	var err error
	if o.namespace, err = o.e.Namespace(); err != nil {
		return err
	}
	if o.dryRun, err = cmdutil.GetDryRunStrategy(cmd); err != nil {
		return err
	}
	if o.dryRun == cmdutil.DryRunClient && !cmd.Flags().Changed("output") {
		// A client dry run is for looking at the object, or applying it later.
		out := "yaml"
		o.printFlags.OutputFormat = &out
	}
	o.printFlags = cmdutil.PrintFlagsWithDryRunStrategy(o.printFlags, o.dryRun)
	o.follow.complete(cmd)
	o.maxSet = cmd.Flags().Changed("max-unavailable")

	op := &ichorv1.TalosOperation{
		TypeMeta:   metav1.TypeMeta{APIVersion: ichorv1.GroupVersion.String(), Kind: "TalosOperation"},
		ObjectMeta: metav1.ObjectMeta{Namespace: o.namespace, Name: o.name},
		Spec: ichorv1.TalosOperationSpec{
			Kind:           o.kind,
			Paused:         o.paused || o.plan,
			Override:       o.override,
			MaxUnavailable: o.maxUnavailable,
		},
	}
	if o.name == "" {
		op.GenerateName = o.generateName
	}
	if o.selector != "" {
		sel, err := metav1.ParseToLabelSelector(o.selector)
		if err != nil {
			return usageErrorf("invalid --selector %q: %v", o.selector, err)
		}
		op.Spec.Machines = sel
	}
	if err := o.build(&op.Spec, args); err != nil {
		return err
	}
	o.op = op
	return nil
}

func (o *createOptions) Validate() error {
	if o.maxUnavailable < 0 || (o.maxUnavailable == 0 && o.maxSet) {
		return usageErrorf("--max-unavailable must be at least 1, not %d", o.maxUnavailable)
	}
	if o.dryRun != cmdutil.DryRunNone && o.follow.following() {
		return usageErrorf("--watch and --wait follow a real operation: they cannot be used with --dry-run")
	}
	if o.dryRun != cmdutil.DryRunNone && o.plan {
		return usageErrorf("--plan shows what ichor-controller plans for a real operation: it cannot be used with --dry-run")
	}
	return o.follow.validate()
}

func (o *createOptions) Run(ctx context.Context) error {
	if ctx == nil {
		ctx = context.Background()
	}
	printer, err := o.printFlags.ToPrinter()
	if err != nil {
		return err
	}
	if o.dryRun == cmdutil.DryRunClient {
		obj, err := applyable(o.op)
		if err != nil {
			return err
		}
		return printer.PrintObj(obj, o.e.Streams.Out)
	}
	c, err := o.e.NewClient()
	if err != nil {
		return err
	}
	ctrl, noController := readController(ctx, c, o.e.ControllerNamespace)
	if err := o.precheck(ctx, c, ctrl); err != nil {
		return err
	}
	// With --plan, nothing runs before the question after the plan.
	if o.danger != nil && o.dryRun == cmdutil.DryRunNone && !o.yes && !o.plan {
		if err := o.e.confirm(o.danger(&o.op.Spec)); err != nil {
			return err
		}
	}
	opts := []client.CreateOption{client.FieldOwner(FieldManager)}
	if o.dryRun == cmdutil.DryRunServer {
		opts = append(opts, client.DryRunAll)
	}
	if err := c.Create(ctx, o.op, opts...); err != nil {
		return err
	}
	if err := printer.PrintObj(o.op, o.e.Streams.Out); err != nil {
		return err
	}
	if o.dryRun == cmdutil.DryRunServer {
		return nil
	}
	// With -o, stdout carries only what -o asked for; the plan and the live view go to stderr.
	view := o.e.Streams.Out
	if o.printFlags.OutputFormat != nil && *o.printFlags.OutputFormat != "" {
		view = o.e.Streams.ErrOut
	}
	if o.plan {
		return o.runPlan(ctx, c, view)
	}
	if !o.follow.following() {
		return o.e.verdict(ctx, c, o.op, noController)
	}
	return o.e.follow(ctx, c, o.namespace, o.op.Name, o.follow, view, -1)
}

// precheck refuses, before anything is created, what the plugin can know
// the controller would refuse, in the controller's words: a kind the
// running controller does not carry out, a machine that is not a Node. What
// it may not read (RBAC) it leaves to the controller, which stays the
// authority; this only saves a round trip and a Refused object.
func (o *createOptions) precheck(ctx context.Context, c client.Reader, ctrl controllerInfo) error {
	var failed []string
	if !ctrl.carriesOut(o.op.Spec.Kind) {
		failed = append(failed, ichorv1.CheckKindSupported+": "+ichorv1.KindNotCarriedOut(o.op.Spec.Kind, ctrl.Kinds))
	}
	if n := o.op.Spec.Node; n != nil {
		err := c.Get(ctx, types.NamespacedName{Name: n.Machine}, &corev1.Node{})
		if apierrors.IsNotFound(err) {
			failed = append(failed, ichorv1.CheckMachinesInScope+": "+ichorv1.MachineNotANode(n.Machine, o.op.Spec.Machines != nil))
		}
	}
	if len(failed) == 0 {
		return nil
	}
	return fmt.Errorf("ichor-controller would refuse this operation, so nothing was created:\n  %s", strings.Join(failed, "\n  "))
}

// applyable is the operation as a client dry run prints it, so that
// `kubectl apply -f` takes the output as it is: with a name (apply cannot
// generate one; this is generateName plus five random characters, as the
// API server makes them) and without the empty status the controller owns.
func applyable(op *ichorv1.TalosOperation) (*unstructured.Unstructured, error) {
	op = op.DeepCopy()
	if op.Name == "" {
		op.Name, op.GenerateName = op.GenerateName+utilrand.String(5), ""
	}
	m, err := runtime.DefaultUnstructuredConverter.ToUnstructured(op)
	if err != nil {
		return nil, err
	}
	delete(m, "status")
	unstructured.RemoveNestedField(m, "metadata", "creationTimestamp")
	return &unstructured.Unstructured{Object: m}, nil
}

// confirm asks on the terminal before something that can take the cluster
// down. Without a terminal it refuses: --yes says it was meant.
func (e *Env) confirm(what string) error {
	if !e.IsTerminal(e.Streams.In) {
		return fmt.Errorf("%s; confirm with --yes (-y), as there is no terminal to ask on", sentenceInside(what))
	}
	yes, err := e.ask(what + "\nProceed?")
	if err != nil || yes {
		return err
	}
	return fmt.Errorf("aborted by user")
}

// ask asks a yes/no question on the terminal; no is the default.
func (e *Env) ask(question string) (bool, error) {
	fmt.Fprintf(e.Streams.ErrOut, "%s [y/N]: ", question)
	answer, err := bufio.NewReader(e.Streams.In).ReadString('\n')
	if err != nil && answer == "" {
		return false, fmt.Errorf("aborted: no answer")
	}
	switch strings.ToLower(strings.TrimSpace(answer)) {
	case "y", "yes":
		return true, nil
	}
	return false, nil
}

// sentenceInside turns a sentence into a clause that can start an error
// message: "This resets x." becomes "this resets x".
func sentenceInside(s string) string {
	s = strings.TrimSuffix(strings.TrimSpace(s), ".")
	if s == "" {
		return s
	}
	return strings.ToLower(s[:1]) + s[1:]
}

var versionRE = regexp.MustCompile(`^v[0-9]+\.[0-9]+\.[0-9]+(-[0-9A-Za-z.-]+)?(\+[0-9A-Za-z.-]+)?$`)

// normalizeVersion accepts 1.13.7 as well as v1.13.7 and returns the form the
// API requires, with the leading v.
func normalizeVersion(flag, v string) (string, error) {
	v = strings.TrimSpace(v)
	if v == "" {
		return "", usageErrorf("--%s is required: give a version like v1.13.7", flag)
	}
	if v[0] >= '0' && v[0] <= '9' {
		v = "v" + v
	}
	if !versionRE.MatchString(v) {
		return "", usageErrorf("invalid --%s %q: want a version like v1.13.7 (the leading v is optional)", flag, v)
	}
	return v, nil
}

const versionHelp = "like v1.13.7; 1.13.7 works too and gets the leading v the API requires"

func boolPtr(b bool) *bool { return &b }

// upgrade talos|kubernetes|ichor|cni

func newUpgradeCmd(e *Env) *cobra.Command {
	cmd := &cobra.Command{
		Use:   "upgrade",
		Short: "Upgrade Talos, Kubernetes, Ichor or the CNI",
	}
	cmd.AddCommand(newUpgradeTalosCmd(e), newUpgradeKubernetesCmd(e), newUpgradeIchorCmd(e), newUpgradeCNICmd(e))
	return cmd
}

func newUpgradeTalosCmd(e *Env) *cobra.Command {
	var to, schematic, repo, rebootMode string
	o := &createOptions{generateName: "upgrade-talos-", kind: ichorv1.KindTalos}
	o.build = func(s *ichorv1.TalosOperationSpec, _ []string) error {
		v, err := normalizeVersion("to", to)
		if err != nil {
			return err
		}
		s.Talos = &ichorv1.TalosUpgrade{Version: v, Schematic: schematic, ImageRepository: repo, RebootMode: ichorv1.RebootMode(rebootMode)}
		return nil
	}
	cmd := &cobra.Command{
		Use:   "talos --to VERSION",
		Short: "Upgrade Talos Linux, one machine at a time, control planes first",
		Example: fmt.Sprintf(`  # Upgrade every machine to Talos v1.13.7 and follow it live
  %[1]s upgrade talos --to v1.13.7 --watch

  # Only the machines in zone a, two workers at a time, with a new schematic
  %[1]s upgrade talos --to 1.13.7 -l topology.kubernetes.io/zone=a --max-unavailable 2 --schematic 376567988ad370138ad8b2698212367b8edcb69b5fd68c80be1f2ec7d603b4ba`, e.Name),
		Args: cobra.NoArgs,
	}
	return newCreateCmd(e, o, cmd, func(c *cobra.Command) {
		c.Flags().StringVar(&to, "to", "", "Talos version to install, "+versionHelp)
		c.Flags().StringVar(&schematic, "schematic", "", "Image Factory schematic ID to install (default: each machine keeps its own)")
		c.Flags().StringVar(&repo, "image-repository", "", "Registry serving installer images (default factory.talos.dev)")
		c.Flags().StringVar(&rebootMode, "reboot-mode", "", "How machines reboot: default (kexec where possible) or powercycle")
		_ = c.MarkFlagRequired("to")
		_ = c.RegisterFlagCompletionFunc("to", completeTalosVersions)
	})
}

func newUpgradeKubernetesCmd(e *Env) *cobra.Command {
	var to string
	var prePull bool
	o := &createOptions{generateName: "upgrade-kubernetes-", kind: ichorv1.KindKubernetes}
	var cmd *cobra.Command
	o.build = func(s *ichorv1.TalosOperationSpec, _ []string) error {
		v, err := normalizeVersion("to", to)
		if err != nil {
			return err
		}
		s.Kubernetes = &ichorv1.KubernetesUpgrade{Version: v}
		if cmd.Flags().Changed("pre-pull-images") {
			s.Kubernetes.PrePullImages = boolPtr(prePull)
		}
		return nil
	}
	cmd = &cobra.Command{
		Use:     "kubernetes --to VERSION",
		Aliases: []string{"k8s"},
		Short:   "Upgrade Kubernetes: control-plane components, kube-proxy, then kubelets",
		Example: fmt.Sprintf("  %[1]s upgrade kubernetes --to v1.36.2 --wait --timeout 1h", e.Name),
		Args:    cobra.NoArgs,
	}
	return newCreateCmd(e, o, cmd, func(c *cobra.Command) {
		c.Flags().StringVar(&to, "to", "", "Kubernetes version to run, "+strings.ReplaceAll(versionHelp, "1.13.7", "1.36.2"))
		c.Flags().BoolVar(&prePull, "pre-pull-images", true, "Pull the new images on every machine before any component moves")
		_ = c.MarkFlagRequired("to")
		_ = c.RegisterFlagCompletionFunc("to", completeKubernetesVersions)
	})
}

func newUpgradeIchorCmd(e *Env) *cobra.Command {
	var to, image string
	o := &createOptions{generateName: "upgrade-ichor-", kind: ichorv1.KindIchor}
	o.build = func(s *ichorv1.TalosOperationSpec, _ []string) error {
		v, err := normalizeVersion("to", to)
		if err != nil {
			return err
		}
		s.Ichor = &ichorv1.IchorUpgrade{Version: v, Image: image}
		return nil
	}
	cmd := &cobra.Command{
		Use:     "ichor --to VERSION",
		Short:   "Upgrade Ichor itself through its installer Job",
		Example: fmt.Sprintf("  %[1]s upgrade ichor --to v0.2.0", e.Name),
		Args:    cobra.NoArgs,
	}
	return newCreateCmd(e, o, cmd, func(c *cobra.Command) {
		c.Flags().StringVar(&to, "to", "", "Ichor version to install, "+strings.ReplaceAll(versionHelp, "1.13.7", "0.2.0"))
		c.Flags().StringVar(&image, "image", "", "Controller image (default: the release image of --to)")
		_ = c.MarkFlagRequired("to")
	})
}

func newUpgradeCNICmd(e *Env) *cobra.Command {
	var chart string
	var kpr bool
	var cmd *cobra.Command
	o := &createOptions{generateName: "upgrade-cni-", kind: ichorv1.KindCNI}
	o.build = func(s *ichorv1.TalosOperationSpec, _ []string) error {
		s.CNI = &ichorv1.CNIChange{ChartVersion: chart}
		if cmd.Flags().Changed("kube-proxy-replacement") {
			s.CNI.KubeProxyReplacement = boolPtr(kpr)
		}
		return nil
	}
	cmd = &cobra.Command{
		Use:   "cni [--chart-version VERSION] [--kube-proxy-replacement=true|false]",
		Short: "Move Cilium to the chart this Ichor embeds, or switch the kube-proxy mode",
		Example: fmt.Sprintf(`  # Move Cilium to the chart this Ichor embeds
  %[1]s upgrade cni

  # Let Cilium replace kube-proxy
  %[1]s upgrade cni --kube-proxy-replacement=true`, e.Name),
		Args: cobra.NoArgs,
	}
	return newCreateCmd(e, o, cmd, func(c *cobra.Command) {
		c.Flags().StringVar(&chart, "chart-version", "", "Cilium chart version (default: the chart this Ichor embeds)")
		c.Flags().BoolVar(&kpr, "kube-proxy-replacement", false, "true: Cilium replaces kube-proxy; false: kube-proxy comes back (default: keep the mode)")
	})
}

// node ACTION NODE

func newNodeCmd(e *Env) *cobra.Command {
	cmd := &cobra.Command{
		Use:   "node",
		Short: "Reboot, shut down, reset or service one machine",
	}
	actions := []struct {
		action ichorv1.NodeActionType
		short  string
	}{
		{ichorv1.NodeReboot, "Reboot one machine (drained first)"},
		{ichorv1.NodeShutdown, "Shut one machine down"},
		{ichorv1.NodeRestartService, "Restart a service (kubelet or an extension) on one machine"},
		{ichorv1.NodeEtcdDefrag, "Defragment etcd on one control plane"},
		{ichorv1.NodeEtcdForfeitLeadership, "Make one control plane give up etcd leadership"},
		{ichorv1.NodeReset, "Reset one machine: wipe it and take it out of the cluster"},
	}
	for _, a := range actions {
		cmd.AddCommand(newNodeActionCmd(e, a.action, a.short))
	}
	return cmd
}

func newNodeActionCmd(e *Env, action ichorv1.NodeActionType, short string) *cobra.Command {
	var service, wipe string
	var graceful, reboot bool
	var cmd *cobra.Command
	o := &createOptions{generateName: "node-" + string(action) + "-", kind: ichorv1.KindNode}
	o.build = func(s *ichorv1.TalosOperationSpec, args []string) error {
		s.Node = &ichorv1.NodeAction{Machine: args[0], Action: action, Service: service}
		if action == ichorv1.NodeRestartService && service == "" {
			return usageErrorf("--service is required: name the service to restart, like kubelet")
		}
		if action == ichorv1.NodeReset {
			s.Node.Reset = &ichorv1.ResetOptions{Wipe: ichorv1.WipeMode(wipe), Reboot: reboot}
			if cmd.Flags().Changed("graceful") {
				s.Node.Reset.Graceful = boolPtr(graceful)
			}
		}
		return nil
	}
	if ichorv1.DangerousKind(ichorv1.KindNode, action) {
		o.danger = func(s *ichorv1.TalosOperationSpec) string {
			return fmt.Sprintf("This resets machine %q: its disks are wiped and it leaves the cluster.", s.Node.Machine)
		}
	}
	cmd = &cobra.Command{
		Use:               string(action) + " NODE",
		Short:             short,
		Example:           fmt.Sprintf("  %[1]s node %[2]s worker-3 --watch", e.Name, action),
		Args:              exactArgs(1, "NODE"),
		ValidArgsFunction: e.completeNodes,
	}
	return newCreateCmd(e, o, cmd, func(c *cobra.Command) {
		switch action {
		case ichorv1.NodeRestartService:
			c.Flags().StringVar(&service, "service", "", "Service to restart (kubelet or an extension service)")
		case ichorv1.NodeReset:
			c.Flags().StringVar(&wipe, "wipe", "", "What to wipe: all (default), system-disk or ephemeral")
			c.Flags().BoolVar(&graceful, "graceful", true, "Cordon and drain first and, on a control plane, leave etcd")
			c.Flags().BoolVar(&reboot, "reboot", false, "Reboot after the reset instead of shutting down")
		}
	})
}

// shutdown

func newShutdownCmd(e *Env) *cobra.Command {
	var force bool
	var snapshot, secret string
	o := &createOptions{generateName: "shutdown-", kind: ichorv1.KindShutdown}
	o.build = func(s *ichorv1.TalosOperationSpec, _ []string) error {
		if secret != "" && snapshot == "" {
			return usageErrorf("--secret goes with --snapshot: it holds the credentials of an s3:// snapshot location")
		}
		s.Shutdown = &ichorv1.ClusterShutdown{Force: force, Snapshot: snapshot, Secret: secret}
		return nil
	}
	o.danger = func(*ichorv1.TalosOperationSpec) string {
		return "This shuts down every machine of the cluster."
	}
	cmd := &cobra.Command{
		Use:   "shutdown",
		Short: "Stop the whole cluster for planned downtime",
		Example: fmt.Sprintf("  %[1]s shutdown --yes\n"+
			"  %[1]s shutdown --snapshot s3://backups/etcd/before-shutdown.snapshot --secret ichor-etcd-snapshot --watch", e.Name),
		Args: cobra.NoArgs,
	}
	return newCreateCmd(e, o, cmd, func(c *cobra.Command) {
		c.Flags().BoolVar(&force, "force", false, "Skip draining (each worker is only cordoned) and stop the machines straight away")
		c.Flags().StringVar(&snapshot, "snapshot", "", "Save an etcd snapshot here first, before any machine stops: file:// (a path the controller writes) or s3://bucket/key")
		c.Flags().StringVar(&secret, "secret", "", "Secret in the controller's namespace with the S3 credentials of --snapshot (AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_REGION, AWS_ENDPOINT_URL)")
	})
}

// rotate ca|keys

func newRotateCmd(e *Env) *cobra.Command {
	cmd := &cobra.Command{
		Use:   "rotate",
		Short: "Replace the cluster CAs or keys",
	}
	cmd.AddCommand(newRotateCACmd(e), newRotateKeysCmd(e))
	return cmd
}

// which turns two "only this one" flags into the API's pair of switches:
// neither flag means both.
func which(a, b bool) (*bool, *bool) {
	if !a && !b {
		return boolPtr(true), boolPtr(true)
	}
	return boolPtr(a), boolPtr(b)
}

func newRotateCACmd(e *Env) *cobra.Command {
	var talos, kube bool
	o := &createOptions{generateName: "rotate-ca-", kind: ichorv1.KindCARotation}
	o.build = func(s *ichorv1.TalosOperationSpec, _ []string) error {
		t, k := which(talos, kube)
		s.CARotation = &ichorv1.CARotation{Talos: t, Kubernetes: k}
		return nil
	}
	o.danger = func(s *ichorv1.TalosOperationSpec) string {
		msg := "This replaces the cluster CAs (" + caList(s.CARotation) + "): every client certificate issued by the old CAs stops working."
		if after := ichorv1.Afterwards(*s); after != "" {
			msg += " Afterwards, " + after + "."
		}
		return msg
	}
	cmd := &cobra.Command{
		Use:   "ca [--talos] [--kubernetes]",
		Short: "Replace the Talos API CA, the Kubernetes API CA, or both",
		Long: `Replace the Talos API CA, the Kubernetes API CA, or both (neither flag: both).

The Talos API CA is rotated as talosctl rotate-ca does, in stages over every
machine: the new CA accepted, then issuing (the old one still accepted), then
the old one dropped, each checked on every machine; ichor-controller keeps its
own access throughout. Once the old CA is dropped, a talosconfig of the old CA
(yours too) is refused: take the new one from Secret ichor-talosconfig.

The Kubernetes CA follows in the same three stages on cluster.ca and
cluster.acceptedCAs, each machine's kubelet restarted, each stage checked with
every control plane's kubeconfig; the API servers follow their machines'
configuration. ichor-controller keeps its access to the API throughout (on
refused credentials it uses an admin kubeconfig from the Talos API until its
own work again). Once the old CA is dropped, a kubeconfig of the old CA (yours
too) is refused: take a new one with talosctl kubeconfig.`,
		Example: fmt.Sprintf(`  # Rotate the Talos API CA
  %[1]s rotate ca --talos

  # Rotate the Kubernetes CA, and follow it
  %[1]s rotate ca --kubernetes --watch

  # Both CAs, the Talos API CA first
  %[1]s rotate ca`, e.Name),
		Args: cobra.NoArgs,
	}
	return newCreateCmd(e, o, cmd, func(c *cobra.Command) {
		c.Flags().BoolVar(&talos, "talos", false, "Rotate the Talos API CA (with neither flag: both)")
		c.Flags().BoolVar(&kube, "kubernetes", false, "Rotate the Kubernetes API CA (with neither flag: both)")
	})
}

func caList(c *ichorv1.CARotation) string {
	var parts []string
	if c.Talos != nil && *c.Talos {
		parts = append(parts, "Talos")
	}
	if c.Kubernetes != nil && *c.Kubernetes {
		parts = append(parts, "Kubernetes")
	}
	return strings.Join(parts, " and ")
}

func newRotateKeysCmd(e *Env) *cobra.Command {
	var sa, secretbox, noRestart bool
	o := &createOptions{generateName: "rotate-keys-", kind: ichorv1.KindKeyRotation}
	o.build = func(s *ichorv1.TalosOperationSpec, _ []string) error {
		a, b := which(sa, secretbox)
		if noRestart && !*a {
			return usageErrorf("--no-restart is about the workloads a service-account key rotation restarts: add --service-account, or drop --no-restart")
		}
		s.KeyRotation = &ichorv1.KeyRotation{ServiceAccount: a, Secretbox: b}
		if noRestart {
			s.KeyRotation.RestartWorkloads = boolPtr(false)
		}
		return nil
	}
	o.danger = func(s *ichorv1.TalosOperationSpec) string {
		var parts []string
		sa, sb := s.KeyRotation.Rotates()
		if sa {
			parts = append(parts, "every ServiceAccount token signed by the old service-account key stops working at the swap")
		}
		if s.KeyRotation.Restarts() {
			parts = append(parts, "the pods holding such tokens are restarted, machine by machine, within their PodDisruptionBudgets")
		}
		if sb {
			parts = append(parts, "Secret writes are refused for the seconds the API servers take to switch secretbox keys")
		}
		msg := "This replaces the cluster's keys: " + strings.Join(parts, "; ") + "."
		if after := ichorv1.Afterwards(*s); after != "" {
			msg += " Afterwards, " + after + "."
		}
		return msg
	}
	cmd := &cobra.Command{
		Use:   "keys [--service-account] [--secretbox] [--no-restart]",
		Short: "Replace the service-account signing key, the secretbox key, or both",
		Long: `Replace the service-account signing key, the secretbox key of Secrets at rest,
or both (neither flag: both; the service-account key first).

The service-account key is a cut-over, as Talos holds one key: the new key on
every control plane, one after the other, each API server restarted before the
next. Every token signed by the old key stops working then, ichor-controller's
own too (it goes on with an admin kubeconfig from the Talos API). The pods that
hold such tokens are then restarted machine by machine through the Eviction API,
one pod of a workload at a time, within their PodDisruptionBudgets (not with
--no-restart), and legacy token Secrets are reissued. Create it paused
(--paused) to read, in each machine's plan, which pods it would restart.

The secretbox key is rotated without a moment in which a Secret cannot be read:
every Secret crosses over on an aescbc key (the cluster's, or a new one) that
the API servers read on both sides, re-encrypted in etcd itself; Secret writes
are refused for the seconds the API servers take to switch secretbox keys, and
the aescbc key is removed at the end. A cluster that encrypts with aescbc today
moves to secretbox the same way.`,
		Example: fmt.Sprintf(`  # Both keys, asking first
  %[1]s rotate keys

  # The service-account key, created paused to read what it would restart
  %[1]s rotate keys --service-account --paused

  # The secretbox key, and follow it
  %[1]s rotate keys --secretbox --watch`, e.Name),
		Args: cobra.NoArgs,
	}
	return newCreateCmd(e, o, cmd, func(c *cobra.Command) {
		c.Flags().BoolVar(&sa, "service-account", false, "Rotate the service-account signing key (with neither flag: both)")
		c.Flags().BoolVar(&secretbox, "secretbox", false, "Rotate the secretbox key of Secrets at rest (with neither flag: both)")
		c.Flags().BoolVar(&noRestart, "no-restart", false, "Do not restart the pods whose tokens the old service-account key signed (restart them yourself)")
	})
}

// restore etcd

func newRestoreCmd(e *Env) *cobra.Command {
	cmd := &cobra.Command{
		Use:   "restore",
		Short: "Rewind the cluster to a stored etcd snapshot",
	}
	var from, machine, secret string
	o := &createOptions{generateName: "restore-etcd-", kind: ichorv1.KindEtcdRestore}
	o.build = func(s *ichorv1.TalosOperationSpec, _ []string) error {
		if from == "" {
			return usageErrorf("--from is required: give a file:// or s3:// URL")
		}
		s.EtcdRestore = &ichorv1.EtcdRestore{Snapshot: from, Machine: machine, Secret: secret}
		return nil
	}
	o.danger = func(s *ichorv1.TalosOperationSpec) string {
		return fmt.Sprintf("This rewinds the whole cluster to the etcd snapshot %s: everything written since is lost.", s.EtcdRestore.Snapshot)
	}
	etcd := &cobra.Command{
		Use:   "etcd --from URL [--machine M] [--secret S]",
		Short: "Restore etcd from a snapshot (file:// or s3://)",
		Example: fmt.Sprintf("  %[1]s restore etcd --from file:///var/lib/etcd-backup/etcd.snapshot\n"+
			"  %[1]s restore etcd --from s3://backups/etcd/2026-08-22.snapshot --secret ichor-etcd-snapshot", e.Name),
		Args: cobra.NoArgs,
	}
	cmd.AddCommand(newCreateCmd(e, o, etcd, func(c *cobra.Command) {
		c.Flags().StringVar(&from, "from", "", "URL of the etcd snapshot: file:// (a path the controller reads) or s3://bucket/key")
		c.Flags().StringVar(&from, "snapshot", "", "Same as --from")
		_ = c.Flags().MarkDeprecated("snapshot", "use --from")
		c.Flags().StringVar(&machine, "machine", "", "Control plane that recovers etcd (default: the first one)")
		c.Flags().StringVar(&secret, "secret", "", "Secret in the controller's namespace with the S3 credentials (AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_REGION, AWS_ENDPOINT_URL)")
		_ = c.RegisterFlagCompletionFunc("machine", e.completeNodes)
	}))
	return cmd
}

func exactArgs(n int, what string) cobra.PositionalArgs {
	return func(cmd *cobra.Command, args []string) error {
		if len(args) != n {
			return usageErrorf("%s takes %s (%d argument), got %d", cmd.CommandPath(), what, n, len(args))
		}
		return nil
	}
}
