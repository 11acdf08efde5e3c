// Package commands holds the commands of kubectl-ichor: one file per group
// of commands, each with an options struct whose Complete, Validate and Run
// the cobra command calls in turn.
package commands

import (
	"bytes"
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"runtime"
	"strings"
	"time"

	"github.com/spf13/cobra"
	"golang.org/x/term"
	"k8s.io/cli-runtime/pkg/genericclioptions"
	"k8s.io/cli-runtime/pkg/genericiooptions"
	"k8s.io/client-go/rest"
	"k8s.io/klog/v2"
	"k8s.io/kubectl/pkg/cmd/options"
	cmdutil "k8s.io/kubectl/pkg/cmd/util"
	"k8s.io/kubectl/pkg/util/templates"
	"sigs.k8s.io/controller-runtime/pkg/client"
	ctrllog "sigs.k8s.io/controller-runtime/pkg/log"

	ichorv1 "maesh.dev/ichor/api/v1alpha1"
	"maesh.dev/ichor/internal/version"
)

// Env is what every command shares: the name the plugin was run as, the
// streams, the kubeconfig flags and the client they lead to.
type Env struct {
	// Name is how the user runs the plugin: "kubectl ichor", or "ichor" when
	// the binary was installed under that name.
	Name    string
	Streams genericiooptions.IOStreams

	ConfigFlags         *genericclioptions.ConfigFlags
	Factory             cmdutil.Factory
	Color               ColorMode
	ControllerNamespace string

	// NewClient builds the API client; tests put a fake in its place.
	NewClient func() (client.WithWatch, error)
	// IsTerminal says whether a stream is a terminal.
	IsTerminal func(any) bool
	// TermSize returns a terminal's width and height.
	TermSize func(any) (int, int, error)
	// Now is the clock.
	Now    func() time.Time
	Getenv func(string) string
}

// NewEnv is the Env of a real run.
func NewEnv(argv0 string, streams genericiooptions.IOStreams) *Env {
	e := &Env{
		Name:                DisplayName(argv0),
		Streams:             streams,
		ConfigFlags:         genericclioptions.NewConfigFlags(true).WithDiscoveryBurst(300).WithDiscoveryQPS(50.0),
		Color:               ColorAuto,
		ControllerNamespace: ichorv1.DefaultNamespace,
		IsTerminal:          isTerminal,
		TermSize:            termSize,
		Now:                 time.Now,
		Getenv:              os.Getenv,
	}
	e.ConfigFlags.WrapConfigFn = func(c *rest.Config) *rest.Config {
		c.UserAgent = UserAgent()
		return c
	}
	e.ConfigFlags.WithWarningPrinter(streams)
	e.Factory = cmdutil.NewFactory(cmdutil.NewMatchVersionFlags(e.ConfigFlags))
	e.NewClient = e.newClient
	return e
}

// UserAgent names the plugin in the API server's audit log.
func UserAgent() string {
	return fmt.Sprintf("kubectl-ichor/%s (%s/%s)", version.Version, runtime.GOOS, runtime.GOARCH)
}

func (e *Env) newClient() (client.WithWatch, error) {
	cfg, err := e.ConfigFlags.ToRESTConfig()
	if err != nil {
		return nil, err
	}
	mapper, err := e.ConfigFlags.ToRESTMapper()
	if err != nil {
		return nil, err
	}
	return client.NewWithWatch(cfg, client.Options{Scheme: Scheme, Mapper: mapper})
}

// Namespace is the namespace the command works in (-n, or the context's).
func (e *Env) Namespace() (string, error) {
	ns, _, err := e.ConfigFlags.ToRawKubeConfigLoader().Namespace()
	return ns, err
}

// DisplayName is how the user ran the plugin: "kubectl ichor" for a binary
// called kubectl-ichor (as kubectl finds it on PATH), else the binary's name.
func DisplayName(argv0 string) string {
	base := strings.TrimSuffix(filepath.Base(argv0), ".exe")
	if rest, ok := strings.CutPrefix(base, "kubectl-"); ok {
		return "kubectl " + strings.ReplaceAll(rest, "_", "-")
	}
	if base == "" || base == "." {
		return "kubectl ichor"
	}
	return base
}

// NewRoot builds the command tree. Help reads as kubectl's: each command
// lists its own flags, and the flags every command takes (kubeconfig,
// namespace, --color, -v) are behind '<name> options', as 'kubectl options'.
func NewRoot(e *Env) *cobra.Command {
	root := &cobra.Command{
		Use:   strings.ReplaceAll(e.Name, " ", "-"),
		Short: "Run and watch Talos cluster operations",
		Long: fmt.Sprintf(`%[1]s starts, watches and steers TalosOperations: upgrades, rotations,
reboots, shutdowns and restores that ichor-controller carries out on a Talos
cluster, one safe step at a time.

Every command reads and writes Kubernetes objects only; kubectl, GitOps and
%[1]s are interchangeable.

Exit codes of --wait, --watch and watch: 0 the operation succeeded, 1 an error
(usage, API, validation), 2 the operation failed (a step failed or preflight
refused it), 3 --timeout expired, 130 interrupted.`, e.Name),
		SilenceUsage:  true,
		SilenceErrors: true,
		Annotations:   map[string]string{cobra.CommandDisplayNameAnnotation: e.Name},
		PersistentPreRunE: func(cmd *cobra.Command, _ []string) error {
			cmd.SetOut(e.Streams.Out)
			return nil
		},
		// Runnable, like kubectl, so its help points at 'options' too.
		RunE: func(cmd *cobra.Command, _ []string) error { return cmd.Help() },
	}
	root.SetIn(e.Streams.In)
	root.SetOut(e.Streams.Out)
	root.SetErr(e.Streams.ErrOut)

	flags := root.PersistentFlags()
	e.ConfigFlags.AddFlags(flags)
	flags.Var(&e.Color, "color", "Colour the output: auto (on a terminal, unless NO_COLOR is set or TERM=dumb), always or never")
	flags.StringVar(&e.ControllerNamespace, "controller-namespace", e.ControllerNamespace, "Namespace where ichor-controller runs (its cluster lock and leader Leases live there)")
	klogFlags := flag.NewFlagSet("klog", flag.ContinueOnError)
	klog.InitFlags(klogFlags)
	flags.AddGoFlag(klogFlags.Lookup("v"))
	_ = root.RegisterFlagCompletionFunc("color", func(*cobra.Command, []string, string) ([]string, cobra.ShellCompDirective) {
		return []string{string(ColorAuto), string(ColorAlways), string(ColorNever)}, cobra.ShellCompDirectiveNoFileComp
	})

	groups := templates.CommandGroups{
		{Message: "Start an operation:", Commands: []*cobra.Command{newUpgradeCmd(e), newNodeCmd(e), newConfigCmd(e), newShutdownCmd(e), newRotateCmd(e), newRestoreCmd(e)}},
		{Message: "Follow and steer operations:", Commands: []*cobra.Command{newOperationCmd(e), newWatchCmd(e), newRetryCmd(e)}},
		{Message: "Inspect the cluster and Ichor:", Commands: []*cobra.Command{newLockCmd(e), newCompatCmd(e), newVersionCmd(e), newCompletionCmd(e, root)}},
	}
	groups.Add(root)
	root.AddCommand(options.NewCmdOptions(e.Streams.Out))
	templates.ActsAsRootCommand(root, []string{"options"}, groups...)
	sayDisplayName(root, e.Name)
	// Errors get their hint once, in Execute.
	root.SetFlagErrorFunc(func(_ *cobra.Command, err error) error { return usageError{err} })
	// 'help COMMAND' works; the list of commands does not show it, as kubectl's does not.
	root.InitDefaultHelpCmd()
	if help, _, err := root.Find([]string{"help"}); err == nil && help != root {
		help.Hidden = true
	}
	forEachCommand(root, func(c *cobra.Command) {
		c.DisableFlagsInUseLine = true // the usage line says [options], as kubectl's
		reportUnknownSubcommand(c)
	})
	return root
}

// sayDisplayName fixes the one line of kubectl's help template that names
// the root by its Use ("kubectl-ichor") instead of its display name
// ("kubectl ichor"): 'Use "kubectl ichor <command> --help" ...'.
func sayDisplayName(root *cobra.Command, name string) {
	if root.Name() == name {
		return
	}
	usage := root.UsageFunc()
	wrong, right := `Use "`+root.Name()+" ", `Use "`+name+" "
	root.SetUsageFunc(func(c *cobra.Command) error {
		out := c.OutOrStderr()
		var b bytes.Buffer
		c.SetOut(&b)
		c.SetErr(&b)
		err := usage(c)
		c.SetOut(out)
		c.SetErr(out)
		_, werr := io.WriteString(out, strings.ReplaceAll(b.String(), wrong, right))
		return errors.Join(err, werr)
	})
}

func forEachCommand(c *cobra.Command, f func(*cobra.Command)) {
	f(c)
	for _, sub := range c.Commands() {
		forEachCommand(sub, f)
	}
}

// reportUnknownSubcommand makes a command that only groups others (upgrade,
// node, operation...) say that a subcommand it does not have is unknown,
// as cobra does for the root, instead of printing its help or failing on
// the flags meant for the subcommand ("unknown flag: --to"). Without
// arguments it prints its help.
func reportUnknownSubcommand(c *cobra.Command) {
	if !c.HasParent() || !c.HasSubCommands() || c.Runnable() {
		return
	}
	c.FParseErrWhitelist.UnknownFlags = true
	c.SuggestionsMinimumDistance = 2 // cobra's default, which it sets for the root only
	c.Args = func(cmd *cobra.Command, args []string) error {
		if len(args) == 0 {
			return nil
		}
		msg := fmt.Sprintf("unknown command %q for %q", args[0], cmd.CommandPath())
		if s := cmd.SuggestionsFor(args[0]); len(s) > 0 {
			msg += "; did you mean " + strings.Join(s, " or ") + "?"
		}
		return usageErrorf("%s", msg)
	}
	c.RunE = func(cmd *cobra.Command, _ []string) error { return cmd.Help() }
}

// fatalExit carries kubectl's fatal error handler out of code (kubectl's own
// get command) that calls cmdutil.CheckErr itself, so Execute can return.
type fatalExit struct {
	msg  string
	code int
}

// Execute runs the plugin with os.Args-style args and returns the exit code.
// Errors print the way kubectl prints them.
func Execute(args []string, streams genericiooptions.IOStreams) int {
	// controller-runtime's client logs through klog, like kubectl (-v).
	ctrllog.SetLogger(klog.NewKlogr())
	return NewEnv(args[0], streams).Execute(args[1:])
}

// Execute runs the command tree with args (without the program name).
func (e *Env) Execute(args []string) (code int) {
	cmdutil.BehaviorOnFatal(func(msg string, code int) { panic(fatalExit{msg, code}) })
	defer cmdutil.DefaultBehaviorOnFatal()
	defer func() {
		if r := recover(); r != nil {
			f, ok := r.(fatalExit)
			if !ok {
				panic(r)
			}
			if f.msg != "" {
				fmt.Fprintln(e.Streams.ErrOut, strings.TrimSuffix(f.msg, "\n"))
			}
			code = f.code
		}
	}()
	root := NewRoot(e)
	root.SetArgs(args)
	cmd, err := root.ExecuteC()
	if err == nil {
		return 0
	}
	if isUsageError(err) {
		err = fmt.Errorf("%s\nSee '%s -h' for help and examples", err, commandPath(cmd))
	}
	cmdutil.CheckErr(err)
	return 1
}

func commandPath(cmd *cobra.Command) string {
	if cmd == nil {
		return ""
	}
	return cmd.CommandPath()
}

// usageError marks errors in how the command was called.
type usageError struct{ error }

func (u usageError) Unwrap() error { return u.error }

func usageErrorf(format string, a ...any) error { return usageError{fmt.Errorf(format, a...)} }

func isUsageError(err error) bool {
	var u usageError
	if errors.As(err, &u) {
		return true
	}
	msg := err.Error()
	for _, p := range []string{"unknown command", "unknown flag", "unknown shorthand flag", "flag needs an argument", "invalid argument", "accepts ", "requires at least", "requires at most", "required flag"} {
		if strings.HasPrefix(msg, p) || strings.Contains(msg, " "+p) {
			return true
		}
	}
	return false
}

func isTerminal(s any) bool {
	f, ok := s.(interface{ Fd() uintptr })
	return ok && term.IsTerminal(int(f.Fd()))
}

func termSize(s any) (int, int, error) {
	f, ok := s.(interface{ Fd() uintptr })
	if !ok {
		return 0, 0, errors.New("not a terminal")
	}
	return term.GetSize(int(f.Fd()))
}

// ColorMode is the --color flag.
type ColorMode string

// Colour modes.
const (
	ColorAuto   ColorMode = "auto"
	ColorAlways ColorMode = "always"
	ColorNever  ColorMode = "never"
)

func (c *ColorMode) String() string { return string(*c) }
func (c *ColorMode) Type() string   { return "auto|always|never" }
func (c *ColorMode) Set(v string) error {
	switch ColorMode(v) {
	case ColorAuto, ColorAlways, ColorNever:
		*c = ColorMode(v)
		return nil
	}
	return fmt.Errorf("must be auto, always or never, not %q", v)
}

// UseColor decides whether output to w is coloured: always and never are
// obeyed; auto colours a terminal unless NO_COLOR is set or TERM is dumb.
func (e *Env) UseColor(w io.Writer) bool {
	switch e.Color {
	case ColorAlways:
		return true
	case ColorNever:
		return false
	}
	if e.Getenv("NO_COLOR") != "" || e.Getenv("TERM") == "dumb" {
		return false
	}
	return e.IsTerminal(w)
}

// completeValidateRun is the Complete/Validate/Run pattern of kubectl's commands.
type completeValidateRun interface {
	Complete(cmd *cobra.Command, args []string) error
	Validate() error
	Run(ctx context.Context) error
}

// runE runs an options struct's Complete, Validate and Run in order.
func runE(o completeValidateRun) func(*cobra.Command, []string) error {
	return func(cmd *cobra.Command, args []string) error {
		if err := o.Complete(cmd, args); err != nil {
			return err
		}
		if err := o.Validate(); err != nil {
			return err
		}
		return o.Run(cmd.Context())
	}
}
