package view

import (
	"fmt"
	"io"
	"regexp"
	"strings"
	"unicode/utf8"
)

// Screen redraws a frame in place on a terminal without flicker: it moves
// the cursor up over the previous frame (counting the physical lines it took
// at the terminal's width), overwrites each line and clears what is left
// below. It never clears the screen, so earlier output stays in scrollback,
// and the last frame stays on screen as permanent output.
type Screen struct {
	w      io.Writer
	lines  int // physical lines of the last frame
	hidden bool
}

// NewScreen draws on w, which must be a terminal.
func NewScreen(w io.Writer) *Screen { return &Screen{w: w} }

var ansi = regexp.MustCompile(`\x1b\[[0-9;?]*[A-Za-z]`)

// physical is how many terminal lines s takes at width columns.
func physical(s string, width int) int {
	n := utf8.RuneCountInString(ansi.ReplaceAllString(s, ""))
	if width <= 0 || n <= width {
		return 1
	}
	return (n + width - 1) / width
}

// Draw replaces the previous frame with frame; width is the terminal's.
func (s *Screen) Draw(frame []string, width int) error {
	var b strings.Builder
	if !s.hidden {
		b.WriteString("\x1b[?25l") // hide the cursor while drawing
		s.hidden = true
	}
	if s.lines > 0 {
		fmt.Fprintf(&b, "\r\x1b[%dA", s.lines)
	}
	lines := 0
	for _, l := range frame {
		b.WriteString(l)
		b.WriteString("\x1b[K\n")
		lines += physical(l, width)
	}
	b.WriteString("\x1b[J")
	s.lines = lines
	_, err := io.WriteString(s.w, b.String())
	return err
}

// Close shows the cursor again; the last frame stays.
func (s *Screen) Close() error {
	if !s.hidden {
		return nil
	}
	s.hidden = false
	_, err := io.WriteString(s.w, "\x1b[?25h")
	return err
}
