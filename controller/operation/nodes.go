package operation

import (
	"context"
	"fmt"
	"sync"

	corev1 "k8s.io/api/core/v1"
	toolscache "k8s.io/client-go/tools/cache"
	"sigs.k8s.io/controller-runtime/pkg/cache"
	"sigs.k8s.io/controller-runtime/pkg/client"
)

// nodeReader reads every Node as the cache holds it: the cache's own
// objects, read-only. A turn reads them all; a list into a NodeList, even
// without deep copies, copies each Node's struct (4.5 MB a turn at 5,000
// Nodes), where the informer's store hands out pointers.
type nodeReader struct {
	client client.Reader
	// informers is the manager's cache. Its Node informer is looked up at
	// the first turn, once the cache has started: an informer asked for
	// before the start would be one the manager waits to sync before
	// anything else, and a controller started while the API server is
	// down could then not be stopped.
	informers cache.Informers

	mu    sync.Mutex
	store toolscache.Store
}

func (r *nodeReader) list(ctx context.Context) ([]*corev1.Node, error) {
	if s := r.informerStore(ctx); s != nil {
		objs := s.List()
		out := make([]*corev1.Node, 0, len(objs))
		for _, o := range objs {
			if n, ok := o.(*corev1.Node); ok {
				out = append(out, n)
			}
		}
		return out, nil
	}
	var nodes corev1.NodeList
	if err := r.client.List(ctx, &nodes, client.UnsafeDisableDeepCopy); err != nil {
		return nil, fmt.Errorf("list nodes: %w", err)
	}
	out := make([]*corev1.Node, len(nodes.Items))
	for i := range nodes.Items {
		out[i] = &nodes.Items[i]
	}
	return out, nil
}

// informerStore is the Node informer's store, or nil when there is none to
// read (no cache, or one that is not client-go's informer).
func (r *nodeReader) informerStore(ctx context.Context) toolscache.Store {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.store == nil && r.informers != nil {
		if inf, err := r.informers.GetInformer(ctx, &corev1.Node{}); err == nil {
			if s, ok := inf.(toolscache.SharedInformer); ok {
				r.store = s.GetStore()
			}
		}
	}
	return r.store
}
