// Package cilium is Ichor's part of Cilium: the chart this release ships
// (loaded from the controller image and checked against its pin), the values
// Talos needs, the Helm upgrade the Cilium Job runs (Helm v4's SDK), and what
// the controller reads of the Cilium that runs (its DaemonSet and
// cilium-config).
package cilium

import (
	"bytes"
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"os"
	"path/filepath"

	chartv2 "helm.sh/helm/v4/pkg/chart/v2"
	"helm.sh/helm/v4/pkg/chart/v2/loader"

	"maesh.dev/ichor/api/compat"
)

// ChartDir is where the controller image keeps the Cilium chart it ships
// (the Dockerfile puts cilium-<version>.tgz there).
const ChartDir = "/charts"

// LoadChart loads the chart pin names from dir, after checking that the
// archive is exactly the pinned one (its sha256) and that it is Cilium's
// chart at the pinned version.
func LoadChart(dir string, pin compat.ChartPin) (*chartv2.Chart, error) {
	file := filepath.Join(dir, pin.Archive())
	data, err := os.ReadFile(file)
	if err != nil {
		return nil, fmt.Errorf("the Cilium chart %s is not in this image (%w): build the image with the Dockerfile, which fetches it", pin.Version, err)
	}
	sum := sha256.Sum256(data)
	if got := "sha256:" + hex.EncodeToString(sum[:]); got != pin.Digest {
		return nil, fmt.Errorf("%s has digest %s, not the pinned %s: the image carries another archive than the one this release pins; rebuild the image", file, got, pin.Digest)
	}
	ch, err := loader.LoadArchive(bytes.NewReader(data))
	if err != nil {
		return nil, fmt.Errorf("load %s: %w", file, err)
	}
	if ch.Name() != "cilium" || ch.Metadata.Version != pin.Version {
		return nil, fmt.Errorf("%s holds chart %s %s, not cilium %s", file, ch.Name(), ch.Metadata.Version, pin.Version)
	}
	return ch, nil
}
