package v1alpha1

// EndingMachine returns the machine whose step ended the operation by
// taking the API away (the shutdown of every control plane): ichor-controller
// records it Succeeded with its step still named and its run counted
// (calls), in the status write right before that step runs, since nothing
// can be written after it. Nil for any other operation: a machine that
// finished otherwise has neither step nor calls.
func (st *TalosOperationStatus) EndingMachine() *MachineStatus {
	for i := range st.Machines {
		if st.Machines[i].Ends() {
			return &st.Machines[i]
		}
	}
	return nil
}

// Ends reports whether the machine's step ended the operation by taking
// the API away (see EndingMachine).
func (m *MachineStatus) Ends() bool {
	return m.Phase == MachineSucceeded && m.Step != "" && m.Calls > 0
}

// APIGoing reports whether the operation succeeded by taking the API away
// and the controller has not recorded the cluster back since (condition
// ClusterBack): the API is going away, or gone, as the operation meant.
func (o *TalosOperation) APIGoing() bool {
	if !o.Succeeded() || o.Status.EndingMachine() == nil {
		return false
	}
	for _, c := range o.Status.Conditions {
		if c.Type == ConditionClusterBack {
			return false
		}
	}
	return true
}
