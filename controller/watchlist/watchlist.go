// Package watchlist reads pods as the API server streams them from its
// watch cache (KEP-3157's watch-list: a watch that sends the pods there are
// as events, then a bookmark that says they have all been sent) instead of
// with a LIST. A drain asks for one machine's pods; as a LIST, that request
// costs the API server a consistent read of every pod of the cluster (or
// a wait on etcd for its cache to catch up) to filter a few, on every
// drain; the watch cache answers a watch-list from its index on
// spec.nodeName.
package watchlist

import (
	"context"
	"errors"
	"fmt"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/watch"
	"k8s.io/client-go/kubernetes"
	typedcorev1 "k8s.io/client-go/kubernetes/typed/core/v1"
	clientwatchlist "k8s.io/client-go/util/watchlist"
)

// Pods returns the pods of namespace ("" is every namespace) that opts
// select, as a watch-list; with a LIST where the options, the client or
// the API server do not take one (an API server without its WatchList
// feature refuses the watch as invalid).
func Pods(ctx context.Context, pods typedcorev1.PodInterface, opts metav1.ListOptions) (*corev1.PodList, error) {
	wopts, ok, err := clientwatchlist.PrepareWatchListOptionsFromListOptions(opts)
	if err != nil || !ok {
		return pods.List(ctx, opts)
	}
	w, err := pods.Watch(ctx, wopts)
	if apierrors.IsInvalid(err) || apierrors.IsBadRequest(err) {
		return pods.List(ctx, opts)
	}
	if err != nil {
		return nil, err
	}
	defer w.Stop()
	return collect(ctx, w)
}

// collect gathers a watch-list's pods: each sent as added, then the
// bookmark that says they all were (what comes after it is a change since,
// which a list does not show).
func collect(ctx context.Context, w watch.Interface) (*corev1.PodList, error) {
	list := &corev1.PodList{}
	for {
		var ev watch.Event
		var open bool
		select {
		case <-ctx.Done():
			return nil, ctx.Err()
		case ev, open = <-w.ResultChan():
		}
		if !open {
			return nil, errors.New("the API server ended the watch-list of pods before it had sent them all")
		}
		switch ev.Type {
		case watch.Error:
			return nil, apierrors.FromObject(ev.Object)
		case watch.Added:
			p, ok := ev.Object.(*corev1.Pod)
			if !ok {
				return nil, fmt.Errorf("the watch-list of pods sent a %T", ev.Object)
			}
			list.Items = append(list.Items, *p)
		case watch.Bookmark:
			if m, ok := ev.Object.(metav1.Object); ok && m.GetAnnotations()[metav1.InitialEventsAnnotationKey] == "true" {
				list.ResourceVersion = m.GetResourceVersion()
				return list, nil
			}
		default:
			return nil, fmt.Errorf("the watch-list of pods sent %s before the end of its pods", ev.Type)
		}
	}
}

// Clientset is cs whose pods are listed with Pods: for code that lists
// through a clientset, kubectl's drain helper. A client that cannot watch
// a list (client-go's fake) is returned as it is.
func Clientset(cs kubernetes.Interface) kubernetes.Interface { return AsOf(cs, "") }

// AsOf is Clientset whose lists that name no resourceVersion show the pods
// as of resourceVersion or later (NotOlderThan), instead of as of now: the
// API server's watch cache answers as soon as it has seen that far. As of
// now, it first waits for etcd to say where now is, and it asks etcd at
// most every 100 ms for every read that waits (the cacher's progress
// requester): the drains of a batch, which start together, queued there.
// An empty resourceVersion is now.
func AsOf(cs kubernetes.Interface, resourceVersion string) kubernetes.Interface {
	if clientwatchlist.DoesClientNotSupportWatchListSemantics(cs) {
		return cs
	}
	return clientset{cs, resourceVersion}
}

type clientset struct {
	kubernetes.Interface
	asOf string
}

func (c clientset) CoreV1() typedcorev1.CoreV1Interface { return coreV1{c.Interface.CoreV1(), c.asOf} }

type coreV1 struct {
	typedcorev1.CoreV1Interface
	asOf string
}

func (c coreV1) Pods(namespace string) typedcorev1.PodInterface {
	return podClient{c.CoreV1Interface.Pods(namespace), c.asOf}
}

type podClient struct {
	typedcorev1.PodInterface
	asOf string
}

func (p podClient) List(ctx context.Context, opts metav1.ListOptions) (*corev1.PodList, error) {
	if opts.ResourceVersion == "" && p.asOf != "" {
		opts.ResourceVersion, opts.ResourceVersionMatch = p.asOf, metav1.ResourceVersionMatchNotOlderThan
	}
	return Pods(ctx, p.PodInterface, opts)
}
