package machineconfig

import (
	"strings"
	"sync"
	"testing"

	"github.com/siderolabs/talos/pkg/machinery/config"
	"github.com/siderolabs/talos/pkg/machinery/config/configloader"
	"github.com/siderolabs/talos/pkg/machinery/config/generate"
	"github.com/siderolabs/talos/pkg/machinery/config/machine"
	"github.com/siderolabs/talos/pkg/machinery/config/types/v1alpha1"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
)

// generated is a worker configuration generated once (generating secrets
// takes seconds), encoded.
var generated = sync.OnceValues(func() ([]byte, error) {
	in, err := generate.NewInput("c", "https://10.0.0.1:6443", "1.35.0")
	if err != nil {
		return nil, err
	}
	cfg, err := in.Config(machine.TypeWorker)
	if err != nil {
		return nil, err
	}
	return Encode(cfg)
})

// worker is a generated worker configuration, as a machine holds one, with
// extra documents appended.
func worker(t *testing.T, extra ...string) config.Provider {
	t.Helper()
	b, err := generated()
	if err != nil {
		t.Fatal(err)
	}
	text := string(b)
	for _, e := range extra {
		text += "---\n" + e
	}
	cfg, err := configloader.NewFromBytes([]byte(text))
	if err != nil {
		t.Fatal(err)
	}
	return cfg
}

// documents checks how many documents a configuration has: a generated
// one has two (v1alpha1 and HostnameConfig).
func documents(n int) func(t *testing.T, p config.Provider) {
	return func(t *testing.T, p config.Provider) {
		t.Helper()
		if got := len(p.Documents()); got != n {
			t.Errorf("%d documents, want %d", got, n)
		}
	}
}

const eventSink = "apiVersion: v1alpha1\nkind: EventSinkConfig\nendpoint: '[fd00::1]:12345'\n"

func TestParsePatches(t *testing.T) {
	tests := []struct {
		name, text, err string
	}{
		{name: "strategic merge", text: "machine:\n  nodeLabels:\n    zone: a\n"},
		{name: "strategic merge, two documents", text: "machine:\n  env:\n    A: b\n---\n" + eventSink},
		{name: "delete a document", text: "apiVersion: v1alpha1\nkind: EventSinkConfig\n$patch: delete\n"},
		{name: "JSON patch as JSON", text: `[{"op": "add", "path": "/machine/nodeLabels", "value": {"zone": "a"}}]`},
		{name: "JSON patch as YAML", text: "- op: add\n  path: /machine/env\n  value: {A: b}\n"},
		{name: "empty", text: " \n", err: "patch 1 is empty"},
		{name: "not YAML", text: "machine: [nodeLabels", err: "patch 1 is not a machine-configuration patch"},
		{name: "a file name is not read", text: "/etc/hostname", err: "patch 1 is not a machine-configuration patch"},
		{name: "not a patch", text: "just words here", err: "patch 1 is not a machine-configuration patch"},
		{name: "an unknown field", text: "machine:\n  nodeLabelz:\n    zone: a\n", err: "unknown keys found during decoding"},
		{name: "a value of the wrong type", text: "machine:\n  env: 3\n", err: "cannot construct !!int `3` into map[string]string"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			ps, err := ParsePatches([]string{tt.text})
			if tt.err == "" {
				if err != nil || len(ps) != 1 || ps[0].Name() != "patch 1" {
					t.Fatalf("ParsePatches = %v, %v", ps, err)
				}
				return
			}
			if err == nil || !strings.Contains(err.Error(), tt.err) {
				t.Fatalf("ParsePatches error %v, want one containing %q", err, tt.err)
			}
		})
	}
	if _, err := ParsePatches(nil); err == nil {
		t.Fatal("no patches parsed")
	}
}

func TestPlanOn(t *testing.T) {
	labels := "machine:\n  nodeLabels:\n    zone: a\n"
	certSAN := `[{"op": "add", "path": "/machine/certSANs/-", "value": "10.9.9.9"}]`
	tests := []struct {
		name    string
		cfg     config.Provider
		patches []string
		// again: patching the patched configuration once more changes nothing
		again bool
		err   string
		check func(t *testing.T, patched config.Provider)
	}{
		{name: "a label", cfg: worker(t), patches: []string{labels}, again: true, check: func(t *testing.T, p config.Provider) {
			if p.Machine().NodeLabels()["zone"] != "a" {
				t.Errorf("labels %v", p.Machine().NodeLabels())
			}
		}},
		{name: "patches apply in order", cfg: worker(t), patches: []string{labels, "machine:\n  nodeLabels:\n    zone: b\n"}, again: true,
			check: func(t *testing.T, p config.Provider) {
				if p.Machine().NodeLabels()["zone"] != "b" {
					t.Errorf("labels %v", p.Machine().NodeLabels())
				}
			}},
		{name: "an appending JSON patch changes again when reapplied", cfg: worker(t), patches: []string{certSAN}, again: false,
			check: func(t *testing.T, p config.Provider) {
				if sans := p.Machine().Security().CertSANs(); len(sans) != 1 || sans[0] != "10.9.9.9" {
					t.Errorf("certSANs %v", sans)
				}
			}},
		{name: "other documents are kept", cfg: worker(t, eventSink), patches: []string{labels}, again: true, check: documents(3)},
		{name: "a JSON patch keeps the other documents", cfg: worker(t, eventSink), patches: []string{certSAN}, check: documents(3)},
		{name: "a document added", cfg: worker(t), patches: []string{eventSink}, again: true, check: documents(3)},
		{name: "a document deleted, twice", cfg: worker(t, eventSink), patches: []string{"apiVersion: v1alpha1\nkind: EventSinkConfig\n$patch: delete\n"}, again: true,
			check: documents(2)},
		{name: "a JSON patch may not remove the v1alpha1 document", cfg: worker(t), patches: []string{`[{"op": "remove", "path": "/machine"}, {"op": "remove", "path": "/cluster"}, {"op": "remove", "path": "/version"}, {"op": "remove", "path": "/debug"}, {"op": "remove", "path": "/persist"}]`},
			err: "patch 1 does not apply"},
		{name: "a JSON patch whose path is missing", cfg: worker(t), patches: []string{`[{"op": "replace", "path": "/machine/nope/x", "value": 1}]`},
			err: "patch 1 does not apply"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			ps, err := ParsePatches(tt.patches)
			if err != nil {
				t.Fatal(err)
			}
			ch, err := PlanOn(tt.cfg, ps)
			if tt.err != "" {
				if Reason(err) != ReasonPatchFailed || !strings.Contains(err.Error(), tt.err) {
					t.Fatalf("PlanOn error %v (reason %q), want %s containing %q", err, Reason(err), ReasonPatchFailed, tt.err)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			if diff, _ := ch.Diff(); ch.Applied() || diff == "" || ch.From == ch.To {
				t.Fatalf("the change is empty: %+v", ch)
			}
			if from, _ := Fingerprint(tt.cfg); from != ch.From {
				t.Fatalf("From %s is not the fingerprint of the configuration %s", ch.From, from)
			}
			again, err := PlanOn(ch.Config, ps)
			if err != nil {
				t.Fatal(err)
			}
			if again.From != ch.To || again.Applied() != tt.again {
				t.Fatalf("patching the patched configuration: %+v, want applied=%v", again, tt.again)
			}
			if tt.check != nil {
				tt.check(t, ch.Config)
			}
		})
	}
}

func TestTypedPatch(t *testing.T) {
	cfg := worker(t, eventSink)
	image := "ghcr.io/siderolabs/kubelet:v1.35.2"
	ch, err := PlanOn(cfg, []Patch{Typed("kubelet image", func(c *v1alpha1.Config) error {
		c.MachineConfig.MachineKubelet.KubeletImage = image
		return nil
	})})
	if err != nil {
		t.Fatal(err)
	}
	if got := ch.Config.Machine().Kubelet().Image(); got != image || len(ch.Config.Documents()) != 3 {
		t.Fatalf("kubelet %s, %d documents", got, len(ch.Config.Documents()))
	}
	if cfg.Machine().Kubelet().Image() == image {
		t.Fatal("the typed patch changed the configuration it was given")
	}
	_, err = PlanOn(cfg, []Patch{Typed("broken", func(*v1alpha1.Config) error { return errorString("no") })})
	if Reason(err) != ReasonPatchFailed || !strings.Contains(err.Error(), "broken does not apply: no") {
		t.Fatalf("a failing typed patch: %v", err)
	}
}

type errorString string

func (e errorString) Error() string { return string(e) }

func TestTalosError(t *testing.T) {
	tests := []struct {
		name   string
		err    error
		reason string
		says   string
	}{
		{"needs a reboot", status.Error(codes.InvalidArgument, "this config change can't be applied in immediate mode\ndiff: ..."), ReasonNeedsReboot, "use mode reboot"},
		{"does not validate", status.Error(codes.InvalidArgument, "1 error occurred:\n\t* kubelet image is not valid"), ReasonInvalid, "kubelet image is not valid"},
		{"another apply", status.Error(codes.FailedPrecondition, "another apply configuration is already in progress"), ReasonApplyInProgress, "wait until it is done"},
		{"rebooting", status.Error(codes.FailedPrecondition, "configuration was already applied and node is rebooting, cannot apply more configuration changes until next reboot"), ReasonRebootPending, "wait until it is back"},
		{"role", status.Error(codes.PermissionDenied, "not authorized"), ReasonNotPermitted, "os:admin"},
		{"no answer", status.Error(codes.Unavailable, "connection refused"), "", "connection refused"},
		{"not from Talos", errorString("boom"), "", "boom"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			err := talosError("apply", tt.err)
			if Reason(err) != tt.reason || !strings.Contains(err.Error(), tt.says) {
				t.Fatalf("%v (reason %q), want reason %q and %q", err, Reason(err), tt.reason, tt.says)
			}
			if status.Code(tt.err) != codes.Unknown && status.Code(err) != status.Code(tt.err) {
				t.Fatalf("the gRPC code is lost: %v", err)
			}
		})
	}
	long := status.Error(codes.InvalidArgument, "this config change can't be applied in immediate mode\ndiff:\n"+strings.Repeat("x", 5000))
	if n := len(talosError("apply", long).Error()); n > maxQuote+300 {
		t.Fatalf("a long Talos message is quoted whole (%d bytes)", n)
	}
}
