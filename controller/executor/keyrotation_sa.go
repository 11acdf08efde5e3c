package executor

import ichorv1 "maesh.dev/ichor/api/v1alpha1"

// saStages are the service-account key rotation's stages (to be built).
func saStages(restart bool) []ichorv1.StageStatus { return nil }

// saSteps are the steps of stage, or nil for a stage not of the
// service-account key rotation.
func saSteps(stage string) []Step { return nil }
