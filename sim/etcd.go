package sim

import (
	"bytes"
	"crypto/sha256"
	"encoding/json"
	"errors"
	"fmt"
	"math/rand/v2"
	"sync"

	"github.com/siderolabs/talos/pkg/machinery/api/machine"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
)

// etcdCluster is the small etcd model: the members are control planes; a
// member is healthy while its machine is up, runs etcd and has no
// etcd-unhealthy fault; a leader exists while a quorum of members is
// healthy; alarms can be raised and disarmed; forfeit moves the leader;
// leave and remove take a member out.
type etcdCluster struct {
	f *Fleet

	mu        sync.Mutex
	members   []*etcdMember
	leader    uint64
	term      uint64
	raftIndex uint64
	revision  int64 // of the key-value store: only writes move it
	alarms    []alarm
	// upgradeMu is Talos's etcd upgrade mutex, held by a legacy Upgrade
	// call during its checks.
	upgradeMu sync.Mutex
}

type etcdMember struct {
	id      uint64
	machine *Machine
}

type alarm struct {
	member uint64
	typ    machine.EtcdMemberAlarm_AlarmType
}

// EtcdState is a snapshot of the etcd model.
type EtcdState struct {
	Members []EtcdMember
	// Leader is the leading member's machine name, empty without quorum.
	Leader string
	Alarms []EtcdAlarm
	// Revision is the key-value store's revision: writes (Fleet.EtcdWrite,
	// the legacy upgrade's mutex) move it; a recovery from a snapshot
	// restores the snapshot's.
	Revision int64
}

// EtcdMember is one member in EtcdState.
type EtcdMember struct {
	ID      uint64
	Name    string
	Healthy bool
}

// EtcdAlarm is one raised alarm in EtcdState.
type EtcdAlarm struct {
	Member string
	Alarm  machine.EtcdMemberAlarm_AlarmType
}

func newEtcd(f *Fleet) *etcdCluster { return &etcdCluster{f: f, revision: 1} }

// State returns a snapshot of the model.
func (e *etcdCluster) State() EtcdState {
	e.mu.Lock()
	defer e.mu.Unlock()
	st := EtcdState{Revision: e.revision}
	for _, mem := range e.members {
		st.Members = append(st.Members, EtcdMember{ID: mem.id, Name: mem.machine.Name(), Healthy: e.healthyLocked(mem)})
		if mem.id == e.leader {
			st.Leader = mem.machine.Name()
		}
	}
	for _, a := range e.alarms {
		st.Alarms = append(st.Alarms, EtcdAlarm{Member: e.nameLocked(a.member), Alarm: a.typ})
	}
	return st
}

func (e *etcdCluster) nameLocked(id uint64) string {
	for _, mem := range e.members {
		if mem.id == id {
			return mem.machine.Name()
		}
	}
	return fmt.Sprintf("%016x", id)
}

func (e *etcdCluster) healthyLocked(mem *etcdMember) bool {
	m := mem.machine
	m.mu.Lock()
	defer m.mu.Unlock()
	return m.up && m.etcdRunning && m.memberID == mem.id && !m.hasFaultLocked(FaultEtcdUnhealthy, false)
}

// bootstrapAll makes every control plane a member of a running cluster, for
// a fleet that starts bootstrapped.
func (e *etcdCluster) bootstrapAll(cps []*Machine) {
	e.mu.Lock()
	for _, m := range cps {
		e.addLocked(m)
	}
	e.mu.Unlock()
	e.update()
}

func (e *etcdCluster) addLocked(m *Machine) *etcdMember {
	mem := &etcdMember{id: e.newIDLocked(), machine: m}
	e.members = append(e.members, mem)
	e.raftIndex++
	m.mu.Lock()
	m.memberID, m.etcdData, m.etcdRunning = mem.id, true, true
	m.mu.Unlock()
	return mem
}

func (e *etcdCluster) newIDLocked() uint64 {
	for {
		id := rand.Uint64()
		if id == 0 {
			continue
		}
		dup := false
		for _, mem := range e.members {
			dup = dup || mem.id == id
		}
		if !dup {
			return id
		}
	}
}

// update re-elects a leader when needed, lets control planes with empty
// etcd data join a cluster that has a leader, and refreshes each machine's
// etcd Service resource.
func (e *etcdCluster) update() {
	e.mu.Lock()
	e.electLocked()
	var joined []*Machine
	if e.leader != 0 {
		for _, m := range e.f.controlPlanes {
			m.mu.Lock()
			waiting := m.up && !m.etcdData && !m.etcdStopped
			m.mu.Unlock()
			if waiting {
				e.addLocked(m)
				joined = append(joined, m)
			}
		}
		e.electLocked()
	}
	e.mu.Unlock()
	for _, m := range joined {
		e.f.logf("%s: joined etcd", m.Name())
	}
	for _, m := range e.f.controlPlanes {
		m.refreshEtcdService()
	}
	e.follow()
}

func (e *etcdCluster) electLocked() {
	healthy := 0
	var first *etcdMember
	leaderOK := false
	for _, mem := range e.members {
		if e.healthyLocked(mem) {
			healthy++
			if first == nil {
				first = mem
			}
			leaderOK = leaderOK || mem.id == e.leader
		}
	}
	if healthy*2 <= len(e.members) || len(e.members) == 0 {
		if e.leader != 0 {
			e.leader = 0
			e.raftIndex++
		}
		return
	}
	if !leaderOK {
		e.leader = first.id
		e.term++
		e.raftIndex++
	}
}

func errNoLeader() error { return status.Error(codes.Unavailable, "etcdserver: no leader") }

// requireLeader is clientv3.WithRequireLeader: calls fail without quorum.
func (e *etcdCluster) requireLeaderLocked() error {
	if e.leader == 0 {
		return errNoLeader()
	}
	return nil
}

func (e *etcdCluster) memberList() ([]*machine.EtcdMember, error) {
	// A hosted fleet's members are one real etcd: each advertises where it
	// serves clients, so that a client of the URLs Talos answers with
	// reaches the data. Read before the model's lock, so that the two
	// locks never nest here.
	hosted := ""
	if e.f.hosting != nil {
		hosted = e.f.hosting.etcd.clientURL()
	}
	e.mu.Lock()
	defer e.mu.Unlock()
	if err := e.requireLeaderLocked(); err != nil {
		return nil, err
	}
	out := make([]*machine.EtcdMember, 0, len(e.members))
	for _, mem := range e.members {
		addr := mem.machine.Address()
		client := "https://" + addr + ":2379"
		if hosted != "" {
			client = hosted
		}
		out = append(out, &machine.EtcdMember{
			Id:         mem.id,
			Hostname:   mem.machine.Name(),
			PeerUrls:   []string{"https://" + addr + ":2380"},
			ClientUrls: []string{client},
		})
	}
	return out, nil
}

func (e *etcdCluster) status(m *Machine) (*machine.EtcdMemberStatus, error) {
	e.mu.Lock()
	defer e.mu.Unlock()
	m.mu.Lock()
	running, id, unhealthy := m.etcdRunning, m.memberID, m.hasFaultLocked(FaultEtcdUnhealthy, false)
	m.mu.Unlock()
	if !running {
		return nil, errors.New("failed to query etcd status: dial tcp 127.0.0.1:2379: connect: connection refused")
	}
	st := &machine.EtcdMemberStatus{
		MemberId:         id,
		ProtocolVersion:  "3.6.8",
		StorageVersion:   "3.6.0",
		DbSize:           m.etcdDBSize,
		DbSizeInUse:      m.etcdDBInUse,
		Leader:           e.leader,
		RaftTerm:         e.term,
		RaftIndex:        e.raftIndex,
		RaftAppliedIndex: e.raftIndex,
	}
	if unhealthy {
		st.Leader = 0
		st.Errors = append(st.Errors, "etcdserver: no leader (simulated etcd-unhealthy fault)")
	}
	for _, a := range e.alarms {
		if a.member == id {
			st.Errors = append(st.Errors, fmt.Sprintf("memberID:%d alarm:%s", a.member, a.typ))
		}
	}
	return st, nil
}

func (e *etcdCluster) alarmList() ([]*machine.EtcdMemberAlarm, error) {
	e.mu.Lock()
	defer e.mu.Unlock()
	if err := e.requireLeaderLocked(); err != nil {
		return nil, fmt.Errorf("failed to list etcd alarms: %w", err)
	}
	out := make([]*machine.EtcdMemberAlarm, 0, len(e.alarms))
	for _, a := range e.alarms {
		out = append(out, &machine.EtcdMemberAlarm{MemberId: a.member, Alarm: a.typ})
	}
	return out, nil
}

func (e *etcdCluster) disarm() ([]*machine.EtcdMemberAlarm, error) {
	list, err := e.alarmList()
	if err != nil {
		return nil, err
	}
	e.mu.Lock()
	e.alarms = nil
	e.raftIndex++
	e.mu.Unlock()
	return list, nil
}

func (e *etcdCluster) raiseAlarm(m *Machine, typ machine.EtcdMemberAlarm_AlarmType) {
	m.mu.Lock()
	id := m.memberID
	m.mu.Unlock()
	if id == 0 {
		return
	}
	e.mu.Lock()
	defer e.mu.Unlock()
	for _, a := range e.alarms {
		if a.member == id && a.typ == typ {
			return
		}
	}
	e.alarms = append(e.alarms, alarm{member: id, typ: typ})
	e.raftIndex++
}

func (e *etcdCluster) clearAlarm(m *Machine, typ machine.EtcdMemberAlarm_AlarmType) {
	m.mu.Lock()
	id := m.memberID
	m.mu.Unlock()
	e.mu.Lock()
	defer e.mu.Unlock()
	for i, a := range e.alarms {
		if a.member == id && a.typ == typ {
			e.alarms = append(e.alarms[:i], e.alarms[i+1:]...)
			e.raftIndex++
			return
		}
	}
}

func (e *etcdCluster) forfeit(m *Machine) (string, error) {
	e.mu.Lock()
	defer e.mu.Unlock()
	if err := e.requireLeaderLocked(); err != nil {
		return "", fmt.Errorf("failed to forfeit leadership: failed to list etcd members: %w", err)
	}
	if len(e.members) == 1 {
		return "", errors.New("failed to forfeit leadership: cannot forfeit leadership, only one member")
	}
	m.mu.Lock()
	id := m.memberID
	m.mu.Unlock()
	if e.leader != id || id == 0 {
		return "", nil
	}
	for _, mem := range e.members {
		if mem.id != id && e.healthyLocked(mem) {
			e.leader = mem.id
			e.term++
			e.raftIndex++
			return mem.machine.Name(), nil
		}
	}
	return "", errors.New("failed to forfeit leadership: etcdserver: unhealthy cluster")
}

// remove takes the member out; the machine it ran on stops etcd.
func (e *etcdCluster) remove(id uint64) error {
	e.mu.Lock()
	if err := e.requireLeaderLocked(); err != nil {
		e.mu.Unlock()
		return err
	}
	idx := -1
	for i, mem := range e.members {
		if mem.id == id {
			idx = i
		}
	}
	if idx < 0 {
		e.mu.Unlock()
		return status.Errorf(codes.NotFound, "failed to remove member %d: etcdserver: member not found", id)
	}
	if len(e.members) == 1 {
		e.mu.Unlock()
		return fmt.Errorf("failed to remove member %d: etcdserver: re-configuration failed due to not enough started members", id)
	}
	mem := e.members[idx]
	e.members = append(e.members[:idx], e.members[idx+1:]...)
	e.raftIndex++
	kept := e.alarms[:0]
	for _, a := range e.alarms {
		if a.member != id {
			kept = append(kept, a)
		}
	}
	e.alarms = kept
	mem.machine.mu.Lock()
	if mem.machine.memberID == id {
		mem.machine.etcdRunning = false
	}
	mem.machine.mu.Unlock()
	e.mu.Unlock()
	e.update()
	return nil
}

// leave is EtcdLeaveCluster on m: remove its member, stop etcd, wipe its data.
func (e *etcdCluster) leave(m *Machine) error {
	m.mu.Lock()
	id := m.memberID
	m.mu.Unlock()
	if id != 0 {
		if err := e.remove(id); err != nil && status.Code(err) != codes.NotFound {
			return fmt.Errorf("failed to leave cluster: %w", err)
		}
	}
	m.mu.Lock()
	m.memberID, m.etcdRunning, m.etcdData, m.etcdStopped = 0, false, false, true
	m.mu.Unlock()
	m.refreshEtcdService()
	e.follow()
	return nil
}

// wipe is a reset of m's EPHEMERAL partition: its etcd data is gone (its
// member, if any, stays in the cluster until removed, as in real etcd).
func (e *etcdCluster) wipe(m *Machine) {
	m.mu.Lock()
	m.memberID, m.etcdRunning, m.etcdData = 0, false, false
	m.mu.Unlock()
	e.update()
}

// snapshotData is what a simulated snapshot holds.
type snapshotData struct {
	Cluster  string   `json:"cluster"`
	Revision int64    `json:"revision"`
	Members  []string `json:"members"`
}

// snapshot renders a snapshot the way etcd writes one: data in 512-byte
// blocks followed by its SHA-256 (talosctl checks size%512 == sha256.Size).
func (e *etcdCluster) snapshot() ([]byte, error) {
	e.mu.Lock()
	if err := e.requireLeaderLocked(); err != nil {
		e.mu.Unlock()
		return nil, fmt.Errorf("failed reading etcd snapshot: %w", err)
	}
	d := snapshotData{Cluster: e.f.spec.Name, Revision: e.revision}
	for _, mem := range e.members {
		d.Members = append(d.Members, mem.machine.Name())
	}
	e.mu.Unlock()
	body, err := json.Marshal(d)
	if err != nil {
		return nil, err
	}
	pad := (512 - len(body)%512) % 512
	body = append(body, bytes.Repeat([]byte{' '}, pad)...)
	sum := sha256.Sum256(body)
	return append(body, sum[:]...), nil
}

func parseSnapshot(b []byte, skipHash bool) (snapshotData, error) {
	var d snapshotData
	if len(b) < sha256.Size || len(b)%512 != sha256.Size {
		return d, errors.New("snapshot has no trailing SHA-256 hash")
	}
	body, sum := b[:len(b)-sha256.Size], b[len(b)-sha256.Size:]
	if got := sha256.Sum256(body); !skipHash && !bytes.Equal(got[:], sum) {
		return d, errors.New("snapshot hash mismatch")
	}
	if err := json.Unmarshal(bytes.TrimRight(body, " "), &d); err != nil {
		return d, fmt.Errorf("not a snapshot of a simulated etcd: %w", err)
	}
	return d, nil
}

// bootstrap starts a new single-member cluster on m (from a snapshot when
// from is not nil); the other control planes with empty data join it.
func (e *etcdCluster) bootstrap(m *Machine, from *snapshotData) {
	e.mu.Lock()
	for _, mem := range e.members {
		mem.machine.mu.Lock()
		if mem.machine.memberID == mem.id {
			// A member of the old cluster is cut off from the new one.
			mem.machine.etcdRunning = false
		}
		mem.machine.mu.Unlock()
	}
	e.members, e.leader, e.alarms = nil, 0, nil
	e.addLocked(m)
	e.revision = 1
	if from != nil {
		e.revision = from.Revision
	}
	e.mu.Unlock()
	e.update()
}

// isMember reports whether m's member ID is in the cluster.
func (e *etcdCluster) isMember(m *Machine) bool {
	m.mu.Lock()
	id := m.memberID
	m.mu.Unlock()
	e.mu.Lock()
	defer e.mu.Unlock()
	for _, mem := range e.members {
		if id != 0 && mem.id == id {
			return true
		}
	}
	return false
}

// validateForUpgrade is the legacy Upgrade's etcd check on a control
// plane: take the upgrade mutex, refuse two members, refuse any member that
// fails a quorum read.
func (e *etcdCluster) validateForUpgrade() error {
	if !e.upgradeMu.TryLock() {
		return errors.New("failed to acquire upgrade mutex: error trying to lock etcd upgrade mutex: mutex: Locked by another session")
	}
	defer e.upgradeMu.Unlock()
	e.mu.Lock()
	defer e.mu.Unlock()
	if e.leader == 0 {
		return errors.New("failed to acquire upgrade mutex: error establishing etcd concurrency session: etcdserver: no leader")
	}
	e.revision += 2 // the mutex's key, put and deleted
	if len(e.members) == 2 {
		return fmt.Errorf("error validating etcd for upgrade: etcd member count(%d) is insufficient to maintain quorum if upgrade commences", len(e.members))
	}
	for _, mem := range e.members {
		if !e.healthyLocked(mem) {
			return fmt.Errorf("error validating etcd for upgrade: etcd member %016x is not healthy; all members must be healthy to perform an upgrade: context deadline exceeded", mem.id)
		}
	}
	return nil
}

// write is a client write: it needs a leader and moves the revision.
func (e *etcdCluster) write() error {
	e.mu.Lock()
	defer e.mu.Unlock()
	if err := e.requireLeaderLocked(); err != nil {
		return err
	}
	e.revision++
	e.raftIndex++
	return nil
}
