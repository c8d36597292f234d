package driver

import (
	"context"
	"regexp"
	"strconv"
	"strings"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"k8s.io/apimachinery/pkg/api/resource"
	"k8s.io/klog/v2"

	"github.com/poolcsi/poolcsi/internal/csierr"
	"github.com/poolcsi/poolcsi/internal/pool"
)

// Mutable parameters: a VolumeAttributesClass's keys, accepted by
// ControllerModifyVolume and in CreateVolume's mutable_parameters.
const (
	MutableReadBPS     = "readBytesPerSecond"
	MutableWriteBPS    = "writeBytesPerSecond"
	MutableReadIOPS    = "readIOPS"
	MutableWriteIOPS   = "writeIOPS"
	MutablePreallocate = "preallocate"
)

var mutableKeys = []string{MutableReadBPS, MutableWriteBPS, MutableReadIOPS, MutableWriteIOPS, MutablePreallocate}

// iopsRE is a plain decimal count: no sign, no exponent, no suffix.
var iopsRE = regexp.MustCompile(`^[0-9]{1,16}$`)

// mutableParams are parsed mutable parameters: a nil field was not given,
// and the volume keeps what it has (CSI: only the keys given modify).
type mutableParams struct {
	readBPS, writeBPS, readIOPS, writeIOPS *int64
	preallocate                            *bool
}

func (m mutableParams) empty() bool { return m == mutableParams{} }

// parseMutableParams checks every key and value before anything acts on one:
// an unknown key or a bad value is INVALID_ARGUMENT and nothing changes.
func parseMutableParams(in map[string]string) (mutableParams, error) {
	var m mutableParams
	for k, v := range in {
		var err error
		switch k {
		case MutableReadBPS:
			m.readBPS, err = parseBytesPerSecond(v)
		case MutableWriteBPS:
			m.writeBPS, err = parseBytesPerSecond(v)
		case MutableReadIOPS:
			m.readIOPS, err = parseIOPS(v)
		case MutableWriteIOPS:
			m.writeIOPS, err = parseIOPS(v)
		case MutablePreallocate:
			var b bool
			switch v {
			case "true":
				b = true
			case "false":
			default:
				return m, status.Errorf(codes.InvalidArgument, "mutable parameter %s=%q: want \"true\" or \"false\"", k, v)
			}
			m.preallocate = &b
		default:
			return m, status.Errorf(codes.InvalidArgument, "unknown mutable parameter %q (known: %s)", k, strings.Join(mutableKeys, ", "))
		}
		if err != nil {
			return m, status.Errorf(codes.InvalidArgument, "mutable parameter %s=%q: %v", k, v, err)
		}
	}
	return m, nil
}

type limitError string

func (e limitError) Error() string { return string(e) }

// parseBytesPerSecond takes a Kubernetes quantity ("20Mi", "1G") or a plain
// integer: a whole, non-negative number of bytes, 0 for no limit.
func parseBytesPerSecond(s string) (*int64, error) {
	if len(s) > 32 {
		return nil, limitError("too long for a quantity")
	}
	q, err := resource.ParseQuantity(s)
	if err != nil {
		return nil, limitError("not a quantity (like 20Mi or 1048576)")
	}
	n, exact := q.AsInt64()
	switch {
	case !exact:
		return nil, limitError("not a whole number of bytes")
	case n < 0 || n > pool.MaxIOLimit:
		return nil, limitError("outside 0.." + strconv.FormatInt(pool.MaxIOLimit, 10) + " bytes per second")
	}
	return &n, nil
}

// parseIOPS takes a plain non-negative integer, 0 for no limit.
func parseIOPS(s string) (*int64, error) {
	if !iopsRE.MatchString(s) {
		return nil, limitError("not a plain non-negative integer")
	}
	n, err := strconv.ParseInt(s, 10, 64)
	if err != nil || n > pool.MaxIOLimit {
		return nil, limitError("outside 0.." + strconv.FormatInt(pool.MaxIOLimit, 10))
	}
	return &n, nil
}

// forLayout refuses mutable parameters on a layout that has nothing for them
// to act on.
func (m mutableParams) forLayout(l pool.Layout) error {
	if m.empty() || l == pool.LayoutImage {
		return nil
	}
	if m.preallocate != nil && *m.preallocate {
		return status.Errorf(codes.InvalidArgument, "mutable parameter %s: a %s volume is a directory of the pool's filesystem, with no image to preallocate; use layout image", MutablePreallocate, l)
	}
	if m.readBPS != nil || m.writeBPS != nil || m.readIOPS != nil || m.writeIOPS != nil {
		return status.Errorf(codes.InvalidArgument, "I/O limits: a %s volume is a directory of the pool's filesystem, with no block device of its own to throttle; use layout image", l)
	}
	return nil // preallocate: "false" asks for what a directory is
}

// createMutable checks CreateVolume's mutable_parameters for a volume of
// layout l and returns the mutable fields the new volume gets, on an
// otherwise empty record.
func createMutable(in map[string]string, l pool.Layout) (pool.Volume, error) {
	var v pool.Volume
	m, err := parseMutableParams(in)
	if err != nil {
		return v, err
	}
	if err := m.forLayout(l); err != nil {
		return v, err
	}
	m.apply(&v)
	return v, nil
}

// apply sets the given fields on v.
func (m mutableParams) apply(v *pool.Volume) {
	set := func(dst *int64, src *int64) {
		if src != nil {
			*dst = *src
		}
	}
	set(&v.IOLimits.ReadBytesPerSecond, m.readBPS)
	set(&v.IOLimits.WriteBytesPerSecond, m.writeBPS)
	set(&v.IOLimits.ReadIOPS, m.readIOPS)
	set(&v.IOLimits.WriteIOPS, m.writeIOPS)
	if m.preallocate != nil {
		v.Preallocate = *m.preallocate
	}
}

// ControllerModifyVolume sets a volume's mutable parameters (a
// VolumeAttributesClass): its I/O limits, which the nodes apply to the pods
// using it (iolimits.go), and preallocation of its image. Only the keys given
// change; the whole request is checked before anything does.
func (d *Driver) ControllerModifyVolume(ctx context.Context, req *csi.ControllerModifyVolumeRequest) (_ *csi.ControllerModifyVolumeResponse, err error) {
	defer csierr.ToStatus(&err)
	var m mutableParams
	rq, err := d.resolve(ctx, rpcControllerModifyVolume, req.GetVolumeId(), dataAccess(req.GetSecrets()), func() (err error) {
		m, err = parseMutableParams(req.GetMutableParameters())
		return err
	})
	if err != nil {
		return nil, err
	}
	defer rq.release()
	vid, p, v := rq.id, rq.pool, rq.vol
	if err := m.forLayout(v.Layout); err != nil {
		return nil, err
	}
	if m.empty() {
		return &csi.ControllerModifyVolumeResponse{}, nil
	}
	before := *v
	// A volume's layout never changes: the check above holds for the record
	// Modify loads again under the volume's lock.
	v, err = p.Modify(ctx, vid, func(v *pool.Volume) error {
		m.apply(v)
		return nil
	}, d.fs.Allocate)
	if err != nil {
		return nil, err
	}
	if before.IOLimits != v.IOLimits || before.Preallocate != v.Preallocate {
		klog.FromContext(ctx).Info("Modified volume", "volume", vid, "ioLimits", v.IOLimits, "preallocate", v.Preallocate)
	}
	return &csi.ControllerModifyVolumeResponse{}, nil
}
