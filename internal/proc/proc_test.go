package proc

import (
	"os"
	"runtime"
	"runtime/debug"
	"strings"
	"sync"
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

func TestReadMachine(t *testing.T) {
	before, err := ReadMachine()
	if err != nil {
		t.Fatal(err)
	}
	own0, err := CPUTime(os.Getpid())
	if err != nil {
		t.Fatal(err)
	}
	// Keep every core busy until the kernel has counted 200 ms of each to
	// this process: the machine's idle time then says little, its busy time
	// at least that much.
	want := time.Duration(runtime.NumCPU()) * 200 * time.Millisecond
	stop := make(chan struct{})
	var wg sync.WaitGroup
	for range runtime.NumCPU() - 1 {
		wg.Go(func() {
			for {
				select {
				case <-stop:
					return
				default:
					_ = strings.Repeat("x", 1<<16)
				}
			}
		})
	}
	own, deadline := own0, time.Now().Add(10*time.Second)
	for own-own0 < want && time.Now().Before(deadline) {
		_ = strings.Repeat("x", 1<<16)
		if own, err = CPUTime(os.Getpid()); err != nil {
			t.Fatal(err)
		}
	}
	close(stop)
	wg.Wait()
	after, err := ReadMachine()
	if err != nil {
		t.Fatal(err)
	}
	// The machine was busy at least while this process was, less a few
	// ticks of rounding.
	if busy := after.Busy - before.Busy; busy < own-own0-50*time.Millisecond {
		t.Errorf("the machine was busy %s while this process used %s", busy, own-own0)
	}
	if share := after.BusySince(before); share <= 0 || share > 1 {
		t.Errorf("busy share %.3f: want it in (0, 1]", share)
	}
	if after.All-before.All < after.Busy-before.Busy {
		t.Errorf("all %s, busy %s: want all at least busy", after.All-before.All, after.Busy-before.Busy)
	}
}
