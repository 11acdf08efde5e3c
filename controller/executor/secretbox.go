package executor

import ichorv1 "maesh.dev/ichor/api/v1alpha1"

// secretboxStages are the secretbox key rotation's stages (to be built).
func secretboxStages() []ichorv1.StageStatus { return nil }

// secretboxSteps are the steps of stage, or nil.
func secretboxSteps(stage string) []Step { return nil }
