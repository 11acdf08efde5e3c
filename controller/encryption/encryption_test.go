package encryption_test

import (
	"context"
	"crypto/aes"
	"crypto/cipher"
	"encoding/base64"
	"strings"
	"testing"

	"maesh.dev/ichor/controller/encryption"
)

// stored is a Secret as the API server stores it in the clear: protobuf
// behind its magic.
var stored = []byte("k8s\x00\n\x0c\n\x02v1\x12\x06Secret")

func newKey(t *testing.T, p encryption.Provider) encryption.Key {
	t.Helper()
	k, err := encryption.NewKey(p)
	if err != nil {
		t.Fatal(err)
	}
	return k
}

// The keys' values carry Talos's fixed key names behind the providers'
// prefixes, each key opens what it sealed and nothing of another key,
// even of the same provider and name, and a ring reads any of its keys
// and the clear.
func TestKeys(t *testing.T) {
	ctx := context.Background()
	const at = "/registry/secrets/default/s"
	sbOld, sbNew, aes := newKey(t, encryption.Secretbox), newKey(t, encryption.Secretbox), newKey(t, encryption.AESCBC)
	if got := sbOld.Prefix(); got != "k8s:enc:secretbox:v1:key2:" {
		t.Errorf("secretbox prefix %q", got)
	}
	if got := aes.Prefix(); got != "k8s:enc:aescbc:v1:key1:" {
		t.Errorf("aescbc prefix %q", got)
	}
	seal := func(k encryption.Key) []byte {
		b, err := k.Encrypt(ctx, at, stored)
		if err != nil {
			t.Fatal(err)
		}
		return b
	}
	for _, tc := range []struct {
		name   string
		value  []byte
		holds  map[string]bool // by key
		ring   encryption.Ring
		reads  bool
		errHas string
	}{
		{name: "old secretbox", value: seal(sbOld), holds: map[string]bool{"old": true},
			ring: encryption.Ring{sbNew, aes, sbOld}, reads: true},
		{name: "new secretbox", value: seal(sbNew), holds: map[string]bool{"new": true},
			ring: encryption.Ring{sbOld, sbNew}, reads: true},
		{name: "aescbc", value: seal(aes), holds: map[string]bool{"aes": true},
			ring: encryption.Ring{sbOld, aes}, reads: true},
		{name: "clear", value: stored, holds: map[string]bool{}, ring: encryption.Ring{sbOld}, reads: true},
		{name: "old secretbox without its key", value: seal(sbOld), holds: map[string]bool{"old": true},
			ring: encryption.Ring{sbNew, aes}, errHas: "/registry/secrets/default/s"},
		{name: "garbage behind a prefix", value: []byte(aes.Prefix() + strings.Repeat("x", 64)), holds: map[string]bool{},
			ring: encryption.Ring{aes}, errHas: "default/s"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			for name, k := range map[string]encryption.Key{"old": sbOld, "new": sbNew, "aes": aes} {
				if got := k.Holds(ctx, at, tc.value); got != tc.holds[name] {
					t.Errorf("the %s key holds it: %t, want %t", name, got, tc.holds[name])
				}
			}
			plain, err := tc.ring.Decrypt(ctx, at, tc.value)
			switch {
			case tc.reads && (err != nil || string(plain) != string(stored)):
				t.Errorf("ring read %q, %v; want the stored object", plain, err)
			case !tc.reads && (err == nil || !strings.Contains(err.Error(), tc.errHas)):
				t.Errorf("ring read it (%v); want an error naming %q", err, tc.errHas)
			}
		})
	}
}

func TestKeyRefusesABadSecret(t *testing.T) {
	for _, k := range []encryption.Key{
		{Provider: encryption.Secretbox, Secret: "not base64!"},
		{Provider: encryption.AESCBC, Secret: "c2hvcnQ="},
		{Provider: "kms", Secret: newKey(t, encryption.AESCBC).Secret},
	} {
		if _, err := k.Encrypt(context.Background(), "/registry/secrets/a/b", stored); err == nil {
			t.Errorf("%+v encrypted", k)
		}
	}
}

// A wrong AES-CBC key yields valid padding once in 256: such a key does
// not hold the value, nor does a ring of it read it.
func TestWrongAESKeyWithValidPadding(t *testing.T) {
	ctx := context.Background()
	const at = "/registry/secrets/default/s"
	right := newKey(t, encryption.AESCBC)
	value, err := right.Encrypt(ctx, at, stored)
	if err != nil {
		t.Fatal(err)
	}
	body := value[len(right.Prefix()):]
	for range 100000 {
		wrong := newKey(t, encryption.AESCBC)
		if !validPadding(t, wrong, body) {
			continue
		}
		if wrong.Holds(ctx, at, value) {
			t.Fatal("a wrong aescbc key whose padding checks out holds the value")
		}
		if _, err := (encryption.Ring{wrong}).Decrypt(ctx, at, value); err == nil {
			t.Fatal("a ring of a wrong aescbc key whose padding checks out reads the value")
		}
		return
	}
	t.Fatal("no wrong key with valid padding found")
}

// validPadding decrypts body (IV, then blocks) with k and checks its
// PKCS#7 padding, as the API server's aescbc provider does.
func validPadding(t *testing.T, k encryption.Key, body []byte) bool {
	t.Helper()
	raw, err := base64.StdEncoding.DecodeString(k.Secret)
	if err != nil {
		t.Fatal(err)
	}
	block, err := aes.NewCipher(raw)
	if err != nil {
		t.Fatal(err)
	}
	out := make([]byte, len(body)-aes.BlockSize)
	cipher.NewCBCDecrypter(block, body[:aes.BlockSize]).CryptBlocks(out, body[aes.BlockSize:])
	pad := int(out[len(out)-1])
	if pad == 0 || pad > len(out) {
		return false
	}
	for _, b := range out[len(out)-pad:] {
		if int(b) != pad {
			return false
		}
	}
	return true
}
