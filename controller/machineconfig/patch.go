package machineconfig

import (
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"

	"github.com/siderolabs/talos/pkg/machinery/config"
	configdoc "github.com/siderolabs/talos/pkg/machinery/config/config"
	"github.com/siderolabs/talos/pkg/machinery/config/configdiff"
	"github.com/siderolabs/talos/pkg/machinery/config/configloader"
	"github.com/siderolabs/talos/pkg/machinery/config/configpatcher"
	"github.com/siderolabs/talos/pkg/machinery/config/container"
	"github.com/siderolabs/talos/pkg/machinery/config/encoder"
	"github.com/siderolabs/talos/pkg/machinery/config/types/v1alpha1"

	"maesh.dev/ichor/internal/configpatch"
)

// Patch is one change to a machine configuration: a patch an operator wrote
// (ParsePatches) or a typed change a kind makes (Typed).
type Patch struct {
	name  string
	patch configpatcher.Patch              // a strategic merge or an RFC 6902 patch, or
	typed func(cfg *v1alpha1.Config) error // a change to the v1alpha1 document
}

// Name says which patch this is in messages: "patch 2", or the typed change's name.
func (p Patch) Name() string { return p.name }

// ParsePatches reads patches as talosctl's --config-patch does
// (configpatch.Load), naming each "patch N" in its errors.
func ParsePatches(texts []string) ([]Patch, error) {
	if len(texts) == 0 {
		return nil, errors.New("no patches: give at least one machine-configuration patch")
	}
	out := make([]Patch, 0, len(texts))
	for i, text := range texts {
		name := fmt.Sprintf("patch %d", i+1)
		p, err := configpatch.Load(text)
		if err != nil {
			return nil, fmt.Errorf("%s is %w; fix it, then create a new operation", name, err)
		}
		out = append(out, Patch{name: name, patch: p})
	}
	return out, nil
}

// Typed is a change a kind makes to the v1alpha1 document, as talosctl's
// upgrade-k8s and rotate-ca do (config.Provider.PatchV1Alpha1): other
// documents are kept as they are.
func Typed(name string, change func(cfg *v1alpha1.Config) error) Patch {
	return Patch{name: name, typed: change}
}

// ApplyPatches applies patches in order to cfg and returns the result; cfg
// is not changed. Documents the patches do not touch are kept.
func ApplyPatches(cfg config.Provider, patches []Patch) (config.Provider, error) {
	for _, p := range patches {
		var err error
		if p.typed != nil {
			cfg, err = cfg.PatchV1Alpha1(p.typed)
		} else {
			cfg, err = applyOne(cfg, p.patch)
		}
		if err != nil {
			return nil, fmt.Errorf("%s does not apply: %w", p.name, err)
		}
	}
	return cfg, nil
}

func applyOne(cfg config.Provider, p configpatcher.Patch) (config.Provider, error) {
	if smp, ok := p.(configpatcher.StrategicMergePatch); ok {
		return strategicMerge(cfg, smp)
	}
	if len(cfg.Documents()) == 1 {
		return configpatcherApply(cfg, p)
	}
	return jsonPatchV1Alpha1(cfg, p)
}

func configpatcherApply(cfg config.Provider, p configpatcher.Patch) (config.Provider, error) {
	out, err := configpatcher.Apply(configpatcher.WithConfig(cfg), []configpatcher.Patch{p})
	if err != nil {
		return nil, err
	}
	return out.Config()
}

// strategicMerge is configpatcher's strategic merge, except that deleting a
// document that is not there changes nothing (configpatcher would add the
// delete selector as a document of its own), so that a delete patch applied
// twice gives the same configuration.
func strategicMerge(cfg config.Provider, p configpatcher.StrategicMergePatch) (config.Provider, error) {
	present := map[string]bool{}
	for _, d := range cfg.Documents() {
		present[documentID(d)] = true
	}
	var keep []configdoc.Document
	for _, d := range p.Documents() {
		if _, del := d.(configloader.Selector); del && !present[documentID(d)] {
			continue
		}
		keep = append(keep, d)
	}
	if len(keep) == len(p.Documents()) {
		return configpatcherApply(cfg, p)
	}
	if len(keep) == 0 {
		return cfg, nil
	}
	c, err := container.New(keep...)
	if err != nil {
		return nil, err
	}
	return configpatcherApply(cfg, configpatcher.NewStrategicMergePatch(c))
}

// documentID identifies a document as configpatcher's strategic merge does.
func documentID(d configdoc.Document) string {
	id := d.APIVersion() + "/" + d.Kind()
	if named, ok := d.(configdoc.NamedDocument); ok {
		id += "/" + named.Name()
	}
	return id
}

// jsonPatchV1Alpha1 applies an RFC 6902 patch to the v1alpha1 document of a
// multi-document configuration (its paths, /machine/..., /cluster/..., are
// that document's) and keeps the other documents. configpatcher refuses
// JSON patches on multi-document configurations, which every configuration
// generated for Talos 1.12 and later is (it carries a HostnameConfig).
func jsonPatchV1Alpha1(cfg config.Provider, p configpatcher.Patch) (config.Provider, error) {
	v1 := cfg.RawV1Alpha1()
	if v1 == nil {
		return nil, errors.New("an RFC 6902 JSON patch changes the v1alpha1 document, and this configuration has none: use a strategic merge patch")
	}
	patched, err := configpatcherApply(container.NewV1Alpha1(v1.DeepCopy()), p)
	if err != nil {
		return nil, err
	}
	pv1 := patched.RawV1Alpha1()
	if pv1 == nil || len(patched.Documents()) != 1 {
		return nil, errors.New("an RFC 6902 JSON patch must leave exactly the v1alpha1 document (use a strategic merge patch to add or remove documents)")
	}
	docs := []configdoc.Document{pv1}
	for _, d := range cfg.Documents() {
		if _, isV1 := d.(*v1alpha1.Config); !isV1 {
			docs = append(docs, d.Clone())
		}
	}
	return container.New(docs...)
}

// Encode is the configuration as ApplyConfiguration receives it: every
// document, without comments.
func Encode(cfg config.Provider) ([]byte, error) {
	b, err := cfg.EncodeBytes(encoder.WithComments(encoder.CommentsDisabled))
	if err != nil {
		return nil, fmt.Errorf("encode machine configuration: %w", err)
	}
	return b, nil
}

// Fingerprint names a configuration's content: equal for two configurations
// exactly when Diff finds nothing between them. It is 32 bits of its
// SHA-256: a machine's status of 5,000 must stay under 1 MiB, and a
// fingerprint is only ever compared with those of the same machine's
// configurations, where a false match is one in four billion.
func Fingerprint(cfg config.Provider) (string, error) {
	b, err := Encode(cfg)
	if err != nil {
		return "", err
	}
	sum := sha256.Sum256(b)
	return hex.EncodeToString(sum[:4]), nil
}

// Diff is the difference between two configurations, as Talos prints it in
// a dry run ("" when there is none).
func Diff(from, to config.Provider) (string, error) {
	d, err := configdiff.DiffConfigs(from, to)
	if err != nil {
		return "", fmt.Errorf("diff machine configurations: %w", err)
	}
	return d, nil
}
