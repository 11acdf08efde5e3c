// Command dist builds what a release of kubectl-ichor ships through krew:
// the plugin cross-built for each platform (static, stripped), one archive
// per platform with the LICENSE and README.md, their sha256 sums, and
// krew/ichor.yaml rendered from krew/ichor.yaml.tmpl with those sums. With
// -krew-tools it then checks the manifest with krew's own validator and
// installs every archive with krew, served from loopback.
//
// `make dist` runs it; its tests build linux/amd64 only.
package main

import (
	"archive/tar"
	"archive/zip"
	"bytes"
	"compress/gzip"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"flag"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"text/template"
	"time"

	utilversion "k8s.io/apimachinery/pkg/util/version"
)

// platform is a GOOS/GOARCH pair, which krew calls os/arch.
type platform struct{ OS, Arch string }

func (p platform) String() string { return p.OS + "/" + p.Arch }

// bin is the plugin's file name on the platform.
func (p platform) bin() string {
	if p.OS == "windows" {
		return "kubectl-ichor.exe"
	}
	return "kubectl-ichor"
}

func (p platform) archive(version string) string {
	ext := ".tar.gz"
	if p.OS == "windows" {
		ext = ".zip"
	}
	return fmt.Sprintf("kubectl-ichor_%s_%s_%s%s", version, p.OS, p.Arch, ext)
}

// allPlatforms are the platforms a release ships.
var allPlatforms = []platform{
	{"linux", "amd64"}, {"linux", "arm64"},
	{"darwin", "amd64"}, {"darwin", "arm64"},
	{"windows", "amd64"}, {"windows", "arm64"},
}

func parsePlatforms(s string) ([]platform, error) {
	if s == "" || s == "all" {
		return allPlatforms, nil
	}
	var out []platform
	for _, f := range strings.Split(s, ",") {
		goos, goarch, ok := strings.Cut(strings.TrimSpace(f), "/")
		p := platform{goos, goarch}
		if !ok || !supported(p) {
			return nil, fmt.Errorf("platform %q: use os/arch, one of %v", f, allPlatforms)
		}
		out = append(out, p)
	}
	return out, nil
}

func supported(p platform) bool {
	for _, a := range allPlatforms {
		if a == p {
			return true
		}
	}
	return false
}

// releaseURL is where a release's archives are downloaded from.
const releaseURL = "https://github.com/maesh-dev/ichor/releases/download/"

// options are the command line.
type options struct {
	Root      string
	Out       string
	Version   string
	Platforms []platform
	Template  string
	Manifest  string
	BaseURL   string
	KrewTools string
	// ModTime is the time stamped on the files in the archives, so that the
	// same commit packs the same bytes.
	ModTime time.Time
}

func main() {
	ctx := context.Background()
	o, err := parseFlags(os.Args[1:])
	if err != nil {
		fmt.Fprintln(os.Stderr, "dist:", err)
		os.Exit(2)
	}
	if err := run(ctx, o, os.Stdout); err != nil {
		fmt.Fprintln(os.Stderr, "dist:", err)
		os.Exit(1)
	}
}

func parseFlags(args []string) (options, error) {
	var o options
	var platforms string
	var mtime int64
	fs := flag.NewFlagSet("dist", flag.ContinueOnError)
	fs.StringVar(&o.Root, "root", ".", "repository root")
	fs.StringVar(&o.Out, "out", "dist", "directory for the archives and checksums.txt")
	fs.StringVar(&o.Version, "version", "", "version to stamp and release, like v0.1.0 (krew needs a semantic version with its v)")
	fs.StringVar(&platforms, "platforms", "all", "comma-separated os/arch list, or all: "+fmt.Sprint(allPlatforms))
	fs.StringVar(&o.Template, "template", "krew/ichor.yaml.tmpl", "the krew manifest template")
	fs.StringVar(&o.Manifest, "manifest", "krew/ichor.yaml", "where to write the rendered krew manifest")
	fs.StringVar(&o.BaseURL, "base-url", "", "URL the archives are downloaded from (default "+releaseURL+"VERSION)")
	fs.StringVar(&o.KrewTools, "krew-tools", "", "directory with kubectl-krew and validate-krew-manifest (hack/krew-tools.sh); empty skips the checks")
	fs.Int64Var(&mtime, "mtime", 0, "Unix time stamped on the archived files (make passes the commit's)")
	if err := fs.Parse(args); err != nil {
		return o, err
	}
	if fs.NArg() > 0 {
		return o, fmt.Errorf("unexpected arguments %q", fs.Args())
	}
	var err error
	if o.Platforms, err = parsePlatforms(platforms); err != nil {
		return o, err
	}
	if err := checkVersion(o.Version); err != nil {
		return o, err
	}
	if o.BaseURL == "" {
		o.BaseURL = releaseURL + o.Version
	}
	o.ModTime = time.Unix(mtime, 0).UTC()
	return o, nil
}

// checkVersion accepts what krew accepts: a semantic version with its v.
func checkVersion(v string) error {
	if v == "" {
		return errors.New("-version is required (make dist passes VERSION, from git describe)")
	}
	if !strings.HasPrefix(v, "v") {
		return fmt.Errorf("version %q: krew needs the leading v, like v0.1.0", v)
	}
	if _, err := utilversion.ParseSemantic(strings.TrimPrefix(v, "v")); err != nil {
		return fmt.Errorf("version %q is not a semantic version, which krew needs: %w", v, err)
	}
	return nil
}

func run(ctx context.Context, o options, stdout io.Writer) error {
	if err := os.MkdirAll(o.Out, 0o755); err != nil {
		return err
	}
	arts, err := buildAll(ctx, o, stdout)
	if err != nil {
		return err
	}
	if err := writeSums(filepath.Join(o.Out, "checksums.txt"), arts); err != nil {
		return err
	}
	manifest, err := render(o.Template, o.Version, o.BaseURL, arts)
	if err != nil {
		return err
	}
	if err := os.WriteFile(o.Manifest, manifest, 0o644); err != nil {
		return err
	}
	fmt.Fprintf(stdout, "wrote %s and %s\n", filepath.Join(o.Out, "checksums.txt"), o.Manifest)
	if o.KrewTools == "" {
		return nil
	}
	if err := validate(ctx, o.KrewTools, o.Manifest, true); err != nil {
		return err
	}
	if err := installAll(ctx, o, arts); err != nil {
		return err
	}
	fmt.Fprintf(stdout, "%s passes validate-krew-manifest, and krew installs each of the %d archives\n", o.Manifest, len(arts))
	return nil
}

// artifact is one platform's archive.
type artifact struct {
	Platform platform
	// Path is the archive's path, SHA256 its hex sum.
	Path   string
	SHA256 string
}

func buildAll(ctx context.Context, o options, stdout io.Writer) ([]artifact, error) {
	tmp, err := os.MkdirTemp("", "ichor-dist-")
	if err != nil {
		return nil, err
	}
	defer os.RemoveAll(tmp)
	extra := []string{filepath.Join(o.Root, "LICENSE"), filepath.Join(o.Root, "README.md")}
	var arts []artifact
	for _, p := range o.Platforms {
		fmt.Fprintf(stdout, "building kubectl-ichor %s for %s\n", o.Version, p)
		bin, err := buildPlugin(ctx, o.Root, o.Version, p, filepath.Join(tmp, p.OS+"-"+p.Arch))
		if err != nil {
			return nil, err
		}
		a := artifact{Platform: p, Path: filepath.Join(o.Out, p.archive(o.Version))}
		if err := pack(a.Path, p, bin, extra, o.ModTime); err != nil {
			return nil, fmt.Errorf("pack %s: %w", p, err)
		}
		if a.SHA256, err = sha256File(a.Path); err != nil {
			return nil, err
		}
		arts = append(arts, a)
	}
	return arts, nil
}

// buildPlugin cross-builds kubectl-ichor: static (no cgo), stripped, no
// local paths, with the version stamped.
func buildPlugin(ctx context.Context, root, version string, p platform, dir string) (string, error) {
	out := filepath.Join(dir, p.bin())
	cmd := exec.CommandContext(ctx, "go", "build", "-trimpath",
		"-ldflags", "-s -w -X maesh.dev/ichor/internal/version.Version="+version,
		"-o", out, "./plugin")
	cmd.Dir = root
	cmd.Env = append(os.Environ(), "CGO_ENABLED=0", "GOOS="+p.OS, "GOARCH="+p.Arch)
	if b, err := cmd.CombinedOutput(); err != nil {
		return "", fmt.Errorf("build kubectl-ichor for %s: %w\n%s", p, err, b)
	}
	return out, nil
}

// pack writes the binary and the extra files, side by side at the root, into
// a .tar.gz (a .zip for windows).
func pack(dst string, p platform, bin string, extra []string, mtime time.Time) error {
	type entry struct {
		name string
		mode os.FileMode
		data []byte
	}
	var entries []entry
	for i, path := range append([]string{bin}, extra...) {
		data, err := os.ReadFile(path)
		if err != nil {
			return err
		}
		mode := os.FileMode(0o644)
		if i == 0 {
			mode = 0o755
		}
		entries = append(entries, entry{filepath.Base(path), mode, data})
	}
	var buf bytes.Buffer
	if p.OS == "windows" {
		zw := zip.NewWriter(&buf)
		for _, e := range entries {
			h := &zip.FileHeader{Name: e.name, Method: zip.Deflate, Modified: mtime}
			h.SetMode(e.mode)
			w, err := zw.CreateHeader(h)
			if err != nil {
				return err
			}
			if _, err := w.Write(e.data); err != nil {
				return err
			}
		}
		if err := zw.Close(); err != nil {
			return err
		}
	} else {
		gz := gzip.NewWriter(&buf)
		tw := tar.NewWriter(gz)
		for _, e := range entries {
			h := &tar.Header{Name: e.name, Mode: int64(e.mode), Size: int64(len(e.data)), ModTime: mtime, Typeflag: tar.TypeReg, Format: tar.FormatPAX}
			if err := tw.WriteHeader(h); err != nil {
				return err
			}
			if _, err := tw.Write(e.data); err != nil {
				return err
			}
		}
		if err := tw.Close(); err != nil {
			return err
		}
		if err := gz.Close(); err != nil {
			return err
		}
	}
	return os.WriteFile(dst, buf.Bytes(), 0o644)
}

func sha256File(path string) (string, error) {
	f, err := os.Open(path)
	if err != nil {
		return "", err
	}
	defer f.Close()
	h := sha256.New()
	if _, err := io.Copy(h, f); err != nil {
		return "", err
	}
	return hex.EncodeToString(h.Sum(nil)), nil
}

// writeSums writes the sums in sha256sum's format, so that
// `sha256sum -c checksums.txt` checks a download.
func writeSums(path string, arts []artifact) error {
	var b strings.Builder
	for _, a := range arts {
		fmt.Fprintf(&b, "%s  %s\n", a.SHA256, filepath.Base(a.Path))
	}
	return os.WriteFile(path, []byte(b.String()), 0o644)
}

// manifestData is what the template sees.
type manifestData struct {
	Version   string
	Platforms []manifestPlatform
}

type manifestPlatform struct {
	OS, Arch, URI, SHA256, Bin string
}

func render(tmplPath, version, baseURL string, arts []artifact) ([]byte, error) {
	src, err := os.ReadFile(tmplPath)
	if err != nil {
		return nil, err
	}
	t, err := template.New(filepath.Base(tmplPath)).Option("missingkey=error").Parse(string(src))
	if err != nil {
		return nil, fmt.Errorf("parse %s: %w", tmplPath, err)
	}
	data := manifestData{Version: version}
	for _, a := range arts {
		data.Platforms = append(data.Platforms, manifestPlatform{
			OS: a.Platform.OS, Arch: a.Platform.Arch, SHA256: a.SHA256, Bin: a.Platform.bin(),
			URI: strings.TrimSuffix(baseURL, "/") + "/" + filepath.Base(a.Path),
		})
	}
	var out bytes.Buffer
	if err := t.Execute(&out, data); err != nil {
		return nil, fmt.Errorf("render %s: %w", tmplPath, err)
	}
	return out.Bytes(), nil
}

// validate runs krew's validate-krew-manifest. Without skipInstall it
// installs every platform with `kubectl krew install`, downloading from the
// manifest's URIs, so kubectl-krew must be on PATH.
func validate(ctx context.Context, tools, manifest string, skipInstall bool) error {
	args := []string{"-manifest", manifest}
	if skipInstall {
		args = append(args, "-skip-install")
	}
	cmd := exec.CommandContext(ctx, filepath.Join(tools, "validate-krew-manifest"), args...)
	cmd.Env = append(os.Environ(), "PATH="+tools+string(os.PathListSeparator)+os.Getenv("PATH"))
	if b, err := cmd.CombinedOutput(); err != nil {
		return fmt.Errorf("validate-krew-manifest %s: %w\n%s", strings.Join(args, " "), err, logLines(b))
	}
	return nil
}

// klogLine is the header of a klog line, like "F1130 03:26:48.053190".
var klogLine = regexp.MustCompile(`^[IWEF]\d{4} `)

// logLines keeps the validator's log lines and drops the goroutine dump
// that klog's Fatal adds.
func logLines(out []byte) string {
	var keep []string
	for _, l := range strings.Split(string(out), "\n") {
		if klogLine.MatchString(l) {
			keep = append(keep, l)
		}
	}
	if len(keep) == 0 {
		return string(out)
	}
	return strings.Join(keep, "\n")
}

// installAll serves the archives from loopback, renders a copy of the
// manifest that points there, and lets validate-krew-manifest install each
// platform with krew: every archive unpacks, matches its sum, and holds
// the binary and a LICENSE.
func installAll(ctx context.Context, o options, arts []artifact) error {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return err
	}
	srv := &http.Server{Handler: http.FileServer(http.Dir(o.Out)), ReadHeaderTimeout: 10 * time.Second}
	go func() { _ = srv.Serve(ln) }()
	defer srv.Close()
	dir, err := os.MkdirTemp("", "ichor-krew-")
	if err != nil {
		return err
	}
	defer os.RemoveAll(dir)
	local, err := render(o.Template, o.Version, "http://"+ln.Addr().String(), arts)
	if err != nil {
		return err
	}
	// The validator takes the plugin's name from the file's.
	path := filepath.Join(dir, "ichor.yaml")
	if err := os.WriteFile(path, local, 0o644); err != nil {
		return err
	}
	return validate(ctx, o.KrewTools, path, false)
}
