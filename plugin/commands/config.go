package commands

import (
	"fmt"
	"io"
	"os"

	"github.com/spf13/cobra"

	ichorv1 "maesh.dev/ichor/api/v1alpha1"
	"maesh.dev/ichor/internal/configpatch"
)

const configApplyExample = `  # Add a node label everywhere; Talos applies it live, so nothing reboots
  %[1]s config apply -f labels.yaml --mode auto --watch

  # Two patches, applied in order, every machine rebooted (the default mode)
  %[1]s config apply -f sysctls.yaml -f kernel-args.yaml

  # A patch from standard input, only on the workers, two at a time, created paused
  # to see per machine what changes and what needs a reboot before it runs
  cat patch.yaml | %[1]s config apply -f - -l '!node-role.kubernetes.io/control-plane' --max-unavailable 2 --paused`

// configApplyOptions are the flags of config apply.
type configApplyOptions struct {
	files []string
	mode  string
}

func newConfigCmd(e *Env) *cobra.Command {
	cmd := &cobra.Command{
		Use:   "config",
		Short: "Roll out machine-configuration patches, a machine at a time",
	}
	c := &configApplyOptions{}
	o := &createOptions{generateName: "config-apply-", kind: ichorv1.KindConfig}
	o.build = func(s *ichorv1.TalosOperationSpec, _ []string) error { return c.build(e, s) }
	apply := &cobra.Command{
		Use:   "apply -f PATCH [-f PATCH...] [--mode auto|reboot]",
		Short: "Apply machine-config patches, control planes first, rebooting only where needed",
		Long: `Apply Talos machine-configuration patches to every machine in scope, control planes first
and one at a time (each after an etcd health check), then the workers within --max-unavailable.
A patch is a YAML strategic merge patch (like talosctl's --config-patch) or an RFC 6902 JSON
patch. Before anything changes, every machine's patched configuration is validated by Talos
(a dry run); one that does not validate refuses the operation. A machine that already carries
the change is left untouched.

--mode reboot (the default) reboots each machine after applying, drained first; --mode auto
applies live where Talos can (node labels, kubelet settings, sysctls, registries, ...) and
reboots only where it must. Each machine's status says "applied live" or "applied, rebooted".`,
		Example: fmt.Sprintf(configApplyExample, e.Name),
		Args:    cobra.NoArgs,
	}
	cmd.AddCommand(newCreateCmd(e, o, apply, func(cmd *cobra.Command) {
		cmd.Flags().StringArrayVarP(&c.files, "filename", "f", nil, "Patch file (YAML strategic merge or RFC 6902 JSON patch), - for standard input; repeat for more, applied in order")
		cmd.Flags().StringVar(&c.mode, "mode", string(ichorv1.ConfigModeReboot), "reboot: reboot every machine after applying; auto: reboot only where the change cannot apply live")
	}))
	return cmd
}

// build reads the patch files into the spec.
func (c *configApplyOptions) build(e *Env, s *ichorv1.TalosOperationSpec) error {
	mode := ichorv1.ConfigMode(c.mode)
	if mode != ichorv1.ConfigModeReboot && mode != ichorv1.ConfigModeAuto {
		return usageErrorf("invalid --mode %q: use auto (reboot only where needed) or reboot", c.mode)
	}
	if len(c.files) == 0 {
		return usageErrorf("-f is required: give a machine-config patch file (YAML strategic merge or RFC 6902 JSON patch), or - for standard input")
	}
	stdin := 0
	patches := make([]string, 0, len(c.files))
	for _, f := range c.files {
		if f == "-" {
			if stdin++; stdin > 1 {
				return usageErrorf("-f - is given twice: standard input can be read once")
			}
		}
		p, err := readPatch(f, e.Streams.In)
		if err != nil {
			return err
		}
		patches = append(patches, p)
	}
	s.Config = &ichorv1.ConfigRollout{Patches: patches, Mode: mode}
	return nil
}

// readPatch reads one patch file (- is standard input) and checks that
// machinery's configpatcher loads it, as the controller will: a typo'd
// field or a file that is not a patch creates nothing. Whether it applies to
// each machine and validates there is for the controller's preflight to
// say, per machine, in Talos's words.
func readPatch(path string, stdin io.Reader) (string, error) {
	name := path
	var data []byte
	var err error
	if path == "-" {
		name = "standard input"
		data, err = io.ReadAll(stdin)
	} else {
		data, err = os.ReadFile(path)
	}
	if err != nil {
		return "", fmt.Errorf("read patch %s: %w", name, err)
	}
	if _, err := configpatch.Load(string(data)); err != nil {
		return "", usageErrorf("patch %s is %v; fix it, then run this again (nothing was created)", name, err)
	}
	return string(data), nil
}
