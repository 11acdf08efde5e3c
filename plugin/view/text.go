// Package view turns TalosOperations into what `kubectl ichor watch` shows:
// frames for a terminal (Render, RenderList), drawn in place by a Screen, and
// an append-only log of changes (Changes) for everything that is not a
// terminal. Rendering is pure: the clock, size and colour come in Options.
package view

import (
	"regexp"
	"strings"
	"unicode"
	"unicode/utf8"

	"k8s.io/cli-runtime/pkg/printers"
)

// style is the colour of a span of text.
type style uint8

const (
	plain style = iota
	bold
	faint
	green
	yellow
	red
	blue
	cyan
)

var sgr = map[style]string{bold: "1", faint: "2", green: "32", yellow: "33", red: "31", blue: "34", cyan: "36"}

type span struct {
	text string
	st   style
}

// line is one row of a frame, built from styled spans so that truncation
// counts only visible characters and colour never breaks in the middle.
type line []span

func (l *line) add(st style, text string) { *l = append(*l, span{text, st}) }

// render fits the line into width columns (0: no limit), cutting with an
// ellipsis, and colours its spans when color is set. Trailing blanks go.
func (l line) render(width int, color bool) string {
	var b strings.Builder
	used := 0
	for i, s := range l {
		text := s.text
		if i == len(l)-1 {
			text = strings.TrimRight(text, " ")
		}
		n := utf8.RuneCountInString(text)
		cut := width > 0 && used+n > width
		if cut {
			text = truncate(text, width-used)
			n = utf8.RuneCountInString(text)
		}
		if color && s.st != plain && text != "" {
			b.WriteString("\x1b[" + sgr[s.st] + "m" + text + "\x1b[0m")
		} else {
			b.WriteString(text)
		}
		used += n
		if cut {
			break
		}
	}
	if color {
		return b.String()
	}
	return strings.TrimRight(b.String(), " ")
}

// truncate shortens s to at most n runes, marking the cut with an ellipsis.
func truncate(s string, n int) string {
	if n <= 0 {
		return ""
	}
	if utf8.RuneCountInString(s) <= n {
		return s
	}
	r := []rune(s)
	return string(r[:n-1]) + "…"
}

// pad left-aligns s in n columns.
func pad(s string, n int) string {
	if c := utf8.RuneCountInString(s); c < n {
		return s + strings.Repeat(" ", n-c)
	}
	return s
}

// Clean makes a string from the server safe for one line of a terminal:
// escape sequences are neutralised (printers.EscapeTerminal), line breaks and
// tabs become spaces, and any other control character becomes '?'.
func Clean(s string) string {
	s = printers.EscapeTerminal(s)
	if strings.IndexFunc(s, unicode.IsControl) < 0 {
		return s
	}
	return strings.Map(func(r rune) rune {
		switch {
		case r == '\n' || r == '\t' || r == '\f' || r == '\v':
			return ' '
		case unicode.IsControl(r):
			return '?'
		}
		return r
	}, s)
}

// longHex is a run of hex digits as long as an Image Factory schematic ID or
// a digest.
var longHex = regexp.MustCompile(`[0-9a-f]{32,}`)

// Shorten shortens what makes a message long without telling more: the
// schematic IDs and digests in image references keep their first 8 digits
// ("factory.talos.dev/installer/376567988ad37013…:v1.13.7"). The rest of the
// message, the error, stays as it is.
func Shorten(s string) string {
	return longHex.ReplaceAllStringFunc(s, func(h string) string { return h[:8] + "…" })
}

// wrap breaks text into lines of at most width runes at spaces, cutting a
// word longer than a line; width 0 or less leaves it one line.
func wrap(text string, width int) []string {
	if width <= 0 || utf8.RuneCountInString(text) <= width {
		return []string{text}
	}
	var lines []string
	var cur []rune
	for _, word := range strings.Fields(text) {
		w := []rune(word)
		if len(cur) > 0 && len(cur)+1+len(w) > width {
			lines, cur = append(lines, string(cur)), nil
		}
		if len(cur) > 0 {
			cur = append(cur, ' ')
		}
		cur = append(cur, w...)
		for len(cur) > width {
			lines, cur = append(lines, string(cur[:width])), cur[width:]
		}
	}
	if len(cur) > 0 {
		lines = append(lines, string(cur))
	}
	return lines
}
