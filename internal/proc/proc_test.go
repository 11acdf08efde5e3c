package proc

import (
	"os"
	"runtime/debug"
	"strings"
	"testing"
	"time"
)

func TestReadMemory(t *testing.T) {
	// Resident memory that this process is sure to have: a slice written through.
	ballast := make([]byte, 32<<20)
	for i := range ballast {
		ballast[i] = 1
	}
	mem, err := ReadMemory(os.Getpid())
	if err != nil {
		t.Fatal(err)
	}
	if mem.Anon < int64(len(ballast)) || mem.File <= 0 || mem.Resident < mem.Anon+mem.File || mem.Peak < mem.Resident {
		t.Errorf("%+v: want Anon >= %d, File > 0, Resident >= Anon+File and Peak >= Resident", mem, len(ballast))
	}
	ballast[0] = 0 // keep it resident until here
}

func TestResetPeak(t *testing.T) {
	ballast := make([]byte, 64<<20)
	for i := range ballast {
		ballast[i] = 1
	}
	ballast = nil //nolint:ineffassign,staticcheck // freed before the reset
	debug.FreeOSMemory()
	if err := ResetPeak(); err != nil {
		t.Fatal(err)
	}
	mem, err := ReadMemory(os.Getpid())
	if err != nil {
		t.Fatal(err)
	}
	// The reset starts the peak from the resident set of that moment, from
	// which the ballast has gone back to the kernel.
	if mem.Peak < mem.Resident || mem.Peak > mem.Resident+(16<<20) {
		t.Errorf("after the reset: peak %d, resident %d; want the peak at the resident set", mem.Peak, mem.Resident)
	}
}

func TestCPUTime(t *testing.T) {
	before, err := CPUTime(os.Getpid())
	if err != nil {
		t.Fatal(err)
	}
	// Spend CPU until the kernel's 10 ms tick has counted some of it.
	after, deadline := before, time.Now().Add(5*time.Second)
	for after == before && time.Now().Before(deadline) {
		_ = strings.Repeat("x", 1<<16)
		if after, err = CPUTime(os.Getpid()); err != nil {
			t.Fatal(err)
		}
	}
	if after <= before {
		t.Errorf("CPU time %s, then %s after 5 s of work: want it to grow", before, after)
	}
}

func TestNoSuchProcess(t *testing.T) {
	const pid = 1 << 30 // above the kernel's pid_max
	if _, err := ReadMemory(pid); err == nil {
		t.Error("ReadMemory of a process that does not exist: no error")
	}
	if _, err := CPUTime(pid); err == nil {
		t.Error("CPUTime of a process that does not exist: no error")
	}
}
