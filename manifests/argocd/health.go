// Package argocd holds Ichor's Argo CD health check for TalosOperation
// (health.lua, which the README's argocd-cm snippet carries) and runs it as
// Argo CD runs a health check from argocd-cm, so tests can ask it what Argo
// CD would show. Only tests import it: the controller does not run Lua.
package argocd

import (
	_ "embed"
	"fmt"
	"slices"

	lua "github.com/yuin/gopher-lua"
)

// Script is the health check, as it goes into argocd-cm.
//
//go:embed health.lua
var Script string

// ConfigKey is the argocd-cm key that holds Script.
const ConfigKey = "resource.customizations.health.ichor.maesh.dev_TalosOperation"

// Health is what the check returns: an Argo CD health status (Healthy,
// Progressing, Degraded, ...) and its message.
type Health struct {
	Status  string
	Message string
}

// statuses are the health statuses Argo CD accepts from a check; it shows
// any other as Unknown.
var statuses = []string{"Healthy", "Progressing", "Degraded", "Suspended", "Missing", "Unknown"}

// Check runs Script on an object (an unstructured object's content, as
// Argo CD passes it): obj is a Lua table converted from it, and only the
// base, table and package libraries are open (Argo CD opens these for
// argocd-cm checks, and a reduced os, which the check does not need; not
// string). A status Argo CD would not accept is an error.
func Check(obj map[string]any) (Health, error) {
	l := lua.NewState(lua.Options{SkipOpenLibs: true})
	defer l.Close()
	for name, open := range map[string]lua.LGFunction{lua.BaseLibName: lua.OpenBase, lua.TabLibName: lua.OpenTable, lua.LoadLibName: lua.OpenPackage} {
		if err := l.CallByParam(lua.P{Fn: l.NewFunction(open), Protect: true}, lua.LString(name)); err != nil {
			return Health{}, fmt.Errorf("open the Lua library %q: %w", name, err)
		}
	}
	l.SetGlobal("obj", toLua(l, obj))
	if err := l.DoString(Script); err != nil {
		return Health{}, fmt.Errorf("run the health check: %w", err)
	}
	hs, ok := l.Get(-1).(*lua.LTable)
	if !ok {
		return Health{}, fmt.Errorf("the health check returned a %s, want a table", l.Get(-1).Type())
	}
	h := Health{Status: lua.LVAsString(hs.RawGetString("status")), Message: lua.LVAsString(hs.RawGetString("message"))}
	if !slices.Contains(statuses, h.Status) {
		return Health{}, fmt.Errorf("the health check returned the status %q, which Argo CD shows as Unknown", h.Status)
	}
	return h, nil
}

// toLua converts a value of an unstructured object to Lua: maps to tables
// with string keys, slices to arrays, numbers to numbers.
func toLua(l *lua.LState, v any) lua.LValue {
	switch v := v.(type) {
	case map[string]any:
		t := l.CreateTable(0, len(v))
		for k, e := range v {
			t.RawSetString(k, toLua(l, e))
		}
		return t
	case []any:
		t := l.CreateTable(len(v), 0)
		for _, e := range v {
			t.Append(toLua(l, e))
		}
		return t
	case string:
		return lua.LString(v)
	case bool:
		return lua.LBool(v)
	case int64:
		return lua.LNumber(v)
	case float64:
		return lua.LNumber(v)
	}
	return lua.LNil
}
