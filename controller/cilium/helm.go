package cilium

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"time"

	"helm.sh/helm/v4/pkg/action"
	chartv2 "helm.sh/helm/v4/pkg/chart/v2"
	"helm.sh/helm/v4/pkg/kube"
	"helm.sh/helm/v4/pkg/release"
	rcommon "helm.sh/helm/v4/pkg/release/common"
	releasev1 "helm.sh/helm/v4/pkg/release/v1"
	"helm.sh/helm/v4/pkg/storage/driver"
	"k8s.io/cli-runtime/pkg/genericclioptions"
	"sigs.k8s.io/controller-runtime/pkg/client"
)

// Request is one run of the Cilium Job: move the cilium release to Chart
// with the kube-proxy mode KubeProxyReplacement.
type Request struct {
	Chart                *chartv2.Chart
	KubeProxyReplacement bool
	// Timeout bounds the upgrade and the wait for every object to be ready.
	Timeout time.Duration
	Log     *slog.Logger
}

// Result is what the run did.
type Result struct {
	// Revision is the release's revision now.
	Revision int
	// Adopted says Helm did not manage this Cilium before: it was installed
	// into the release, taking over its objects.
	Adopted bool
	// Changes are the values Ichor set over the user's (Plan.Changes).
	Changes []string
}

// Upgrade moves Cilium to req.Chart with Helm v4, as `helm upgrade` would
// with the values passed explicitly (the user's, read from the release, and
// what Talos needs): never --reuse-values. It waits, with kstatus, until
// every object of the release is ready, so the agents have rolled. A Cilium
// that Helm does not manage is installed into the release taking its
// objects over. A release left pending by a run that was killed is marked
// failed first: the run holds the cluster lock, so no other run is in
// flight.
func Upgrade(ctx context.Context, getter genericclioptions.RESTClientGetter, req Request) (Result, error) {
	log := req.Log
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	// Ichor upgrades the release as the helm CLI does, under its field
	// manager: server-side apply removes only the fields the applying
	// manager owned, so under a manager of its own a field the new chart no
	// longer renders (1.18's mount-cgroup init container) would stay.
	kube.ManagedFieldsManager = FieldManager
	cfg := action.NewConfiguration(action.ConfigurationSetLogger(log.Handler()))
	if err := cfg.Init(getter, Namespace, "secret"); err != nil {
		return Result{}, fmt.Errorf("helm: %w", err)
	}
	restCfg, err := getter.ToRESTConfig()
	if err != nil {
		return Result{}, err
	}
	kc, err := client.New(restCfg, client.Options{})
	if err != nil {
		return Result{}, err
	}
	agents, err := ReadAgents(ctx, kc)
	if err != nil {
		return Result{}, err
	}
	if agents == nil {
		return Result{}, fmt.Errorf("no Cilium runs (no DaemonSet %s/%s): Ichor upgrades the Cilium a cluster runs and installs no CNI of its own", Namespace, DaemonSet)
	}
	cur := Current{KubeProxyReplacement: agents.KubeProxyReplacement, IPAM: agents.IPAM}
	history, err := action.NewHistory(cfg).Run(Release)
	managed := !errors.Is(err, driver.ErrReleaseNotFound)
	if err != nil && managed {
		return Result{}, fmt.Errorf("read the history of release %s/%s: %w", Namespace, Release, err)
	}
	if managed {
		if err := readRelease(cfg, history, &cur, log); err != nil {
			return Result{}, err
		}
	}
	plan, err := PlanValues(cur, req.KubeProxyReplacement)
	if err != nil {
		return Result{}, err
	}
	for _, c := range plan.Changes {
		log.Info("value set by Ichor", "value", c)
	}
	res := Result{Changes: plan.Changes, Adopted: !managed}
	var rel release.Releaser
	if managed {
		up := action.NewUpgrade(cfg)
		up.Namespace, up.WaitStrategy, up.Timeout, up.MaxHistory = Namespace, kube.StatusWatcherStrategy, req.Timeout, 10
		up.ResetValues = true
		// The fields Ichor sets are Ichor's from now on, whoever applied them
		// before (the user's helm, as another field manager).
		up.ForceConflicts = true
		log.Info("upgrading", "release", Release, "from", agents.Version.String(), "chart", req.Chart.Metadata.Version, "kubeProxyReplacement", req.KubeProxyReplacement)
		rel, err = up.RunWithContext(ctx, Release, req.Chart, plan.Values)
	} else {
		in := action.NewInstall(cfg)
		in.ReleaseName, in.Namespace, in.WaitStrategy, in.Timeout = Release, Namespace, kube.StatusWatcherStrategy, req.Timeout
		in.TakeOwnership, in.ForceConflicts = true, true
		log.Info("Helm does not manage this Cilium: installing the release over its objects", "release", Release, "from", agents.Version.String(), "chart", req.Chart.Metadata.Version)
		rel, err = in.RunWithContext(ctx, req.Chart, plan.Values)
	}
	if err != nil {
		return res, fmt.Errorf("helm: %w", err)
	}
	if r, ok := rel.(*releasev1.Release); ok {
		res.Revision = r.Version
	}
	return res, nil
}

// readRelease reads the user's values and the first chart version from the
// release, and marks a revision left pending by a killed run failed.
func readRelease(cfg *action.Configuration, history []release.Releaser, cur *Current, log *slog.Logger) error {
	var oldest, last *releasev1.Release
	for _, h := range history {
		r, ok := h.(*releasev1.Release)
		if !ok {
			continue
		}
		if oldest == nil || r.Version < oldest.Version {
			oldest = r
		}
		if last == nil || r.Version > last.Version {
			last = r
		}
	}
	if oldest != nil && oldest.Chart != nil && oldest.Chart.Metadata != nil {
		cur.FirstVersion = oldest.Chart.Metadata.Version
	}
	if last != nil && last.Info != nil && last.Info.Status.IsPending() {
		log.Info("the last revision was left pending by a run that did not finish; marking it failed", "revision", last.Version, "status", last.Info.Status)
		last.Info.Status = rcommon.StatusFailed
		last.Info.Description = "marked failed by Ichor: the run that started it did not finish"
		if err := cfg.Releases.Update(last); err != nil {
			return fmt.Errorf("mark revision %d failed: %w", last.Version, err)
		}
	}
	user, err := action.NewGetValues(cfg).Run(Release)
	if err != nil {
		return fmt.Errorf("read the values of release %s/%s: %w", Namespace, Release, err)
	}
	cur.User = user
	if cur.IPAM == "" {
		all := action.NewGetValues(cfg)
		all.AllValues = true
		if vals, err := all.Run(Release); err == nil {
			if mode, ok := lookup(vals, "ipam.mode"); ok {
				cur.IPAM, _ = mode.(string)
			}
		}
	}
	return nil
}
