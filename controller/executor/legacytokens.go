package executor

import (
	"cmp"
	"context"
	"fmt"
	"slices"
	"time"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/fields"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/apimachinery/pkg/util/wait"
	"k8s.io/client-go/kubernetes"
)

// legacyTokenInvalidSince labels a legacy token Secret that the API
// servers refuse on purpose (kube-controller-manager's
// legacy-serviceaccount-token-cleaner marks unused ones so): a new token
// would be refused too, so the rotation leaves it alone.
const legacyTokenInvalidSince = "kubernetes.io/legacy-token-invalid-since"

// reissueTokensStep has every legacy token Secret whose token the API
// servers no longer take signed again: its token key is removed (an
// update at the version read, so a concurrent writer is never clobbered),
// and the tokens controller of kube-controller-manager, which runs with
// the new key once its control plane took it, fills a new one. It waits
// until every one authenticates, then removes the rotation's Secret. The
// Secrets are read and written with an admin kubeconfig a control plane
// issues: the controller's own role reads no Secret but its own. A run
// again goes over them all again: those that authenticate are left.
func reissueTokensStep() Step {
	return Step{Name: StepReissueTokens, Timeout: 10 * time.Minute, Run: func(ctx context.Context, e *Env) (Outcome, error) {
		cs, err := adminClient(ctx, e)
		if err != nil {
			return Outcome{}, err
		}
		r := &reissue{cs: cs, e: e, taken: map[types.UID]string{}}
		if err := wait.PollUntilContextCancel(ctx, time.Second, true, r.pass); err != nil {
			return Outcome{}, Fail("TokensNotReissued", "legacy token Secrets not signed again in time: %s (%v): "+
				"kube-controller-manager's tokens controller fills a Secret whose token was removed; check that it runs, then retry", r.waiting(), cmp.Or(r.last, err))
		}
		if err := removeSAState(ctx, e); err != nil {
			return Outcome{}, err
		}
		return Outcome{Message: r.summary()}, nil
	}}
}

// reissue is one run of the reissue: what it found and did so far.
type reissue struct {
	cs kubernetes.Interface
	e  *Env
	// taken maps each Secret whose token authenticates to the version
	// read then: it is not asked about again while it stays so.
	taken map[types.UID]string
	// reissued are the Secrets whose token this run removed; pending
	// those without a token after the last pass.
	reissued, pending []string
	last              error
}

// pass goes over every legacy token Secret once: a token the API server
// refuses is removed, and a Secret without a token waits for the tokens
// controller. It is done when every one authenticates. An API error is
// kept for the message and the next pass tries again.
func (r *reissue) pass(ctx context.Context) (bool, error) {
	secrets, err := legacyTokenSecrets(ctx, r.cs)
	if err != nil {
		r.last = err
		return false, nil
	}
	r.pending = nil
	for i := range secrets {
		s := &secrets[i]
		if s.Labels[legacyTokenInvalidSince] != "" || r.taken[s.UID] == s.ResourceVersion {
			continue
		}
		if !r.settle(ctx, s) {
			r.pending = append(r.pending, s.Namespace+"/"+s.Name)
		}
	}
	if len(r.pending) > 0 {
		r.e.report(fmt.Sprintf("reissuing legacy tokens: waiting for the tokens controller to sign %s", r.waiting()))
	}
	return len(r.pending) == 0, nil
}

// settle reports whether the Secret's token authenticates, and removes
// it when the API server refuses it.
func (r *reissue) settle(ctx context.Context, s *corev1.Secret) bool {
	token := s.Data[corev1.ServiceAccountTokenKey]
	if len(token) == 0 {
		return false
	}
	ok, err := authenticates(ctx, r.cs, string(token))
	if err != nil {
		r.last = err
		return false
	}
	if ok {
		r.taken[s.UID] = s.ResourceVersion
		return true
	}
	out := s.DeepCopy()
	delete(out.Data, corev1.ServiceAccountTokenKey)
	_, err = r.cs.CoreV1().Secrets(s.Namespace).Update(ctx, out, metav1.UpdateOptions{FieldManager: "ichor-controller"})
	switch {
	case err == nil:
		r.reissued = append(r.reissued, s.Namespace+"/"+s.Name)
	case !apierrors.IsConflict(err) && !apierrors.IsNotFound(err):
		r.last = fmt.Errorf("remove the token of Secret %s/%s: %w", s.Namespace, s.Name, err)
	}
	return false
}

// waiting names the Secrets still without a token the API server takes.
func (r *reissue) waiting() string {
	if len(r.pending) == 0 {
		return "none"
	}
	return fitList(r.pending, 160)
}

func (r *reissue) summary() string {
	if len(r.reissued) == 0 {
		return "every legacy token Secret's token authenticates; none needed signing again"
	}
	slices.Sort(r.reissued)
	return fmt.Sprintf("every legacy token Secret's token authenticates; signed again: %s", fitList(r.reissued, 180))
}

// legacyTokenSecrets lists the Secrets of type
// kubernetes.io/service-account-token, a page at a time.
func legacyTokenSecrets(ctx context.Context, cs kubernetes.Interface) ([]corev1.Secret, error) {
	opts := metav1.ListOptions{Limit: 500, FieldSelector: fields.OneTermEqualSelector("type", string(corev1.SecretTypeServiceAccountToken)).String()}
	var out []corev1.Secret
	for {
		list, err := cs.CoreV1().Secrets("").List(ctx, opts)
		if err != nil {
			return nil, fmt.Errorf("list the legacy token Secrets: %w", err)
		}
		out = append(out, list.Items...)
		if list.Continue == "" {
			return out, nil
		}
		opts.Continue = list.Continue
	}
}
