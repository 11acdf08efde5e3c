package encryption_test

import (
	"context"
	"fmt"
	"os"
	"strings"
	"sync"
	"testing"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"
	"go.uber.org/zap"

	"maesh.dev/ichor/controller/encryption"
	"maesh.dev/ichor/internal/testenv"
)

var env *testenv.Env

func TestMain(m *testing.M) { os.Exit(testenv.Main(m, &env)) }

// etcdKV is a client of the test's etcd, its Secrets cleared first.
func etcdKV(t *testing.T) *clientv3.Client {
	t.Helper()
	cli, err := clientv3.New(clientv3.Config{Endpoints: []string{env.EtcdURL()}, DialTimeout: 10 * time.Second, Logger: zap.NewNop()})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = cli.Close() })
	if _, err := cli.Delete(context.Background(), encryption.SecretsPrefix, clientv3.WithPrefix()); err != nil {
		t.Fatal(err)
	}
	return cli
}

func put(t *testing.T, kv clientv3.KV, key string, value []byte) {
	t.Helper()
	if _, err := kv.Put(context.Background(), key, string(value)); err != nil {
		t.Fatal(err)
	}
}

func sealed(t *testing.T, k encryption.Key, key string, plain []byte) []byte {
	t.Helper()
	b, err := k.Encrypt(context.Background(), key, plain)
	if err != nil {
		t.Fatal(err)
	}
	return b
}

func object(i int) []byte { return append([]byte("k8s\x00"), fmt.Sprintf("secret-%d", i)...) }

// A rewrap moves every Secret under its key, page after page, keeps what
// each holds, and leaves those already under it as they are.
func TestRewrap(t *testing.T) {
	ctx := context.Background()
	kv := etcdKV(t)
	sbOld, aes := newKey(t, encryption.Secretbox), newKey(t, encryption.AESCBC)
	const n = 450 // more than two pages
	want := map[string][]byte{}
	for i := range n {
		key := fmt.Sprintf("%sns%d/s%d", encryption.SecretsPrefix, i%7, i)
		want[key] = object(i)
		switch i % 3 {
		case 0:
			put(t, kv, key, sealed(t, sbOld, key, object(i)))
		case 1:
			put(t, kv, key, object(i)) // in the clear
		default:
			put(t, kv, key, sealed(t, aes, key, object(i)))
		}
	}
	put(t, kv, "/registry/configmaps/default/c", []byte("not a Secret")) // not looked at
	outside, total, err := encryption.Outside(ctx, kv, aes, 3)
	if err != nil || total != n || len(outside) != 3 {
		t.Fatalf("before: outside %v of %d, %v", outside, total, err)
	}
	var reported int
	res, err := encryption.Rewrap{KV: kv, Ring: encryption.Ring{sbOld, aes}, To: aes, Progress: func(done, total int) {
		if total != n || done < reported {
			t.Errorf("progress %d of %d after %d", done, total, reported)
		}
		reported = done
	}}.Run(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if moved := n - n/3; res.Secrets != n || res.Moved != moved || reported != n {
		t.Errorf("result %+v, progress %d; want %d Secrets, %d moved", res, reported, n, moved)
	}
	for key, plain := range want {
		got, err := kv.Get(ctx, key)
		if err != nil {
			t.Fatal(err)
		}
		if !aes.Holds(ctx, key, got.Kvs[0].Value) {
			t.Fatalf("%s is not under the aescbc key after the rewrap", key)
		}
		if p, err := (encryption.Ring{aes}).Decrypt(ctx, key, got.Kvs[0].Value); err != nil || string(p) != string(plain) {
			t.Fatalf("%s holds %q (%v), want %q", key, p, err, plain)
		}
	}
	if outside, _, err := encryption.Outside(ctx, kv, aes, 3); err != nil || len(outside) != 0 {
		t.Errorf("after: outside %v, %v", outside, err)
	}
}

// racing is etcd where another writer writes (or deletes) a key right
// before the rewrap's compare-and-swap of it, once.
type racing struct {
	clientv3.KV
	t     *testing.T
	key   string
	value []byte // nil deletes
	once  sync.Once
}

func (r *racing) Txn(ctx context.Context) clientv3.Txn {
	r.once.Do(func() {
		if r.value == nil {
			if _, err := r.KV.Delete(ctx, r.key); err != nil {
				r.t.Error(err)
			}
			return
		}
		put(r.t, r.KV, r.key, r.value)
	})
	return r.KV.Txn(ctx)
}

// A Secret written by someone else between the rewrap's read and its
// write is read again: what they wrote is kept (re-encrypted), never
// replaced by what was read before; one deleted meanwhile stays deleted;
// one no key of the ring reads stops the rewrap, named.
func TestRewrapRaces(t *testing.T) {
	ctx := context.Background()
	sbOld, aes := newKey(t, encryption.Secretbox), newKey(t, encryption.AESCBC)
	key := encryption.SecretsPrefix + "default/raced"
	for _, tc := range []struct {
		name    string
		theirs  []byte // nil: deleted
		wantErr string
	}{
		{name: "written meanwhile", theirs: sealed(t, sbOld, key, object(99))},
		{name: "deleted meanwhile"},
		{name: "written with a key the ring lacks", theirs: sealed(t, newKey(t, encryption.Secretbox), key, object(98)), wantErr: "default/raced cannot be read"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			kv := etcdKV(t)
			put(t, kv, key, sealed(t, sbOld, key, object(1)))
			res, err := encryption.Rewrap{KV: &racing{KV: kv, t: t, key: key, value: tc.theirs}, Ring: encryption.Ring{sbOld, aes}, To: aes}.Run(ctx)
			if tc.wantErr != "" {
				if err == nil || !strings.Contains(err.Error(), tc.wantErr) {
					t.Fatalf("rewrap: %v, want an error with %q", err, tc.wantErr)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			if res.Raced != 1 {
				t.Errorf("raced %d, want 1", res.Raced)
			}
			got, err := kv.Get(ctx, key)
			if err != nil {
				t.Fatal(err)
			}
			if tc.theirs == nil {
				if len(got.Kvs) != 0 {
					t.Errorf("the deleted Secret is back: %q", got.Kvs[0].Value)
				}
				return
			}
			if p, err := (encryption.Ring{aes}).Decrypt(ctx, key, got.Kvs[0].Value); err != nil || string(p) != string(object(99)) {
				t.Errorf("holds %q (%v), want what the other writer wrote, under the aescbc key", p, err)
			}
		})
	}
}
