// Package configpatch reads a Talos machine-configuration patch as talosctl's
// --config-patch does, with machinery's configpatcher. The plugin checks a
// patch with it before it creates an operation, and the controller reads the
// operation's patches with it (controller/machineconfig), so both refuse the
// same text in the same words.
package configpatch

import (
	"bytes"
	"errors"
	"fmt"

	"github.com/siderolabs/talos/pkg/machinery/config/configpatcher"
)

// ErrEmpty is the error of Load for a text that is only white space.
var ErrEmpty = errors.New("empty: write a YAML strategic merge patch (e.g. `machine: {nodeLabels: {zone: a}}`) or an RFC 6902 JSON patch")

// Load reads one patch: a YAML strategic merge patch (one or more
// documents, `$patch: delete` allowed) or an RFC 6902 JSON patch written as
// JSON or YAML. The text is always the patch itself, never a file name
// (configpatcher.LoadPatches would read a file of that name). Its error
// completes "patch X is ...": ErrEmpty, or "not a machine-configuration
// patch (...): " and configpatcher's words. configpatcher decodes a
// strategic merge patch as a machine configuration, so an unknown field or
// a value of the wrong type is refused here, before any machine is asked.
func Load(text string) (configpatcher.Patch, error) {
	if len(bytes.TrimSpace([]byte(text))) == 0 {
		return nil, ErrEmpty
	}
	p, err := configpatcher.LoadPatch([]byte(text))
	if err != nil {
		return nil, fmt.Errorf("not a machine-configuration patch (a YAML strategic merge patch of known fields, or an RFC 6902 JSON patch): %w", err)
	}
	return p, nil
}
