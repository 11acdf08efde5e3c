package executor

import (
	"slices"
	"testing"
)

func TestFailingChecks(t *testing.T) {
	for _, tc := range []struct {
		body string
		want []string
	}{
		{"[+]ping ok\n[+]log ok\n[-]etcd failed: reason withheld\n[+]informer-sync ok\n[-]poststarthook/rbac/bootstrap-roles failed: reason withheld\nreadyz check failed\n",
			[]string{"etcd", "poststarthook/rbac/bootstrap-roles"}},
		{"[+]ping ok\nreadyz check passed\n", nil},
		{"[-]\n", nil},
		{"", nil},
	} {
		if got := failingChecks(tc.body); !slices.Equal(got, tc.want) {
			t.Errorf("failingChecks(%q) = %v, want %v", tc.body, got, tc.want)
		}
	}
}
