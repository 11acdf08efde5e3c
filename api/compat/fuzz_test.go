package compat

import (
	"strings"
	"testing"
)

// FuzzParseVersion: whatever the input, parsing never panics, and a version
// that parses spells itself back to an equal version. The seed corpus runs
// in every `go test`; `go test -fuzz FuzzParseVersion ./api/compat` explores.
func FuzzParseVersion(f *testing.F) {
	for _, s := range []string{
		"v1.13.7", "1.13.7", " v1.36.2 ", "v1.13.0-beta.1", "v1.12.4+dirty",
		"v1.13.0-rc.0+g1234", "v1.13", "V1.13.7", "v01.2.3", "v1.2.3-01",
		"v18446744073709551615.0.0", "v1.2.3-a..b", "", "Talos (v1.12.4)",
	} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, s string) {
		v, err := ParseVersion(s)
		if err != nil {
			if !strings.Contains(err.Error(), "is not a version like v1.13.7") {
				t.Fatalf("error without the expected form: %v", err)
			}
			return
		}
		back, err := ParseVersion(v.String())
		if err != nil || back != v {
			t.Fatalf("%q parsed as %+v, which spells %q and parses back as %+v, %v", s, v, v.String(), back, err)
		}
		if n, err := Normalize(s); err != nil || n != v.String() || !strings.HasPrefix(n, "v") {
			t.Fatalf("Normalize(%q) = %q, %v", s, n, err)
		}
		if v.Compare(v) != 0 || v.Compare(v.Core()) != -v.Core().Compare(v) {
			t.Fatalf("Compare is not reflexive or not antisymmetric for %s", v)
		}
		if v.Final() != (v.Compare(v.Core()) == 0 && v.Build == "") {
			t.Fatalf("Final(%s) = %v disagrees with Compare against its core", v, v.Final())
		}
	})
}

// FuzzSupports: the table answers any three strings without panicking, and
// its answer for a version does not depend on the leading v.
func FuzzSupports(f *testing.F) {
	tab := defaultTable(f)
	f.Add("v1.13.7", "v1.36.2", "v1.20.1")
	f.Add("1.13", "1.36", "none")
	f.Add("v1.14.0", "v1.31.0", "")
	f.Add("v1.10.0", "1.28.0-rc.1", "1.16.0+x")
	f.Add("v1.13.18446744073709551615", "v1.18446744073709551615.0", "1.1")
	f.Fuzz(func(t *testing.T, talos, kubernetes, cilium string) {
		err := tab.Supports(talos, kubernetes, cilium)
		with := tab.Supports(spell(talos, "v"), spell(kubernetes, "v"), spell(cilium, "v"))
		bare := tab.Supports(spell(talos, ""), spell(kubernetes, ""), spell(cilium, ""))
		if (err == nil) != (with == nil) || (with == nil) != (bare == nil) {
			t.Fatalf("Supports(%q, %q, %q) = %v; with v: %v; without: %v", talos, kubernetes, cilium, err, with, bare)
		}
	})
}

// spell writes s, when it is a version, with the given prefix; anything else
// it leaves alone.
func spell(s, prefix string) string {
	v, err := ParseVersion(s)
	if err != nil {
		return s
	}
	return prefix + strings.TrimPrefix(v.String(), "v")
}
