package compat

import (
	"encoding/json"
	"fmt"
	"strings"
)

// Range is a span of versions, both ends included: "1.31 - 1.36", "1.18",
// "1.18.4 - 1.19", or (Cilium only) "none" for no Cilium installed by Ichor.
type Range struct {
	// None is the "none" range: it holds no version, only a missing Cilium.
	None     bool
	Min, Max Bound
}

// Bound is one end of a Range: a whole minor ("1.36", every patch of it) or
// one patch ("1.18.4").
type Bound struct {
	Major, Minor, Patch uint
	// HasPatch says the bound is one patch, not a whole minor.
	HasPatch bool
}

// ParseRange reads a range as table.yaml spells it.
func ParseRange(s string) (Range, error) {
	s = strings.TrimSpace(s)
	if s == "none" {
		return Range{None: true}, nil
	}
	lo, hi, isSpan := strings.Cut(s, "-")
	min, err := parseBound(lo)
	if err != nil {
		return Range{}, fmt.Errorf("range %q: %w", s, err)
	}
	max := min
	if isSpan {
		if max, err = parseBound(hi); err != nil {
			return Range{}, fmt.Errorf("range %q: %w", s, err)
		}
	}
	return Range{Min: min, Max: max}, nil
}

func parseBound(s string) (Bound, error) {
	if v, err := ParseVersion(s); err == nil && v.Final() {
		return Bound{Major: v.Major, Minor: v.Minor, Patch: v.Patch, HasPatch: true}, nil
	}
	m, err := ParseMinor(s)
	if err != nil {
		return Bound{}, fmt.Errorf("%q is neither a minor like 1.31 nor a version like 1.18.4", strings.TrimSpace(s))
	}
	return Bound{Major: m.Major, Minor: m.Minor}, nil
}

func (r Range) validate() error {
	if !r.None && !r.Max.atLeast(r.Min.lowest()) {
		return fmt.Errorf("range %s starts after it ends", r)
	}
	return nil
}

// Contains reports whether the range holds the version (its pre-release and
// build metadata aside). The none range holds no version.
func (r Range) Contains(v Version) bool {
	if r.None {
		return false
	}
	core := v.Core()
	return compareCore(core, r.Min.lowest()) >= 0 && r.Max.atLeast(core)
}

// ContainsMinor reports whether the range holds some patch of the minor.
func (r Range) ContainsMinor(m Minor) bool {
	if r.None {
		return false
	}
	return m.Compare(r.Min.minor()) >= 0 && m.Compare(r.Max.minor()) <= 0
}

// String spells the range as table.yaml does.
func (r Range) String() string {
	switch {
	case r.None:
		return "none"
	case r.Min == r.Max:
		return r.Min.String()
	}
	return r.Min.String() + " - " + r.Max.String()
}

// MarshalJSON writes the range as a string.
func (r Range) MarshalJSON() ([]byte, error) { return json.Marshal(r.String()) }

// UnmarshalJSON reads a range string.
func (r *Range) UnmarshalJSON(data []byte) error {
	s, err := unquote(data)
	if err != nil {
		return err
	}
	*r, err = ParseRange(s)
	return err
}

// String spells the bound: "1.36" or "1.18.4".
func (b Bound) String() string {
	if b.HasPatch {
		return fmt.Sprintf("%d.%d.%d", b.Major, b.Minor, b.Patch)
	}
	return b.minor().String()
}

// MajorMinor is the minor the bound is in.
func (b Bound) MajorMinor() Minor { return Minor{Major: b.Major, Minor: b.Minor} }

func (b Bound) minor() Minor { return b.MajorMinor() }

// lowest is the oldest version the bound admits as a lower end.
func (b Bound) lowest() Version {
	v := Version{Major: b.Major, Minor: b.Minor}
	if b.HasPatch {
		v.Patch = b.Patch
	}
	return v
}

// atLeast reports whether v is at or below the bound as an upper end.
func (b Bound) atLeast(v Version) bool {
	if c := v.MajorMinor().Compare(b.minor()); c != 0 || !b.HasPatch {
		return c <= 0
	}
	return v.Patch <= b.Patch
}

// compare orders bounds as lower ends (a whole minor starts at its .0).
func (b Bound) compare(o Bound) int { return compareCore(b.lowest(), o.lowest()) }

// compareUpper orders bounds as upper ends (a whole minor ends after every patch).
func (b Bound) compareUpper(o Bound) int {
	if c := b.minor().Compare(o.minor()); c != 0 {
		return c
	}
	switch {
	case b.HasPatch && o.HasPatch:
		return cmpUint(uint64(b.Patch), uint64(o.Patch))
	case b.HasPatch:
		return -1
	case o.HasPatch:
		return 1
	}
	return 0
}
