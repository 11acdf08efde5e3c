// Command ichor-sandbox runs Ichor on this machine and nothing else: a real
// kube-apiserver, kube-controller-manager and kube-scheduler on each
// simulated control plane and their etcd, as Talos runs them (--hosted,
// the default; --hosted=false runs one of each beside the machines), the
// binaries `make envtest-assets` builds, Ichor's manifests applied with the
// real kubectl, a fleet of simulated Talos machines that play the kubelets,
// the workloads of workloads.yaml, and ichor-controller as its Deployment's
// pods, which the machines run as processes of bin/ichor-controller (as
// they run the Jobs the controller starts). It writes a kubeconfig and a talosconfig under
// .ichor-sandbox/ and stays up until Ctrl-C, which stops everything and
// removes those files. Everything listens on loopback only.
//
// With --demo it runs a scripted walk-through with the real kubectl and
// kubectl ichor instead, checks every step, and exits: 0 only if each step
// behaved as described.
//
// It lives in hack/ because it is a tool for trying and demonstrating Ichor,
// not part of what ships (neither the controller image nor the krew plugin).
// `make sandbox` and `make demo` run it.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"os/exec"
	"os/signal"
	"path/filepath"
	"strings"
	"syscall"
	"time"

	ichorv1 "maesh.dev/ichor/api/v1alpha1"
	"maesh.dev/ichor/internal/repo"
	"maesh.dev/ichor/manifests"
	"maesh.dev/ichor/sim"
)

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	go func() {
		// A second Ctrl-C ends the process at once.
		<-ctx.Done()
		stop()
	}()
	os.Exit(run(ctx, os.Args[1:], os.Stdout, os.Stderr))
}

// options are the command line.
type options struct {
	config
	// demo is --demo's: with a script, it runs instead of waiting for Ctrl-C.
	demo demoConfig
}

func parseFlags(args []string, stderr io.Writer) (options, error) {
	root, err := repo.Root()
	if err != nil {
		return options{}, err
	}
	o := options{config: config{Root: root, Assets: os.Getenv("KUBEBUILDER_ASSETS")}}
	fs := flag.NewFlagSet("ichor-sandbox", flag.ContinueOnError)
	fs.SetOutput(stderr)
	fs.Usage = func() {
		fmt.Fprintf(stderr, "Usage: ichor-sandbox [flags]   (make sandbox, make demo)\n\n%s\n\nFlags:\n", usageIntro)
		fs.PrintDefaults()
	}
	fs.IntVar(&o.ControlPlanes, "control-planes", 3, "simulated control-plane machines")
	fs.IntVar(&o.Workers, "workers", 3, "simulated worker machines")
	fs.StringVar(&o.Talos, "talos", sim.DefaultTalos, "Talos version the machines run")
	fs.StringVar(&o.Kubernetes, "kubernetes", sim.DefaultKubernetes, "Kubernetes version the machines run")
	fs.Var(pairValue{&o.TalosOn, "MACHINE=VERSION", "sandbox-w-1=v1.12.4", nil}, "talos-on", "MACHINE=VERSION: that machine runs another Talos version than --talos (repeatable)")
	fs.BoolVar(&o.Cilium, "cilium", true, "install the user's Cilium beside kube-proxy; with false the CNI is Talos's and the compatibility table's Cilium \"none\" rows apply (Kubernetes 1.36, say)")
	fs.StringVar(&o.Name, "name", "sandbox", "cluster name: prefixes the machine names (sandbox-cp-1, sandbox-w-1) and names the talosconfig context")
	fs.BoolVar(&o.Hosted, "hosted", true, "the control planes run the cluster as on Talos: each its own kube-apiserver, kube-controller-manager and kube-scheduler, and their etcd; false runs one of each beside the machines")
	fs.DurationVar(&o.Pace, "pace", time.Second, "length of the shortest simulated step; a reboot takes 3 times as long, an install 2")
	fs.StringVar(&o.Dir, "dir", filepath.Join(root, ".ichor-sandbox"), "directory for the kubeconfig, talosconfig, env file and logs (removed on exit)")
	fs.StringVar(&o.Kubectl, "kubectl", defaultKubectl(), "the kubectl to run ($KUBECTL)")
	fs.StringVar(&o.Controller, "controller", filepath.Join(root, "bin", "ichor-controller"), "the ichor-controller binary the controller's pods run (make build)")
	fs.Var(pairValue{&o.Images, "IMAGE=BINARY", "ghcr.io/maesh-dev/ichor-controller:v0.2.0=/tmp/v0.2.0/ichor-controller", filepath.Abs}, "image", "IMAGE=BINARY: the machines run pods of IMAGE as BINARY, like a second build to upgrade to (repeatable)")
	fs.Var(scriptValue{&o.demo.Script}, "demo", "run a scripted walk-through, check every step, then stop: --demo is the tour (make demo), --demo=recovery a shutdown and an etcd restore (make demo-recovery)")
	fs.StringVar(&o.demo.Target, "to", "v1.13.7", "with --demo: the Talos version the demo upgrades to")
	fs.StringVar(&o.demo.PluginDir, "plugin-dir", filepath.Join(root, "bin"), "with --demo: the directory holding kubectl-ichor (make build)")
	if err := fs.Parse(args); err != nil {
		return o, err
	}
	if fs.NArg() > 0 {
		return o, fmt.Errorf("unexpected arguments %q: ichor-sandbox takes flags only (see -h)", fs.Args())
	}
	if o.Dir, err = filepath.Abs(o.Dir); err != nil {
		return o, err
	}
	o.Stdout = io.Discard
	if o.demo.Script != "" {
		return o, o.demo.validate(o.config)
	}
	return o, nil
}

const usageIntro = `Runs Ichor on this machine: simulated Talos machines whose control planes each run a
real kube-apiserver, kube-controller-manager and kube-scheduler and share a real etcd (or,
with --hosted=false, one of each beside the machines), Ichor's manifests, workloads, and
ichor-controller's pods on the machines, all on loopback, until Ctrl-C.`

// pairValue is a repeatable KEY=VALUE flag (--image IMAGE=BINARY, --talos-on
// MACHINE=VERSION) into a map; value, if set, rewrites each value.
type pairValue struct {
	m              *map[string]string
	syntax, sample string
	value          func(string) (string, error)
}

func (v pairValue) String() string { return "" }

func (v pairValue) Set(s string) error {
	key, val, ok := strings.Cut(s, "=")
	if !ok || key == "" || val == "" {
		return fmt.Errorf("%q: write %s, like %s", s, v.syntax, v.sample)
	}
	if v.value != nil {
		var err error
		if val, err = v.value(val); err != nil {
			return err
		}
	}
	if *v.m == nil {
		*v.m = map[string]string{}
	}
	(*v.m)[key] = val
	return nil
}

// scriptValue is --demo: a boolean flag (--demo runs the tour) that also
// takes the name of another script (--demo=recovery).
type scriptValue struct{ script *string }

// Scripts of --demo.
const (
	scriptTour     = "tour"
	scriptRecovery = "recovery"
)

func (v scriptValue) String() string {
	if v.script == nil {
		return ""
	}
	return *v.script
}

func (v scriptValue) IsBoolFlag() bool { return true }

func (v scriptValue) Set(s string) error {
	switch s {
	case "true", scriptTour:
		*v.script = scriptTour
	case "false":
		*v.script = ""
	case scriptRecovery:
		*v.script = scriptRecovery
	default:
		return fmt.Errorf("%q: write --demo (the tour) or --demo=%s", s, scriptRecovery)
	}
	return nil
}

// controlPlaneLine says where the cluster's control plane runs.
func controlPlaneLine(hosted bool) string {
	if hosted {
		return "each control plane with its own kube-apiserver, kube-controller-manager and kube-scheduler, and their etcd"
	}
	return "one kube-apiserver, etcd, kube-controller-manager and kube-scheduler beside them"
}

func defaultKubectl() string {
	if k := os.Getenv("KUBECTL"); k != "" {
		return k
	}
	if p, err := exec.LookPath("kubectl"); err == nil {
		return p
	}
	return "kubectl"
}

func run(ctx context.Context, args []string, stdout, stderr io.Writer) int {
	o, err := parseFlags(args, stderr)
	if errors.Is(err, flag.ErrHelp) {
		return 0
	}
	if err != nil {
		fmt.Fprintln(stderr, "error:", err)
		return 2
	}
	fmt.Fprintf(stdout, "Starting the Ichor sandbox: %d control planes + %d workers on Talos %s and Kubernetes %s, %s, Ichor's manifests, Cilium, workloads, ichor-controller...\n",
		o.ControlPlanes, o.Workers, o.Talos, o.Kubernetes, controlPlaneLine(o.Hosted))
	sb, err := Start(ctx, o.config)
	if ctx.Err() != nil {
		fmt.Fprintln(stderr, "interrupted while starting; everything it started is stopped")
		if sb != nil {
			sb.Stop()
		}
		return 130
	}
	if err != nil {
		fmt.Fprintln(stderr, "error:", err)
		return 1
	}
	defer func() {
		fmt.Fprintln(stdout, "Stopping the sandbox: ichor-controller, the machines, the control plane; removing", relative(o.Dir))
		sb.Stop()
	}()
	if o.demo.Script != "" {
		if err := runDemo(ctx, sb, o.demo, stdout); err != nil {
			fmt.Fprintf(stderr, "\nDEMO FAILED: %v\n", err)
			demoFailed(stderr, sb)
			return 1
		}
		fmt.Fprintln(stdout, "\nThe demo ran as described: every step was checked.")
		return 0
	}
	if err := printUsage(stdout, sb); err != nil {
		fmt.Fprintln(stderr, "error:", err)
		return 1
	}
	<-ctx.Done()
	return 0
}

// demoFailed keeps the sandbox's logs, which Stop removes, and prints
// where they are and the end of each: a failure in CI then says what each
// part of the cluster did last.
func demoFailed(stderr io.Writer, sb *Sandbox) {
	kept, err := sb.KeepLogs()
	if err != nil {
		fmt.Fprintf(stderr, "(keeping the sandbox's logs in %s failed: %v)\n", kept, err)
		return
	}
	fmt.Fprintf(stderr, "The sandbox's logs are kept in %s (the controller's under pods/, the machines' in %s, the control planes' under %s/); the end of each:\n", kept, fileSim, dirControlPlane)
	if err := logTails(stderr, kept, tailLines); err != nil {
		fmt.Fprintln(stderr, "(reading them back:", err, ")")
	}
}

// printUsage says what runs where, then the walk-through.
func printUsage(w io.Writer, sb *Sandbox) error {
	machines := sb.Fleet.Machines()
	first, last := machines[0].Name(), machines[len(machines)-1].Name()
	api := fmt.Sprintf(`%s (kube-apiserver, etcd, kube-controller-manager and kube-scheduler
                 built by make envtest-assets, beside the machines; their logs in %s)`, sb.Admin.Host, relative(sb.cfg.Dir))
	if sb.cfg.Hosted {
		api = fmt.Sprintf(`%s, balanced across the control planes (KubePrism's role): each runs
                 its own kube-apiserver, kube-controller-manager and kube-scheduler (one
                 of each leads), restarted as Talos restarts its static pods, and they
                 share etcd (%s); logs in %s/<machine>/`, sb.Admin.Host, sb.Fleet.HostedEtcd().ClientURL, relative(sb.Path(dirControlPlane)))
	}
	fmt.Fprintf(w, `
The Ichor sandbox is up (ready). Everything listens on loopback and stays up until Ctrl-C.

  API            %s
  Machines       %d simulated Talos machines: %s ... %s, Talos API at %s
  Workloads      Deployment web (4, PDB minAvailable 3), StatefulSet db (3, PDB maxUnavailable 1),
                 DaemonSet node-agent, pod debug: %s
  CNI            %s
  Controller     Deployment %s/%s (image %s): its pods run on the workers
                 as %s, the leader and a standby; their logs in %s
`, api, len(machines), first, last, sb.Fleet.Endpoints()[0], relative(sb.Path(fileWorkloads)),
		cniLine(sb), ichorv1.DefaultNamespace, manifests.Deployment, sb.Image, relative(sb.cfg.Controller), relative(sb.Path(dirPods))+"/"+ichorv1.DefaultNamespace+"_"+manifests.Deployment+"-*/"+manifests.Container+".log")
	if err := printWalkThrough(w, sb); err != nil {
		return err
	}
	fmt.Fprintf(w, `
Faults: error:METHOD[:CODE][:once], hang:METHOD, rollback[:once], no-return,
etcd-unhealthy, alarm[:NOSPACE|CORRUPT], comma-separated (sim/README.md).
The machines log what happens to them in %s.

Ctrl-C stops everything and removes %s.
`, relative(sb.Path(fileSim)), relative(sb.cfg.Dir))
	return nil
}

// cniLine says which CNI the sandbox runs, for printUsage.
func cniLine(sb *Sandbox) string {
	if !sb.cfg.Cilium {
		return "Talos's (--cilium=false): no Cilium, kube-proxy as Talos applies it"
	}
	return fmt.Sprintf(`Cilium %s, Helm release kube-system/cilium (Ichor's test chart, shaped like
                 Cilium's), beside kube-proxy as Talos applies it; kubectl ichor upgrade cni
                 moves it to the chart Ichor ships, %s (its Job runs bin/ichor-controller too)`, sb.userChart.Version, sb.shippedChart.Version)
}
