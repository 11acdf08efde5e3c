package executor

import (
	"context"
	"errors"
	"fmt"
	"net"
	"strconv"
	"strings"
	"time"

	"github.com/siderolabs/talos/pkg/machinery/config"
	"github.com/siderolabs/talos/pkg/machinery/config/types/v1alpha1"
	"github.com/siderolabs/talos/pkg/machinery/constants"
	"github.com/siderolabs/talos/pkg/machinery/resources/k8s"
	corev1 "k8s.io/api/core/v1"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"
	podutils "k8s.io/kubectl/pkg/util/podutils"
	"sigs.k8s.io/controller-runtime/pkg/client"

	"maesh.dev/ichor/controller/machineconfig"
)

// Steps of a change to a control plane's cluster section that restarts
// its kube-apiserver (a key rotation's): the API server's secrets version
// recorded, the change applied live, then the API server waited for until
// it runs the new secrets and is Ready, before the next control plane's
// turn, so that the others serve meanwhile.
const (
	StepRecordAPIServer = "record-api-server"
	StepWaitAPIServer   = "wait-api-server"
)

// clusterChange is a change to a control plane's cluster section: it
// reports false when the section already carries it.
type clusterChange func(c *v1alpha1.ClusterConfig) bool

// clusterChangeOf reads, from the rotation's stored state, the change a
// stage makes.
type clusterChangeOf func(ctx context.Context, e *Env) (clusterChange, error)

// apiServerPatchSteps are the steps of a stage that applies a change to
// each control plane's cluster section live (NO_REBOOT: .cluster applies
// live, and Talos restarts the static pods whose secrets changed): record
// the version of the secrets kube-apiserver runs, apply, wait until it runs
// newer ones and is Ready.
func apiServerPatchSteps(name string, of clusterChangeOf) []Step {
	return []Step{recordAPIServerStep(of), clusterPatchStep(name, of), waitAPIServerStep()}
}

// recordAPIServerStep records, as the machine's From (and To, until the
// change), the secrets version (talos.dev/secrets-version) of its Ready
// kube-apiserver, so that the wait after the change can tell the restarted
// one, whatever crashes when. A
// machine that already carries the change needs nothing more. A check: it
// follows the step before it in the same run.
func recordAPIServerStep(of clusterChangeOf) Step {
	return Step{Name: StepRecordAPIServer, Timeout: 2 * time.Minute, Chained: true, Run: func(ctx context.Context, e *Env) (Outcome, error) {
		if err := e.requireAddress(); err != nil {
			return Outcome{}, err
		}
		ch, changed, err := planClusterChange(ctx, e, of)
		if err != nil {
			return Outcome{}, err
		}
		pod, err := apiServerPod(ctx, e)
		if err != nil {
			return Outcome{}, err
		}
		if pod == nil || !podutils.IsPodReady(pod) {
			return Outcome{}, Fail("APIServerNotReady", "the kube-apiserver of %s is not running and Ready (its mirror pod kube-system/%s-%s): "+
				"the change restarts it, and the other control planes serve while it does, so it must be Ready first", e.Machine.Name, k8s.APIServerID, e.Machine.Name)
		}
		if !changed || ch.Applied() {
			return Outcome{Done: true, Message: "already carries the change; its API server is Ready"}, nil
		}
		return Outcome{From: secretsVersion(pod), To: secretsVersion(pod)}, nil
	}}
}

// clusterPatchStep applies the change to the machine's active
// configuration live and verifies through COSI that the machine runs it.
// A machine that already carries it (a run again after a restart) is not
// applied again.
func clusterPatchStep(name string, of clusterChangeOf) Step {
	return Step{Name: name, Timeout: 2 * time.Minute, Run: func(ctx context.Context, e *Env) (Outcome, error) {
		ch, changed, err := planClusterChange(ctx, e, of)
		if err != nil {
			return Outcome{}, err
		}
		if !changed || ch.Applied() {
			return Outcome{Message: "already applied"}, nil
		}
		mc := configMachine(e)
		if _, err := mc.Apply(ctx, ch.Config, machineconfig.NoReboot); err != nil {
			return Outcome{}, configFail(err)
		}
		if err := untilAnswers(ctx, func() error { return mc.Verify(ctx, ch.To) }); err != nil {
			return Outcome{}, configFail(err)
		}
		return Outcome{Message: "applied live; waiting for its API server to restart"}, nil
	}}
}

// planClusterChange plans the change of the machine's (of says it) on its
// active configuration.
func planClusterChange(ctx context.Context, e *Env, of clusterChangeOf) (machineconfig.Change, bool, error) {
	change, err := of(ctx, e)
	if err != nil {
		return machineconfig.Change{}, false, err
	}
	mc := configMachine(e)
	var active config.Provider
	if err := untilAnswers(ctx, func() (err error) { active, err = mc.Active(ctx); return err }); err != nil {
		return machineconfig.Change{}, false, configFail(err)
	}
	changed := false
	ch, err := machineconfig.PlanOn(active, []machineconfig.Patch{machineconfig.Typed("cluster", func(cfg *v1alpha1.Config) error {
		if cfg.ClusterConfig == nil {
			return errors.New("the configuration has no cluster section")
		}
		changed = change(cfg.ClusterConfig)
		return nil
	})})
	if err != nil {
		return machineconfig.Change{}, false, configFail(err)
	}
	return ch, changed, nil
}

// waitAPIServerStep waits until the machine's kube-apiserver runs other
// secrets than those recorded before the change (its mirror pod's
// talos.dev/secrets-version), is Ready, and answers at its own address.
func waitAPIServerStep() Step {
	return Step{Name: StepWaitAPIServer, Timeout: 5 * time.Minute, Wait: func(ctx context.Context, e *Env) (bool, Outcome, error) {
		pod, err := apiServerPod(ctx, e)
		if err != nil {
			return false, Outcome{}, err
		}
		switch {
		case pod == nil:
			return false, Outcome{Message: "waiting for its kube-apiserver's mirror pod", Recheck: time.Second}, nil
		case secretsVersion(pod) == e.Machine.From:
			return false, Outcome{Message: "waiting for its kube-apiserver to restart on the new secrets", Recheck: time.Second}, nil
		case !podutils.IsPodReady(pod):
			return false, Outcome{Message: fmt.Sprintf("waiting for %s to be Ready", pod.Name), Recheck: time.Second}, nil
		}
		cs, err := directClient(ctx, e, e.Machine.Name)
		if err != nil {
			return false, Outcome{}, err
		}
		if err := readyz(ctx, cs); err != nil {
			return false, Outcome{Message: fmt.Sprintf("waiting for its kube-apiserver to answer at its own address: %v", err), Recheck: time.Second}, nil
		}
		return true, Outcome{To: secretsVersion(pod), Message: "its API server restarted on the new secrets and is Ready"}, nil
	}}
}

// secretsVersion names the secrets a kube-apiserver mirror pod runs (its
// talos.dev/secrets-version), as the machine's From and To show it: the
// version of the secrets before a change and after.
func secretsVersion(pod *corev1.Pod) string {
	return "secrets-" + pod.Annotations[constants.AnnotationStaticPodSecretsVersion]
}

// apiServerPod is the machine's kube-apiserver mirror pod, or nil.
func apiServerPod(ctx context.Context, e *Env) (*corev1.Pod, error) {
	pods, err := mirrorPods(ctx, e.Live, e, k8s.APIServerID)
	if err != nil || len(pods) == 0 {
		return nil, err
	}
	return &pods[0], nil
}

// mirrorPods are the machine's mirror pods of a control-plane component,
// as r has them: the cache (it holds every control-plane mirror pod, so
// the machine's are filtered here) for a wait that looks again every
// second; the API server for a rotation's stages, whose moments a cache
// that lags could blur.
func mirrorPods(ctx context.Context, r client.Reader, e *Env, component string) ([]corev1.Pod, error) {
	var pods corev1.PodList
	if err := r.List(ctx, &pods, client.InNamespace("kube-system"), client.MatchingLabels{"k8s-app": component}); err != nil {
		return nil, fmt.Errorf("read the %s mirror pod of %s: %w", component, e.Machine.Name, err)
	}
	out := pods.Items[:0]
	for _, p := range pods.Items {
		if p.Spec.NodeName == e.Machine.Name {
			out = append(out, p)
		}
	}
	return out, nil
}

// apiServerAddress is where the kube-apiserver of the control plane name
// serves, as Talos runs it: on every address of the machine (the Node's
// InternalIP, its Talos address), at the port of its
// cluster.controlPlane.localAPIServerPort.
func apiServerAddress(ctx context.Context, e *Env, name string) (string, error) {
	addr := nodeAddress(e, name)
	if addr == "" {
		return "", Fail("NoNodeAddress", "the Node %s has no InternalIP: its API server cannot be reached", name)
	}
	var active config.Provider
	mc := machineconfig.Machine{Talos: e.Talos, Node: addr}
	if err := untilAnswers(ctx, func() (err error) { active, err = mc.Active(ctx); return err }); err != nil {
		return "", configFail(err)
	}
	port := active.Cluster().LocalAPIServerPort()
	if port == 0 {
		port = constants.DefaultControlPlanePort
	}
	return net.JoinHostPort(addr, strconv.Itoa(port)), nil
}

// adminConfig is an admin REST config for the cluster's endpoint, issued
// now by the first control plane (Talos's Kubeconfig): for the work of a
// key rotation on every Secret of the cluster (legacy tokens reissued,
// Secrets rewritten), which the controller's own role does not grant it
// (it reads no Secret but its own), as talosctl would do it with the
// cluster's admin credentials.
func adminConfig(ctx context.Context, e *Env) (*rest.Config, error) {
	if len(e.ControlPlanes) == 0 {
		return nil, errors.New("no control plane to ask for a kubeconfig")
	}
	return talosKubeconfig(ctx, e.Talos, e.ControlPlanes[0])
}

// directConfig is an admin REST config for the kube-apiserver of the
// control plane name at its own address, not through the cluster's
// endpoint: a check that must hold on every API server asks each one. Its
// credentials are those the first control plane issues now (Talos's
// Kubeconfig), which hold whatever the controller's own have become.
func directConfig(ctx context.Context, e *Env, name string) (*rest.Config, error) {
	address, err := apiServerAddress(ctx, e, name)
	if err != nil {
		return nil, err
	}
	admin, err := adminConfig(ctx, e)
	if err != nil {
		return nil, err
	}
	return atAPIServer(admin, address), nil
}

// atAPIServer is rc for the API server at address (host:port) itself.
func atAPIServer(rc *rest.Config, address string) *rest.Config {
	out := rest.CopyConfig(rc)
	out.Host = "https://" + address
	out.Timeout = 10 * time.Second
	return out
}

// directClient is a clientset of directConfig.
func directClient(ctx context.Context, e *Env, name string) (kubernetes.Interface, error) {
	rc, err := directConfig(ctx, e, name)
	if err != nil {
		return nil, err
	}
	return kubernetes.NewForConfig(rc)
}

// readyz asks the API server whether it is ready; not ready, it names the
// checks that fail (/readyz's "[-]name failed" lines), not the whole list.
func readyz(ctx context.Context, cs kubernetes.Interface) error {
	body, err := cs.Discovery().RESTClient().Get().AbsPath("/readyz").DoRaw(ctx)
	if err == nil {
		return nil
	}
	failed := failingChecks(string(body))
	if len(failed) == 0 {
		return err
	}
	return fmt.Errorf("not ready yet (failing: %s)", strings.Join(failed, ", "))
}

// failingChecks are the names of the checks a /readyz answer says fail.
func failingChecks(body string) []string {
	var out []string
	for _, line := range strings.Split(body, "\n") {
		if rest, ok := strings.CutPrefix(line, "[-]"); ok {
			if f := strings.Fields(rest); len(f) > 0 {
				out = append(out, f[0])
			}
		}
	}
	return out
}
