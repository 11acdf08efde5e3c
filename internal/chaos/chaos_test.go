package chaos

import (
	"flag"
	"fmt"
	"os"
	"path/filepath"
	"testing"
	"time"

	"k8s.io/klog/v2"
	ctrllog "sigs.k8s.io/controller-runtime/pkg/log"
	"sigs.k8s.io/controller-runtime/pkg/log/zap"

	"maesh.dev/ichor/internal/testenv"
)

var (
	campaign = flag.Bool("chaos.campaign", false, "run the randomized campaign (make chaos) rather than only its deterministic slice")
	seed     = flag.Int64("chaos.seed", 0, "the campaign's seed (run i uses seed+i); 0 takes one from the clock")
	runs     = flag.Int("chaos.runs", 10, "runs in the campaign")
	minKills = flag.Int("chaos.min-kills", 0, "go on past -chaos.runs until the campaign has killed this many controllers")
	kills    = flag.Int("chaos.kills", 3, "kills at random moments per run (every gap after an irreversible call is killed on top)")
	faults   = flag.Int("chaos.faults", 6, "Talos faults per run")
	actions  = flag.Int("chaos.actions", 6, "operator actions per run")
	span     = flag.Duration("chaos.span", 12*time.Second, "time over which a run's schedule is spread")
	rerun    = flag.Bool("chaos.rerun", true, "run a run that found violations once more from its seed, to see whether they come back")
	logPath  = flag.String("chaos.log", "", "file for the controllers' and the simulator's logs (default: ichor-chaos.log in the temporary directory)")
)

var env *testenv.Env

func TestMain(m *testing.M) {
	flag.Parse()
	if *logPath == "" {
		*logPath = filepath.Join(os.TempDir(), "ichor-chaos.log")
	}
	_ = os.Remove(*logPath)
	// The controllers log there (testcluster.LogSink), and so do klog and
	// controller-runtime's global logger (killed controllers' event
	// broadcasters complain). The Jobs' lock command finds the API server
	// through KUBECONFIG, as in a Pod through its ServiceAccount.
	os.Setenv("ICHOR_TEST_LOG", *logPath)
	f, err := os.OpenFile(*logPath, os.O_CREATE|os.O_APPEND|os.O_WRONLY, 0o600)
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	logger := zap.New(zap.WriteTo(f))
	klog.SetLogger(logger)
	ctrllog.SetLogger(logger)
	os.Exit(testenv.Main(m, &env, func(e *testenv.Env) error { return os.Setenv("KUBECONFIG", e.Kubeconfig) }))
}

// TestSlice is the deterministic slice of the campaign that `make test`
// runs: two fixed seeds, the controller killed in every gap between an
// irreversible call and its status write, and a few kills, faults and
// operator actions at random.
func TestSlice(t *testing.T) {
	if testing.Short() {
		t.Skip("the slice runs two runs of the campaign (about a minute); -short skips it")
	}
	r := Report{Seed: 1, Params: Params{Span: 8 * time.Second, Kills: 1, Faults: 3, OperatorActions: 3}}
	campaignRuns(t, &r, 2, 0)
}

// TestCampaign is `make chaos`: -chaos.runs runs (or more, until
// -chaos.min-kills kills) from -chaos.seed, then the report.
func TestCampaign(t *testing.T) {
	if !*campaign {
		t.Skip("the campaign runs with -chaos.campaign (make chaos); make test runs TestSlice")
	}
	s := *seed
	if s == 0 {
		s = time.Now().UnixNano() % 1_000_000_000
	}
	r := Report{Seed: s, Params: Params{Span: *span, Kills: *kills, Faults: *faults, OperatorActions: *actions}}
	campaignRuns(t, &r, *runs, *minKills)
}

// campaignRuns runs the campaign of r and prints its report; a violation
// fails the test.
func campaignRuns(t *testing.T, r *Report, runs, minKills int) {
	logf := logTo(t, *logPath)
	for i := 0; i < runs || r.Kills() < minKills; i++ {
		cfg := Config{Seed: r.Seed + int64(i), Params: r.Params, Gaps: true, Settle: 2 * time.Minute, Logf: logf}
		var res Result
		t.Run(fmt.Sprintf("seed=%d", cfg.Seed), func(t *testing.T) {
			res = Execute(t, env, cfg)
			logResult(t, res)
		})
		if len(res.Violations) > 0 && *rerun {
			t.Run(fmt.Sprintf("seed=%d/rerun", cfg.Seed), func(t *testing.T) {
				again := Execute(t, env, cfg)
				logResult(t, again)
				res.Rerun = &again
			})
		}
		r.Runs = append(r.Runs, res)
	}
	fmt.Printf("\n%s\nlogs: %s\n", r, *logPath)
	if n := r.Violations(); n > 0 {
		t.Errorf("%d invariant violations; the report above has each one's seed, history and rerun command", n)
	}
}

func logResult(t *testing.T, res Result) {
	t.Logf("seed %d: %d kills (%d in gaps), %d leader changes, %d faults, %d operator actions, %d operations (%d succeeded), %d violations, %s",
		res.Seed, res.Kills, res.GapKills, res.LeaderChanges, res.Faults, res.OperatorActions, res.Operations, res.Succeeded,
		len(res.Violations), res.Took.Round(time.Second))
}

// logTo appends the simulator's lines to the log file.
func logTo(t *testing.T, path string) func(string, ...any) {
	f, err := os.OpenFile(path, os.O_CREATE|os.O_APPEND|os.O_WRONLY, 0o600)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = f.Close() })
	return func(format string, args ...any) {
		fmt.Fprintf(f, time.Now().Format(time.RFC3339Nano)+" "+format+"\n", args...)
	}
}
