package testenv

import (
	"fmt"
	"os"
	"strconv"
	"strings"
)

// PeakRSS reads a process's peak resident set size (VmHWM, proc(5)), in
// bytes: what the benchmarks report of the controller's and the plugin's
// memory.
func PeakRSS(pid int) (int64, error) {
	data, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", pid))
	if err != nil {
		return 0, fmt.Errorf("read the peak RSS of process %d: %w", pid, err)
	}
	for _, line := range strings.Split(string(data), "\n") {
		if rest, ok := strings.CutPrefix(line, "VmHWM:"); ok {
			kb, err := strconv.ParseInt(strings.TrimSpace(strings.TrimSuffix(strings.TrimSpace(rest), "kB")), 10, 64)
			if err != nil {
				return 0, fmt.Errorf("parse VmHWM of process %d: %w", pid, err)
			}
			return kb << 10, nil
		}
	}
	return 0, fmt.Errorf("process %d: no VmHWM in /proc/%d/status", pid, pid)
}
