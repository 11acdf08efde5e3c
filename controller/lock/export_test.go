package lock

// ConfirmsWaiting is how many Confirms of h wait for the one under way.
func ConfirmsWaiting(l *Lock, h Holder) int {
	l.mu.Lock()
	defer l.mu.Unlock()
	if next := l.confirms[h]; next != nil {
		return next.waiting
	}
	return 0
}
