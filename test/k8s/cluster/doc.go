// Package cluster runs Kubernetes on this machine for poolcsi's tests: a control plane
// (etcd, kube-apiserver, kube-controller-manager: Cluster), real nodes (containerd, kubelet,
// kube-proxy: Node, one or two, each in its own mount namespace when there are two), the
// images they run (built here, never pulled), the chart installed as pods on them (Env,
// StartEnv), and the environment lock with its record, through which a run reclaims what a
// killed one left (LockKubeletEnv). The scenarios that use it are package harness; the
// conformance runner is cmd/conformance.
//
// Everything here takes a testing.TB and undoes what it made in its cleanups. It needs
// root, loop devices and the tools docs/testing.md lists; what is missing skips, or fails
// under CI (RequireRoot, RequireCommands).
package cluster
