package compat

import (
	"testing"
)

func TestParseVersion(t *testing.T) {
	tests := []struct {
		in      string
		want    Version
		wantErr string
	}{
		{in: "v1.13.7", want: Version{Major: 1, Minor: 13, Patch: 7}},
		{in: "1.13.7", want: Version{Major: 1, Minor: 13, Patch: 7}},
		{in: " v1.36.2 ", want: Version{Major: 1, Minor: 36, Patch: 2}},
		{in: "v1.13.0-beta.1", want: Version{Major: 1, Minor: 13, PreRelease: "beta.1"}},
		{in: "v1.12.4+dirty", want: Version{Major: 1, Minor: 12, Patch: 4, Build: "dirty"}},
		{in: "v1.13.0-rc.0+g1234", want: Version{Major: 1, Minor: 13, PreRelease: "rc.0", Build: "g1234"}},
		{in: "v1.13", wantErr: `"v1.13" is not a version like v1.13.7`},
		{in: "1.13.7.1", wantErr: `"1.13.7.1" is not a version like v1.13.7`},
		{in: "V1.13.7", wantErr: `"V1.13.7" is not a version like v1.13.7`},
		{in: "vv1.13.7", wantErr: `"vv1.13.7" is not a version like v1.13.7`},
		{in: "v01.13.7", wantErr: `"v01.13.7" is not a version like v1.13.7`},
		{in: "v1.13.7-", wantErr: `"v1.13.7-" is not a version like v1.13.7`},
		{in: "v1.13.7-beta.01", wantErr: `"v1.13.7-beta.01" is not a version like v1.13.7`},
		{in: "v1.13.7 extra", wantErr: `"v1.13.7 extra" is not a version like v1.13.7`},
		{in: "v1.99999999999999999999.0", wantErr: `"v1.99999999999999999999.0" is not a version like v1.13.7`},
		{in: "", wantErr: `"" is not a version like v1.13.7`},
		{in: "latest", wantErr: `"latest" is not a version like v1.13.7`},
	}
	for _, tt := range tests {
		t.Run(tt.in, func(t *testing.T) {
			got, err := ParseVersion(tt.in)
			if tt.wantErr != "" {
				if err == nil || err.Error() != tt.wantErr {
					t.Fatalf("ParseVersion(%q) = %v, %v; want error %q", tt.in, got, err, tt.wantErr)
				}
				return
			}
			if err != nil || got != tt.want {
				t.Fatalf("ParseVersion(%q) = %+v, %v; want %+v", tt.in, got, err, tt.want)
			}
		})
	}
}

func TestNormalize(t *testing.T) {
	for in, want := range map[string]string{
		"1.13.7":         "v1.13.7",
		"v1.13.7":        "v1.13.7",
		"  1.36.0-rc.1 ": "v1.36.0-rc.1",
		"1.12.4+build.5": "v1.12.4+build.5",
	} {
		got, err := Normalize(in)
		if err != nil || got != want {
			t.Errorf("Normalize(%q) = %q, %v; want %q", in, got, err, want)
		}
	}
	if got, err := Normalize("1.13"); err == nil || err.Error() != `"1.13" is not a version like v1.13.7` {
		t.Errorf(`Normalize("1.13") = %q, %v; want the not-a-version error`, got, err)
	}
}

func TestCompare(t *testing.T) {
	// Ascending, from semver 2.0.0 §11 and the versions Talos publishes.
	ordered := []string{
		"v1.0.0-alpha", "v1.0.0-alpha.1", "v1.0.0-alpha.beta", "v1.0.0-beta",
		"v1.0.0-beta.2", "v1.0.0-beta.11", "v1.0.0-rc.1", "v1.0.0",
		"v1.12.9", "v1.13.0-alpha.2", "v1.13.0-beta.0", "v1.13.0", "v1.13.7", "v2.0.0",
	}
	for i, a := range ordered {
		for j, b := range ordered {
			want := 0
			switch {
			case i < j:
				want = -1
			case i > j:
				want = 1
			}
			if got := MustParseVersion(a).Compare(MustParseVersion(b)); got != want {
				t.Errorf("%s.Compare(%s) = %d, want %d", a, b, got, want)
			}
		}
	}
	if c := MustParseVersion("v1.13.7+a").Compare(MustParseVersion("v1.13.7+b")); c != 0 {
		t.Errorf("build metadata counted in precedence: %d", c)
	}
}

func TestVersionParts(t *testing.T) {
	v := MustParseVersion("v1.13.0-rc.1+g12")
	if v.Final() || v.Core() != MustParseVersion("v1.13.0") || v.MajorMinor() != (Minor{1, 13}) {
		t.Fatalf("Final %v, Core %v, MajorMinor %v", v.Final(), v.Core(), v.MajorMinor())
	}
	if !MustParseVersion("v1.13.0").Final() {
		t.Fatal("v1.13.0 is final")
	}
}

func TestParseMinor(t *testing.T) {
	for in, want := range map[string]Minor{"1.13": {1, 13}, "v1.36": {1, 36}, " 2.0 ": {2, 0}} {
		if got, err := ParseMinor(in); err != nil || got != want {
			t.Errorf("ParseMinor(%q) = %v, %v; want %v", in, got, err, want)
		}
	}
	for _, in := range []string{"1", "1.13.7", "1.-3", "1.+3", "01.13", "1.013", "a.b", ""} {
		if got, err := ParseMinor(in); err == nil {
			t.Errorf("ParseMinor(%q) = %v, want an error", in, got)
		}
	}
	if _, err := ParseMinor("1.x"); err == nil || err.Error() != `"1.x" is not a minor version like 1.13` {
		t.Errorf("ParseMinor error = %v", err)
	}
}

func TestMinorAhead(t *testing.T) {
	tests := []struct {
		m, o  Minor
		n     uint
		ahead bool
	}{
		{Minor{1, 13}, Minor{1, 11}, 2, true},
		{Minor{1, 12}, Minor{1, 11}, 1, true},
		{Minor{1, 11}, Minor{1, 11}, 0, false},
		{Minor{1, 10}, Minor{1, 11}, 0, false},
		{Minor{2, 0}, Minor{1, 13}, 0, false},
	}
	for _, tt := range tests {
		if n, ok := tt.m.Ahead(tt.o); n != tt.n || ok != tt.ahead {
			t.Errorf("%v.Ahead(%v) = %d, %v; want %d, %v", tt.m, tt.o, n, ok, tt.n, tt.ahead)
		}
	}
}

func TestParseOSImage(t *testing.T) {
	if v, err := ParseOSImage("Talos (v1.12.4)"); err != nil || v != MustParseVersion("v1.12.4") {
		t.Fatalf("ParseOSImage = %v, %v", v, err)
	}
	for in, want := range map[string]string{
		"Ubuntu 24.04 LTS":   `os image "Ubuntu 24.04 LTS" is not Talos's, which reads like "Talos (v1.13.7)"`,
		"Talos (v1.12.4":     `os image "Talos (v1.12.4" is not Talos's, which reads like "Talos (v1.13.7)"`,
		"Talos (v1.12)":      `os image "Talos (v1.12)": "v1.12" is not a version like v1.13.7`,
		"Talos (v1.12.4) x":  `os image "Talos (v1.12.4) x" is not Talos's, which reads like "Talos (v1.13.7)"`,
		"Talos (v1.13.0-rc)": "",
	} {
		_, err := ParseOSImage(in)
		if want == "" {
			if err != nil {
				t.Errorf("ParseOSImage(%q): %v", in, err)
			}
			continue
		}
		if err == nil || err.Error() != want {
			t.Errorf("ParseOSImage(%q) error = %v, want %q", in, err, want)
		}
	}
}
