// Package testchart is a small chart of Ichor's own with the shape of
// Cilium's: the name cilium, the values Ichor reads and sets (ipam, cgroup,
// the agent's capabilities, kubeProxyReplacement, the KubePrism host and
// port, rollOutCiliumPods) and the objects Ichor looks at (the cilium
// DaemonSet and the cilium-config ConfigMap). Tests and the sandbox pack it
// at any version, as the controller image carries Cilium's real chart:
// cilium-<version>.tgz in a chart directory.
package testchart

import (
	"crypto/sha256"
	"embed"
	"encoding/hex"
	"fmt"
	"io/fs"
	"os"
	"path"
	"path/filepath"

	"helm.sh/helm/v4/pkg/chart/loader/archive"
	"helm.sh/helm/v4/pkg/chart/v2/loader"
	chartutil "helm.sh/helm/v4/pkg/chart/v2/util"

	"maesh.dev/ichor/api/compat"
)

//go:embed all:cilium
var files embed.FS

// Write packs the chart at version (its appVersion too) into dir as
// cilium-<version>.tgz and returns its pin: the version and the archive's
// digest, as the compatibility table pins Cilium's chart.
func Write(dir, version string) (compat.ChartPin, error) {
	var bufs []*archive.BufferedFile
	err := fs.WalkDir(files, "cilium", func(p string, d fs.DirEntry, err error) error {
		if err != nil || d.IsDir() {
			return err
		}
		data, err := files.ReadFile(p)
		if err != nil {
			return err
		}
		rel, _ := filepath.Rel("cilium", p)
		bufs = append(bufs, &archive.BufferedFile{Name: path.Clean(filepath.ToSlash(rel)), Data: data})
		return nil
	})
	if err != nil {
		return compat.ChartPin{}, err
	}
	ch, err := loader.LoadFiles(bufs)
	if err != nil {
		return compat.ChartPin{}, fmt.Errorf("load the test chart: %w", err)
	}
	ch.Metadata.Version, ch.Metadata.AppVersion = version, version
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return compat.ChartPin{}, err
	}
	file, err := chartutil.Save(ch, dir)
	if err != nil {
		return compat.ChartPin{}, fmt.Errorf("pack the test chart: %w", err)
	}
	data, err := os.ReadFile(file)
	if err != nil {
		return compat.ChartPin{}, err
	}
	sum := sha256.Sum256(data)
	return compat.ChartPin{Repository: "https://charts.invalid", Version: version, Digest: "sha256:" + hex.EncodeToString(sum[:])}, nil
}
