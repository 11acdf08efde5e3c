package snapshot

import (
	"context"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"net/url"
	"os"
	"path/filepath"
	"strings"

	"github.com/aws/aws-sdk-go-v2/aws"
	"github.com/aws/aws-sdk-go-v2/credentials"
	"github.com/aws/aws-sdk-go-v2/service/s3"
	s3types "github.com/aws/aws-sdk-go-v2/service/s3/types"
	"github.com/aws/smithy-go"
	corev1 "k8s.io/api/core/v1"
)

// Secret keys an S3 snapshot's credentials are read from: the names of
// the AWS SDK's environment variables.
const (
	KeyAccessKeyID     = "AWS_ACCESS_KEY_ID"
	KeySecretAccessKey = "AWS_SECRET_ACCESS_KEY"
	KeySessionToken    = "AWS_SESSION_TOKEN"
	KeyRegion          = "AWS_REGION"
	KeyEndpoint        = "AWS_ENDPOINT_URL"
)

// Credentials reach an S3 bucket. Empty keys make anonymous requests; an
// Endpoint (an S3-compatible server: MinIO, Ceph, ...) is addressed by path.
type Credentials struct {
	AccessKeyID, SecretAccessKey, SessionToken string
	Region, Endpoint                           string
}

// CredentialsFrom reads Credentials from a Secret's data.
func CredentialsFrom(s *corev1.Secret) (Credentials, error) {
	get := func(k string) string { return strings.TrimSpace(string(s.Data[k])) }
	c := Credentials{
		AccessKeyID: get(KeyAccessKeyID), SecretAccessKey: get(KeySecretAccessKey),
		SessionToken: get(KeySessionToken), Region: get(KeyRegion), Endpoint: get(KeyEndpoint),
	}
	if (c.AccessKeyID == "") != (c.SecretAccessKey == "") {
		return c, fmt.Errorf("secret %s/%s has only one of %s and %s: set both", s.Namespace, s.Name, KeyAccessKeyID, KeySecretAccessKey)
	}
	return c, nil
}

// Location is a parsed snapshot URL.
type Location struct {
	// Scheme is "file" or "s3".
	Scheme string
	// Path is the file's path (file) or the object's key (s3).
	Path string
	// Bucket is the S3 bucket.
	Bucket string
}

// Parse reads file:///abs/path and s3://bucket/key.
func Parse(raw string) (Location, error) {
	u, err := url.Parse(raw)
	if err != nil {
		return Location{}, fmt.Errorf("snapshot URL %q: %w", raw, err)
	}
	switch u.Scheme {
	case "file":
		if u.Host != "" || !strings.HasPrefix(u.Path, "/") {
			return Location{}, fmt.Errorf("snapshot URL %q: a file URL names an absolute path, as file:///var/lib/etcd-backup/snapshot.db", raw)
		}
		return Location{Scheme: "file", Path: u.Path}, nil
	case "s3":
		key := strings.TrimPrefix(u.Path, "/")
		if u.Host == "" || key == "" {
			return Location{}, fmt.Errorf("snapshot URL %q: an S3 URL names a bucket and a key, as s3://backups/etcd/snapshot.db", raw)
		}
		return Location{Scheme: "s3", Bucket: u.Host, Path: key}, nil
	}
	return Location{}, fmt.Errorf("snapshot URL %q: must be a file:// or s3:// URL", raw)
}

// Local is a snapshot on the controller's disk, to verify and upload.
type Local struct {
	Path string
	temp bool
}

// Close removes the local copy of a downloaded snapshot.
func (l *Local) Close() error {
	if l.temp {
		return os.Remove(l.Path)
	}
	return nil
}

// Fetch makes the snapshot at loc readable on local disk: a file as it
// is, an S3 object downloaded into a temporary file. A snapshot that is
// not there wraps ErrNotFound.
func Fetch(ctx context.Context, loc Location, creds Credentials) (*Local, error) {
	if loc.Scheme == "file" {
		f, err := os.Open(loc.Path)
		if errors.Is(err, fs.ErrNotExist) {
			return nil, fmt.Errorf("%w: no file %s on the controller (mount the volume that holds it)", ErrNotFound, loc.Path)
		}
		if err != nil {
			return nil, fmt.Errorf("open snapshot: %w", err)
		}
		_ = f.Close()
		return &Local{Path: loc.Path}, nil
	}
	return fetchS3(ctx, loc, creds)
}

func fetchS3(ctx context.Context, loc Location, creds Credentials) (*Local, error) {
	out, err := s3Client(creds).GetObject(ctx, &s3.GetObjectInput{Bucket: &loc.Bucket, Key: &loc.Path})
	if err != nil {
		return nil, s3Error("read", loc, err)
	}
	defer out.Body.Close()
	f, err := os.CreateTemp("", "etcd-snapshot-*.db")
	if err != nil {
		return nil, fmt.Errorf("download snapshot: %w", err)
	}
	l := &Local{Path: f.Name(), temp: true}
	_, err = io.Copy(f, out.Body)
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	if err != nil {
		_ = l.Close()
		return nil, fmt.Errorf("download s3://%s/%s: %w", loc.Bucket, loc.Path, err)
	}
	return l, nil
}

// Save stores the snapshot at local in loc: a file written beside its
// destination and renamed into place, so that a reader never finds half of
// one; an S3 object uploaded whole.
func Save(ctx context.Context, loc Location, creds Credentials, local string) error {
	src, err := os.Open(local)
	if err != nil {
		return fmt.Errorf("save snapshot: %w", err)
	}
	defer src.Close() //nolint:errcheck
	if loc.Scheme == "s3" {
		if _, err := s3Client(creds).PutObject(ctx, &s3.PutObjectInput{Bucket: &loc.Bucket, Key: &loc.Path, Body: src}); err != nil {
			return s3Error("write", loc, err)
		}
		return nil
	}
	dir := filepath.Dir(loc.Path)
	tmp, err := os.CreateTemp(dir, "."+filepath.Base(loc.Path)+".*")
	if errors.Is(err, fs.ErrNotExist) {
		return fmt.Errorf("no directory %s on the controller (mount the volume the snapshot goes to)", dir)
	}
	if err != nil {
		return fmt.Errorf("save snapshot: %w", err)
	}
	defer os.Remove(tmp.Name()) //nolint:errcheck // gone after the rename
	_, err = io.Copy(tmp, src)
	if err == nil {
		err = tmp.Sync()
	}
	if cerr := tmp.Close(); err == nil {
		err = cerr
	}
	if err == nil {
		err = os.Rename(tmp.Name(), loc.Path)
	}
	if err != nil {
		return fmt.Errorf("save snapshot to %s: %w", loc.Path, err)
	}
	return nil
}

func s3Client(c Credentials) *s3.Client {
	// Checksums only where S3 requires them: S3-compatible servers do not
	// all read the SDK's default aws-chunked uploads with trailing checksums.
	o := s3.Options{Region: c.Region, RequestChecksumCalculation: aws.RequestChecksumCalculationWhenRequired}
	if o.Region == "" {
		o.Region = "us-east-1"
	}
	if c.AccessKeyID != "" {
		o.Credentials = aws.NewCredentialsCache(credentials.NewStaticCredentialsProvider(c.AccessKeyID, c.SecretAccessKey, c.SessionToken))
	} else {
		o.Credentials = aws.AnonymousCredentials{}
	}
	if c.Endpoint != "" {
		o.BaseEndpoint = aws.String(c.Endpoint)
		o.UsePathStyle = true
	}
	return s3.New(o)
}

// s3Error says what S3 answered to a read or write, with ErrNotFound for a
// missing bucket or key.
func s3Error(verb string, loc Location, err error) error {
	var noKey *s3types.NoSuchKey
	var noBucket *s3types.NoSuchBucket
	var api smithy.APIError
	switch {
	case errors.As(err, &noKey), errors.As(err, &api) && api.ErrorCode() == "NoSuchKey":
		return fmt.Errorf("%w: no object %q in bucket %s", ErrNotFound, loc.Path, loc.Bucket)
	case errors.As(err, &noBucket), errors.As(err, &api) && api.ErrorCode() == "NoSuchBucket":
		return fmt.Errorf("%w: no bucket %s", ErrNotFound, loc.Bucket)
	case errors.As(err, &api) && api.ErrorCode() == "NotFound":
		return fmt.Errorf("%w: s3://%s/%s", ErrNotFound, loc.Bucket, loc.Path)
	case errors.As(err, &api):
		return fmt.Errorf("%s s3://%s/%s: %s: %s", verb, loc.Bucket, loc.Path, api.ErrorCode(), api.ErrorMessage())
	}
	return fmt.Errorf("%s s3://%s/%s: %w", verb, loc.Bucket, loc.Path, err)
}
