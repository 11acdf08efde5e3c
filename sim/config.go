package sim

import (
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"reflect"
	"strings"
	"sync"

	"github.com/blang/semver/v4"
	"github.com/hashicorp/go-multierror"
	"github.com/siderolabs/talos/pkg/machinery/api/machine"
	"github.com/siderolabs/talos/pkg/machinery/compatibility"
	"github.com/siderolabs/talos/pkg/machinery/config"
	"github.com/siderolabs/talos/pkg/machinery/config/configdiff"
	"github.com/siderolabs/talos/pkg/machinery/config/configloader"
	"github.com/siderolabs/talos/pkg/machinery/config/container"
	"github.com/siderolabs/talos/pkg/machinery/config/generate"
	machinetype "github.com/siderolabs/talos/pkg/machinery/config/machine"
	"github.com/siderolabs/talos/pkg/machinery/config/types/v1alpha1"
)

const (
	machineTypeControlPlane = machinetype.TypeControlPlane
	machineTypeWorker       = machinetype.TypeWorker
)

// configs generates machine configurations from the fleet's secrets. A
// generated config is immutable and shared by every machine with the same
// role, versions and installer image, so a large fleet holds a handful.
type configs struct {
	f     *Fleet
	mu    sync.Mutex
	cache map[string]config.Provider
}

func (c *configs) get(m MachineSpec, endpoint string) (config.Provider, error) {
	image := installerImage(m.Platform, m.SecureBoot, m.Schematic, m.Talos)
	key := strings.Join([]string{string(m.Role), m.Talos, m.Kubernetes, image}, "|")
	c.mu.Lock()
	defer c.mu.Unlock()
	if p, ok := c.cache[key]; ok {
		return p, nil
	}
	contract, err := config.ParseContractFromVersion(m.Talos)
	if err != nil {
		return nil, fmt.Errorf("config contract for %s: %w", m.Talos, err)
	}
	opts := []generate.Option{
		generate.WithSecretsBundle(c.f.secrets),
		generate.WithVersionContract(contract),
		generate.WithInstallImage(image),
		generate.WithInstallDisk("/dev/vda"),
	}
	if c.f.hosting != nil {
		opts = append(opts, generate.WithLocalAPIServerPort(c.f.hosting.port))
	}
	in, err := generate.NewInput(c.f.spec.Name, endpoint, m.Kubernetes, opts...)
	if err != nil {
		return nil, fmt.Errorf("generate config input: %w", err)
	}
	typ := machinetype.TypeWorker
	if m.Role == ControlPlane {
		typ = machinetype.TypeControlPlane
	}
	generated, err := in.Config(typ)
	if err != nil {
		return nil, fmt.Errorf("generate %s config: %w", m.Role, err)
	}
	// A machine holds its configuration as the bytes it was given (talosctl
	// gen config writes them with comments), loaded read-only, as Talos
	// loads it from its STATE partition: served as those bytes.
	b, err := generated.EncodeBytes()
	if err != nil {
		return nil, fmt.Errorf("encode %s config: %w", m.Role, err)
	}
	p, err := configloader.NewFromBytes(b)
	if err != nil {
		return nil, fmt.Errorf("load %s config: %w", m.Role, err)
	}
	c.cache[key] = p
	return p, nil
}

// installerImage is the installer a machine with these properties boots
// from: Image Factory's for a schematic, else the vanilla one.
func installerImage(platform string, secureBoot bool, schematic, version string) string {
	if schematic == "" {
		return "ghcr.io/siderolabs/installer:" + version
	}
	sb := ""
	if secureBoot {
		sb = "-secureboot"
	}
	return fmt.Sprintf("factory.talos.dev/%s-installer%s/%s:%s", platform, sb, schematic, version)
}

// installer is what an installer image reference says it installs.
type installer struct {
	ref        string
	version    string // "v1.13.0"
	schematic  string // "" for a non-Image-Factory installer
	secureBoot bool
}

// parseInstaller reads an installer reference. The simulated registry has
// every installer whose tag is a version; anything else is not found.
func parseInstaller(ref string) (installer, error) {
	name, _, _ := strings.Cut(ref, "@")
	slash := strings.LastIndexByte(name, '/')
	colon := strings.LastIndexByte(name, ':')
	if colon < 0 || colon < slash {
		return installer{}, fmt.Errorf("%s: not found (the simulated registry serves installers tagged with a Talos version)", ref)
	}
	repo, tag := name[:colon], name[colon+1:]
	if _, err := semver.ParseTolerant(tag); err != nil || !strings.HasPrefix(tag, "v") {
		return installer{}, fmt.Errorf("%s: not found (tag %q is not a Talos version like v1.13.0)", ref, tag)
	}
	in := installer{ref: ref, version: tag}
	parts := strings.Split(repo, "/")
	if len(parts) >= 3 && parts[0] == "factory.talos.dev" {
		flavour := parts[len(parts)-2]
		if flavour == "installer" || strings.HasSuffix(flavour, "-installer") ||
			flavour == "installer-secureboot" || strings.HasSuffix(flavour, "-installer-secureboot") {
			in.schematic = parts[len(parts)-1]
			in.secureBoot = strings.HasSuffix(flavour, "-secureboot")
		}
	}
	return in, nil
}

// resolve is parseInstaller against the fleet's registry, which lacks the
// Unpublished versions.
func (f *Fleet) resolve(ref string) (installer, error) {
	in, err := parseInstaller(ref)
	if err != nil {
		return installer{}, err
	}
	for _, v := range f.spec.Unpublished {
		if "v"+strings.TrimPrefix(v, "v") == in.version {
			return installer{}, fmt.Errorf("failed to resolve reference %q: %s: not found", ref, ref)
		}
	}
	return in, nil
}

// pinned is the digest reference a pull of ref returns.
func pinned(ref string) string {
	name, _, _ := strings.Cut(ref, "@")
	if colon := strings.LastIndexByte(name, ':'); colon > strings.LastIndexByte(name, '/') {
		name = name[:colon]
	}
	sum := sha256.Sum256([]byte(ref))
	return name + "@sha256:" + hex.EncodeToString(sum[:])
}

// checkUpgradeable is the installer's preflight: the target must accept the
// host version. Targets newer than this machinery knows are let through, as
// their own installer would judge them.
func checkUpgradeable(host, target string) error {
	t, err := compatibility.ParseTalosVersion(&machine.VersionInfo{Tag: target})
	if err != nil {
		return err
	}
	h, err := compatibility.ParseTalosVersion(&machine.VersionInfo{Tag: host})
	if err != nil {
		return err
	}
	if err := t.UpgradeableFrom(h); err != nil && !strings.Contains(err.Error(), "are not supported") {
		return err
	}
	return nil
}

// validateConfig is ApplyConfiguration's Validate and RuntimeValidate: the
// document must be a valid v1alpha1 config whose Kubernetes images the
// running Talos version supports.
func validateConfig(p config.Provider, talos string) ([]string, error) {
	if p.RawV1Alpha1() == nil {
		return nil, errors.New("the applied machine configuration doesn't contain v1alpha1 config, did you mean to patch the machine config instead?")
	}
	warnings, err := p.Validate(validationMode{})
	if err != nil {
		return warnings, err
	}
	host, err := compatibility.ParseTalosVersion(&machine.VersionInfo{Tag: talos})
	if err != nil {
		return warnings, err
	}
	// As Talos's RuntimeValidate (ValidateKubernetesImageTag, against the
	// version the machine runs), its errors gathered in a multierror.
	var errs *multierror.Error
	check := func(what, ref string) {
		v, err := v1alpha1.KubernetesVersionFromImageRef(ref)
		if err != nil {
			err = fmt.Errorf("failed to parse Kubernetes version from image reference %q: %w", ref, err)
		} else {
			err = v.SupportedWith(host)
		}
		if err != nil {
			errs = multierror.Append(errs, fmt.Errorf("%s image is not valid: %w", what, err))
		}
	}
	cfg := p.RawV1Alpha1()
	check("kubelet", cfg.Machine().Kubelet().Image())
	if cfg.Machine().Type().IsControlPlane() && cfg.ClusterConfig != nil {
		check("kube-apiserver", cfg.Cluster().APIServer().Image())
		check("kube-controller-manager", cfg.Cluster().ControllerManager().Image())
		check("kube-scheduler", cfg.Cluster().Scheduler().Image())
	}
	return warnings, errs.ErrorOrNil()
}

type validationMode struct{}

func (validationMode) String() string        { return "metal" }
func (validationMode) RequiresInstall() bool { return false }
func (validationMode) InContainer() bool     { return false }

// canApplyImmediate is Talos's Runtime.CanApplyImmediate: only the sections
// Talos applies live may differ.
func canApplyImmediate(current, next config.Provider) error {
	cur, nxt := current.RawV1Alpha1(), next.RawV1Alpha1()
	if cur == nil || nxt == nil {
		return errors.New("config is not v1alpha1")
	}
	nxt = nxt.DeepCopy()
	nxt.ConfigDebug = cur.ConfigDebug
	nxt.ClusterConfig = cur.ClusterConfig
	if nxt.MachineConfig != nil && cur.MachineConfig != nil {
		nm, cm := nxt.MachineConfig, cur.MachineConfig
		nm.MachineCA = cm.MachineCA
		nm.MachineAcceptedCAs = cm.MachineAcceptedCAs
		nm.MachineTime = cm.MachineTime //nolint:staticcheck // Talos compares it too
		nm.MachineCertSANs = cm.MachineCertSANs
		nm.MachineInstall = cm.MachineInstall
		nm.MachineNetwork = cm.MachineNetwork //nolint:staticcheck
		nm.MachineSysfs = cm.MachineSysfs
		nm.MachineSysctls = cm.MachineSysctls
		nm.MachineLogging = cm.MachineLogging
		nm.MachineControlPlane = cm.MachineControlPlane
		nm.MachineKubelet = cm.MachineKubelet
		nm.MachineKernel = cm.MachineKernel
		nm.MachineRegistries = cm.MachineRegistries //nolint:staticcheck
		nm.MachinePods = cm.MachinePods
		nm.MachineSeccompProfiles = cm.MachineSeccompProfiles
		nm.MachineNodeAnnotations = cm.MachineNodeAnnotations
		nm.MachineNodeLabels = cm.MachineNodeLabels
		nm.MachineNodeTaints = cm.MachineNodeTaints
		if nm.MachineFeatures != nil && cm.MachineFeatures != nil {
			nm.MachineFeatures.KubernetesTalosAPIAccessConfig = cm.MachineFeatures.KubernetesTalosAPIAccessConfig
			nm.MachineFeatures.KubePrismSupport = cm.MachineFeatures.KubePrismSupport
			nm.MachineFeatures.HostDNSSupport = cm.MachineFeatures.HostDNSSupport
			nm.MachineFeatures.ImageCacheSupport = cm.MachineFeatures.ImageCacheSupport
			nm.MachineFeatures.FeatureNodeAddressSortAlgorithm = cm.MachineFeatures.FeatureNodeAddressSortAlgorithm
		}
	}
	if reflect.DeepEqual(cur, nxt) {
		return nil
	}
	diff, err := configdiff.DiffConfigs(container.NewV1Alpha1(cur), container.NewV1Alpha1(nxt))
	if err != nil {
		return fmt.Errorf("error calculating diff: %w", err)
	}
	return fmt.Errorf("this config change can't be applied in immediate mode\ndiff:\n%s", diff)
}

// imageTag is the version tag of an image reference ("" if none).
func imageTag(ref string) string {
	v, err := v1alpha1.KubernetesVersionFromImageRef(ref)
	if err != nil {
		return ""
	}
	return v.String()
}
