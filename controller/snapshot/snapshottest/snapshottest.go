// Package snapshottest writes etcd snapshots for tests: bbolt files laid
// out as etcd's backend, with the SHA-256 etcd appends.
package snapshottest

import (
	"crypto/sha256"
	"encoding/binary"
	"os"
	"path/filepath"
	"testing"

	bolt "go.etcd.io/bbolt"
	"go.etcd.io/etcd/api/v3/mvccpb"
	"google.golang.org/protobuf/proto"
)

// Put is one write in a fake store: Key at Rev, or its deletion.
type Put struct {
	Rev     int64
	Key     string
	Deleted bool
}

// Make writes a bbolt file laid out as etcd's backend (bucket
// "key" keyed by revision, bucket "meta" with the storage version) and
// appends its SHA-256 as etcd's snapshot stream does.
func Make(t testing.TB, puts ...Put) []byte {
	t.Helper()
	path := filepath.Join(t.TempDir(), "db")
	db, err := bolt.Open(path, 0o600, nil)
	if err != nil {
		t.Fatal(err)
	}
	err = db.Update(func(tx *bolt.Tx) error {
		meta, err := tx.CreateBucket([]byte("meta"))
		if err != nil {
			return err
		}
		if err := meta.Put([]byte("storageVersion"), []byte("3.6.0")); err != nil {
			return err
		}
		kb, err := tx.CreateBucket([]byte("key"))
		if err != nil {
			return err
		}
		for _, p := range puts {
			k := make([]byte, 17, 18)
			binary.BigEndian.PutUint64(k, uint64(p.Rev))
			k[8] = '_'
			if p.Deleted {
				k = append(k, 't')
			}
			v, err := proto.Marshal(&mvccpb.KeyValue{Key: []byte(p.Key), ModRevision: p.Rev, Value: []byte("v")})
			if err != nil {
				return err
			}
			if err := kb.Put(k, v); err != nil {
				return err
			}
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	if err := db.Close(); err != nil {
		t.Fatal(err)
	}
	b, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	sum := sha256.Sum256(b)
	return append(b, sum[:]...)
}

// File writes Make(puts) to a file in a test directory and returns its path.
func File(t testing.TB, puts ...Put) string {
	t.Helper()
	path := filepath.Join(t.TempDir(), "snapshot.db")
	if err := os.WriteFile(path, Make(t, puts...), 0o600); err != nil {
		t.Fatal(err)
	}
	return path
}
