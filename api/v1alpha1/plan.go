package v1alpha1

import (
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
)

// planned is what a plan shows of one machine, in the order it runs.
type planned struct {
	Name    string       `json:"n"`
	Role    MachineRole  `json:"r,omitempty"`
	Phase   MachinePhase `json:"p,omitempty"`
	From    string       `json:"f,omitempty"`
	To      string       `json:"t,omitempty"`
	Message string       `json:"m,omitempty"`
}

// PlanFingerprint identifies the plan the operation's status holds: the
// target, the batch size, and the machines in order with their roles, what
// they go from and to, and what the plan says of each (skipped, already
// done, needs a reboot). Whatever else status says (conditions, times)
// leaves it as it is.
func (o *TalosOperation) PlanFingerprint() string {
	ms := make([]planned, len(o.Status.Machines))
	for i, m := range o.Status.Machines {
		ms[i] = planned{Name: m.Name, Role: m.Role, Phase: m.Phase, From: m.From, To: m.To, Message: m.Message}
	}
	b, err := json.Marshal(struct {
		Target         string    `json:"target"`
		MaxUnavailable int32     `json:"maxUnavailable"`
		Machines       []planned `json:"machines"`
	}{o.Status.Target, o.Spec.MaxUnavailable, ms})
	if err != nil {
		panic(err) // strings and integers only
	}
	sum := sha256.Sum256(b)
	return hex.EncodeToString(sum[:8])
}

// PlanChanged reports whether a person approved a plan for the operation
// and, before it started, the plan made again differs from that one.
func (o *TalosOperation) PlanChanged() bool {
	approved := o.Annotations[PlanApprovedAnnotation]
	return o.Status.StartTime == nil && approved != "" && approved != o.PlanFingerprint()
}
