package conflict

import (
	"errors"
	"fmt"
	"strings"
	"testing"

	"github.com/go-logr/logr/funcr"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"sigs.k8s.io/controller-runtime/pkg/reconcile"
)

func TestRequeue(t *testing.T) {
	lease := apierrors.NewConflict(schema.GroupResource{Group: "coordination.k8s.io", Resource: "leases"}, "ichor-cluster-lock", errors.New("changed"))
	tests := []struct {
		name    string
		err     error
		wantErr bool
		wantLog string
	}{
		{"no error", nil, false, ""},
		{"a conflict", lease, false, `"level"=1 "msg"="conflict: the object changed meanwhile; reconciling again"`},
		{"a wrapped conflict says what was being done", fmt.Errorf("releasing the cluster lock: %w", lease), false, `"conflict"="releasing the cluster lock: Operation cannot be fulfilled`},
		{"another error", errors.New("list nodes: forbidden"), true, ""},
		{"a wrapped other API error", fmt.Errorf("write status: %w", apierrors.NewForbidden(schema.GroupResource{}, "x", errors.New("no"))), true, ""},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			var logged strings.Builder
			log := funcr.New(func(prefix, args string) { logged.WriteString(args + "\n") }, funcr.Options{Verbosity: 1})
			res, err := Requeue(log, reconcile.Result{}, tt.err)
			if (err != nil) != tt.wantErr || (err != nil && err != tt.err) {
				t.Errorf("err = %v, want it passed on: %v", err, tt.wantErr)
			}
			if requeued := res.RequeueAfter == Retry; requeued != (tt.wantLog != "") {
				t.Errorf("result %+v", res)
			}
			if !strings.Contains(logged.String(), tt.wantLog) || (tt.wantLog == "" && logged.Len() > 0) {
				t.Errorf("logged %q, want %q", logged.String(), tt.wantLog)
			}
		})
	}
}
