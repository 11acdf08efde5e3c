package encryption

import (
	"context"
	"fmt"
	"strings"

	"go.etcd.io/etcd/api/v3/mvccpb"
	clientv3 "go.etcd.io/etcd/client/v3"
)

// SecretsPrefix is where kube-apiserver keeps Secrets in etcd (its default
// --etcd-prefix, which Talos keeps).
const SecretsPrefix = "/registry/secrets/"

// pageSize bounds one range read: a cluster's Secrets are read a page at
// a time, not all at once.
const pageSize = 200

// Rewrap moves the Secrets stored in etcd under to.
type Rewrap struct {
	// KV is etcd.
	KV clientv3.KV
	// Ring reads what is stored: every key the Secrets may be under.
	Ring Ring
	// To is the key every Secret ends under.
	To Key
	// Progress, when set, is told how many Secrets were looked at of how
	// many there were when the rewrap began.
	Progress func(done, total int)
}

// Result is what a rewrap did.
type Result struct {
	// Secrets is how many Secrets it looked at; Moved how many it
	// re-encrypted under the key (the others were under it already).
	Secrets, Moved int
	// Raced counts the Secrets written by someone else between its read
	// and its write: their new value was looked at again, never replaced
	// unseen.
	Raced int
}

func (r Result) String() string {
	s := fmt.Sprintf("%d Secrets, %d re-encrypted", r.Secrets, r.Moved)
	if r.Raced > 0 {
		s += fmt.Sprintf(" (%d written by others meanwhile, read again)", r.Raced)
	}
	return s
}

// Run re-encrypts under To every Secret that is not: each read with the
// ring, encrypted with To and written back only if etcd still holds what
// was read (a transaction on its mod revision). A Secret someone wrote
// meanwhile is read again and looked at anew; one deleted meanwhile is
// left deleted. Secrets created after the run passed their key are not
// its business: the caller runs it again where that matters.
func (w Rewrap) Run(ctx context.Context) (Result, error) {
	var res Result
	total, err := Count(ctx, w.KV)
	if err != nil {
		return res, err
	}
	err = eachSecret(ctx, w.KV, func(kv *mvccpb.KeyValue) error {
		moved, raced, err := w.one(ctx, string(kv.Key), kv.Value, kv.ModRevision, kv.Lease)
		if err != nil {
			return err
		}
		res.Secrets++
		res.Raced += raced
		if moved {
			res.Moved++
		}
		if w.Progress != nil {
			w.Progress(res.Secrets, max(total, res.Secrets))
		}
		return nil
	})
	return res, err
}

// eachSecret calls f with every Secret stored in etcd, a page at a time.
func eachSecret(ctx context.Context, kv clientv3.KV, f func(*mvccpb.KeyValue) error) error {
	end := clientv3.GetPrefixRangeEnd(SecretsPrefix)
	for from := SecretsPrefix; ; {
		page, err := kv.Get(ctx, from, clientv3.WithRange(end), clientv3.WithLimit(pageSize))
		if err != nil {
			return fmt.Errorf("read Secrets from etcd at %s: %w", from, err)
		}
		for _, item := range page.Kvs {
			if err := f(item); err != nil {
				return err
			}
		}
		if !page.More || len(page.Kvs) == 0 {
			return nil
		}
		from = string(page.Kvs[len(page.Kvs)-1].Key) + "\x00"
	}
}

// one moves the Secret at key under To, unless it is already; raced
// counts the times another writer came first.
func (w Rewrap) one(ctx context.Context, key string, stored []byte, rev, lease int64) (moved bool, raced int, err error) {
	for {
		if w.To.Holds(ctx, key, stored) {
			return false, raced, nil
		}
		plain, err := w.Ring.Decrypt(ctx, key, stored)
		if err != nil {
			return false, raced, fmt.Errorf("Secret %s cannot be read with the rotation's keys, so it is left as it is: %w", secretName(key), err)
		}
		enc, err := w.To.Encrypt(ctx, key, plain)
		if err != nil {
			return false, raced, err
		}
		var opts []clientv3.OpOption
		if lease != 0 {
			opts = append(opts, clientv3.WithLease(clientv3.LeaseID(lease)))
		}
		resp, err := w.KV.Txn(ctx).
			If(clientv3.Compare(clientv3.ModRevision(key), "=", rev)).
			Then(clientv3.OpPut(key, string(enc), opts...)).
			Else(clientv3.OpGet(key)).
			Commit()
		if err != nil {
			return false, raced, fmt.Errorf("write Secret %s to etcd: %w", secretName(key), err)
		}
		if resp.Succeeded {
			return true, raced, nil
		}
		raced++
		now := resp.Responses[0].GetResponseRange().Kvs
		if len(now) == 0 {
			return false, raced, nil // deleted meanwhile
		}
		stored, rev, lease = now[0].Value, now[0].ModRevision, now[0].Lease
	}
}

// Outside lists the Secrets stored under another key than k (at most
// limit of them), and how many Secrets there are.
func Outside(ctx context.Context, kv clientv3.KV, k Key, limit int) (outside []string, total int, err error) {
	err = eachSecret(ctx, kv, func(item *mvccpb.KeyValue) error {
		total++
		if !k.Holds(ctx, string(item.Key), item.Value) && len(outside) < limit {
			outside = append(outside, secretName(string(item.Key)))
		}
		return nil
	})
	return outside, total, err
}

// Count is how many Secrets etcd holds.
func Count(ctx context.Context, kv clientv3.KV) (int, error) {
	resp, err := kv.Get(ctx, SecretsPrefix, clientv3.WithPrefix(), clientv3.WithCountOnly())
	if err != nil {
		return 0, fmt.Errorf("count the Secrets in etcd: %w", err)
	}
	return int(resp.Count), nil
}

// secretName is namespace/name of a Secret's etcd key.
func secretName(key string) string { return strings.TrimPrefix(key, SecretsPrefix) }
