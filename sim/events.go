package sim

import (
	"context"
	"fmt"
	"sync"
	"sync/atomic"
	"time"

	"github.com/siderolabs/talos/pkg/machinery/api/machine"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/anypb"
)

// maxEvents is how many events a machine keeps per boot (Talos keeps a
// bounded in-memory buffer too, lost at reboot).
const maxEvents = 500

var eventSeq atomic.Uint64

// eventLog is a machine's runtime events of the current boot.
type eventLog struct {
	mu      sync.Mutex
	events  []loggedEvent
	changed chan struct{}
}

type loggedEvent struct {
	at time.Time
	ev *machine.Event
}

func newEventLog() *eventLog { return &eventLog{changed: make(chan struct{})} }

// emit appends an event whose payload is one of the messages the client's
// UnmarshalEvent understands (SequenceEvent, PhaseEvent, TaskEvent,
// ServiceStateEvent, MachineStatusEvent, ...).
func (l *eventLog) emit(actorID string, payload proto.Message) {
	value, err := proto.Marshal(payload)
	if err != nil {
		panic(fmt.Sprintf("marshal event: %v", err)) // our own messages always marshal
	}
	ev := &machine.Event{
		Data: &anypb.Any{
			TypeUrl: "talos/runtime/" + string(payload.ProtoReflect().Descriptor().FullName()),
			Value:   value,
		},
		Id:      fmt.Sprintf("sim%017d", eventSeq.Add(1)),
		ActorId: actorID,
	}
	l.mu.Lock()
	defer l.mu.Unlock()
	l.events = append(l.events, loggedEvent{at: time.Now(), ev: ev})
	if len(l.events) > maxEvents {
		l.events = append([]loggedEvent(nil), l.events[len(l.events)-maxEvents:]...)
	}
	close(l.changed)
	l.changed = make(chan struct{})
}

// start picks where a watch begins as Talos does: tail_events (-1 all, 0
// none, n the last n), tail_id (after that event) or tail_seconds.
func (l *eventLog) start(req *machine.EventsRequest) (string, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	from := len(l.events)
	switch {
	case req.TailId != "":
		found := false
		for i, e := range l.events {
			if e.ev.Id == req.TailId {
				from, found = i+1, true
			}
		}
		if !found {
			return "", fmt.Errorf("error parsing tail_id: unknown event %q", req.TailId)
		}
	case req.TailEvents < 0:
		from = 0
	case req.TailEvents > 0:
		from = max(0, len(l.events)-int(req.TailEvents))
	case req.TailSeconds > 0:
		since := time.Now().Add(-time.Duration(req.TailSeconds) * time.Second)
		for from > 0 && l.events[from-1].at.After(since) {
			from--
		}
	}
	if from == len(l.events) {
		return "", nil
	}
	return l.events[from].ev.Id, nil
}

// watch sends events from the one with ID first (or only new ones when
// first is empty) until ctx ends.
func (l *eventLog) watch(ctx context.Context, first, actorID string, send func(*machine.Event) error) error {
	l.mu.Lock()
	next := len(l.events)
	for i, e := range l.events {
		if e.ev.Id == first {
			next = i
		}
	}
	l.mu.Unlock()
	var lastID string
	for {
		l.mu.Lock()
		// Events may have been dropped from the front; find our place by ID.
		if lastID != "" {
			next = len(l.events)
			for i := len(l.events) - 1; i >= 0; i-- {
				if l.events[i].ev.Id == lastID {
					next = i + 1
					break
				}
				if l.events[i].ev.Id < lastID {
					next = i + 1
					break
				}
			}
		}
		pending := append([]loggedEvent(nil), l.events[min(next, len(l.events)):]...)
		changed := l.changed
		l.mu.Unlock()
		for _, e := range pending {
			lastID = e.ev.Id
			if actorID != "" && e.ev.ActorId != actorID {
				continue
			}
			if err := send(e.ev); err != nil {
				return err
			}
		}
		if len(pending) > 0 {
			continue
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-changed:
		}
	}
}
