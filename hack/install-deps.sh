#!/usr/bin/env bash
# Installs the filesystem and block tools the driver and its tests use, when any
# is missing. Debian/Ubuntu only; elsewhere it says what to install.
set -euo pipefail
need=()
for cmd in mkfs.ext4:e2fsprogs resize2fs:e2fsprogs mkfs.xfs:xfsprogs xfs_growfs:xfsprogs \
	mkfs.btrfs:btrfs-progs btrfs:btrfs-progs losetup:util-linux blkid:util-linux mount:mount \
	containerd:containerd ctr:containerd runc:runc iptables:iptables ip:iproute2 ldd:libc-bin; do
	command -v "${cmd%%:*}" >/dev/null 2>&1 || need+=("${cmd##*:}")
done
# The CephFS tests (test/support/cephfs): a one-node Ceph 16.2 (mon, mgr, OSD, MDS) and two
# ceph-fuse clients; ceph-common has the ceph command line, ceph-base monmaptool.
for cmd in ceph:ceph-common ceph-authtool:ceph-common monmaptool:ceph-base ceph-mon:ceph-mon \
	ceph-mgr:ceph-mgr ceph-osd:ceph-osd ceph-mds:ceph-mds ceph-fuse:ceph-fuse; do
	command -v "${cmd%%:*}" >/dev/null 2>&1 || need+=("${cmd##*:}")
done
# The kubelet tests (test/k8s/harness/kubelet_test.go): CNI plugins for the pod network and
# a static busybox for the test pods' image.
[ -x /usr/lib/cni/bridge ] || need+=(containernetworking-plugins)
{ [ -x /bin/busybox ] && ! ldd /bin/busybox >/dev/null 2>&1; } || need+=(busybox-static)
# make image's push route, which docs/deploy.md documents and TestImagePushPull takes.
command -v skopeo >/dev/null 2>&1 || need+=(skopeo)
# make image-lock and its tests check signed InRelease files with gpgv against Debian's
# archive keyring; the tests sign their own with a throw-away gpg key.
for cmd in gpg:gpg gpg-agent:gpg-agent gpgv:gpgv gpgconf:gpgconf; do
	command -v "${cmd%%:*}" >/dev/null 2>&1 || need+=("${cmd##*:}")
done
[ -f /usr/share/keyrings/debian-archive-keyring.gpg ] || need+=(debian-archive-keyring)
# mount.nfs, which the poolcsi image carries (deploy/image-tools.txt) and the test harness
# copies from this machine into the image it builds.
[ -x /sbin/mount.nfs ] || need+=(nfs-common)
# The fence tests' FUSE pool (test/shared TestLostPoolNeverWritesLate): a passthrough whose
# daemon can be stopped or killed.
command -v bindfs >/dev/null 2>&1 || need+=(bindfs)
command -v fusermount3 >/dev/null 2>&1 || need+=(fuse3)
# The direct-I/O writer of the fio benchmarks (test/e2e BenchmarkFio, BenchmarkIOLimitsV1).
command -v fio >/dev/null 2>&1 || need+=(fio)
# promtool, which checks the chart's alert rules (test/k8s/chart TestAlertRules).
command -v promtool >/dev/null 2>&1 || need+=(prometheus)
[ ${#need[@]} -eq 0 ] && exit 0
# Once each, in the order found.
mapfile -t need < <(printf '%s\n' "${need[@]}" | awk '!seen[$0]++')
if ! command -v apt-get >/dev/null 2>&1; then
	echo "install-deps: missing packages ${need[*]}; install them with your package manager" >&2
	exit 1
fi
echo "install-deps: installing ${need[*]}"
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
apt-get install -y -qq "${need[@]}" >/dev/null
