package main

import (
	"bytes"
	"context"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/siderolabs/talos/pkg/machinery/client"
	clientconfig "github.com/siderolabs/talos/pkg/machinery/client/config"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"maesh.dev/ichor/internal/testenv"
	"maesh.dev/ichor/sim"
)

var env *testenv.Env

func TestMain(m *testing.M) { os.Exit(testenv.Main(m, &env)) }

// TestRun: the command starts a fleet whose talosconfig works and whose
// Nodes are in the API server, and stops when its context ends.
func TestRun(t *testing.T) {
	dir := t.TempDir()
	tc := filepath.Join(dir, "talosconfig")
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	started := make(chan *sim.Fleet, 1)
	done := make(chan error, 1)
	var out bytes.Buffer
	go func() {
		done <- run(ctx, []string{"--kubeconfig", env.Kubeconfig, "--name", "cmd", "--workers", "1", "--talosconfig", tc}, &out, func(f *sim.Fleet) { started <- f })
	}()
	var f *sim.Fleet
	select {
	case f = <-started:
	case err := <-done:
		t.Fatalf("run: %v", err)
	}
	cfg, err := clientconfig.Open(tc)
	if err != nil {
		t.Fatal(err)
	}
	c, err := client.New(ctx, client.WithConfig(cfg))
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	if _, err := c.Version(client.WithNode(ctx, f.Machine("cmd-w-1").Address())); err != nil {
		t.Fatalf("Version through the written talosconfig: %v", err)
	}
	if _, err := env.Kube.CoreV1().Nodes().Get(ctx, "cmd-cp-3", metav1.GetOptions{}); err != nil {
		t.Fatal(err)
	}
	cancel()
	if err := <-done; err != nil {
		t.Fatalf("run after interrupt: %v", err)
	}
	if !strings.Contains(out.String(), "cmd-w-1") {
		t.Fatalf("output lists no machines:\n%s", out.String())
	}
}

func TestRunRefusesBadInput(t *testing.T) {
	var out bytes.Buffer
	for _, tc := range []struct {
		args []string
		want string
	}{
		{[]string{"--kubeconfig", ""}, "pass --kubeconfig or set KUBECONFIG"},
		{[]string{"--kubeconfig", env.Kubeconfig, "--control-planes", "0"}, "at least one control plane"},
		{[]string{"--kubeconfig", env.Kubeconfig, "--talos", "latest"}, "Talos version"},
		{[]string{"--bogus"}, "flag provided but not defined"},
	} {
		t.Setenv("KUBECONFIG", "")
		err := run(context.Background(), tc.args, &out, nil)
		if err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("run %v: %v, want %q", tc.args, err, tc.want)
		}
	}
}
