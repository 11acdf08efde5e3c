package commands

import (
	"fmt"
	"strings"

	"github.com/spf13/cobra"
	corev1 "k8s.io/api/core/v1"
	"sigs.k8s.io/controller-runtime/pkg/client"

	"maesh.dev/ichor/api/compat"
	ichorv1 "maesh.dev/ichor/api/v1alpha1"
)

func newCompletionCmd(e *Env, root *cobra.Command) *cobra.Command {
	cmd := &cobra.Command{
		Use:   "completion bash|zsh|fish|powershell|kubectl",
		Short: "Print a shell completion script",
		Long: fmt.Sprintf(`Print a shell completion script.

For the plugin run as 'kubectl ichor', kubectl (1.26 or newer) completes it
through an executable named kubectl_complete-ichor on PATH; 'completion
kubectl' prints that script:

  %[1]s completion kubectl > ~/.local/bin/kubectl_complete-ichor
  chmod +x ~/.local/bin/kubectl_complete-ichor

For the binary installed as 'ichor', load the script of your shell:

  source <(ichor completion bash)`, e.Name),
		ValidArgs: []string{"bash", "zsh", "fish", "powershell", "kubectl"},
		Args:      cobra.MatchAll(cobra.ExactArgs(1), cobra.OnlyValidArgs),
		RunE: func(cmd *cobra.Command, args []string) error {
			out := e.Streams.Out
			switch args[0] {
			case "bash":
				return root.GenBashCompletionV2(out, true)
			case "zsh":
				return root.GenZshCompletion(out)
			case "fish":
				return root.GenFishCompletion(out, true)
			case "powershell":
				return root.GenPowerShellCompletionWithDesc(out)
			}
			_, err := fmt.Fprint(out, "#!/usr/bin/env sh\n# kubectl runs this to complete 'kubectl ichor ...'.\nexec kubectl ichor __complete \"$@\"\n")
			return err
		},
	}
	root.CompletionOptions.DisableDefaultCmd = true
	return cmd
}

// Filters of operation names for completion, per verb.
func anyOperation(*ichorv1.TalosOperation) bool { return true }

func pausable(op *ichorv1.TalosOperation) bool {
	return !op.PausedByOperator() && !op.Succeeded() && !op.Refused()
}

func resumable(op *ichorv1.TalosOperation) bool {
	return !op.Succeeded() && !op.Refused() && (op.PausedByOperator() || op.PlanChanged() || (op.StepFailed() && !op.RetryPending()))
}

func cancellable(op *ichorv1.TalosOperation) bool {
	asked, _ := op.CancelRequested()
	return !asked && !op.Succeeded() && !op.Cancelled()
}

func retryable(op *ichorv1.TalosOperation) bool { return op.StepFailed() && !op.RetryPending() }

func skippable(op *ichorv1.TalosOperation) bool { return op.Status.FailedMachine() != nil }

// completeSkip completes skip's NAME (operations with a failed machine),
// then its MACHINE (that operation's failed machines).
func (e *Env) completeSkip(cmd *cobra.Command, args []string, toComplete string) ([]string, cobra.ShellCompDirective) {
	if len(args) == 0 {
		return e.completeOperations(skippable)(cmd, args, toComplete)
	}
	if len(args) > 1 {
		return nil, cobra.ShellCompDirectiveNoFileComp
	}
	ns, err := e.Namespace()
	if err != nil {
		return nil, cobra.ShellCompDirectiveError
	}
	c, err := e.NewClient()
	if err != nil {
		return nil, cobra.ShellCompDirectiveError
	}
	name, err := operationName(args[0])
	if err != nil {
		return nil, cobra.ShellCompDirectiveNoFileComp
	}
	op, err := getOperation(cmd.Context(), c, ns, name)
	if err != nil {
		return nil, cobra.ShellCompDirectiveError
	}
	var names []string
	for _, m := range op.Status.Machines {
		if m.Phase == ichorv1.MachineFailed && strings.HasPrefix(m.Name, toComplete) {
			names = append(names, m.Name)
		}
	}
	return names, cobra.ShellCompDirectiveNoFileComp
}

// completeOperations completes operation names in the namespace the command
// line names so far (-n, --context), keeping those the verb can act on.
func (e *Env) completeOperations(keep func(*ichorv1.TalosOperation) bool) cobra.CompletionFunc {
	return func(cmd *cobra.Command, args []string, toComplete string) ([]string, cobra.ShellCompDirective) {
		ns, err := e.Namespace()
		if err != nil {
			return nil, cobra.ShellCompDirectiveError
		}
		c, err := e.NewClient()
		if err != nil {
			return nil, cobra.ShellCompDirectiveError
		}
		list := &ichorv1.TalosOperationList{}
		if err := c.List(cmd.Context(), list, client.InNamespace(ns)); err != nil {
			return nil, cobra.ShellCompDirectiveError
		}
		sortByArrival(list.Items)
		var names []string
		for i := range list.Items {
			op := &list.Items[i]
			if keep(op) && strings.HasPrefix(op.Name, toComplete) && !contains(args, op.Name) {
				names = append(names, op.Name)
			}
		}
		return names, cobra.ShellCompDirectiveNoFileComp
	}
}

// completeNodes completes Node names (the machines).
func (e *Env) completeNodes(cmd *cobra.Command, args []string, toComplete string) ([]string, cobra.ShellCompDirective) {
	if len(args) > 0 {
		return nil, cobra.ShellCompDirectiveNoFileComp
	}
	c, err := e.NewClient()
	if err != nil {
		return nil, cobra.ShellCompDirectiveError
	}
	list := &corev1.NodeList{}
	if err := c.List(cmd.Context(), list); err != nil {
		return nil, cobra.ShellCompDirectiveError
	}
	var names []string
	for _, n := range list.Items {
		if strings.HasPrefix(n.Name, toComplete) {
			names = append(names, n.Name)
		}
	}
	return names, cobra.ShellCompDirectiveNoFileComp
}

// completeTalosVersions offers the latest patch of each Talos minor in
// Ichor's compatibility table, newest first: the versions preflight accepts.
func completeTalosVersions(_ *cobra.Command, _ []string, toComplete string) ([]string, cobra.ShellCompDirective) {
	table, err := compat.Default()
	if err != nil {
		return nil, cobra.ShellCompDirectiveError
	}
	var out []string
	for i := len(table.Talos) - 1; i >= 0; i-- {
		v := table.Talos[i].Latest.String()
		if strings.HasPrefix(v, toComplete) || strings.HasPrefix(strings.TrimPrefix(v, "v"), toComplete) {
			out = append(out, v)
		}
	}
	return out, cobra.ShellCompDirectiveNoFileComp | cobra.ShellCompDirectiveKeepOrder
}

// completeKubernetesVersions offers the Kubernetes minors the newest Talos
// of the compatibility table runs, newest first, as "v1.36." for the patch
// to be typed: the table knows minors, not every patch release.
func completeKubernetesVersions(_ *cobra.Command, _ []string, toComplete string) ([]string, cobra.ShellCompDirective) {
	table, err := compat.Default()
	if err != nil {
		return nil, cobra.ShellCompDirectiveError
	}
	span, ok := table.KubernetesRange(table.Newest().Minor)
	if !ok {
		return nil, cobra.ShellCompDirectiveNoFileComp
	}
	var out []string
	for m := int(span.Max.Minor); m >= int(span.Min.Minor); m-- {
		v := fmt.Sprintf("v%d.%d.", span.Max.Major, m)
		if strings.HasPrefix(v, toComplete) || strings.HasPrefix(strings.TrimPrefix(v, "v"), toComplete) {
			out = append(out, v)
		}
	}
	return out, cobra.ShellCompDirectiveNoFileComp | cobra.ShellCompDirectiveNoSpace | cobra.ShellCompDirectiveKeepOrder
}

func contains(list []string, s string) bool {
	for _, x := range list {
		if x == s {
			return true
		}
	}
	return false
}
