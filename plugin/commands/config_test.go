package commands

import (
	"os"
	"path/filepath"
	"reflect"
	"strings"
	"testing"

	ichorv1 "maesh.dev/ichor/api/v1alpha1"
)

func TestConfigApplyBuild(t *testing.T) {
	dir := t.TempDir()
	file := func(name, body string) string {
		p := filepath.Join(dir, name)
		if err := os.WriteFile(p, []byte(body), 0o600); err != nil {
			t.Fatal(err)
		}
		return p
	}
	labels := "machine:\n  nodeLabels:\n    zone: a\n"
	json6902 := `[{"op": "add", "path": "/machine/env", "value": {"A": "b"}}]`
	twoDocs := labels + "---\napiVersion: v1alpha1\nkind: EventSinkConfig\nendpoint: '[fd00::1]:12345'\n"
	tests := []struct {
		name  string
		files []string
		mode  string
		stdin string
		want  *ichorv1.ConfigRollout
		err   string
	}{
		{name: "two files in order", files: []string{file("a.yaml", labels), file("b.json", json6902)}, mode: "auto",
			want: &ichorv1.ConfigRollout{Patches: []string{labels, json6902}, Mode: ichorv1.ConfigModeAuto}},
		{name: "standard input", files: []string{"-"}, stdin: twoDocs, mode: "reboot",
			want: &ichorv1.ConfigRollout{Patches: []string{twoDocs}, Mode: ichorv1.ConfigModeReboot}},
		{name: "a JSON patch written as YAML", files: []string{file("c.yaml", "- op: remove\n  path: /machine/env\n")}, mode: "reboot",
			want: &ichorv1.ConfigRollout{Patches: []string{"- op: remove\n  path: /machine/env\n"}, Mode: ichorv1.ConfigModeReboot}},
		{name: "no file", mode: "reboot", err: "-f is required"},
		{name: "a mode of its own", files: []string{file("d.yaml", labels)}, mode: "staged", err: `invalid --mode "staged"`},
		{name: "a file that is not there", files: []string{filepath.Join(dir, "nope.yaml")}, mode: "reboot", err: "read patch"},
		{name: "an empty file", files: []string{file("e.yaml", "\n  \n")}, mode: "reboot", err: "is empty"},
		{name: "not YAML", files: []string{file("f.yaml", "machine: [nodeLabels\n")}, mode: "reboot", err: "f.yaml is not a machine-configuration patch"},
		{name: "a scalar", files: []string{file("g.yaml", "just words\n")}, mode: "reboot", err: "expected a YAML document at line 1"},
		{name: "a JSON patch beside a document", files: []string{file("h.yaml", labels+"---\n- op: remove\n  path: /machine/env\n")}, mode: "reboot",
			err: "expected a YAML document at line 5"},
		{name: "an unknown field", files: []string{file("i.yaml", "machine:\n  nodeLabelz:\n    zone: a\n")}, mode: "reboot",
			err: "unknown keys found during decoding"},
		{name: "a value of the wrong type", files: []string{file("j.yaml", "machine:\n  env: 3\n")}, mode: "reboot",
			err: "cannot construct !!int `3` into map[string]string"},
		{name: "standard input twice", files: []string{"-", "-"}, stdin: labels, mode: "reboot", err: "given twice"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			r := newFakeRun(t)
			r.env.Streams.In = strings.NewReader(tt.stdin)
			c := &configApplyOptions{files: tt.files, mode: tt.mode}
			var spec ichorv1.TalosOperationSpec
			err := c.build(r.env, &spec)
			if tt.err != "" {
				if err == nil || !strings.Contains(err.Error(), tt.err) {
					t.Fatalf("build error %v, want one containing %q", err, tt.err)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			if !reflect.DeepEqual(spec.Config, tt.want) {
				t.Fatalf("spec.config %+v, want %+v", spec.Config, tt.want)
			}
		})
	}
}
