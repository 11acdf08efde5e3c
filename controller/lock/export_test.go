package lock

import "time"

// ConfirmsWaiting is how many Confirms of h wait for the one under way.
func ConfirmsWaiting(l *Lock, h Holder) int {
	l.mu.Lock()
	defer l.mu.Unlock()
	if next := l.confirms[h]; next != nil {
		return next.waiting
	}
	return 0
}

// EndWaiting is how many Acquires wait for h's release (Ending).
func EndWaiting(l *Lock, h Holder) int {
	l.mu.Lock()
	defer l.mu.Unlock()
	if e := l.ending[h.UID]; e != nil {
		return e.waiting
	}
	return 0
}

// SetEndingWait sets how long an Acquire waits for an ending holder's
// release, until the returned restore is called.
func SetEndingWait(d time.Duration) (restore func()) {
	was := endingWait
	endingWait = d
	return func() { endingWait = was }
}
