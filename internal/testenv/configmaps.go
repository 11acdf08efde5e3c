package testenv

import (
	"context"
	"sort"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"
)

// CreateConfigMaps creates empty ConfigMaps of these names in default:
// objects an etcd restore must take away, or keep.
func CreateConfigMaps(t testing.TB, kc kubernetes.Interface, names ...string) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	for _, name := range names {
		cm := &corev1.ConfigMap{ObjectMeta: metav1.ObjectMeta{Name: name}}
		if _, err := kc.CoreV1().ConfigMaps("default").Create(ctx, cm, metav1.CreateOptions{}); err != nil {
			t.Fatalf("create ConfigMap %s: %v", name, err)
		}
	}
}

// ConfigMaps lists the names of the ConfigMaps in default, sorted and
// comma-separated, but the one Kubernetes publishes, within 5 seconds.
func ConfigMaps(kc kubernetes.Interface) (string, error) {
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	l, err := kc.CoreV1().ConfigMaps("default").List(ctx, metav1.ListOptions{})
	if err != nil {
		return "", err
	}
	var names []string
	for _, cm := range l.Items {
		if cm.Name != "kube-root-ca.crt" {
			names = append(names, cm.Name)
		}
	}
	sort.Strings(names)
	return strings.Join(names, ","), nil
}
