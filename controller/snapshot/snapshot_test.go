package snapshot_test

import (
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/json"
	"errors"
	"net/http/httptest"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

	"github.com/johannesboyne/gofakes3"
	"github.com/johannesboyne/gofakes3/backend/s3mem"
	corev1 "k8s.io/api/core/v1"

	"maesh.dev/ichor/controller/snapshot"
	"maesh.dev/ichor/controller/snapshot/snapshottest"
)

func writeFile(t *testing.T, b []byte) string {
	t.Helper()
	path := filepath.Join(t.TempDir(), "snapshot.db")
	if err := os.WriteFile(path, b, 0o600); err != nil {
		t.Fatal(err)
	}
	return path
}

var puts = []snapshottest.Put{{Rev: 2, Key: "/registry/a"}, {Rev: 3, Key: "/registry/b"}, {Rev: 4, Key: "/registry/a", Deleted: true}, {Rev: 7, Key: "/registry/c"}}

// TestVerify: a good snapshot's status; one cut short, one corrupted and
// one that is not a bbolt file each refused with what was found. Where the
// envtest assets have etcdutl, its snapshot status must agree.
func TestVerify(t *testing.T) {
	good := snapshottest.Make(t, puts...)
	st, err := snapshot.Verify(writeFile(t, good))
	if err != nil {
		t.Fatal(err)
	}
	if st.Revision != 7 || st.TotalKey != 2 || st.Version != "3.6.0" || st.TotalSize == 0 || st.TotalSize > int64(len(good)-32) || len(st.SHA256) != 64 {
		t.Fatalf("status %+v", st)
	}

	flipped := bytes.Clone(good)
	flipped[len(flipped)/2] ^= 0xff
	junk := bytes.Repeat([]byte{1}, 4096)
	sum := sha256.Sum256(junk)
	for name, c := range map[string]struct {
		b    []byte
		want string
	}{
		"truncated": {good[:len(good)-1], "not an etcd snapshot with its SHA-256"},
		"corrupted": {flipped, "SHA-256 mismatch"},
		"not bbolt": {append(junk, sum[:]...), "not a bbolt database"},
	} {
		_, err := snapshot.Verify(writeFile(t, c.b))
		if err == nil || !strings.Contains(err.Error(), c.want) {
			t.Errorf("%s: want %q, got %v", name, c.want, err)
		}
	}

	etcdutl := filepath.Join(os.Getenv("KUBEBUILDER_ASSETS"), "etcdutl")
	if _, err := os.Stat(etcdutl); err != nil {
		t.Log("no etcdutl in KUBEBUILDER_ASSETS: not compared with etcdutl")
		return
	}
	out, err := exec.Command(etcdutl, "snapshot", "status", "-w", "json", writeFile(t, good)).Output()
	if err != nil {
		t.Fatalf("etcdutl: %v", err)
	}
	var want struct {
		Hash      uint32 `json:"hash"`
		Revision  int64  `json:"revision"`
		TotalKey  int    `json:"totalKey"`
		TotalSize int64  `json:"totalSize"`
		Version   string `json:"version"`
	}
	if err := json.Unmarshal(out, &want); err != nil {
		t.Fatalf("etcdutl said %s: %v", out, err)
	}
	if st.Hash != want.Hash || st.Revision != want.Revision || st.TotalKey != want.TotalKey || st.TotalSize != want.TotalSize || st.Version != want.Version {
		t.Fatalf("ours %+v, etcdutl's %+v", st, want)
	}
}

func TestParse(t *testing.T) {
	for raw, want := range map[string]string{
		"file:///var/backup/s.db": "file  /var/backup/s.db",
		"s3://backups/etcd/s.db":  "s3 backups etcd/s.db",
		"file://relative/s.db":    "error: absolute path",
		"s3://backups":            "error: a bucket and a key",
		"s3:///key":               "error: a bucket and a key",
		"http://x/s.db":           "error: file:// or s3://",
	} {
		loc, err := snapshot.Parse(raw)
		got := loc.Scheme + " " + loc.Bucket + " " + loc.Path
		if err != nil {
			got = "error: " + err.Error()
		}
		if !strings.HasPrefix(want, "error: ") && got != want || strings.HasPrefix(want, "error: ") && !strings.Contains(got, strings.TrimPrefix(want, "error: ")) {
			t.Errorf("Parse(%q) = %q, want %q", raw, got, want)
		}
	}
}

// TestFetch: a file is read where it is; an S3 object, from a real S3
// server (gofakes3) with the Secret's credentials and endpoint, is
// downloaded and verifies; a missing file, key or bucket is ErrNotFound.
func TestFetch(t *testing.T) {
	ctx := context.Background()
	good := snapshottest.Make(t, puts...)
	path := writeFile(t, good)
	l, err := snapshot.Fetch(ctx, snapshot.Location{Scheme: "file", Path: path}, snapshot.Credentials{})
	if err != nil || l.Path != path {
		t.Fatalf("file: %v, %v", l, err)
	}
	_, err = snapshot.Fetch(ctx, snapshot.Location{Scheme: "file", Path: path + ".missing"}, snapshot.Credentials{})
	if !errors.Is(err, snapshot.ErrNotFound) {
		t.Fatalf("missing file: %v", err)
	}

	backend := s3mem.New()
	srv := httptest.NewServer(gofakes3.New(backend).Server())
	defer srv.Close()
	if err := backend.CreateBucket("backups"); err != nil {
		t.Fatal(err)
	}
	if _, err := backend.PutObject("backups", "etcd/s.db", map[string]string{}, bytes.NewReader(good), int64(len(good)), nil); err != nil {
		t.Fatal(err)
	}
	creds, err := snapshot.CredentialsFrom(&corev1.Secret{Data: map[string][]byte{
		snapshot.KeyAccessKeyID: []byte("ichor"), snapshot.KeySecretAccessKey: []byte("secret"), snapshot.KeyEndpoint: []byte(srv.URL),
	}})
	if err != nil {
		t.Fatal(err)
	}
	loc, err := snapshot.Parse("s3://backups/etcd/s.db")
	if err != nil {
		t.Fatal(err)
	}
	l, err = snapshot.Fetch(ctx, loc, creds)
	if err != nil {
		t.Fatalf("s3: %v", err)
	}
	st, err := snapshot.Verify(l.Path)
	if err != nil || st.Revision != 7 {
		t.Fatalf("downloaded snapshot: %+v, %v", st, err)
	}
	if err := l.Close(); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(l.Path); !os.IsNotExist(err) {
		t.Fatalf("the downloaded copy is still there: %v", err)
	}
	for _, raw := range []string{"s3://backups/etcd/missing.db", "s3://nobucket/etcd/s.db"} {
		loc, _ := snapshot.Parse(raw)
		if _, err := snapshot.Fetch(ctx, loc, creds); !errors.Is(err, snapshot.ErrNotFound) {
			t.Errorf("%s: want ErrNotFound, got %v", raw, err)
		}
	}

	if _, err := snapshot.CredentialsFrom(&corev1.Secret{Data: map[string][]byte{snapshot.KeyAccessKeyID: []byte("x")}}); err == nil || !strings.Contains(err.Error(), "set both") {
		t.Fatalf("half credentials: %v", err)
	}
}

// TestSave: a snapshot saved to a file is there whole, with nothing left
// beside it, and overwrites an earlier one; saved to S3 (a real S3 server,
// gofakes3) it reads back byte for byte and verifies; a missing directory
// or bucket says what is missing.
func TestSave(t *testing.T) {
	ctx := context.Background()
	good := snapshottest.Make(t, puts...)
	local := writeFile(t, good)
	dir := t.TempDir()
	dst := filepath.Join(dir, "before-shutdown.db")
	if err := os.WriteFile(dst, []byte("an older one"), 0o600); err != nil {
		t.Fatal(err)
	}
	if err := snapshot.Save(ctx, snapshot.Location{Scheme: "file", Path: dst}, snapshot.Credentials{}, local); err != nil {
		t.Fatalf("file: %v", err)
	}
	if got, err := os.ReadFile(dst); err != nil || !bytes.Equal(got, good) {
		t.Fatalf("the saved file: %d bytes (%v), want the snapshot's %d", len(got), err, len(good))
	}
	if entries, _ := os.ReadDir(dir); len(entries) != 1 {
		t.Errorf("the directory holds %d entries after the save, want the snapshot only", len(entries))
	}
	err := snapshot.Save(ctx, snapshot.Location{Scheme: "file", Path: filepath.Join(dir, "missing", "s.db")}, snapshot.Credentials{}, local)
	if err == nil || !strings.Contains(err.Error(), "no directory "+filepath.Join(dir, "missing")) {
		t.Errorf("missing directory: %v", err)
	}

	backend := s3mem.New()
	srv := httptest.NewServer(gofakes3.New(backend).Server())
	defer srv.Close()
	if err := backend.CreateBucket("backups"); err != nil {
		t.Fatal(err)
	}
	creds := snapshot.Credentials{AccessKeyID: "ichor", SecretAccessKey: "secret", Endpoint: srv.URL}
	loc, err := snapshot.Parse("s3://backups/etcd/before-shutdown.db")
	if err != nil {
		t.Fatal(err)
	}
	if err := snapshot.Save(ctx, loc, creds, local); err != nil {
		t.Fatalf("s3: %v", err)
	}
	obj, err := backend.GetObject("backups", "etcd/before-shutdown.db", nil)
	if err != nil {
		t.Fatal(err)
	}
	defer obj.Contents.Close()
	var got bytes.Buffer
	if _, err := got.ReadFrom(obj.Contents); err != nil || !bytes.Equal(got.Bytes(), good) {
		t.Fatalf("the object: %d bytes (%v), want the snapshot's %d", got.Len(), err, len(good))
	}
	loc, _ = snapshot.Parse("s3://nobucket/s.db")
	if err := snapshot.Save(ctx, loc, creds, local); !errors.Is(err, snapshot.ErrNotFound) || !strings.Contains(err.Error(), "no bucket nobucket") {
		t.Errorf("missing bucket: %v", err)
	}
}
