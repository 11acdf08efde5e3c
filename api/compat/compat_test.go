package compat

import (
	"encoding/json"
	"fmt"
	"slices"
	"strings"
	"testing"

	"github.com/siderolabs/talos/pkg/machinery/api/machine"
	"github.com/siderolabs/talos/pkg/machinery/compatibility"
)

func defaultTable(t testing.TB) *Table {
	t.Helper()
	tab, err := Default()
	if err != nil {
		t.Fatalf("Default: %v", err)
	}
	return tab
}

func TestDefaultCoversTalos110To113(t *testing.T) {
	tab := defaultTable(t)
	var minors []string
	for _, r := range tab.Talos {
		minors = append(minors, r.Minor.String())
	}
	if got := strings.Join(minors, " "); got != "1.10 1.11 1.12 1.13" {
		t.Fatalf("Talos minors = %s", got)
	}
	for _, r := range tab.Talos {
		if _, ok := tab.KubernetesRange(r.Minor); !ok {
			t.Errorf("Talos %s has no Kubernetes range", r.Minor)
		}
		if err := tab.Supports(r.Minor.String(), mustSpan(t, tab, r.Minor).Max.String(), "none"); err != nil {
			t.Errorf("Talos %s without Cilium: %v", r.Minor, err)
		}
	}
}

func mustSpan(t testing.TB, tab *Table, m Minor) Range {
	t.Helper()
	r, ok := tab.KubernetesRange(m)
	if !ok {
		t.Fatalf("no Kubernetes range for Talos %s", m)
	}
	return r
}

func talosVersion(t testing.TB, v string) *compatibility.TalosVersion {
	t.Helper()
	tv, err := compatibility.ParseTalosVersion(&machine.VersionInfo{Tag: v})
	if err != nil {
		t.Fatal(err)
	}
	return tv
}

func kubeVersion(t testing.TB, v string) *compatibility.KubernetesVersion {
	t.Helper()
	kv, err := compatibility.ParseKubernetesVersion(v)
	if err != nil {
		t.Fatal(err)
	}
	return kv
}

// The table may not promise what machinery's compatibility package (the
// rules talosctl applies) refuses, and should list all that it accepts.
func TestDefaultAgreesWithMachinery(t *testing.T) {
	tab := defaultTable(t)
	for _, c := range tab.Combinations {
		tv := talosVersion(t, fmt.Sprintf("v%s.0", c.Talos))
		for m := c.Kubernetes.Min.Minor; m <= c.Kubernetes.Max.Minor; m++ {
			// machinery's upper bound is 1.N.99, exclusive.
			for _, patch := range []uint{0, 98} {
				k := Version{Major: 1, Minor: m, Patch: patch}
				if !c.Kubernetes.Contains(k) {
					continue
				}
				if err := kubeVersion(t, k.String()).SupportedWith(tv); err != nil {
					t.Errorf("table lists Kubernetes %s with Talos %s, machinery says: %v", k, c.Talos, err)
				}
			}
		}
	}
	for _, r := range tab.Talos {
		span := mustSpan(t, tab, r.Minor)
		tv := talosVersion(t, r.Latest.String())
		below := fmt.Sprintf("v%d.%d.99", span.Min.Major, span.Min.Minor-1)
		above := fmt.Sprintf("v%d.%d.0", span.Max.Major, span.Max.Minor+1)
		for _, k := range []string{below, above} {
			if err := kubeVersion(t, k).SupportedWith(tv); err == nil {
				t.Errorf("machinery runs Kubernetes %s with Talos %s, the table stops at %s", k, r.Minor, span)
			}
		}
	}
}

// Each latest patch must be installable over the previous minor's, or the
// path preflight hands out would be refused by the installer.
func TestDefaultPathsAreUpgradeable(t *testing.T) {
	tab := defaultTable(t)
	for i := 1; i < len(tab.Talos); i++ {
		from, to := tab.Talos[i-1].Latest.String(), tab.Talos[i].Latest.String()
		if err := talosVersion(t, to).UpgradeableFrom(talosVersion(t, from)); err != nil {
			t.Errorf("%s -> %s: %v", from, to, err)
		}
	}
}

func TestSupports(t *testing.T) {
	tab := defaultTable(t)
	tests := []struct {
		talos, kubernetes, cilium string
		want                      string
	}{
		{"v1.13.7", "v1.36.2", "v1.20.1", ""},
		{"1.13", "1.36", "1.20", ""},
		{"v1.13.7", "v1.31.0", "", ""},
		{"v1.13.7", "v1.31.0", "none", ""},
		{"v1.10.9", "v1.28.15", "1.16.9", ""},
		{"v1.12.2", "v1.33.4", "v1.18.0-rc.1", ""}, // pre-releases count as their release
		{"v1.14.0", "v1.36.2", "", "Talos v1.14.0 is not in Ichor's compatibility table, which lists Talos 1.10 to 1.13"},
		{"v1.9.5", "v1.30.0", "", "Talos v1.9.5 is not in Ichor's compatibility table, which lists Talos 1.10 to 1.13"},
		{"v1.13.7", "v1.30.2", "", "Kubernetes v1.30.2 with Talos v1.13.7 is not in Ichor's compatibility table, which lists Kubernetes 1.31 - 1.36 with Talos 1.13"},
		{"1.13", "1.37", "", "Kubernetes 1.37 with Talos 1.13 is not in Ichor's compatibility table, which lists Kubernetes 1.31 - 1.36 with Talos 1.13"},
		{"v1.13.7", "v1.31.4", "v1.16.5", "Cilium v1.16.5 with Talos v1.13.7 and Kubernetes v1.31.4 is not in Ichor's compatibility table, which lists Cilium 1.18 or none with them"},
		{"v1.13.7", "v1.33.1", "1.21.0", "Cilium v1.21.0 with Talos v1.13.7 and Kubernetes v1.33.1 is not in Ichor's compatibility table, which lists Cilium 1.18, 1.19, 1.20 or none with them"},
		{"nope", "v1.33.1", "", `talos: "nope" is not a version like v1.13.7 or a minor like 1.13`},
		{"v1.13.7", "1", "", `kubernetes: "1" is not a version like v1.13.7 or a minor like 1.13`},
		{"v1.13.7", "v1.33.1", "cilium", `cilium: "cilium" is not a version like v1.13.7 or a minor like 1.13`},
	}
	for _, tt := range tests {
		t.Run(tt.talos+"/"+tt.kubernetes+"/"+tt.cilium, func(t *testing.T) {
			err := tab.Supports(tt.talos, tt.kubernetes, tt.cilium)
			switch {
			case tt.want == "" && err != nil:
				t.Fatalf("Supports: %v", err)
			case tt.want != "" && (err == nil || err.Error() != tt.want):
				t.Fatalf("Supports error = %v\nwant %s", err, tt.want)
			}
		})
	}
}

func TestSupportsWithoutCiliumRow(t *testing.T) {
	tab, err := Parse([]byte(`
ciliumChart: {repository: https://helm.cilium.io, version: 1.19.6, digest: sha256:` + strings.Repeat("0", 64) + `}
talos: [{minor: "1.13", latest: v1.13.7}]
combinations: [{talos: "1.13", kubernetes: 1.31 - 1.36, cilium: 1.18.4 - 1.19}]
`))
	if err != nil {
		t.Fatal(err)
	}
	want := "a cluster without Cilium with Talos v1.13.7 and Kubernetes v1.32.0 is not in Ichor's compatibility table, which lists Cilium 1.18.4 - 1.19 with them"
	if err := tab.Supports("v1.13.7", "v1.32.0", ""); err == nil || err.Error() != want {
		t.Fatalf("Supports error = %v, want %s", err, want)
	}
	if err := tab.Supports("v1.13.7", "v1.32.0", "v1.18.3"); err == nil {
		t.Fatal("Cilium 1.18.3 is below the range 1.18.4 - 1.19")
	}
	for _, c := range []string{"v1.18.4", "v1.19.12", "1.19"} {
		if err := tab.Supports("v1.13.7", "v1.32.0", c); err != nil {
			t.Errorf("Cilium %s: %v", c, err)
		}
	}
}

func TestRange(t *testing.T) {
	tests := []struct {
		in       string
		str      string
		in1, out []string
	}{
		{"1.31 - 1.36", "1.31 - 1.36", []string{"v1.31.0", "v1.36.99", "v1.33.2-rc.0"}, []string{"v1.30.9", "v1.37.0", "v2.33.0"}},
		{"1.18", "1.18", []string{"v1.18.0", "v1.18.7"}, []string{"v1.17.99", "v1.19.0"}},
		{"1.18.4-1.19.2", "1.18.4 - 1.19.2", []string{"v1.18.4", "v1.19.2"}, []string{"v1.18.3", "v1.19.3"}},
		{" none ", "none", nil, []string{"v1.18.0"}},
	}
	for _, tt := range tests {
		r, err := ParseRange(tt.in)
		if err != nil {
			t.Fatalf("ParseRange(%q): %v", tt.in, err)
		}
		if r.String() != tt.str {
			t.Errorf("ParseRange(%q).String() = %q, want %q", tt.in, r.String(), tt.str)
		}
		for _, v := range tt.in1 {
			if !r.Contains(MustParseVersion(v)) {
				t.Errorf("%s does not contain %s", r, v)
			}
		}
		for _, v := range tt.out {
			if r.Contains(MustParseVersion(v)) {
				t.Errorf("%s contains %s", r, v)
			}
		}
	}
	for in, want := range map[string]string{
		"1.31 - ":     `range "1.31 -": "" is neither a minor like 1.31 nor a version like 1.18.4`,
		"x":           `range "x": "x" is neither a minor like 1.31 nor a version like 1.18.4`,
		"1.18.0-rc.1": `range "1.18.0-rc.1": "rc.1" is neither a minor like 1.31 nor a version like 1.18.4`,
	} {
		if _, err := ParseRange(in); err == nil || err.Error() != want {
			t.Errorf("ParseRange(%q) error = %v, want %s", in, err, want)
		}
	}
}

func TestKubernetesRangeAndTalosFor(t *testing.T) {
	tab := defaultTable(t)
	for talos, want := range map[string]string{"1.10": "1.28 - 1.33", "1.11": "1.29 - 1.34", "1.12": "1.30 - 1.35", "1.13": "1.31 - 1.36"} {
		if got := mustSpan(t, tab, must(ParseMinor(talos))).String(); got != want {
			t.Errorf("KubernetesRange(%s) = %s, want %s", talos, got, want)
		}
	}
	if _, ok := tab.KubernetesRange(Minor{1, 14}); ok {
		t.Error("KubernetesRange(1.14) found")
	}
	for k, want := range map[string]string{"1.28": "1.10", "1.33": "1.10 1.11 1.12 1.13", "1.36": "1.13", "1.37": ""} {
		var got []string
		for _, m := range tab.TalosFor(must(ParseMinor(k))) {
			got = append(got, m.String())
		}
		if strings.Join(got, " ") != want {
			t.Errorf("TalosFor(%s) = %v, want %s", k, got, want)
		}
	}
}

func TestTalosPath(t *testing.T) {
	tab := defaultTable(t)
	tests := []struct {
		from, to string
		want     []string
	}{
		{"v1.11.2", "v1.13.7", []string{"v1.12.7", "v1.13.7"}},
		{"v1.10.0", "v1.13.0", []string{"v1.11.6", "v1.12.7", "v1.13.0"}},
		{"v1.8.3", "v1.11.0", []string{"the latest 1.9 patch", "v1.10.9", "v1.11.0"}},
		{"v1.12.4", "v1.13.7", nil},
		{"v1.13.7", "v1.11.0", nil},
		{"v1.13.7", "v2.1.0", nil},
		{"v1.1.0", "v1.100.0", nil},
	}
	for _, tt := range tests {
		got := tab.TalosPath(MustParseVersion(tt.from), MustParseVersion(tt.to))
		if !slices.Equal(got, tt.want) {
			t.Errorf("TalosPath(%s, %s) = %q, want %q", tt.from, tt.to, got, tt.want)
		}
	}
}

func TestParseRejectsBadTables(t *testing.T) {
	digest := "sha256:" + strings.Repeat("ab", 32)
	ok := `ciliumChart: {repository: https://helm.cilium.io, version: 1.19.6, digest: ` + digest + `}
talos: [{minor: "1.12", latest: v1.12.7}, {minor: "1.13", latest: v1.13.7}]
combinations: [{talos: "1.12", kubernetes: "1.30", cilium: none}, {talos: "1.13", kubernetes: "1.31", cilium: "1.19"}]
`
	if _, err := Parse([]byte(ok)); err != nil {
		t.Fatalf("good table: %v", err)
	}
	tests := map[string]struct{ yaml, want string }{
		"unknown field": {ok + "extra: 1\n", `compatibility table: error unmarshaling JSON: while decoding JSON: json: unknown field "extra"`},
		"empty":         {"talos: []\n", "compatibility table: needs at least one entry in talos and in combinations"},
		"latest of another minor": {strings.Replace(ok, "latest: v1.12.7", "latest: v1.11.7", 1),
			"compatibility table: talos[0]: latest v1.11.7 is not a release of Talos 1.12"},
		"pre-release latest": {strings.Replace(ok, "latest: v1.12.7", "latest: v1.12.0-rc.1", 1),
			"compatibility table: talos[0]: latest v1.12.0-rc.1 is not a release of Talos 1.12"},
		"gap": {strings.NewReplacer(`"1.12"`, `"1.11"`, "v1.12.7", "v1.11.7").Replace(ok),
			"compatibility table: talos[1]: Talos 1.13 does not follow 1.11: list every minor, oldest first"},
		"kubernetes none": {strings.Replace(ok, `kubernetes: "1.30"`, "kubernetes: none", 1),
			"compatibility table: combinations[0]: kubernetes cannot be none"},
		"backwards range": {strings.Replace(ok, `kubernetes: "1.30"`, "kubernetes: 1.30 - 1.29", 1),
			"compatibility table: combinations[0]: kubernetes: range 1.30 - 1.29 starts after it ends"},
		"talos not listed": {strings.Replace(ok, `{talos: "1.12"`, `{talos: "1.9"`, 1),
			"compatibility table: combinations[0]: Talos 1.9 is not listed under talos"},
		"uncovered minor": {strings.Replace(ok, `{talos: "1.12"`, `{talos: "1.13"`, 1),
			"compatibility table: talos: Talos 1.12 has no combination"},
		"chart version with v": {strings.Replace(ok, "version: 1.19.6", "version: v1.19.6", 1),
			`compatibility table: ciliumChart: version "v1.19.6" is not a chart release like 1.19.6`},
		"chart pre-release": {strings.Replace(ok, "version: 1.19.6", "version: 1.19.0-rc.1", 1),
			`compatibility table: ciliumChart: version "1.19.0-rc.1" is not a chart release like 1.19.6`},
		"chart without digest": {strings.Replace(ok, digest, "sha256:abc", 1),
			`compatibility table: ciliumChart: digest "sha256:abc" is not sha256: and 64 lower-case hex digits`},
		"chart over http": {strings.Replace(ok, "https://helm", "http://helm", 1),
			`compatibility table: ciliumChart: repository "http://helm.cilium.io" is not an https:// URL`},
		"chart the newest Talos does not run": {strings.Replace(ok, `cilium: "1.19"`, `cilium: "1.20"`, 1),
			"compatibility table: ciliumChart: Cilium 1.19.6 is in no combination with Talos 1.13"},
		"bad range": {strings.Replace(ok, "cilium: none", "cilium: nothing", 1),
			`compatibility table: error unmarshaling JSON: while decoding JSON: range "nothing": "nothing" is neither a minor like 1.31 nor a version like 1.18.4`},
	}
	for name, tt := range tests {
		t.Run(name, func(t *testing.T) {
			_, err := Parse([]byte(tt.yaml))
			if err == nil || err.Error() != tt.want {
				t.Fatalf("Parse error = %v\nwant %s", err, tt.want)
			}
		})
	}
}

// A printer (kubectl ichor compat -o json) writes the table back as the
// strings of the file.
func TestDefaultCiliumChart(t *testing.T) {
	pin := defaultTable(t).CiliumChart
	if got, want := pin.URL(), "https://helm.cilium.io/cilium-"+pin.Version+".tgz"; got != want {
		t.Fatalf("URL = %s, want %s", got, want)
	}
	if got, want := pin.Archive(), "cilium-"+pin.Version+".tgz"; got != want {
		t.Fatalf("Archive = %s, want %s", got, want)
	}
}

// TestChartWithDigest: another archive's digest keeps the pin's version and
// repository; one that is not sha256 is refused, saying what it must be.
func TestChartWithDigest(t *testing.T) {
	pin := defaultTable(t).CiliumChart
	digest := "sha256:" + strings.Repeat("ab", 32)
	got, err := pin.WithDigest(digest)
	if err != nil || got.Digest != digest || got.Version != pin.Version || got.Repository != pin.Repository {
		t.Errorf("WithDigest(%s) = %+v, %v", digest, got, err)
	}
	if _, err := pin.WithDigest("md5:abc"); err == nil || !strings.Contains(err.Error(), "is not sha256: and 64 lower-case hex digits") {
		t.Errorf("WithDigest(md5:abc) = %v, want it refused", err)
	}
}

func TestTableJSON(t *testing.T) {
	tab := defaultTable(t)
	data, err := json.Marshal(tab.Combinations[0])
	if err != nil {
		t.Fatal(err)
	}
	if want := `{"talos":"1.10","kubernetes":"1.28 - 1.30","cilium":"1.16"}`; string(data) != want {
		t.Fatalf("JSON = %s, want %s", data, want)
	}
	var back Combination
	if err := json.Unmarshal(data, &back); err != nil || back != tab.Combinations[0] {
		t.Fatalf("round trip = %+v, %v", back, err)
	}
	if !strings.Contains(string(DefaultYAML()), "combinations:") {
		t.Fatal("DefaultYAML is not the table file")
	}
}

func must[T any](v T, err error) T {
	if err != nil {
		panic(err)
	}
	return v
}
