package iolimits

import "testing"

func TestPodUIDOfTarget(t *testing.T) {
	const uid = "0d7d9a9e-3c1b-4d7e-9a55-1b2c3d4e5f60"
	tests := []struct {
		path string
		ok   bool
	}{
		{"/var/lib/kubelet/pods/" + uid + "/volumes/kubernetes.io~csi/pvc-1/mount", true},
		{"/var/lib/kubelet/plugins/kubernetes.io/csi/volumeDevices/publish/pvc-1/" + uid, true},
		{"/pods/" + uid + "/volumes/kubernetes.io~csi/pvc-1/mount", true},
		{"/var/lib/kubelet/pods/" + uid + "/volumes/kubernetes.io~csi/pvc-1/mount/sub", false},
		{"/var/lib/kubelet/pods/" + uid + "/volumes/kubernetes.io~nfs/pvc-1/mount", false},
		{"/var/lib/kubelet/pods/" + uid + "/volumes/kubernetes.io~csi//mount", false},
		{"/var/lib/kubelet/pods/../volumes/kubernetes.io~csi/pvc-1/mount", false},
		{"/var/lib/kubelet/plugins/kubernetes.io/csi/volumeDevices/pvc-1/dev/" + uid, false},
		{"/var/lib/kubelet/plugins/kubernetes.io/csi/volumeDevices/staging/pvc-1", false},
		{"/var/lib/kubelet/plugins/kubernetes.io/csi/volumeDevices/publish/pvc-1/" + uid + "x", false},
		{"/var/lib/kubelet/plugins/kubernetes.io/csi/poolcsi.io/0123abcd/globalmount", false},
	}
	for _, tt := range tests {
		got, ok := podUIDOfTarget(tt.path)
		if ok != tt.ok || (ok && got != uid) {
			t.Errorf("%s: %q, %t; want ok=%t", tt.path, got, ok, tt.ok)
		}
	}
}
