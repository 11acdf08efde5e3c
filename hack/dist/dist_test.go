package main

import (
	"archive/tar"
	"archive/zip"
	"bytes"
	"compress/gzip"
	"context"
	"crypto/sha256"
	"debug/elf"
	"encoding/hex"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"sigs.k8s.io/yaml"

	"maesh.dev/ichor/api/compat"
	"maesh.dev/ichor/controller/cilium"
)

// root is the repository root; go test runs in hack/dist.
var root = filepath.Join("..", "..")

// krewTools builds (or finds in the cache) kubectl-krew and
// validate-krew-manifest of krew v0.4.3, as `make dist` does.
func krewTools(t *testing.T) string {
	t.Helper()
	out, err := exec.Command(filepath.Join(root, "hack", "krew-tools.sh")).Output()
	if err != nil {
		var stderr []byte
		if ee, ok := err.(*exec.ExitError); ok {
			stderr = ee.Stderr
		}
		t.Fatalf("hack/krew-tools.sh: %v\n%s", err, stderr)
	}
	return strings.TrimSpace(string(out))
}

// TestKrew builds the linux/amd64 archive exactly as `make dist` does
// (the other five platforms only differ in GOOS/GOARCH, and cross-building
// them is slow), renders the manifest, and checks it the way krew's index
// does: validate-krew-manifest, including its install of the archive
// (served from loopback). Then `kubectl krew install --manifest --archive`
// into a temporary KREW_ROOT installs a plugin that kubectl runs.
func TestKrew(t *testing.T) {
	tools := krewTools(t)
	out := t.TempDir()
	const version = "v0.9.1-test"
	p := platform{"linux", "amd64"}
	o := options{
		Root: root, Out: out, Version: version, Platforms: []platform{p},
		Template: filepath.Join(root, "krew", "ichor.yaml.tmpl"), Manifest: filepath.Join(out, "ichor.yaml"),
		BaseURL: releaseURL + version, KrewTools: tools, ModTime: time.Unix(1700000000, 0),
	}
	var log bytes.Buffer
	if err := run(context.Background(), o, &log); err != nil {
		t.Fatalf("dist: %v\n%s", err, log.String())
	}
	archive := filepath.Join(out, p.archive(version))

	// checksums.txt holds the archive's sum, in sha256sum's format.
	sums, err := os.ReadFile(filepath.Join(out, "checksums.txt"))
	if err != nil {
		t.Fatal(err)
	}
	data, err := os.ReadFile(archive)
	if err != nil {
		t.Fatal(err)
	}
	sum := sha256.Sum256(data)
	if want := hex.EncodeToString(sum[:]) + "  " + p.archive(version) + "\n"; string(sums) != want {
		t.Errorf("checksums.txt = %q, want %q", sums, want)
	}

	// The archive holds the static, stripped binary, the LICENSE and the README.
	files := untar(t, data)
	if len(files) != 3 || files["LICENSE"] == nil || files["README.md"] == nil || files["kubectl-ichor"] == nil {
		t.Fatalf("archive holds %v, want kubectl-ichor, LICENSE and README.md", keys(files))
	}
	checkStaticStripped(t, files["kubectl-ichor"])

	// The command a user runs with a downloaded archive.
	krewRoot := t.TempDir()
	env := append(os.Environ(), "KREW_ROOT="+krewRoot, "PATH="+tools+string(os.PathListSeparator)+os.Getenv("PATH"))
	install := exec.Command("kubectl", "krew", "install", "--manifest="+o.Manifest, "--archive="+archive)
	install.Env = env
	if b, err := install.CombinedOutput(); err != nil {
		t.Fatalf("kubectl krew install: %v\n%s", err, b)
	} else if !strings.Contains(string(b), "kubectl_complete-ichor") {
		t.Errorf("krew did not show the caveats about completion:\n%s", b)
	}
	for _, f := range []string{"LICENSE", "README.md", "kubectl-ichor"} {
		if _, err := os.Stat(filepath.Join(krewRoot, "store", "ichor", version, f)); err != nil {
			t.Errorf("krew did not install %s: %v", f, err)
		}
	}
	// kubectl finds the plugin in $KREW_ROOT/bin; without a cluster it still
	// prints its own version, and says why the controller's is unknown.
	ver := exec.Command("kubectl", "ichor", "version")
	ver.Env = append(os.Environ(), "PATH="+filepath.Join(krewRoot, "bin")+string(os.PathListSeparator)+os.Getenv("PATH"),
		"KUBECONFIG="+filepath.Join(t.TempDir(), "none"))
	b, err := ver.Output()
	if err != nil {
		t.Fatalf("kubectl ichor version, installed by krew: %v\n%s", err, b)
	}
	if !strings.Contains(string(b), "Client Version: "+version+"\n") || !strings.Contains(string(b), "Controller Version: unknown") {
		t.Errorf("kubectl ichor version printed:\n%s", b)
	}
}

func untar(t *testing.T, data []byte) map[string][]byte {
	t.Helper()
	gz, err := gzip.NewReader(bytes.NewReader(data))
	if err != nil {
		t.Fatal(err)
	}
	tr := tar.NewReader(gz)
	files := map[string][]byte{}
	for {
		h, err := tr.Next()
		if err == io.EOF {
			return files
		}
		if err != nil {
			t.Fatal(err)
		}
		b, err := io.ReadAll(tr)
		if err != nil {
			t.Fatal(err)
		}
		files[h.Name] = b
	}
}

func keys(m map[string][]byte) []string {
	var out []string
	for k := range m {
		out = append(out, k)
	}
	return out
}

// checkStaticStripped: no dynamic loader or libraries (CGO_ENABLED=0) and
// no symbol table (-s -w).
func checkStaticStripped(t *testing.T, bin []byte) {
	t.Helper()
	f, err := elf.NewFile(bytes.NewReader(bin))
	if err != nil {
		t.Fatalf("kubectl-ichor is not an ELF binary: %v", err)
	}
	if f.Machine != elf.EM_X86_64 {
		t.Errorf("kubectl-ichor is built for %s, want x86-64", f.Machine)
	}
	for _, p := range f.Progs {
		if p.Type == elf.PT_INTERP {
			t.Error("kubectl-ichor asks for a dynamic loader: it is not static")
		}
	}
	if libs, _ := f.ImportedLibraries(); len(libs) > 0 {
		t.Errorf("kubectl-ichor links %v", libs)
	}
	if f.Section(".symtab") != nil || f.Section(".debug_info") != nil {
		t.Error("kubectl-ichor keeps its symbol table or debug info: build with -s -w")
	}
}

// krewManifest is the part of krew's Plugin that the tests read.
type krewManifest struct {
	Metadata struct{ Name string }
	Spec     struct {
		Version          string
		ShortDescription string `json:"shortDescription"`
		Caveats          string
		Platforms        []struct {
			Selector struct{ MatchLabels map[string]string } `json:"selector"`
			URI      string
			SHA256   string `json:"sha256"`
			Bin      string
		}
	}
}

// TestManifestTemplate renders the template for all six platforms, as a
// release does, and passes the result through krew's validator (structure,
// every platform's selector used, none overlapping). The sums here are of
// stand-in bytes: TestKrew checks real ones against a real archive.
func TestManifestTemplate(t *testing.T) {
	tools := krewTools(t)
	const version = "v1.2.3"
	var arts []artifact
	for _, p := range allPlatforms {
		sum := sha256.Sum256([]byte(p.String()))
		arts = append(arts, artifact{Platform: p, Path: filepath.Join("dist", p.archive(version)), SHA256: hex.EncodeToString(sum[:])})
	}
	out, err := render(filepath.Join(root, "krew", "ichor.yaml.tmpl"), version, releaseURL+version, arts)
	if err != nil {
		t.Fatal(err)
	}
	path := filepath.Join(t.TempDir(), "ichor.yaml")
	if err := os.WriteFile(path, out, 0o644); err != nil {
		t.Fatal(err)
	}
	if err := validate(context.Background(), tools, path, true); err != nil {
		t.Fatal(err)
	}
	var m krewManifest
	if err := yaml.Unmarshal(out, &m); err != nil {
		t.Fatal(err)
	}
	if m.Metadata.Name != "ichor" || m.Spec.Version != version {
		t.Errorf("name %q version %q", m.Metadata.Name, m.Spec.Version)
	}
	if n := len(m.Spec.ShortDescription); n == 0 || n >= 50 {
		t.Errorf("shortDescription %q has %d characters; krew-index wants under 50", m.Spec.ShortDescription, n)
	}
	for _, want := range []string{"kubectl_complete-ichor", "completion kubectl", "?ref=" + version} {
		if !strings.Contains(m.Spec.Caveats, want) {
			t.Errorf("caveats lack %q:\n%s", want, m.Spec.Caveats)
		}
	}
	if len(m.Spec.Platforms) != len(allPlatforms) {
		t.Fatalf("%d platforms, want %d", len(m.Spec.Platforms), len(allPlatforms))
	}
	for i, p := range m.Spec.Platforms {
		want := arts[i]
		sel := p.Selector.MatchLabels
		if sel["os"] != want.Platform.OS || sel["arch"] != want.Platform.Arch || p.SHA256 != want.SHA256 || p.Bin != want.Platform.bin() ||
			p.URI != "https://github.com/maesh-dev/ichor/releases/download/"+version+"/"+want.Platform.archive(version) {
			t.Errorf("platform %d: %+v, want %s %s %s", i, p, want.Platform, want.SHA256, want.Platform.archive(version))
		}
	}
}

// TestPack: both archive formats hold the files at their root, with the
// binary executable and the given time, so one commit packs the same bytes.
func TestPack(t *testing.T) {
	dir := t.TempDir()
	write := func(name, data string) string {
		p := filepath.Join(dir, name)
		if err := os.WriteFile(p, []byte(data), 0o600); err != nil {
			t.Fatal(err)
		}
		return p
	}
	mtime := time.Date(2026, 1, 2, 3, 4, 5, 0, time.UTC)
	extra := []string{write("LICENSE", "license"), write("README.md", "readme")}
	for _, p := range []platform{{"linux", "arm64"}, {"windows", "amd64"}} {
		t.Run(p.String(), func(t *testing.T) {
			bin := write(p.bin(), "binary")
			dst := filepath.Join(dir, p.archive("v1.0.0"))
			if err := pack(dst, p, bin, extra, mtime); err != nil {
				t.Fatal(err)
			}
			got := map[string]string{}
			modes := map[string]os.FileMode{}
			data, _ := os.ReadFile(dst)
			if p.OS == "windows" {
				zr, err := zip.NewReader(bytes.NewReader(data), int64(len(data)))
				if err != nil {
					t.Fatal(err)
				}
				for _, f := range zr.File {
					rc, _ := f.Open()
					b, _ := io.ReadAll(rc)
					got[f.Name], modes[f.Name] = string(b), f.Mode().Perm()
					if !f.Modified.Equal(mtime) {
						t.Errorf("%s modified %s", f.Name, f.Modified)
					}
				}
			} else {
				for name, b := range untar(t, data) {
					got[name] = string(b)
				}
				gz, _ := gzip.NewReader(bytes.NewReader(data))
				tr := tar.NewReader(gz)
				for h, err := tr.Next(); err == nil; h, err = tr.Next() {
					modes[h.Name] = os.FileMode(h.Mode).Perm()
					if !h.ModTime.Equal(mtime) {
						t.Errorf("%s modified %s", h.Name, h.ModTime)
					}
				}
			}
			want := map[string]string{p.bin(): "binary", "LICENSE": "license", "README.md": "readme"}
			if len(got) != len(want) {
				t.Fatalf("archive holds %v", got)
			}
			for name, data := range want {
				if got[name] != data {
					t.Errorf("%s = %q, want %q", name, got[name], data)
				}
			}
			if modes[p.bin()] != 0o755 || modes["LICENSE"] != 0o644 {
				t.Errorf("modes %v", modes)
			}
			again := dst + ".again"
			if err := pack(again, p, bin, extra, mtime); err != nil {
				t.Fatal(err)
			}
			if b, _ := os.ReadFile(again); !bytes.Equal(b, data) {
				t.Error("packing the same files twice gave different bytes")
			}
		})
	}
}

// TestFlags: versions krew refuses and unknown platforms are refused with
// what to do.
func TestFlags(t *testing.T) {
	for _, tc := range []struct {
		args []string
		want string // empty: accepted
	}{
		{[]string{"-version", "v0.1.0"}, ""},
		{[]string{"-version", "v0.1.0-3-gabc1234-dirty"}, ""},
		{[]string{"-version", "v0.0.0-g0123abc"}, ""},
		{[]string{"-version", "v0.1.0", "-platforms", "linux/amd64,windows/arm64"}, ""},
		{nil, "-version is required"},
		{[]string{"-version", "0.1.0"}, "leading v"},
		{[]string{"-version", "6c44aaf-dirty"}, "leading v"},
		{[]string{"-version", "v1.2"}, "not a semantic version"},
		{[]string{"-version", "v0.1.0", "-platforms", "plan9/amd64"}, `platform "plan9/amd64"`},
		{[]string{"-version", "v0.1.0", "-platforms", "linux"}, `platform "linux"`},
	} {
		t.Run(strings.Join(tc.args, " "), func(t *testing.T) {
			_, err := parseFlags(tc.args)
			switch {
			case tc.want == "" && err != nil:
				t.Errorf("refused: %v", err)
			case tc.want != "" && (err == nil || !strings.Contains(err.Error(), tc.want)):
				t.Errorf("error %v, want one with %q", err, tc.want)
			}
		})
	}
}

// TestDeploymentImage: the installed Deployment runs the controller image
// of a release version, and that tag is set in one place, the
// kustomization's images: entry, which `make release` checks.
func TestDeploymentImage(t *testing.T) {
	out, err := exec.Command("kubectl", "kustomize", filepath.Join(root, "manifests")).Output()
	if err != nil {
		t.Fatalf("kubectl kustomize manifests: %v", err)
	}
	var images []string
	for _, doc := range strings.Split(string(out), "\n---\n") {
		var obj struct {
			Kind string
			Spec struct {
				Template struct {
					Spec struct{ Containers []struct{ Image string } }
				}
			}
		}
		if err := yaml.Unmarshal([]byte(doc), &obj); err != nil {
			t.Fatal(err)
		}
		if obj.Kind == "Deployment" {
			for _, c := range obj.Spec.Template.Spec.Containers {
				images = append(images, c.Image)
			}
		}
	}
	if len(images) != 1 {
		t.Fatalf("images of the Deployments: %v, want one", images)
	}
	name, tag, _ := strings.Cut(images[0], ":")
	if name != "ghcr.io/maesh-dev/ichor-controller" || checkVersion(tag) != nil || strings.Contains(tag, "-") {
		t.Errorf("the Deployment runs %q, want ghcr.io/maesh-dev/ichor-controller:vX.Y.Z", images[0])
	}
	raw, err := os.ReadFile(filepath.Join(root, "manifests", "controller", "deployment.yaml"))
	if err != nil {
		t.Fatal(err)
	}
	if strings.Contains(string(raw), "ichor-controller:") {
		t.Error("deployment.yaml names an image tag: set it in manifests/controller/kustomization.yaml (images:) only")
	}
}

// TestImageSources: the Dockerfile copies every directory of the main
// module that ichor-controller is built from; a new dependency elsewhere
// would break `make image`, which no test can run here.
func TestImageSources(t *testing.T) {
	docker, err := os.ReadFile(filepath.Join(root, "Dockerfile"))
	if err != nil {
		t.Fatal(err)
	}
	var copied []string
	for _, line := range strings.Split(string(docker), "\n") {
		f := strings.Fields(line)
		if len(f) == 3 && f[0] == "COPY" && strings.HasSuffix(f[1], "/") {
			copied = append(copied, f[1])
		}
	}
	cmd := exec.Command("go", "list", "-deps", "-f", "{{.ImportPath}}", "./controller")
	cmd.Dir = root
	out, err := cmd.Output()
	if err != nil {
		t.Fatal(err)
	}
	for _, pkg := range strings.Fields(string(out)) {
		rel, ok := strings.CutPrefix(pkg, "maesh.dev/ichor/")
		if !ok {
			continue
		}
		found := false
		for _, c := range copied {
			found = found || strings.HasPrefix(rel+"/", c)
		}
		if !found {
			t.Errorf("ichor-controller imports %s, which the Dockerfile does not copy (it copies %v)", pkg, copied)
		}
	}
	if !strings.Contains(string(docker), "CGO_ENABLED=0") || !strings.Contains(string(docker), "distroless/static") || !strings.Contains(string(docker), "USER 65532") {
		t.Error("the image must be a static binary on distroless/static, run as a non-root user")
	}
}

// TestImageShipsTheCiliumChart: the Dockerfile fetches the chart the
// compatibility table pins, checks its digest, and puts it where the
// controller loads it from.
func TestImageShipsTheCiliumChart(t *testing.T) {
	docker, err := os.ReadFile(filepath.Join(root, "Dockerfile"))
	if err != nil {
		t.Fatal(err)
	}
	for _, want := range []string{"$(go run ./hack/chartpin)", "sha256sum -c -", "COPY --from=build /out/charts/ " + cilium.ChartDir + "/"} {
		if !strings.Contains(string(docker), want) {
			t.Errorf("the Dockerfile does not say %q", want)
		}
	}
	run := exec.Command("go", "run", "./hack/chartpin")
	run.Dir = root
	out, err := run.Output()
	if err != nil {
		t.Fatal(err)
	}
	table, err := compat.Default()
	if err != nil {
		t.Fatal(err)
	}
	p := table.CiliumChart
	if got, want := strings.TrimSpace(string(out)), p.URL()+" "+p.Digest+" "+p.Archive(); got != want {
		t.Fatalf("hack/chartpin prints %q, want %q", got, want)
	}
}
