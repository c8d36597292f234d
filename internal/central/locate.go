package central

import (
	"cmp"
	"context"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"
	"k8s.io/klog/v2"

	"github.com/poolcsi/poolcsi/internal/pool"
)

// Finding the node of an ID (docs/design/central-controller.md §4). A hint names the
// node an ID was last known on; the call goes there. A hinted node that is down answers
// UNAVAILABLE at once: the data is there. If the hinted node says the ID is not there,
// or there is no hint, every node whose PoolNode lists the ID's pool is asked with a
// read-only call, and the call goes to the one that holds it. Nobody holds it and every
// such node is live: NOT_FOUND (OK for a delete). Any such node not live: UNAVAILABLE,
// for a delete must never say OK while the data may sit on a node that is down.

// idKind is what an ID names.
type idKind int

const (
	volumeKind idKind = iota
	snapshotKind
	groupKind
)

func (k idKind) String() string {
	return [...]string{"volume", "snapshot", "group snapshot"}[k]
}

// lookup is one call about an existing ID.
type lookup struct {
	kind     idKind
	id, pool string
	// call is the real call, on node.
	call func(ctx context.Context, node string) (proto.Message, error)
	// notHere tells whether call's answer means that node does not hold the ID; nil:
	// the answer is NOT_FOUND.
	notHere func(proto.Message, error) bool
	// absent answers when no node holds the ID.
	absent func() (proto.Message, error)
	// trustHint: the hinted node's answer stands, whatever it is. A delete: the node
	// answers OK for an ID it does not hold, so its answer cannot say "not here"; the
	// hint (the PV's or content's node, or a Done call's) is where the ID was made.
	trustHint bool
	// probeHit: call is itself read-only; asking everyone answers with its response.
	probeHit bool
	// members are a group call's snapshot_ids, for the read-only GetVolumeGroupSnapshot.
	members []string
	// also are IDs learnt on the node with id once the call is done (a new snapshot).
	also []string
	// madeBy is the method that makes the ID (CreateVolume, …) when a "not found" of
	// this call is final (a delete's OK, an expand's NOT_FOUND): while a call of it
	// about the ID is under way, the ID answers no probe yet, and this call is ABORTED.
	madeBy string
}

func (l lookup) isNotHere(resp proto.Message, err error) bool {
	if l.notHere != nil {
		return l.notHere(resp, err)
	}
	return status.Code(err) == codes.NotFound
}

// callOn is a call of method on a node, about target.
func (s *Server) callOn(method, target string, req proto.Message) func(context.Context, string) (proto.Message, error) {
	return func(ctx context.Context, node string) (proto.Message, error) {
		return s.d.Calls.Call(ctx, node, method, target, req)
	}
}

// hint is the node the hints name for l's ID.
func (s *Server) hint(kind idKind, id string) (string, bool) {
	switch kind {
	case snapshotKind:
		return s.d.Hints.SnapshotNode(id)
	case groupKind:
		return s.d.Hints.GroupNode(id)
	}
	return s.d.Hints.VolumeNode(id)
}

// live is nil when node is live, else the UNAVAILABLE that says why it matters (what:
// "volume X is there").
func (s *Server) live(node, what string) error {
	ok, since := s.d.Nodes.Live(node)
	if ok {
		return nil
	}
	for _, k := range s.d.Nodes.Known() {
		if k == node {
			return status.Errorf(codes.Unavailable, "poolcsi on node %s has not renewed for %s; %s: retry once it is back", node, since.Round(time.Second), what)
		}
	}
	return status.Errorf(codes.Unavailable, "poolcsi on node %s has no PoolNode (its agent never started, or the node is gone); %s", node, what)
}

// locate runs l's call on the node that holds its ID.
func (s *Server) locate(ctx context.Context, l lookup) (proto.Message, error) {
	what := l.kind.String() + " " + l.id
	if err := s.underway(l, what); err != nil {
		return nil, err
	}
	tried := ""
	if node, ok := s.hint(l.kind, l.id); ok {
		if err := s.live(node, what+" is there"); err != nil {
			return nil, err
		}
		resp, err := l.call(ctx, node)
		if l.trustHint || !l.isNotHere(resp, err) {
			s.learn(l, node, err)
			return resp, err
		}
		klog.FromContext(ctx).V(2).Info("Hinted node does not hold the ID; asking every node", "kind", l.kind.String(), "id", l.id, "node", node)
		tried = node
	}
	holder, resp, err := s.askEveryone(ctx, l, tried)
	switch {
	case err != nil:
		return nil, err
	case holder == "":
		return l.absent()
	case l.probeHit:
		s.learn(l, holder, nil)
		return resp, nil
	}
	resp, err = l.call(ctx, holder)
	s.learn(l, holder, err)
	return resp, err
}

// underway is ABORTED when l's ID is being made: a volume or snapshot whose create is
// still running (or not yet taken) on a node answers NOT_FOUND to every probe, so a
// delete would answer OK and the create then leave it behind, and an expand or modify
// would answer a final NOT_FOUND. The sidecar retries, and the create's answer comes
// first. Even with a hint on the create's node (the agent runs a target's calls in the
// order issued), waiting is simpler and as correct.
func (s *Server) underway(l lookup, what string) error {
	if l.madeBy == "" {
		return nil
	}
	p, ok := s.d.Calls.(PendingCalls)
	if !ok {
		return nil
	}
	if node, ok := p.Underway(l.madeBy, l.id); ok {
		return status.Errorf(codes.Aborted, "%s: a %s of this ID is under way on node %s; retry once it is answered", what, l.madeBy, node)
	}
	return nil
}

func (s *Server) learn(l lookup, node string, err error) {
	if err != nil {
		return
	}
	s.d.Hints.Learn(l.id, node)
	for _, id := range l.also {
		s.d.Hints.Learn(id, node)
	}
}

// holders are the nodes whose PoolNode lists poolName, but skip.
func (s *Server) holders(poolName, skip string) []string {
	var out []string
	for _, n := range s.d.Nodes.Known() {
		if n == skip {
			continue
		}
		for _, p := range s.d.Nodes.Pools(n) {
			if p.Name == poolName {
				out = append(out, n)
				break
			}
		}
	}
	return out
}

// probe asks node, read-only, whether it holds l's ID: found, or not (nil error), or
// it cannot tell (the error).
func (s *Server) probe(ctx context.Context, l lookup, node string) (found bool, resp proto.Message, err error) {
	if l.probeHit {
		resp, err = l.call(ctx, node)
		if l.isNotHere(resp, err) {
			return false, nil, nil
		}
		return err == nil, resp, err
	}
	switch l.kind {
	case volumeKind:
		_, err = s.d.Calls.Call(ctx, node, "ControllerGetVolume", l.id, &csi.ControllerGetVolumeRequest{VolumeId: l.id})
	case snapshotKind:
		resp, err = s.d.Calls.Call(ctx, node, "ListSnapshots", l.id, &csi.ListSnapshotsRequest{SnapshotId: l.id})
		if emptyList(resp, err) {
			return false, nil, nil
		}
	case groupKind:
		_, err = s.d.Calls.Call(ctx, node, "GetVolumeGroupSnapshot", l.id, &csi.GetVolumeGroupSnapshotRequest{GroupSnapshotId: l.id, SnapshotIds: l.members})
		if status.Code(err) == codes.InvalidArgument {
			// The group is there, with other members than the call names: the real
			// call gets the node's own answer.
			return true, nil, nil
		}
	}
	switch status.Code(err) {
	case codes.OK:
		return true, nil, nil
	case codes.NotFound:
		return false, nil, nil
	}
	return false, nil, err
}

// askEveryone asks every node that lists l's pool, but tried, whether it holds l's ID,
// at once. It returns the holder ("" for none) and, for a read-only call, its answer.
func (s *Server) askEveryone(ctx context.Context, l lookup, tried string) (string, proto.Message, error) {
	return s.askNodes(ctx, l, s.holders(l.pool, tried))
}

// askNodes asks nodes at once whether they hold l's ID: the holder ("" for none) and,
// for a read-only call, its answer. A node that is not live, or cannot tell, makes it
// fail unless another holds the ID; two holders are FAILED_PRECONDITION.
func (s *Server) askNodes(ctx context.Context, l lookup, nodes []string) (string, proto.Message, error) {
	what := l.kind.String() + " " + l.id
	type answer struct {
		node  string
		found bool
		resp  proto.Message
		err   error
	}
	answers := make([]answer, len(nodes))
	var wg sync.WaitGroup
	for i, n := range nodes {
		answers[i].node = n
		if err := s.live(n, what+" may be there"); err != nil {
			answers[i].err = err
			continue
		}
		wg.Add(1)
		go func() {
			defer wg.Done()
			answers[i].found, answers[i].resp, answers[i].err = s.probe(ctx, l, n)
		}()
	}
	wg.Wait()
	var found []answer
	var down []string
	var failed error
	for _, a := range answers {
		switch {
		case a.found:
			found = append(found, a)
		case status.Code(a.err) == codes.Unavailable:
			down = append(down, a.node)
			if failed == nil || status.Code(failed) != codes.Unavailable {
				failed = a.err
			}
		case a.err != nil && failed == nil:
			failed = a.err
		}
	}
	switch {
	case len(found) == 1:
		return found[0].node, found[0].resp, nil
	case len(found) > 1:
		var names []string
		for _, a := range found {
			names = append(names, a.node)
		}
		if l.kind == groupKind {
			// Parts of one group across nodes (crossgroup.go); a node that did not
			// answer may hold another part.
			if failed != nil {
				return "", nil, failed
			}
			return "", nil, &holdersError{nodes: names}
		}
		return "", nil, status.Errorf(codes.FailedPrecondition, "%s exists on nodes %s: a local pool exists once per node and poolcsi cannot tell which one is meant; remove the others by hand", what, strings.Join(names, ", "))
	case len(down) > 1:
		return "", nil, status.Errorf(codes.Unavailable, "%s is on no live node; nodes %s are not answering and may hold it: retry once they are back", what, strings.Join(down, ", "))
	case failed != nil:
		// Down, busy, or a fault: a node that may hold the ID did not say it does not.
		return "", nil, failed
	}
	return "", nil, nil
}

// listTarget is the target of a ListSnapshots without a filter: it is about no ID.
const listTarget = "snapshots"

// listEverywhere is a ListSnapshots without a snapshot_id, asked of every node that has
// a PoolNode (any not live: UNAVAILABLE, for its snapshots would be missing), merged
// by ID and paged as the node driver pages: by (pool, key), the token the first ID of
// the next page.
func (s *Server) listEverywhere(ctx context.Context, req *csi.ListSnapshotsRequest) (*csi.ListSnapshotsResponse, error) {
	nodes := s.d.Nodes.Known()
	for _, n := range nodes {
		if err := s.live(n, "its snapshots are not listed"); err != nil {
			return nil, err
		}
	}
	type answer struct {
		resp *csi.ListSnapshotsResponse
		err  error
	}
	answers := make([]answer, len(nodes))
	var wg sync.WaitGroup
	for i, n := range nodes {
		wg.Add(1)
		go func() {
			defer wg.Done()
			resp, err := s.d.Calls.Call(ctx, n, "ListSnapshots", listTarget, req)
			answers[i].resp, answers[i].err = as[*csi.ListSnapshotsResponse](resp, err)
		}()
	}
	wg.Wait()
	type entry struct {
		id pool.SnapshotID
		e  *csi.ListSnapshotsResponse_Entry
	}
	byID := map[string]entry{}
	var cutoff *pool.SnapshotID // the least next token: no node listed beyond it
	for i, a := range answers {
		if a.err != nil {
			return nil, a.err
		}
		for _, e := range a.resp.GetEntries() {
			id, err := pool.ParseSnapshotID(e.GetSnapshot().GetSnapshotId())
			if err != nil {
				klog.FromContext(ctx).Info("Dropping a listed snapshot whose ID is not a poolcsi snapshot ID", "node", nodes[i], "snapshot", e.GetSnapshot().GetSnapshotId())
				continue
			}
			byID[id.String()] = entry{id, e}
		}
		if next := a.resp.GetNextToken(); next != "" {
			id, err := pool.ParseSnapshotID(next)
			if err != nil {
				return nil, status.Errorf(codes.Internal, "node %s answered next_token %q, not a snapshot ID", nodes[i], next)
			}
			if cutoff == nil || compareSnapshotIDs(id, *cutoff) < 0 {
				cutoff = &id
			}
		}
	}
	all := make([]entry, 0, len(byID))
	for _, e := range byID {
		if cutoff == nil || compareSnapshotIDs(e.id, *cutoff) < 0 {
			all = append(all, e)
		}
	}
	slices.SortFunc(all, func(a, b entry) int { return compareSnapshotIDs(a.id, b.id) })
	out := &csi.ListSnapshotsResponse{}
	if cutoff != nil {
		out.NextToken = cutoff.String()
	}
	if most := int(req.GetMaxEntries()); most > 0 && len(all) > most {
		out.NextToken = all[most].id.String()
		all = all[:most]
	}
	for _, e := range all {
		out.Entries = append(out.Entries, e.e)
	}
	return out, nil
}

// compareSnapshotIDs orders as the node driver lists: by pool name, then key (not by
// the ID's text: "a-b@…" sorts before "a@…", pool "a" before pool "a-b").
func compareSnapshotIDs(a, b pool.SnapshotID) int {
	return cmp.Or(cmp.Compare(a.Pool, b.Pool), cmp.Compare(a.Key, b.Key))
}
