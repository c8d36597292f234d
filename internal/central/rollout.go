package central

import (
	"context"
	"fmt"
	"slices"
	"strings"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/fields"
	"k8s.io/client-go/kubernetes"
)

// perNodeProvisionerContainer is the chart's name of the per-node layout's provisioner
// (deploy/helm/poolcsi/templates/node.yaml, without localController.central).
const perNodeProvisionerContainer = "csi-provisioner-local"

// PodRollout is the Rollout of a release: the per-node provisioner runs in the node
// DaemonSet's pods, in the release's namespace, until the DaemonSet's roll replaces
// them with pods that run the agent alone.
type PodRollout struct {
	Client kubernetes.Interface
	// Namespace is the release's (the node pods').
	Namespace string
}

// PerNodeProvisioner lists the namespace's pods bound to node (a read from the API
// server, not a cache: a pod gone from it is gone) and names the first one with the
// per-node provisioner: a container of the chart's name, or one given
// --node-deployment-immediate-binding, which only csi-provisioner takes. A pod being
// deleted still counts: its object goes only once the kubelet has stopped its
// containers. A pod Succeeded or Failed (evicted) runs none.
func (r PodRollout) PerNodeProvisioner(ctx context.Context, node string) (string, error) {
	list, err := r.Client.CoreV1().Pods(r.Namespace).List(ctx, metav1.ListOptions{
		FieldSelector: fields.OneTermEqualSelector("spec.nodeName", node).String(),
	})
	if err != nil {
		return "", fmt.Errorf("list the pods of namespace %s on node %s: %w", r.Namespace, node, err)
	}
	for i := range list.Items {
		p := &list.Items[i]
		// The field selector is the server's; the reader checks it again.
		if p.Spec.NodeName != node || p.Status.Phase == corev1.PodSucceeded || p.Status.Phase == corev1.PodFailed {
			continue
		}
		for _, c := range p.Spec.Containers {
			if isPerNodeProvisioner(c) {
				return r.Namespace + "/" + p.Name, nil
			}
		}
	}
	return "", nil
}

func isPerNodeProvisioner(c corev1.Container) bool {
	if c.Name == perNodeProvisionerContainer {
		return true
	}
	for _, a := range slices.Concat(c.Command, c.Args) {
		if strings.HasPrefix(a, "--node-deployment-immediate-binding") {
			return true
		}
	}
	return false
}

var _ Rollout = PodRollout{}
