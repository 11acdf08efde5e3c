// Package proc reads what Linux says of a process's memory and CPU
// (proc(5)): the figures the benchmarks report of the controller, the
// plugin and the simulated fleet.
package proc

import (
	"fmt"
	"os"
	"strconv"
	"strings"
	"time"
)

// userHZ is the kernel's clock ticks a second on Linux (USER_HZ), the
// unit of the CPU times in proc(5).
const userHZ = 100

// Memory is a process's resident memory, in bytes (proc(5), status).
type Memory struct {
	// Peak is the high-water mark of the resident set (VmHWM).
	Peak int64
	// Resident is the resident set now (VmRSS): Anon plus File (and the
	// shared memory, which these processes do not use).
	Resident int64
	// Anon is the resident anonymous memory (RssAnon): the heap, stacks.
	Anon int64
	// File is the resident file-backed memory (RssFile): mostly the
	// binary's own pages, as many as the process touched and the kernel
	// mapped around each fault from the page cache.
	File int64
}

// ReadMemory reads the resident memory of process pid.
func ReadMemory(pid int) (Memory, error) {
	data, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", pid))
	if err != nil {
		return Memory{}, fmt.Errorf("read the memory of process %d: %w", pid, err)
	}
	var m Memory
	fields := map[string]*int64{"VmHWM": &m.Peak, "VmRSS": &m.Resident, "RssAnon": &m.Anon, "RssFile": &m.File}
	for _, line := range strings.Split(string(data), "\n") {
		k, v, ok := strings.Cut(line, ":")
		dst := fields[k]
		if !ok || dst == nil {
			continue
		}
		kb, err := strconv.ParseInt(strings.TrimSpace(strings.TrimSuffix(strings.TrimSpace(v), "kB")), 10, 64)
		if err != nil {
			return Memory{}, fmt.Errorf("parse %s of process %d: %w", k, pid, err)
		}
		*dst = kb << 10
		delete(fields, k)
	}
	if len(fields) > 0 {
		return Memory{}, fmt.Errorf("process %d: /proc/%d/status lacks %d of VmHWM, VmRSS, RssAnon and RssFile", pid, pid, len(fields))
	}
	return m, nil
}

// ResetPeak starts this process's peak resident set (VmHWM) anew from its
// resident set now (proc(5), clear_refs).
func ResetPeak() error {
	if err := os.WriteFile("/proc/self/clear_refs", []byte("5"), 0); err != nil {
		return fmt.Errorf("reset the peak RSS: %w", err)
	}
	return nil
}

// CPUTime reads the user and system CPU time process pid has used
// (proc(5), stat).
func CPUTime(pid int) (time.Duration, error) {
	data, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return 0, fmt.Errorf("read the CPU time of process %d: %w", pid, err)
	}
	// The fields after the command name (in parentheses, which may hold spaces).
	fields := strings.Fields(string(data[strings.LastIndexByte(string(data), ')')+1:]))
	if len(fields) < 13 {
		return 0, fmt.Errorf("parse /proc/%d/stat: %q", pid, data)
	}
	utime, err1 := strconv.ParseInt(fields[11], 10, 64)
	stime, err2 := strconv.ParseInt(fields[12], 10, 64)
	if err1 != nil || err2 != nil {
		return 0, fmt.Errorf("parse /proc/%d/stat: %q", pid, data)
	}
	return time.Duration(utime+stime) * time.Second / userHZ, nil
}

// Machine is the CPU time of every core of the machine since boot, busy
// and in all (proc(5), the cpu line of stat): over a span, busy over all is
// how much of the machine's CPU its processes, every one of them, used.
type Machine struct {
	Busy, All time.Duration
}

// ReadMachine reads the machine's CPU time.
func ReadMachine() (Machine, error) {
	data, err := os.ReadFile("/proc/stat")
	if err != nil {
		return Machine{}, fmt.Errorf("read the machine's CPU time: %w", err)
	}
	line, _, _ := strings.Cut(string(data), "\n")
	fields := strings.Fields(line)
	// cpu user nice system idle iowait irq softirq steal (guest time is in user's).
	if len(fields) < 9 || fields[0] != "cpu" {
		return Machine{}, fmt.Errorf("parse /proc/stat: %q", line)
	}
	var all, idle int64
	for i, f := range fields[1:9] {
		n, err := strconv.ParseInt(f, 10, 64)
		if err != nil {
			return Machine{}, fmt.Errorf("parse /proc/stat: %q", line)
		}
		all += n
		if i == 3 || i == 4 { // idle, iowait
			idle += n
		}
	}
	return Machine{Busy: time.Duration(all-idle) * time.Second / userHZ, All: time.Duration(all) * time.Second / userHZ}, nil
}

// BusySince is the share of the machine's CPU used between before and m, 0 to 1.
func (m Machine) BusySince(before Machine) float64 {
	if m.All <= before.All {
		return 0
	}
	return float64(m.Busy-before.Busy) / float64(m.All-before.All)
}
