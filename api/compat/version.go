package compat

import (
	"encoding/json"
	"fmt"
	"strconv"
	"strings"

	utilversion "k8s.io/apimachinery/pkg/util/version"
)

// Version is a semantic version as Talos, Kubernetes and Cilium spell them:
// v1.13.7, v1.36.0-rc.1, v1.12.4+build.
type Version struct {
	Major, Minor, Patch uint
	// PreRelease is what follows "-" (rc.1), empty for a release.
	PreRelease string
	// Build is what follows "+", empty when there is none.
	Build string
}

// ParseVersion reads a version with or without its leading v ("1.13.7",
// "v1.13.7"), ignoring surrounding spaces. It wants all three numbers.
func ParseVersion(s string) (Version, error) {
	// utilversion takes the leading v and the surrounding blanks too; what it
	// refuses we refuse, with a message that shows the expected form.
	sv, err := utilversion.ParseSemantic(strings.TrimSpace(s))
	if err != nil {
		return Version{}, fmt.Errorf("%q is not a version like v1.13.7", s)
	}
	return Version{
		Major: sv.Major(), Minor: sv.Minor(), Patch: sv.Patch(),
		PreRelease: sv.PreRelease(), Build: sv.BuildMetadata(),
	}, nil
}

// MustParseVersion is ParseVersion for versions known to be good; it panics on a bad one.
func MustParseVersion(s string) Version {
	v, err := ParseVersion(s)
	if err != nil {
		panic(err)
	}
	return v
}

// Normalize returns the version in the form the TalosOperation API wants
// (with the leading v): "1.13.7" becomes "v1.13.7".
func Normalize(s string) (string, error) {
	v, err := ParseVersion(s)
	if err != nil {
		return "", err
	}
	return v.String(), nil
}

// String spells the version with its leading v.
func (v Version) String() string {
	var b strings.Builder
	fmt.Fprintf(&b, "v%d.%d.%d", v.Major, v.Minor, v.Patch)
	if v.PreRelease != "" {
		b.WriteString("-" + v.PreRelease)
	}
	if v.Build != "" {
		b.WriteString("+" + v.Build)
	}
	return b.String()
}

// Final reports whether this is a release: no pre-release and no build metadata.
func (v Version) Final() bool { return v.PreRelease == "" && v.Build == "" }

// Core is the version without pre-release and build metadata.
func (v Version) Core() Version { return Version{Major: v.Major, Minor: v.Minor, Patch: v.Patch} }

// MajorMinor is the minor release the version belongs to.
func (v Version) MajorMinor() Minor { return Minor{Major: v.Major, Minor: v.Minor} }

// Compare orders versions by semantic-version precedence (build metadata
// does not count): -1 when v is older than o, 0 when they are equal, 1 when
// v is newer.
func (v Version) Compare(o Version) int {
	if c := compareCore(v, o); c != 0 {
		return c
	}
	switch {
	case v.PreRelease == o.PreRelease:
		return 0
	case v.PreRelease == "": // a release is newer than its pre-releases
		return 1
	case o.PreRelease == "":
		return -1
	}
	return comparePreRelease(v.PreRelease, o.PreRelease)
}

// comparePreRelease follows semver 2.0.0 §11: dot-separated identifiers in
// turn, numeric ones numerically and before alphanumeric ones, and a shorter
// list first when it is a prefix of the longer.
func comparePreRelease(a, b string) int {
	as, bs := strings.Split(a, "."), strings.Split(b, ".")
	for i := 0; i < len(as) && i < len(bs); i++ {
		an, aErr := strconv.ParseUint(as[i], 10, 64)
		bn, bErr := strconv.ParseUint(bs[i], 10, 64)
		switch {
		case aErr == nil && bErr == nil:
			if an != bn {
				return cmpUint(an, bn)
			}
		case aErr == nil:
			return -1
		case bErr == nil:
			return 1
		default:
			if c := strings.Compare(as[i], bs[i]); c != 0 {
				return c
			}
		}
	}
	return cmpUint(uint64(len(as)), uint64(len(bs)))
}

func cmpUint(a, b uint64) int {
	switch {
	case a < b:
		return -1
	case a > b:
		return 1
	}
	return 0
}

func compareCore(v, o Version) int {
	for _, p := range [][2]uint{{v.Major, o.Major}, {v.Minor, o.Minor}, {v.Patch, o.Patch}} {
		if c := cmpUint(uint64(p[0]), uint64(p[1])); c != 0 {
			return c
		}
	}
	return 0
}

// MarshalJSON writes the version as a string, like "v1.13.7".
func (v Version) MarshalJSON() ([]byte, error) { return []byte(strconv.Quote(v.String())), nil }

// UnmarshalJSON reads a version string.
func (v *Version) UnmarshalJSON(data []byte) error {
	s, err := unquote(data)
	if err != nil {
		return err
	}
	*v, err = ParseVersion(s)
	return err
}

// Minor is a minor release line, like Talos 1.13 or Kubernetes 1.36.
type Minor struct {
	Major, Minor uint
}

// ParseMinor reads "1.13" or "v1.13".
func ParseMinor(s string) (Minor, error) {
	trimmed := strings.TrimPrefix(strings.TrimSpace(s), "v")
	major, minor, ok := strings.Cut(trimmed, ".")
	ma, errMa := parseNumber(major)
	mi, errMi := parseNumber(minor)
	if !ok || errMa != nil || errMi != nil {
		return Minor{}, fmt.Errorf("%q is not a minor version like 1.13", s)
	}
	return Minor{Major: ma, Minor: mi}, nil
}

// parseNumber reads a version number: digits, no sign, no leading zero.
func parseNumber(s string) (uint, error) {
	if s == "" || (len(s) > 1 && s[0] == '0') || strings.TrimLeft(s, "0123456789") != "" {
		return 0, fmt.Errorf("%q is not a version number", s)
	}
	n, err := strconv.ParseUint(s, 10, 0)
	return uint(n), err
}

// String spells the minor without a v: "1.13".
func (m Minor) String() string { return fmt.Sprintf("%d.%d", m.Major, m.Minor) }

// Compare orders minors: -1 when m is older than o, 0 when equal, 1 when newer.
func (m Minor) Compare(o Minor) int {
	return compareCore(Version{Major: m.Major, Minor: m.Minor}, Version{Major: o.Major, Minor: o.Minor})
}

// Ahead says how many minors m is ahead of o within the same major; ok is
// false when the majors differ or m is not ahead.
func (m Minor) Ahead(o Minor) (n uint, ok bool) {
	if m.Major != o.Major || m.Minor <= o.Minor {
		return 0, false
	}
	return m.Minor - o.Minor, true
}

// MarshalJSON writes the minor as a string, like "1.13".
func (m Minor) MarshalJSON() ([]byte, error) { return []byte(strconv.Quote(m.String())), nil }

// UnmarshalJSON reads a minor string.
func (m *Minor) UnmarshalJSON(data []byte) error {
	s, err := unquote(data)
	if err != nil {
		return err
	}
	*m, err = ParseMinor(s)
	return err
}

// ParseOSImage reads the Talos version out of a Node's status.nodeInfo.osImage,
// which Talos sets to "Talos (v1.12.4)".
func ParseOSImage(osImage string) (Version, error) {
	inner, ok := strings.CutPrefix(strings.TrimSpace(osImage), "Talos (")
	inner, closed := strings.CutSuffix(inner, ")")
	if !ok || !closed {
		return Version{}, fmt.Errorf("os image %q is not Talos's, which reads like \"Talos (v1.13.7)\"", osImage)
	}
	v, err := ParseVersion(inner)
	if err != nil {
		return Version{}, fmt.Errorf("os image %q: %w", osImage, err)
	}
	return v, nil
}

func unquote(data []byte) (string, error) {
	var s string
	if err := json.Unmarshal(data, &s); err != nil {
		return "", fmt.Errorf("want a string, got %s", data)
	}
	return s, nil
}
