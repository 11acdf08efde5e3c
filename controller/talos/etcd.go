package talos

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/url"
	"slices"
	"sort"
	"strings"

	"github.com/siderolabs/talos/pkg/machinery/api/machine"
	talosclient "github.com/siderolabs/talos/pkg/machinery/client"
)

// Member is one etcd member as the control planes report it.
type Member struct {
	ID       uint64
	Hostname string
	Learner  bool
	PeerIPs  []string
	// ClientURLs are where the member serves etcd's clients.
	ClientURLs []string
}

// EtcdMembers lists the etcd members as the control plane at node sees them.
func EtcdMembers(ctx context.Context, c *talosclient.Client, node string) ([]Member, error) {
	resp, err := c.EtcdMemberList(talosclient.WithNode(ctx, node), &machine.EtcdMemberListRequest{QueryLocal: true})
	if err != nil {
		return nil, fmt.Errorf("etcd members on %s: %w", node, err)
	}
	if len(resp.Messages) == 0 {
		return nil, fmt.Errorf("etcd members on %s: empty answer", node)
	}
	return members(resp.Messages[0]), nil
}

func members(msg *machine.EtcdMembers) []Member {
	var out []Member
	for _, m := range msg.Members {
		mem := Member{ID: m.Id, Hostname: m.Hostname, Learner: m.IsLearner, ClientURLs: m.ClientUrls}
		for _, u := range m.PeerUrls {
			if pu, err := url.Parse(u); err == nil {
				if host, _, err := net.SplitHostPort(pu.Host); err == nil {
					mem.PeerIPs = append(mem.PeerIPs, host)
				}
			}
		}
		out = append(out, mem)
	}
	sort.Slice(out, func(i, j int) bool { return out[i].ID < out[j].ID })
	return out
}

// EtcdHealth is the check before a control plane is disrupted, as talosctl's
// cluster health check does it: every control plane reports the same member
// list, every member is a started voter on a control plane, there are not
// exactly two members (losing one would lose quorum), every member has a
// leader and no errors, and no alarm is raised.
func EtcdHealth(ctx context.Context, c *talosclient.Client, controlPlanes []string) error {
	return etcdHealth(ctx, c, controlPlanes, func(ms []Member) error {
		if len(ms) == 2 {
			return errors.New("etcd has exactly two members: disrupting either loses quorum; add a third control plane or remove one first")
		}
		return nil
	})
}

// EtcdRemoved is the check that the removal of the control plane named
// name (whose Node had the given addresses) has settled: etcd lists no
// member for it (by hostname or peer address) and is healthy on the
// remaining control planes as EtcdHealth finds it, but for the rule on two
// members (which is about disrupting one of them, not about health).
func EtcdRemoved(ctx context.Context, c *talosclient.Client, controlPlanes []string, name string, addresses []string) error {
	return etcdHealth(ctx, c, controlPlanes, func(ms []Member) error {
		for _, m := range ms {
			if m.Hostname == name || slices.ContainsFunc(m.PeerIPs, func(ip string) bool { return slices.Contains(addresses, ip) }) {
				return fmt.Errorf("etcd still lists member %s (%x, peer %s) for the removed machine %s: remove it (talosctl etcd remove-member)",
					m.Hostname, m.ID, strings.Join(m.PeerIPs, ","), name)
			}
		}
		return nil
	})
}

// etcdHealth is EtcdHealth with check, its caller's own, as the first
// check of the member list.
func etcdHealth(ctx context.Context, c *talosclient.Client, controlPlanes []string, check func([]Member) error) error {
	if len(controlPlanes) == 0 {
		return errors.New("no control planes to check etcd on")
	}
	resp, err := c.EtcdMemberList(talosclient.WithNodes(ctx, controlPlanes...), &machine.EtcdMemberListRequest{QueryLocal: true})
	if err != nil {
		return fmt.Errorf("etcd member list: %w", err)
	}
	var first []Member
	for i, msg := range resp.Messages {
		got := members(msg)
		if i == 0 {
			first = got
			continue
		}
		if !sameMembers(first, got) {
			return fmt.Errorf("etcd member lists differ between control planes (%s sees %s, %s sees %s)",
				hostname(resp.Messages[0].Metadata), describe(first), hostname(msg.Metadata), describe(got))
		}
	}
	if err := check(first); err != nil {
		return err
	}
	if err := checkMembers(first, controlPlanes); err != nil {
		return err
	}
	st, err := c.EtcdStatus(talosclient.WithNodes(ctx, controlPlanes...))
	if err != nil {
		return fmt.Errorf("etcd status: %w", err)
	}
	for _, msg := range st.Messages {
		ms := msg.MemberStatus
		switch {
		case ms == nil:
			return fmt.Errorf("etcd status on %s: empty answer", hostname(msg.Metadata))
		case len(ms.Errors) > 0:
			return fmt.Errorf("etcd member on %s reports errors: %s", hostname(msg.Metadata), strings.Join(ms.Errors, "; "))
		case ms.Leader == 0:
			return fmt.Errorf("etcd member on %s has no leader", hostname(msg.Metadata))
		}
	}
	alarms, err := c.EtcdAlarmList(talosclient.WithNodes(ctx, controlPlanes...))
	if err != nil {
		return fmt.Errorf("etcd alarms: %w", err)
	}
	for _, msg := range alarms.Messages {
		for _, a := range msg.MemberAlarms {
			if a.Alarm != machine.EtcdMemberAlarm_NONE {
				return fmt.Errorf("etcd alarm %s raised on member %x (seen from %s): disarm it before disrupting a control plane",
					a.Alarm, a.MemberId, hostname(msg.Metadata))
			}
		}
	}
	return nil
}

func checkMembers(ms []Member, controlPlanes []string) error {
	switch {
	case len(ms) == 0:
		return errors.New("etcd reports no members")
	}
	for _, m := range ms {
		if m.Learner {
			return fmt.Errorf("etcd member %s is still a learner: wait for it to be promoted", m.Hostname)
		}
		for _, ip := range m.PeerIPs {
			if !slices.Contains(controlPlanes, ip) {
				return fmt.Errorf("etcd member %s (%s) is not one of the control planes %v: remove it first", m.Hostname, ip, controlPlanes)
			}
		}
	}
	return nil
}

func sameMembers(a, b []Member) bool {
	if len(a) != len(b) {
		return false
	}
	for i := range a {
		if a[i].ID != b[i].ID || a[i].Hostname != b[i].Hostname || a[i].Learner != b[i].Learner {
			return false
		}
	}
	return true
}

func describe(ms []Member) string {
	var names []string
	for _, m := range ms {
		names = append(names, m.Hostname)
	}
	return "[" + strings.Join(names, " ") + "]"
}

type hostnamed interface{ GetHostname() string }

func hostname(md hostnamed) string {
	if md == nil {
		return "?"
	}
	if h := md.GetHostname(); h != "" {
		return h
	}
	return "?"
}

// EtcdSnapshot streams a snapshot of etcd from the control plane at node
// into w, as `talosctl etcd snapshot` does: the file etcd's maintenance API
// makes, its SHA-256 at the end.
func EtcdSnapshot(ctx context.Context, c *talosclient.Client, node string, w io.Writer) error {
	rc, err := c.EtcdSnapshot(talosclient.WithNode(ctx, node), &machine.EtcdSnapshotRequest{})
	if err != nil {
		return fmt.Errorf("etcd snapshot from %s: %w", node, err)
	}
	defer rc.Close() //nolint:errcheck
	if _, err := io.Copy(w, rc); err != nil {
		return fmt.Errorf("etcd snapshot from %s: %w", node, err)
	}
	return nil
}
