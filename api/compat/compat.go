// Package compat holds Ichor's compatibility table (which Talos, Kubernetes
// and Cilium versions run together, and the latest patch of each Talos minor)
// and the version parsing that goes with it. The table is an embedded YAML
// file, the single source that ichor-controller's preflight checks and
// `kubectl ichor compat` read. The package does no I/O and talks to nothing.
package compat

import (
	_ "embed"
	"fmt"
	"strings"

	"sigs.k8s.io/yaml"
)

//go:embed table.yaml
var tableYAML []byte

// Table is the compatibility table.
type Table struct {
	// CiliumChart is the Cilium chart this release of Ichor ships.
	CiliumChart ChartPin `json:"ciliumChart"`
	// Talos lists the Talos minors Ichor knows, oldest first, each with its
	// latest patch.
	Talos []TalosRelease `json:"talos"`
	// Combinations are the supported Talos x Kubernetes x Cilium combinations,
	// in the file's order. A combination is supported when one entry holds it.
	Combinations []Combination `json:"combinations"`
}

// TalosRelease is one Talos minor and its latest patch.
type TalosRelease struct {
	Minor  Minor   `json:"minor"`
	Latest Version `json:"latest"`
}

// ChartPin names one chart archive exactly: where it is published, its
// version and the sha256 digest of the archive.
type ChartPin struct {
	// Repository is the Helm chart repository's URL.
	Repository string `json:"repository"`
	// Version is the chart's version, like 1.19.6 (Cilium's charts carry no v).
	Version string `json:"version"`
	// Digest is "sha256:" and the hex sha256 of the .tgz archive.
	Digest string `json:"digest"`
}

// URL is where the archive is published: <repository>/cilium-<version>.tgz.
func (p ChartPin) URL() string {
	return strings.TrimSuffix(p.Repository, "/") + "/cilium-" + p.Version + ".tgz"
}

// Archive is the archive's file name, cilium-<version>.tgz.
func (p ChartPin) Archive() string { return "cilium-" + p.Version + ".tgz" }

// WithDigest is the pin of another archive at the same chart version (a
// mirror's rebuild, the sandbox's test chart), its digest checked as the
// table's are.
func (p ChartPin) WithDigest(digest string) (ChartPin, error) {
	p.Digest = digest
	return p, p.validate()
}

func (p ChartPin) validate() error {
	v, err := ParseVersion(p.Version)
	if err != nil || !v.Final() || strings.HasPrefix(p.Version, "v") {
		return fmt.Errorf("version %q is not a chart release like 1.19.6", p.Version)
	}
	hex, ok := strings.CutPrefix(p.Digest, "sha256:")
	if !ok || len(hex) != 64 || strings.Trim(hex, "0123456789abcdef") != "" {
		return fmt.Errorf("digest %q is not sha256: and 64 lower-case hex digits", p.Digest)
	}
	if !strings.HasPrefix(p.Repository, "https://") {
		return fmt.Errorf("repository %q is not an https:// URL", p.Repository)
	}
	return nil
}

// Combination says that a Talos minor runs every Kubernetes in a range with
// every Cilium in a range (or without Cilium, when Cilium.None).
type Combination struct {
	Talos      Minor `json:"talos"`
	Kubernetes Range `json:"kubernetes"`
	Cilium     Range `json:"cilium"`
}

// Default is the table embedded in this build of Ichor. Each call returns a
// table of its own, so callers may sort or change it.
func Default() (*Table, error) { return Parse(tableYAML) }

// DefaultYAML is the embedded table file as it is written, comments included.
func DefaultYAML() []byte { return append([]byte(nil), tableYAML...) }

// Parse reads and checks a table in the YAML form of table.yaml.
func Parse(data []byte) (*Table, error) {
	var t Table
	if err := yaml.UnmarshalStrict(data, &t); err != nil {
		return nil, fmt.Errorf("compatibility table: %w", err)
	}
	if err := t.validate(); err != nil {
		return nil, fmt.Errorf("compatibility table: %w", err)
	}
	return &t, nil
}

func (t *Table) validate() error {
	if len(t.Talos) == 0 || len(t.Combinations) == 0 {
		return fmt.Errorf("needs at least one entry in talos and in combinations")
	}
	for i, r := range t.Talos {
		if r.Latest.MajorMinor() != r.Minor || !r.Latest.Final() {
			return fmt.Errorf("talos[%d]: latest %s is not a release of Talos %s", i, r.Latest, r.Minor)
		}
		if i > 0 {
			if n, ok := r.Minor.Ahead(t.Talos[i-1].Minor); !ok || n != 1 {
				return fmt.Errorf("talos[%d]: Talos %s does not follow %s: list every minor, oldest first", i, r.Minor, t.Talos[i-1].Minor)
			}
		}
	}
	if err := t.CiliumChart.validate(); err != nil {
		return fmt.Errorf("ciliumChart: %w", err)
	}
	covered := map[Minor]bool{}
	for i, c := range t.Combinations {
		if _, ok := t.Latest(c.Talos); !ok {
			return fmt.Errorf("combinations[%d]: Talos %s is not listed under talos", i, c.Talos)
		}
		if c.Kubernetes.None {
			return fmt.Errorf("combinations[%d]: kubernetes cannot be none", i)
		}
		if err := c.Kubernetes.validate(); err != nil {
			return fmt.Errorf("combinations[%d]: kubernetes: %w", i, err)
		}
		if err := c.Cilium.validate(); err != nil {
			return fmt.Errorf("combinations[%d]: cilium: %w", i, err)
		}
		covered[c.Talos] = true
	}
	for _, r := range t.Talos {
		if !covered[r.Minor] {
			return fmt.Errorf("talos: Talos %s has no combination", r.Minor)
		}
	}
	if !t.runsCilium(t.Newest().Minor, MustParseVersion(t.CiliumChart.Version)) {
		return fmt.Errorf("ciliumChart: Cilium %s is in no combination with Talos %s", t.CiliumChart.Version, t.Newest().Minor)
	}
	return nil
}

func (t *Table) runsCilium(talos Minor, cilium Version) bool {
	for _, c := range t.Combinations {
		if c.Talos == talos && !c.Cilium.None && c.Cilium.Contains(cilium) {
			return true
		}
	}
	return false
}

// Latest is the latest patch of a Talos minor, when the table knows the minor.
func (t *Table) Latest(talos Minor) (Version, bool) {
	for _, r := range t.Talos {
		if r.Minor == talos {
			return r.Latest, true
		}
	}
	return Version{}, false
}

// Oldest and Newest are the first and last Talos minors the table knows.
func (t *Table) Oldest() TalosRelease { return t.Talos[0] }

// Newest is the last Talos minor the table knows, with its latest patch.
func (t *Table) Newest() TalosRelease { return t.Talos[len(t.Talos)-1] }

// KubernetesRange is the span of Kubernetes versions the table lists with a
// Talos minor (from the lowest to the highest of its combinations).
func (t *Table) KubernetesRange(talos Minor) (Range, bool) {
	var span Range
	found := false
	for _, c := range t.Combinations {
		if c.Talos != talos {
			continue
		}
		if !found || c.Kubernetes.Min.compare(span.Min) < 0 {
			span.Min = c.Kubernetes.Min
		}
		if !found || c.Kubernetes.Max.compareUpper(span.Max) > 0 {
			span.Max = c.Kubernetes.Max
		}
		found = true
	}
	return span, found
}

// TalosFor lists, oldest first, the Talos minors the table runs a Kubernetes minor with.
func (t *Table) TalosFor(kubernetes Minor) []Minor {
	var out []Minor
	for _, r := range t.Talos {
		for _, c := range t.Combinations {
			if c.Talos == r.Minor && c.Kubernetes.ContainsMinor(kubernetes) {
				out = append(out, r.Minor)
				break
			}
		}
	}
	return out
}

// maxPath bounds TalosPath, so a typo like v1.1300.0 does not spell out a
// thousand steps.
const maxPath = 16

// TalosPath is the way from one Talos version to another a minor at a time:
// the latest patch of each minor in between (or "the latest 1.N patch" for a
// minor the table does not know), then to. It is nil when to is not ahead of
// from by two minors or more within the same major, or is too far ahead to list.
func (t *Table) TalosPath(from, to Version) []string {
	n, ok := to.MajorMinor().Ahead(from.MajorMinor())
	if !ok || n < 2 || n > maxPath {
		return nil
	}
	var path []string
	for m := from.Minor + 1; m < to.Minor; m++ {
		minor := Minor{Major: from.Major, Minor: m}
		if latest, ok := t.Latest(minor); ok {
			path = append(path, latest.String())
		} else {
			path = append(path, "the latest "+minor.String()+" patch")
		}
	}
	return append(path, to.String())
}

// Supports says whether Talos, Kubernetes and Cilium run together: nil when a
// combination of the table holds them, or an error that says which part is
// missing and what the table lists instead. Each argument is a version
// ("v1.13.7", "1.36.2") or a minor ("1.13"); cilium "" or "none" means a
// cluster without a Cilium installed by Ichor.
func (t *Table) Supports(talos, kubernetes, cilium string) error {
	tv, err := parsePoint(talos)
	if err != nil {
		return fmt.Errorf("talos: %w", err)
	}
	kv, err := parsePoint(kubernetes)
	if err != nil {
		return fmt.Errorf("kubernetes: %w", err)
	}
	var cv *point
	if c := strings.TrimSpace(cilium); c != "" && c != "none" {
		p, err := parsePoint(c)
		if err != nil {
			return fmt.Errorf("cilium: %w", err)
		}
		cv = &p
	}
	if _, ok := t.Latest(tv.v.MajorMinor()); !ok {
		return fmt.Errorf("Talos %s is not in Ichor's compatibility table, which lists Talos %s to %s",
			tv, t.Oldest().Minor, t.Newest().Minor)
	}
	var ciliums []string
	for _, c := range t.Combinations {
		if c.Talos != tv.v.MajorMinor() || !kv.in(c.Kubernetes) {
			continue
		}
		if (cv == nil && c.Cilium.None) || (cv != nil && cv.in(c.Cilium)) {
			return nil
		}
		ciliums = append(ciliums, c.Cilium.String())
	}
	if len(ciliums) == 0 {
		span, _ := t.KubernetesRange(tv.v.MajorMinor())
		return fmt.Errorf("Kubernetes %s with Talos %s is not in Ichor's compatibility table, which lists Kubernetes %s with Talos %s",
			kv, tv, span, tv.v.MajorMinor())
	}
	what := "a cluster without Cilium"
	if cv != nil {
		what = "Cilium " + cv.String()
	}
	return fmt.Errorf("%s with Talos %s and Kubernetes %s is not in Ichor's compatibility table, which lists Cilium %s with them",
		what, tv, kv, orList(ciliums))
}

// orList joins "a", "b" and "c" as "a, b or c".
func orList(items []string) string {
	if len(items) == 1 {
		return items[0]
	}
	return strings.Join(items[:len(items)-1], ", ") + " or " + items[len(items)-1]
}

// point is a version or a whole minor, as Supports takes them.
type point struct {
	v         Version
	minorOnly bool
}

func parsePoint(s string) (point, error) {
	if v, err := ParseVersion(s); err == nil {
		return point{v: v}, nil
	}
	m, err := ParseMinor(s)
	if err != nil {
		return point{}, fmt.Errorf("%q is not a version like v1.13.7 or a minor like 1.13", s)
	}
	return point{v: Version{Major: m.Major, Minor: m.Minor}, minorOnly: true}, nil
}

func (p point) in(r Range) bool {
	if p.minorOnly {
		return r.ContainsMinor(p.v.MajorMinor())
	}
	return r.Contains(p.v)
}

func (p point) String() string {
	if p.minorOnly {
		return p.v.MajorMinor().String()
	}
	return p.v.String()
}
