// Package encryption holds how kube-apiserver on Talos encrypts Secrets at
// rest, and re-encrypts them in etcd itself. Talos 1.13 renders one
// EncryptionConfiguration for secrets from the control plane's cluster
// section: secretbox with one key named key2 (cluster.secretboxEncryptionSecret),
// then aescbc with one key named key1 (cluster.aescbcEncryptionSecret),
// then identity (TALOS_API.md §4.2). The API server writes with the first
// provider and reads with any, so a new secretbox key cannot be brought in
// beside the old one: a key rotation moves every Secret through the aescbc
// slot, and it does so in etcd, compare-and-swap per key, because a
// rewrite through the API would write with the first provider.
package encryption

import (
	"bytes"
	"context"
	"crypto/aes"
	"crypto/rand"
	"encoding/base64"
	"errors"
	"fmt"

	"k8s.io/apiserver/pkg/storage/value"
	aestransformer "k8s.io/apiserver/pkg/storage/value/encrypt/aes"
	"k8s.io/apiserver/pkg/storage/value/encrypt/identity"
	"k8s.io/apiserver/pkg/storage/value/encrypt/secretbox"
)

// Provider is an encryption provider Talos renders.
type Provider string

// Providers, as Talos renders them (each with one key of a fixed name).
const (
	Secretbox Provider = "secretbox"
	AESCBC    Provider = "aescbc"
)

// keyName is the name Talos gives the one key of each provider.
var keyName = map[Provider]string{Secretbox: "key2", AESCBC: "key1"}

// Key is one provider's key: its secret as the machine configuration holds
// it (32 bytes, base64).
type Key struct {
	Provider Provider
	Secret   string
}

// NewKey makes a key as Talos generates one (secrets.NewBundle): 32 random
// bytes, base64.
func NewKey(p Provider) (Key, error) {
	b := make([]byte, 32)
	if _, err := rand.Read(b); err != nil {
		return Key{}, fmt.Errorf("new %s key: %w", p, err)
	}
	return Key{Provider: p, Secret: base64.StdEncoding.EncodeToString(b)}, nil
}

func (k Key) String() string { return fmt.Sprintf("%s key %s", k.Provider, keyName[k.Provider]) }

// Prefix is what every value stored under k begins with.
func (k Key) Prefix() string {
	return fmt.Sprintf("k8s:enc:%s:v1:%s:", k.Provider, keyName[k.Provider])
}

// transformer is the API server's transformer of k, its prefix stripped.
func (k Key) transformer() (value.Transformer, error) {
	raw, err := base64.StdEncoding.DecodeString(k.Secret)
	if err != nil {
		return nil, fmt.Errorf("the %s: not base64: %w", k, err)
	}
	if len(raw) != 32 {
		return nil, fmt.Errorf("the %s is %d bytes, not 32", k, len(raw))
	}
	switch k.Provider {
	case Secretbox:
		return secretbox.NewSecretboxTransformer([32]byte(raw)), nil
	case AESCBC:
		block, err := aes.NewCipher(raw)
		if err != nil {
			return nil, fmt.Errorf("the %s: %w", k, err)
		}
		return aestransformer.NewCBCTransformer(block), nil
	}
	return nil, fmt.Errorf("provider %q is not one Talos renders", k.Provider)
}

// Encrypt is the value the API server would store for plain under k, at
// the etcd key key.
func (k Key) Encrypt(ctx context.Context, key string, plain []byte) ([]byte, error) {
	t, err := k.transformer()
	if err != nil {
		return nil, err
	}
	out, err := t.TransformToStorage(ctx, plain, value.DefaultContext(key))
	if err != nil {
		return nil, fmt.Errorf("encrypt %s with the %s: %w", key, k, err)
	}
	return append([]byte(k.Prefix()), out...), nil
}

// Holds reports whether the value stored at key is encrypted with k: its
// prefix is k's, and k opens it to an object the API server stored.
func (k Key) Holds(ctx context.Context, key string, stored []byte) bool {
	_, err := Ring{k}.decrypt(ctx, key, stored, false)
	return err == nil
}

// Ring is every key a stored value may be encrypted with; a value stored
// in the clear is read too, as the API server's identity provider reads it.
type Ring []Key

// Decrypt reads the value stored at key with the first key of the ring
// that opens it (two keys of one provider share a prefix: each is tried,
// as the API server tries every provider whose prefix matches).
func (r Ring) Decrypt(ctx context.Context, key string, stored []byte) ([]byte, error) {
	return r.decrypt(ctx, key, stored, true)
}

func (r Ring) decrypt(ctx context.Context, key string, stored []byte, clear bool) ([]byte, error) {
	var ts []value.PrefixTransformer
	for _, k := range r {
		t, err := k.transformer()
		if err != nil {
			return nil, err
		}
		ts = append(ts, value.PrefixTransformer{Prefix: []byte(k.Prefix()), Transformer: t})
	}
	if clear {
		ts = append(ts, value.PrefixTransformer{Prefix: nil, Transformer: identity.NewEncryptCheckTransformer()})
	}
	plain, _, err := value.NewPrefixTransformers(errNoKey, ts...).TransformFromStorage(ctx, stored, value.DefaultContext(key))
	if err != nil {
		return nil, fmt.Errorf("%s: %w", key, err)
	}
	// A wrong AES-CBC key still yields valid padding once in 256: what
	// was stored is an object in the API server's encoding, or it was not
	// this key.
	if !isStoredObject(plain) {
		return nil, fmt.Errorf("%s: %w", key, errNoKey)
	}
	return plain, nil
}

var errNoKey = errors.New("no key of the rotation opens it")

// isStoredObject reports whether plain is an object as the API server stores it:
// protobuf behind its magic "k8s\x00", or JSON.
func isStoredObject(plain []byte) bool {
	return bytes.HasPrefix(plain, []byte("k8s\x00")) || bytes.HasPrefix(bytes.TrimLeft(plain, " \t\r\n"), []byte("{"))
}
