package main

import (
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// TestKeepLogs: a failed demo keeps every log of the sandbox, in its
// place, and nothing else (no token, key or data), where Stop leaves it;
// the tails show each log's last lines under its path.
func TestKeepLogs(t *testing.T) {
	dir := filepath.Join(t.TempDir(), "sandbox")
	var sim strings.Builder
	for i := 1; i <= 100; i++ {
		fmt.Fprintf(&sim, "machine line %d\n", i)
	}
	files := map[string]string{
		fileSim: sim.String(),
		"pods/ichor-system_ichor-controller-1/controller.log":    "leader\ntakeover\n",
		"pods/ichor-system_ichor-controller-1/token":             "secret token",
		"control-plane/etcd/etcd.log":                            "restored\n",
		"control-plane/etcd/data-1/member/snap/db":               "data",
		"control-plane/sandbox-cp-1/kube-apiserver.log":          "serving\n",
		"control-plane/sandbox-cp-1/4/apiserver.key":             "key",
		"control-plane/sandbox-cp-1/kube-controller-manager.log": "leading\n",
	}
	for name, content := range files {
		writeFile(t, filepath.Join(dir, name), content)
	}
	sb := &Sandbox{cfg: config{Dir: dir}}
	kept, err := sb.KeepLogs()
	if err != nil {
		t.Fatal(err)
	}
	defer os.RemoveAll(kept) //nolint:errcheck
	if !strings.HasPrefix(kept, os.TempDir()) {
		t.Errorf("the logs are kept in %s, want a directory under %s", kept, os.TempDir())
	}
	for name, content := range files {
		b, err := os.ReadFile(filepath.Join(kept, name))
		switch {
		case strings.HasSuffix(name, ".log") && (err != nil || string(b) != content):
			t.Errorf("kept %s: %q, %v; want it copied whole", name, b, err)
		case !strings.HasSuffix(name, ".log") && err == nil:
			t.Errorf("kept %s, which is no log", name)
		}
	}
	sb.Stop()
	if _, err := os.Stat(filepath.Join(kept, fileSim)); err != nil {
		t.Errorf("the kept logs went with the sandbox: %v", err)
	}

	var tails strings.Builder
	if err := logTails(&tails, kept, 3); err != nil {
		t.Fatal(err)
	}
	for _, want := range []string{
		"==> sim.log (the last 3 lines) <==\nmachine line 98\nmachine line 99\nmachine line 100\n",
		"==> pods/ichor-system_ichor-controller-1/controller.log (the last 3 lines) <==\nleader\ntakeover\n",
		"==> control-plane/etcd/etcd.log (the last 3 lines) <==\nrestored\n",
	} {
		if !strings.Contains(tails.String(), want) {
			t.Errorf("the tails lack %q:\n%s", want, tails.String())
		}
	}
	if strings.Contains(tails.String(), "machine line 97\n") {
		t.Errorf("the tails hold more than 3 lines of sim.log:\n%s", tails.String())
	}
}

// TestLastLines: the last n lines, whatever the file ends with.
func TestLastLines(t *testing.T) {
	for _, tc := range []struct {
		in   string
		n    int
		want string
	}{
		{"", 3, "\n"},
		{"a", 3, "a\n"},
		{"a\nb\nc\n", 2, "b\nc\n"},
		{"a\nb\nc", 2, "b\nc\n"},
		{"a\nb\nc\n", 3, "a\nb\nc\n"},
		{"a\nb\nc\n", 9, "a\nb\nc\n"},
	} {
		if got := lastLines(tc.in, tc.n); got != tc.want {
			t.Errorf("lastLines(%q, %d) = %q, want %q", tc.in, tc.n, got, tc.want)
		}
	}
}

func writeFile(t *testing.T, path, content string) {
	t.Helper()
	if err := os.MkdirAll(filepath.Dir(path), 0o700); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(path, []byte(content), 0o600); err != nil {
		t.Fatal(err)
	}
}
