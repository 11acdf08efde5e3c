// Command ichor-sim runs a fleet of simulated Talos machines against a
// Kubernetes API server until it is interrupted: the sandbox's machines.
// It writes an os:admin talosconfig for the fleet and registers a Node per
// machine; faults are set with the sim.ichor.maesh.dev/fault Node
// annotation (see the sim package).
//
//	ichor-sim --kubeconfig ~/.kube/config --workers 5 --talosconfig ./talosconfig
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"os/signal"
	"syscall"
	"time"

	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/tools/clientcmd"

	"maesh.dev/ichor/sim"
)

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	if err := run(ctx, os.Args[1:], os.Stdout, nil); err != nil && !errors.Is(err, flag.ErrHelp) {
		fmt.Fprintln(os.Stderr, "ichor-sim:", err)
		os.Exit(1)
	}
}

// run starts the fleet, calls ready (if set) and serves until ctx ends.
func run(ctx context.Context, args []string, out io.Writer, ready func(*sim.Fleet)) error {
	fs := flag.NewFlagSet("ichor-sim", flag.ContinueOnError)
	fs.SetOutput(out)
	kubeconfig := fs.String("kubeconfig", os.Getenv("KUBECONFIG"), "kubeconfig of the API server the Nodes live in")
	name := fs.String("name", "sandbox", "cluster name: prefixes the machine names")
	controlPlanes := fs.Int("control-planes", 3, "number of control-plane machines")
	workers := fs.Int("workers", 3, "number of worker machines")
	talos := fs.String("talos", sim.DefaultTalos, "Talos version the machines run")
	kube := fs.String("kubernetes", sim.DefaultKubernetes, "Kubernetes version the machines run")
	talosconfig := fs.String("talosconfig", "talosconfig", "file to write the os:admin talosconfig to")
	d := sim.Durations{}
	fs.DurationVar(&d.Stop, "stop", time.Second, "time to stop services before going down")
	fs.DurationVar(&d.Reboot, "reboot", 5*time.Second, "time a machine is down during a reboot")
	fs.DurationVar(&d.Install, "install", 3*time.Second, "time the installer runs")
	fs.DurationVar(&d.ImagePull, "image-pull", 2*time.Second, "time an image pull takes")
	fs.DurationVar(&d.KubeletRestart, "kubelet-restart", 2*time.Second, "time a kubelet restart takes")
	fs.DurationVar(&d.PodGrace, "pod-grace", 2*time.Second, "longest time a deleted pod lingers")
	if err := fs.Parse(args); err != nil {
		return err
	}
	if *kubeconfig == "" {
		return errors.New("no kubeconfig: pass --kubeconfig or set KUBECONFIG")
	}
	cfg, err := clientcmd.BuildConfigFromFlags("", *kubeconfig)
	if err != nil {
		return fmt.Errorf("load kubeconfig %s: %w", *kubeconfig, err)
	}
	cs, err := kubernetes.NewForConfig(cfg)
	if err != nil {
		return err
	}
	spec := sim.Cluster(*name, *controlPlanes, *workers)
	for i := range spec.Machines {
		spec.Machines[i].Talos, spec.Machines[i].Kubernetes = *talos, *kube
	}
	spec.Durations = d
	spec.Logf = func(format string, args ...any) { fmt.Fprintf(out, format+"\n", args...) }
	f, err := sim.Start(ctx, spec, cs)
	if err != nil {
		return err
	}
	defer f.Stop()
	b, err := f.Talosconfig().Bytes()
	if err != nil {
		return err
	}
	if err := os.WriteFile(*talosconfig, b, 0o600); err != nil {
		return fmt.Errorf("write talosconfig: %w", err)
	}
	fmt.Fprintf(out, "fleet %s: %d machines, endpoints %v, talosconfig %s\n", *name, len(f.Machines()), f.Endpoints(), *talosconfig)
	for _, m := range f.Machines() {
		fmt.Fprintf(out, "  %-20s %-12s %-15s %s\n", m.Name(), m.Role(), m.Address(), m.Version())
	}
	if ready != nil {
		ready(f)
	}
	<-ctx.Done()
	return nil
}
