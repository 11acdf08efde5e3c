package commands

import (
	"fmt"
	"io"

	"github.com/spf13/cobra"

	"maesh.dev/ichor/api/compat"
	"maesh.dev/ichor/internal/version"
)

type compatOptions struct {
	e                         *Env
	talos, kubernetes, cilium string
	output                    string
}

func newCompatCmd(e *Env) *cobra.Command {
	o := &compatOptions{e: e}
	cmd := &cobra.Command{
		Use:   "compat [--talos V] [--kubernetes V] [--cilium V]",
		Short: "Print the Talos, Kubernetes and Cilium versions Ichor runs together",
		Long: fmt.Sprintf(`Print Ichor's compatibility table: the Talos, Kubernetes and Cilium versions
that run together, and the latest patch of each Talos minor Ichor lists.
Preflight refuses an upgrade whose result is not in it (spec.override bypasses
the refusal). A patch newer than the latest listed (released after this table)
is accepted and checked as its minor; whether the registry has it, the upgrade
finds out by pulling the installer before it disrupts the first machine.

This is the table built into this plugin (%[2]s); ichor-controller checks
against the table of its own release ('%[1]s version' shows both versions).

With --talos alone it lists that Talos minor's combinations; with --talos and
--kubernetes (and --cilium, or none for a cluster without Ichor's Cilium) it
says whether they run together, and exits 1 when they do not.`, e.Name, version.Version),
		Example: fmt.Sprintf(`  %[1]s compat
  %[1]s compat --talos 1.13
  %[1]s compat --talos v1.13.7 --kubernetes v1.36.2 --cilium 1.20.1`, e.Name),
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			if o.output != "" && o.output != "json" && o.output != "yaml" {
				return usageErrorf("unsupported --output %q: use json or yaml", o.output)
			}
			if (o.kubernetes != "" || o.cilium != "") && o.talos == "" {
				return usageErrorf("--kubernetes and --cilium are checked against a Talos version: give --talos too")
			}
			return o.Run()
		},
	}
	cmd.Flags().StringVar(&o.talos, "talos", "", "Talos version or minor (1.13.7, v1.13.7 or 1.13)")
	cmd.Flags().StringVar(&o.kubernetes, "kubernetes", "", "Kubernetes version or minor to check with --talos")
	cmd.Flags().StringVar(&o.cilium, "cilium", "", "Cilium version or minor to check with --talos and --kubernetes; none for a cluster without Ichor's Cilium")
	cmd.Flags().StringVarP(&o.output, "output", "o", "", "Output format: json or yaml (default: a table)")
	return cmd
}

func (o *compatOptions) Run() error {
	table, err := compat.Default()
	if err != nil {
		return err
	}
	out := o.e.Streams.Out
	if o.talos != "" && o.kubernetes != "" {
		if err := table.Supports(o.talos, o.kubernetes, o.cilium); err != nil {
			return err
		}
		cilium := "no Cilium installed by Ichor"
		if o.cilium != "" && o.cilium != "none" {
			cilium = "Cilium " + o.cilium
		}
		_, err := fmt.Fprintf(out, "Talos %s, Kubernetes %s and %s run together\n", o.talos, o.kubernetes, cilium)
		return err
	}
	if o.talos != "" {
		minor, err := compat.ParseMinor(trimPatch(o.talos))
		if err != nil {
			return usageErrorf("invalid --talos: %v", err)
		}
		if _, ok := table.Latest(minor); !ok {
			return fmt.Errorf("Talos %s is not in Ichor's compatibility table, which lists Talos %s to %s", minor, table.Oldest().Minor, table.Newest().Minor)
		}
		filtered := &compat.Table{}
		for _, r := range table.Talos {
			if r.Minor == minor {
				filtered.Talos = append(filtered.Talos, r)
			}
		}
		for _, c := range table.Combinations {
			if c.Talos == minor {
				filtered.Combinations = append(filtered.Combinations, c)
			}
		}
		table = filtered
	}
	return printStructured(out, o.output, table, func(w io.Writer) {
		tw := newTabWriter(w)
		fmt.Fprintln(tw, "TALOS\tLATEST\tKUBERNETES\tCILIUM")
		for _, c := range table.Combinations {
			latest, _ := table.Latest(c.Talos)
			fmt.Fprintf(tw, "%s\t%s\t%s\t%s\n", c.Talos, latest, c.Kubernetes, c.Cilium)
		}
		_ = tw.Flush()
	})
}

// trimPatch turns v1.13.7 into 1.13 and leaves 1.13 alone.
func trimPatch(v string) string {
	m, err := compat.ParseVersion(v)
	if err != nil {
		return v
	}
	return m.MajorMinor().String()
}
