// Package snapshot fetches an etcd snapshot from where an etcd-restore
// names it (file:// or s3://) and verifies it as etcdutl's `snapshot
// status` and restore do: the SHA-256 that etcd appends to a snapshot it
// streams, the bbolt file's integrity, and what it holds (revision, hash,
// keys). It reads the bbolt file itself, so etcdutl (a tool-only module,
// built for the tests in hack/envtest/etcd) stays out of the controller.
package snapshot

import (
	"bytes"
	"crypto/sha256"
	"encoding/binary"
	"errors"
	"fmt"
	"hash/crc32"
	"io"
	"os"
	"strings"

	bolt "go.etcd.io/bbolt"
	"go.etcd.io/etcd/api/v3/mvccpb"
	"google.golang.org/protobuf/proto"
)

// Status is what a verified snapshot holds, as etcdutl's snapshot status
// reports it.
type Status struct {
	// Hash is etcdutl's hash: CRC-32C over every bucket's name, keys and values.
	Hash uint32
	// Revision is the store's revision when the snapshot was taken.
	Revision int64
	// TotalKey counts the live keys (tombstones remove theirs).
	TotalKey int
	// TotalSize is the bbolt file's size.
	TotalSize int64
	// Version is the storage version ("" before etcd 3.6).
	Version string
	// SHA256 is the trailing hash etcd appended, hex.
	SHA256 string
}

// String says what the snapshot holds in the words a refusal uses.
func (s Status) String() string {
	return fmt.Sprintf("revision %d, %d keys, hash %08x, %d bytes", s.Revision, s.TotalKey, s.Hash, s.TotalSize)
}

// Verify checks the snapshot file at path and reads its status: it must
// end in the SHA-256 of what comes before (a snapshot etcd streamed ends
// so; talosctl and etcdutl's restore check it), and be a bbolt file that
// passes bbolt's consistency check.
func Verify(path string) (Status, error) {
	sum, err := checkTrailer(path)
	if err != nil {
		return Status{}, err
	}
	st, err := readStatus(path)
	if err != nil {
		return Status{}, err
	}
	st.SHA256 = sum
	return st, nil
}

// checkTrailer verifies the trailing SHA-256 (size%512 == sha256.Size).
func checkTrailer(path string) (string, error) {
	f, err := os.Open(path)
	if err != nil {
		return "", err
	}
	defer f.Close()
	fi, err := f.Stat()
	if err != nil {
		return "", err
	}
	size := fi.Size()
	if size < sha256.Size || size%512 != sha256.Size {
		return "", fmt.Errorf("not an etcd snapshot with its SHA-256: %d bytes (a snapshot etcd streams is 512-byte pages and a 32-byte hash)", size)
	}
	h := sha256.New()
	if _, err := io.CopyN(h, f, size-sha256.Size); err != nil {
		return "", err
	}
	want := make([]byte, sha256.Size)
	if _, err := io.ReadFull(f, want); err != nil {
		return "", err
	}
	if got := h.Sum(nil); !bytes.Equal(got, want) {
		return "", fmt.Errorf("SHA-256 mismatch: the snapshot says %x, its content hashes to %x (truncated or corrupted)", want, got)
	}
	return fmt.Sprintf("%x", want), nil
}

// readStatus is etcdutl's v3Manager.Status.
func readStatus(path string) (st Status, err error) {
	db, err := bolt.Open(path, 0o400, &bolt.Options{ReadOnly: true})
	if err != nil {
		return st, fmt.Errorf("not a bbolt database: %w", err)
	}
	defer db.Close()
	h := crc32.New(crc32.MakeTable(crc32.Castagnoli))
	seen := map[string]bool{}
	err = db.View(func(tx *bolt.Tx) error {
		var problems []string
		for err := range tx.Check() {
			problems = append(problems, err.Error())
		}
		if len(problems) > 0 {
			return fmt.Errorf("integrity check failed, %d errors: %s", len(problems), strings.Join(problems, "; "))
		}
		st.TotalSize = tx.Size()
		if b := tx.Bucket([]byte("meta")); b != nil {
			st.Version = storageVersion(b.Get([]byte("storageVersion")))
		}
		c := tx.Cursor()
		for name, _ := c.First(); name != nil; name, _ = c.Next() {
			b := tx.Bucket(name)
			if b == nil {
				return fmt.Errorf("nil bucket %q", name)
			}
			h.Write(name)
			isKey := string(name) == "key"
			if err := b.ForEach(func(k, v []byte) error {
				h.Write(k)
				h.Write(v)
				if !isKey {
					return nil
				}
				return countKey(&st, seen, k, v)
			}); err != nil {
				return fmt.Errorf("bucket %q: %w", name, err)
			}
		}
		return nil
	})
	st.TotalKey = len(seen)
	st.Hash = h.Sum32()
	return st, err
}

// countKey reads one entry of the key bucket: its key is the revision
// (8 bytes main, '_', 8 bytes sub, and 't' for a tombstone), its value a
// KeyValue.
func countKey(st *Status, seen map[string]bool, k, v []byte) error {
	if len(k) < 17 || k[8] != '_' {
		return fmt.Errorf("revision key %q is not etcd's", k)
	}
	st.Revision = int64(binary.BigEndian.Uint64(k[:8]))
	var kv mvccpb.KeyValue
	if err := proto.Unmarshal(v, &kv); err != nil {
		return fmt.Errorf("value of revision %d: %w", st.Revision, err)
	}
	if len(k) == 18 && k[17] == 't' {
		delete(seen, string(kv.Key))
	} else {
		seen[string(kv.Key)] = true
	}
	return nil
}

// storageVersion is the meta bucket's storage version as etcdutl prints
// it: major.minor.patch, or "" when it is not one.
func storageVersion(v []byte) string {
	var major, minor, patch int
	if _, err := fmt.Sscanf(string(v), "%d.%d.%d", &major, &minor, &patch); err != nil {
		return ""
	}
	return fmt.Sprintf("%d.%d.%d", major, minor, patch)
}

// ErrNotFound is a snapshot that is not where the operation says.
var ErrNotFound = errors.New("snapshot not found")
