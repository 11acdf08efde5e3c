package testcluster

import (
	"fmt"
	"io"
	"os"
	"strings"
	"sync"
	"testing"
)

// maxLogLines bounds what a failed test prints of its background logs:
// the end, where a failure's cause usually is.
const maxLogLines = 3000

// backgroundLog holds what a test's background workers (its controllers,
// its simulated machines) logged, and prints it only if the test failed,
// after the test's own messages: without -v, go test prints a failed
// test's output in order, and a failure's message buried under thousands
// of controller lines is what a truncated CI log then lacks. With -v the
// lines go to the test as they come.
type backgroundLog struct {
	t       testing.TB
	mu      sync.Mutex
	lines   []string
	dropped int
	closed  bool
}

var backgroundLogs sync.Map // testing.TB → *backgroundLog

// logOf is t's background log, made (and its printing at the test's end
// registered) on first use.
func logOf(t testing.TB) *backgroundLog {
	if l, ok := backgroundLogs.Load(t); ok {
		return l.(*backgroundLog)
	}
	l, loaded := backgroundLogs.LoadOrStore(t, &backgroundLog{t: t})
	bl := l.(*backgroundLog)
	if !loaded {
		t.Cleanup(bl.flush)
	}
	return bl
}

// Logf logs to t's background log, as sim.Spec.Logf takes it.
func Logf(t testing.TB) func(format string, args ...any) {
	bl := logOf(t)
	return func(format string, args ...any) { bl.add(fmt.Sprintf(format, args...)) }
}

func (bl *backgroundLog) add(line string) {
	bl.mu.Lock()
	defer bl.mu.Unlock()
	if bl.closed {
		return // a worker that outlived its test
	}
	if testing.Verbose() {
		bl.t.Log(line)
		return
	}
	if len(bl.lines) == maxLogLines {
		bl.lines = bl.lines[1:]
		bl.dropped++
	}
	bl.lines = append(bl.lines, line)
}

// flush prints the held lines if the test failed. It is registered as a
// cleanup when the first worker is given the log, before that worker's
// own cleanup (and those of the workers after it), so it runs after they
// have stopped them.
func (bl *backgroundLog) flush() {
	bl.mu.Lock()
	defer bl.mu.Unlock()
	bl.closed = true
	backgroundLogs.Delete(bl.t)
	if !bl.t.Failed() || len(bl.lines) == 0 {
		return
	}
	head := "the background log (controllers, simulated machines)"
	if bl.dropped > 0 {
		head += fmt.Sprintf(", its last %d lines (%d before them left out)", len(bl.lines), bl.dropped)
	}
	bl.t.Log(head + ":\n" + strings.Join(bl.lines, "\n"))
}

// LogSink is the test's background log, or the file $ICHOR_TEST_LOG
// (benchmarks truncate their logs).
func LogSink(t testing.TB) io.Writer {
	if path := os.Getenv("ICHOR_TEST_LOG"); path != "" {
		f, err := os.OpenFile(path, os.O_CREATE|os.O_APPEND|os.O_WRONLY, 0o600)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { _ = f.Close() })
		return f
	}
	return logWriter{logOf(t)}
}

type logWriter struct{ bl *backgroundLog }

func (w logWriter) Write(p []byte) (int, error) {
	w.bl.add(strings.TrimRight(string(p), "\n"))
	return len(p), nil
}
