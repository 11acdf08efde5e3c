package preflight

import (
	"fmt"
	"slices"
	"strings"

	"maesh.dev/ichor/api/compat"
)

// report collects failures; a check that fails for several reasons is
// reported once, its reasons joined, because a Refused operation has one
// condition per check.
type report struct {
	msgs map[string][]string
}

func (r *report) add(check, msg string) {
	if r.msgs == nil {
		r.msgs = map[string][]string{}
	}
	r.msgs[check] = append(r.msgs[check], msg)
}

func (r *report) failed(check string) bool { return len(r.msgs[check]) > 0 }

func (r *report) sorted() []Failure {
	var out []Failure
	for _, check := range Checks {
		if msgs := r.msgs[check]; len(msgs) > 0 {
			out = append(out, Failure{Check: check, Message: strings.Join(msgs, "; ")})
		}
	}
	return out
}

// group is one version and who runs it, as the messages name them.
type group struct {
	v   compat.Version
	who []string
}

// groups are the distinct versions running, oldest first.
type groups []group

func (gs *groups) add(v compat.Version, who string) {
	i, found := slices.BinarySearchFunc(*gs, v, func(g group, v compat.Version) int { return g.v.Compare(v) })
	if found && (*gs)[i].v == v {
		(*gs)[i].who = append((*gs)[i].who, who)
		return
	}
	*gs = slices.Insert(*gs, i, group{v: v, who: []string{who}})
}

// facts are the versions of the cluster the checks read.
type facts struct {
	// machines is how many machines the checks look at.
	machines        int
	talos, kubelets groups
	// controlPlane is nil when it could not be read.
	controlPlane *compat.Version
	// cilium is "" for none; ciliumOK is false when it could not be read.
	cilium   string
	ciliumOK bool
}

// gather reads the versions of the machines, reporting those it cannot read
// under VersionsReadable. A machine Ichor cannot read is left out of the
// version checks, which then cannot vouch for it: the VersionsReadable
// failure is what refuses the operation.
func gather(r *report, machines []Machine, c Cluster) facts {
	f := facts{machines: len(machines)}
	var unreadable []string
	for _, m := range machines {
		if v, err := compat.ParseVersion(m.Talos); err == nil {
			f.talos.add(v, m.Name)
		} else {
			unreadable = append(unreadable, fmt.Sprintf("Talos %q on %s", m.Talos, m.Name))
		}
		if v, err := compat.ParseVersion(m.Kubelet); err == nil {
			f.kubelets.add(v, m.Name)
		} else {
			unreadable = append(unreadable, fmt.Sprintf("kubelet %q on %s", m.Kubelet, m.Name))
		}
	}
	if v, err := compat.ParseVersion(c.ControlPlane); err == nil {
		f.controlPlane = &v
	} else {
		unreadable = append(unreadable, fmt.Sprintf("the control plane's Kubernetes %q", c.ControlPlane))
	}
	f.ciliumOK = true
	if c.Cilium != "" {
		if v, err := compat.ParseVersion(c.Cilium); err == nil {
			f.cilium = v.String()
		} else {
			f.ciliumOK = false
			unreadable = append(unreadable, fmt.Sprintf("Cilium %q", c.Cilium))
		}
	}
	if len(c.Unreadable) > 0 {
		r.add(VersionsReadable, fmt.Sprintf("Ichor cannot read %s, so it cannot check for removed feature gates, flags and APIs; "+
			"make those machines answer the Talos API or leave them out with spec.machines", andList(c.Unreadable, 5)))
	}
	if len(unreadable) > 0 {
		r.add(VersionsReadable, fmt.Sprintf("Ichor cannot read %s, so it cannot check them; fix what the Nodes report "+
			"(status.nodeInfo.osImage and kubeletVersion) or leave those machines out with spec.machines", andList(unreadable, 5)))
	}
	return f
}

// on names machines for a message: "on cp-1, w-1 and 3 more", or "on all
// 6 machines" when they are all the machines the check looked at.
func on(names []string, all int) string {
	if all > 1 && len(names) == all {
		return fmt.Sprintf("on all %d machines", all)
	}
	return "on " + andList(names, 3)
}

// andList joins items as "a, b and c", naming at most max of them and
// counting the rest ("a, b and 7 more"), so a message over 5,000 machines
// stays short.
func andList(items []string, max int) string {
	if len(items) > max {
		return strings.Join(items[:max], ", ") + fmt.Sprintf(" and %d more", len(items)-max)
	}
	if len(items) <= 1 {
		return strings.Join(items, "")
	}
	return strings.Join(items[:len(items)-1], ", ") + " and " + items[len(items)-1]
}

// orList joins items as "a, b or c".
func orList(items []string) string {
	if len(items) <= 1 {
		return strings.Join(items, "")
	}
	return strings.Join(items[:len(items)-1], ", ") + " or " + items[len(items)-1]
}
