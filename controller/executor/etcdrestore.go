package executor

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"sort"
	"strconv"
	"strings"
	"time"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"sigs.k8s.io/controller-runtime/pkg/client"

	"google.golang.org/grpc/codes"

	talosclient "github.com/siderolabs/talos/pkg/machinery/client"
	"github.com/siderolabs/talos/pkg/machinery/resources/runtime"

	ichorv1 "maesh.dev/ichor/api/v1alpha1"
	"maesh.dev/ichor/controller/journal"
	"maesh.dev/ichor/controller/machine"
	"maesh.dev/ichor/controller/snapshot"
	"maesh.dev/ichor/controller/talos"
)

// Steps of the etcd-restore kind, all on the recovering control plane.
const (
	StepCheckSnapshot = "check-snapshot"
	StepLeaveOthers   = "etcd-leave-others"
	StepResetAll      = "reset-control-planes"
	StepRecover       = "recover-etcd"
	StepRestored      = "etcd-restored"
)

// EtcdRestore rewinds the cluster to an etcd snapshot with Talos's
// disaster-recovery flow (TALOS_API.md 1.7), every step on the recovering
// control plane (spec.etcdRestore.machine, or the first) and about all of
// them: the snapshot fetched and verified; every other control plane
// forfeits leadership and leaves etcd; every control plane is reset at
// once with EPHEMERAL wiped; the snapshot is uploaded to the recovering one
// and etcd bootstrapped from it; the others join; the members, their
// health and the store's revision are verified.
//
// The recovering machine's status keeps what the steps need: BootID its
// boot before the reset, From the store's revision before the restore and
// To the snapshot's ("revision N").
type EtcdRestore struct{}

// Target implements Executor.
func (EtcdRestore) Target(op *ichorv1.TalosOperation) (string, string) {
	if op.Spec.EtcdRestore == nil {
		return "", ""
	}
	return "restore etcd from " + op.Spec.EtcdRestore.Snapshot, ""
}

// Scope implements Executor: the recovering control plane, the one named
// or else the first by name.
func (EtcdRestore) Scope(op *ichorv1.TalosOperation, nodes []*corev1.Node) ([]*corev1.Node, error) {
	var cps []*corev1.Node
	for _, n := range nodes {
		if machine.Role(n) == ichorv1.RoleControlPlane {
			cps = append(cps, n)
		}
	}
	if len(cps) == 0 {
		return nil, errors.New("no control plane among the machines selected: an etcd restore recovers etcd on a control plane")
	}
	sort.Slice(cps, func(i, j int) bool { return cps[i].Name < cps[j].Name })
	name := op.Spec.EtcdRestore.Machine
	if name == "" {
		return cps[:1], nil
	}
	for _, n := range cps {
		if n.Name == name {
			return []*corev1.Node{n}, nil
		}
	}
	for _, n := range nodes {
		if n.Name == name {
			return nil, fmt.Errorf("%s is a worker: spec.etcdRestore.machine names the control plane that recovers etcd", name)
		}
	}
	return nil, errors.New(ichorv1.MachineNotANode(name, op.Spec.Machines != nil))
}

// HonourHold implements Executor: the restore concerns the whole cluster.
func (EtcdRestore) HonourHold() bool { return false }

// LockIdentity implements LockIdentifier: none of its own.
func (EtcdRestore) LockIdentity(*ichorv1.TalosOperation, ichorv1.MachineRole) string { return "" }

// Check implements Executor: the snapshot exists, verifies, and is not
// newer than the running store (unless spec.override): a snapshot from
// the future is another cluster's, or this one's before an earlier rewind.
//
// It also refuses to run from a controller on a control plane: the reset
// wipes its machine's EPHEMERAL, where its pod keeps the hand-over the
// rest of the restore needs while the API is gone.
func (EtcdRestore) Check(ctx context.Context, e *Env) []string {
	if cp := controllerOnControlPlane(e); cp != "" {
		return []string{fmt.Sprintf("the controller runs on the control plane %s, which the restore resets with EPHEMERAL wiped (its pod and the restore's hand-over with it): "+
			"move the controller to a worker first (kubectl -n %s delete pod %s once %s is cordoned, or a nodeSelector/affinity on the Deployment), then retry", cp, e.Controller.Namespace, podName(e.Controller.Pod), cp)}
	}
	st, running, err := checkSnapshot(ctx, e)
	if err != nil {
		return []string{err.Error()}
	}
	if running > 0 && st.Revision > running && !e.Op.Spec.Override {
		return []string{fmt.Sprintf("the snapshot %s is at revision %d, newer than the running store's %d: it is not a snapshot of this cluster's past (another cluster's, or one taken before an earlier restore); set spec.override to restore it anyway",
			e.Op.Spec.EtcdRestore.Snapshot, st.Revision, running)}
	}
	return nil
}

// controllerOnControlPlane names the control plane the controller's pod
// runs on (Controller.Node, the downward API's), or "".
func controllerOnControlPlane(e *Env) string {
	for _, n := range e.Nodes {
		if n.Name == e.Controller.Node && machine.Role(n) == ichorv1.RoleControlPlane {
			return n.Name
		}
	}
	return ""
}

// podName is the name of "namespace/name", or a placeholder outside a pod.
func podName(pod string) string {
	if _, name, ok := strings.Cut(pod, "/"); ok {
		return name
	}
	return "<the controller's pod>"
}

// Steps implements Executor.
func (EtcdRestore) Steps(*ichorv1.TalosOperation, *ichorv1.MachineStatus) []Step {
	return []Step{
		{Name: StepCheckSnapshot, Timeout: 10 * time.Minute, Run: runCheckSnapshot},
		{Name: StepLeaveOthers, Timeout: 10 * time.Minute, Irreversible: true, Run: runLeaveOthers},
		{Name: StepResetAll, Timeout: 20 * time.Minute, Irreversible: true, Run: runResetAll},
		{Name: StepRecover, Timeout: 15 * time.Minute, Irreversible: true, Run: runRecover},
		{Name: StepRestored, Timeout: 15 * time.Minute, Run: runRestored},
	}
}

// checkSnapshot fetches and verifies the operation's snapshot, and reads
// the running store's revision (0 when the API does not say).
func checkSnapshot(ctx context.Context, e *Env) (snapshot.Status, int64, error) {
	local, err := fetchSnapshot(ctx, e)
	if err != nil {
		return snapshot.Status{}, 0, err
	}
	st, err := snapshot.Verify(local)
	if err != nil {
		return st, 0, fmt.Errorf("the snapshot %s does not verify: %w", e.Op.Spec.EtcdRestore.Snapshot, err)
	}
	running, err := storeRevision(ctx, e)
	if err != nil {
		return st, 0, err
	}
	return st, running, nil
}

// snapshotCopy is where the controller keeps the snapshot of an operation
// it downloaded: the upload after the reset needs it when the API (and
// with it the Secret that reaches the bucket) is gone.
func snapshotCopy(op *ichorv1.TalosOperation) string {
	return filepath.Join(os.TempDir(), "ichor-etcd-restore-"+string(op.UID)+".db")
}

// fetchSnapshot makes the snapshot readable on the controller's disk and
// returns its path: a file:// snapshot where it is, an s3:// one in the
// operation's copy (downloaded with the Secret's credentials unless a
// copy that verifies is there).
func fetchSnapshot(ctx context.Context, e *Env) (string, error) {
	r := e.Op.Spec.EtcdRestore
	loc, err := snapshot.Parse(r.Snapshot)
	if err != nil {
		return "", err
	}
	if loc.Scheme == "file" {
		l, err := snapshot.Fetch(ctx, loc, snapshot.Credentials{})
		if err != nil {
			return "", err
		}
		return l.Path, nil
	}
	dst := snapshotCopy(e.Op)
	if _, err := snapshot.Verify(dst); err == nil {
		return dst, nil
	}
	creds, err := s3Credentials(ctx, e, r.Secret, "spec.etcdRestore.secret")
	if err != nil {
		return "", err
	}
	l, err := snapshot.Fetch(ctx, loc, creds)
	if err != nil {
		return "", err
	}
	if err := os.Rename(l.Path, dst); err != nil {
		_ = l.Close()
		return "", fmt.Errorf("keep the downloaded snapshot: %w", err)
	}
	return dst, nil
}

// s3Credentials reads an S3 snapshot's credentials from the Secret name in
// the controller's namespace, which the field says (none without a name).
func s3Credentials(ctx context.Context, e *Env, name, field string) (snapshot.Credentials, error) {
	if name == "" {
		return snapshot.Credentials{}, nil
	}
	var s corev1.Secret
	key := client.ObjectKey{Namespace: e.Controller.Namespace, Name: name}
	if err := e.Live.Get(ctx, key, &s); apierrors.IsForbidden(err) {
		return snapshot.Credentials{}, fmt.Errorf("the controller may not read the Secret %s/%s that %s names: "+
			"add it to the resourceNames of the Role ichor-controller-etcd-restore there (it lists ichor-etcd-snapshot), or put the credentials in ichor-etcd-snapshot", key.Namespace, key.Name, field)
	} else if err != nil {
		return snapshot.Credentials{}, fmt.Errorf("read the Secret %s/%s that %s names: %w", key.Namespace, key.Name, field, err)
	}
	return snapshot.CredentialsFrom(&s)
}

// storeRevision is the running store's revision: a quorum list's
// resourceVersion is etcd's revision.
func storeRevision(ctx context.Context, e *Env) (int64, error) {
	if e.Clientset == nil {
		return 0, nil
	}
	l, err := e.Clientset.CoreV1().Namespaces().List(ctx, metav1.ListOptions{Limit: 1})
	if err != nil {
		return 0, fmt.Errorf("read the store's revision: %w", err)
	}
	rev, err := strconv.ParseInt(l.ResourceVersion, 10, 64)
	if err != nil {
		return 0, nil // not etcd's revision: nothing to compare
	}
	return rev, nil
}

func revisionText(rev int64) string { return fmt.Sprintf("revision %d", rev) }

func parseRevision(s string) int64 {
	rev, _ := strconv.ParseInt(strings.TrimPrefix(s, "revision "), 10, 64)
	return rev
}

// runCheckSnapshot verifies the snapshot again right before anything is
// disrupted and records the recovering machine's boot, the running
// store's revision and the snapshot's.
func runCheckSnapshot(ctx context.Context, e *Env) (Outcome, error) {
	if err := e.requireAddress(); err != nil {
		return Outcome{}, err
	}
	st, running, err := checkSnapshot(ctx, e)
	if err != nil {
		if errors.Is(err, snapshot.ErrNotFound) {
			return Outcome{}, Fail("SnapshotNotFound", "%w", err)
		}
		return Outcome{}, Fail("SnapshotInvalid", "%w", err)
	}
	boot, err := talos.BootID(ctx, e.Talos, e.Address)
	if err != nil {
		return Outcome{}, err
	}
	return Outcome{BootID: boot, From: revisionText(running), To: revisionText(st.Revision),
		Message: fmt.Sprintf("snapshot verified: %s, sha256 %.12s; the store is at revision %d", st, st.SHA256, running)}, nil
}

// others are the control planes other than the recovering one.
func (e *Env) others() []string {
	return slices.DeleteFunc(slices.Clone(e.ControlPlanes), func(a string) bool { return a == e.Address })
}

// runLeaveOthers takes every other control plane out of etcd, forfeiting
// leadership first where it leads. It decides from the member list, so a
// rerun leaves only those still members.
func runLeaveOthers(ctx context.Context, e *Env) (Outcome, error) {
	if err := e.requireAddress(); err != nil {
		return Outcome{}, err
	}
	if err := notJournalled(ctx, e); err != nil {
		return Outcome{}, err
	}
	members, err := talos.EtcdMembers(ctx, e.Talos, e.Address)
	if err != nil {
		return Outcome{}, Fail("EtcdUnavailable", "%w", err)
	}
	var left []string
	for _, addr := range e.others() {
		if !slices.ContainsFunc(members, func(m talos.Member) bool { return slices.Contains(m.PeerIPs, addr) }) {
			continue
		}
		if leader, err := talos.IsLeader(ctx, e.Talos, addr); err == nil && leader {
			if _, err := talos.ForfeitLeadership(ctx, e.Talos, addr); err != nil {
				return Outcome{}, Fail("ForfeitFailed", "%w", err)
			}
		}
		if err := talos.LeaveEtcd(ctx, e.Talos, addr); err != nil {
			return Outcome{}, Fail("EtcdLeaveFailed", "%w", err)
		}
		left = append(left, addr)
	}
	members, err = talos.EtcdMembers(ctx, e.Talos, e.Address)
	if err != nil {
		return Outcome{}, Fail("EtcdUnavailable", "%w", err)
	}
	if len(members) != 1 || !slices.Contains(members[0].PeerIPs, e.Address) {
		return Outcome{}, Fail("EtcdLeaveFailed", "etcd should have the recovering machine as its one member, it has %d: %v", len(members), members)
	}
	if len(left) == 0 {
		return Outcome{Message: "the other control planes had left etcd already"}, nil
	}
	return Outcome{Message: fmt.Sprintf("%s left etcd", strings.Join(left, ", "))}, nil
}

// notJournalled fails when the journal in META holds a restore already:
// this operation's, which was handed over before and goes on from its
// hand-over (a store rewound to a snapshot taken while the operation ran
// has it again, at a step before; another replica may lead), or another
// operation's that did not finish. Leaving etcd again would take members
// out of the restored cluster, or out from under that restore.
func notJournalled(ctx context.Context, e *Env) error {
	st, _, err := journal.Journal{Talos: e.Talos, ControlPlanes: e.ControlPlanes}.ReadState(ctx)
	switch {
	case err != nil:
		return Fail("JournalUnreadable", "read the etcd restore journal in META before etcd is left: %w", err)
	case st == nil:
		return nil
	case st.UID == e.Op.UID:
		return Fail("RestoreHandedOver", "the journal in META (keys 0x%x, 0x%x) holds this operation's restore at %s: it was handed over already and goes on from its hand-over; nothing left etcd again",
			journal.StateKey, journal.OperationKey, st.Machine.Step)
	default:
		return Fail("RestoreUnderWay", "the journal in META (keys 0x%x, 0x%x) holds another operation's etcd restore (uid %s, at %s) that did not finish: "+
			"see the README's etcd restore section; once that restore is dealt with, clear the keys (talosctl meta delete) and retry", journal.StateKey, journal.OperationKey, st.UID, st.Machine.Step)
	}
}

// runResetAll resets every control plane at once with EPHEMERAL wiped,
// at most once: a rerun after an earlier run may have made the call
// (Calls > 1) looks at the recovering machine first (resetMade). It
// returns once every control plane answers again, the recovering one with
// a new boot.
//
// In the driver of a controller with a takeover (Controller.Takeover),
// the step hands the rest of the flow over to it instead: the driver's
// status and leadership do not survive the reset.
func runResetAll(ctx context.Context, e *Env) (Outcome, error) {
	if err := e.requireAddress(); err != nil {
		return Outcome{}, err
	}
	if e.Controller.Takeover != nil {
		return e.Controller.Takeover.HandOver(ctx, e)
	}
	if e.Machine.Calls <= 1 || !resetMade(ctx, e) {
		if err := talos.ResetForRecovery(ctx, e.Talos, e.ControlPlanes); err != nil && !talos.Unreachable(err) {
			return Outcome{}, Fail("ResetFailed", "%w", err)
		}
	}
	e.report("waiting for the control planes to come back from the reset")
	for {
		back, waiting := resetBack(ctx, e)
		if back {
			return Outcome{Message: fmt.Sprintf("%d control plane(s) reset with EPHEMERAL wiped", len(e.ControlPlanes))}, nil
		}
		e.report("waiting for " + waiting + " to come back from the reset")
		if err := pause(ctx, 2*time.Second); err != nil {
			return Outcome{}, Fail("ResetTimedOut", "the control planes did not come back from the reset: %s does not answer", waiting)
		}
	}
}

// resetMade says whether an earlier run's reset reached the recovering
// machine: it does not answer, it has booted since its recorded boot, or
// it is in the reset's stages (resetting, then rebooting). A machine that
// answers and shows none of it is given showTime to show it, as call.make
// gives one: Talos answers the call first and enters the stage after.
func resetMade(ctx context.Context, e *Env) bool {
	since := time.Now()
	for {
		boot, stage, err := observe(ctx, e)
		switch {
		case talos.Unreachable(err):
			return true
		case err == nil && (boot != e.Machine.BootID || stage == runtime.MachineStageResetting || stage == runtime.MachineStageRebooting):
			return true
		case time.Since(since) >= showTime:
			return false
		}
		if pause(ctx, poll) != nil {
			return false
		}
	}
}

// resetBack says whether every control plane answers, the recovering one
// with a boot other than the recorded one, or names one that does not.
func resetBack(ctx context.Context, e *Env) (bool, string) {
	for _, addr := range e.ControlPlanes {
		cctx, cancel := context.WithTimeout(ctx, probeTimeout)
		boot, err := talos.BootID(cctx, e.Talos, addr)
		cancel()
		if err != nil || addr == e.Address && boot == e.Machine.BootID {
			return false, addr
		}
	}
	return true, ""
}

// runRecover uploads the snapshot to the recovering machine and
// bootstraps etcd from it, retrying while Talos is not ready for either
// (FailedPrecondition, as Talos's own test retries). A Bootstrap refused
// with AlreadyExists after one that may have been made (by an earlier run,
// or by this one, whose answer did not come) means etcd's data is there:
// that Bootstrap made it; the step after checks the store's revision.
func runRecover(ctx context.Context, e *Env) (Outcome, error) {
	if err := e.requireAddress(); err != nil {
		return Outcome{}, err
	}
	local, err := fetchSnapshot(ctx, e)
	if err != nil {
		return Outcome{}, Fail("SnapshotNotFound", "the snapshot is needed again for the upload: %w", err)
	}
	earlier := e.Machine.Calls > 1 // an earlier run may have bootstrapped
	if earlier {
		if _, err := talos.EtcdMembers(ctx, e.Talos, e.Address); err == nil {
			// etcd answers on the recovering machine, which the reset
			// left without it: an earlier run's Bootstrap made it.
			return Outcome{Message: "etcd was bootstrapped from the snapshot by an earlier run"}, nil
		}
	}
	// Once this run has sent a Bootstrap that was not refused, it may have
	// taken effect: from then on only the Bootstrap is sent again (its
	// AlreadyExists is the answer that did not come), never the upload,
	// which would leave a snapshot beside the restored store. A run after
	// a crash (earlier) uploads again: it cannot know that the
	// earlier run's upload is there, and a Bootstrap without it restores
	// nothing.
	bootstrapped := false
	for {
		var err error
		sent := bootstrapped
		if !bootstrapped {
			err = talos.UploadSnapshot(ctx, e.Talos, e.Address, local)
			sent = err == nil
		}
		if sent {
			err = talos.BootstrapFromSnapshot(ctx, e.Talos, e.Address)
		}
		code := talosclient.StatusCode(err)
		switch {
		case err == nil:
			return Outcome{Message: "etcd bootstrapped from the snapshot, " + e.Machine.To}, nil
		case code == codes.AlreadyExists && (earlier || bootstrapped):
			return Outcome{Message: "etcd was bootstrapped from the snapshot by an earlier Bootstrap whose answer did not come"}, nil
		case code == codes.AlreadyExists:
			return Outcome{}, Fail("EtcdNotEmpty", "etcd's data on %s is not empty: it was not wiped by the reset (%v)", e.Machine.Name, err)
		case code != codes.FailedPrecondition && code != codes.DeadlineExceeded && !talos.Unreachable(err):
			return Outcome{}, Fail("RecoverFailed", "%w", err)
		}
		// Refused before anything changed, or not answered: only the
		// refusal says that no Bootstrap was made.
		bootstrapped = bootstrapped || sent && code != codes.FailedPrecondition
		e.report("waiting for Talos to be ready for the recovery: " + err.Error())
		if err := pause(ctx, time.Second); err != nil {
			return Outcome{}, Fail("RecoverTimedOut", "Talos on %s was not ready for the recovery in time", e.Machine.Name)
		}
	}
}

// runRestored waits until every control plane is a healthy voter of the
// restored etcd, and checks the store is the snapshot's: its revision is
// at least the snapshot's (the API servers write on from there).
func runRestored(ctx context.Context, e *Env) (Outcome, error) {
	var last error
	for {
		last = talos.EtcdRestored(ctx, e.Talos, e.ControlPlanes)
		if last == nil {
			break
		}
		e.report("waiting for the control planes to join the restored etcd: " + last.Error())
		if err := pause(ctx, 2*time.Second); err != nil {
			return Outcome{}, Fail("EtcdNotRestored", "etcd is not healthy after the restore: %w", last)
		}
	}
	want := parseRevision(e.Machine.To)
	var rev int64
	for {
		rev, last = storeRevision(ctx, e)
		if last == nil {
			break
		}
		e.report("waiting for the API to answer on the restored store")
		if err := pause(ctx, 2*time.Second); err != nil {
			return Outcome{}, Fail("APINotBack", "the API did not answer after the restore: %w", last)
		}
	}
	if rev != 0 && rev < want {
		return Outcome{}, Fail("EtcdNotRestored", "the store is at revision %d, before the snapshot's %d: it was not restored from it", rev, want)
	}
	_ = os.Remove(snapshotCopy(e.Op)) // a downloaded copy is no longer needed
	return Outcome{Message: fmt.Sprintf("etcd restored to %s on %d healthy member(s); the store is at revision %d", e.Machine.To, len(e.ControlPlanes), rev)}, nil
}

// pause waits d, or fails when ctx ends first.
func pause(ctx context.Context, d time.Duration) error {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-ctx.Done():
		return ctx.Err()
	case <-t.C:
		return nil
	}
}
