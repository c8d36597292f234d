package params

import (
	"regexp"
	"strconv"
	"strings"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"k8s.io/apimachinery/pkg/api/resource"

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

// Mutable are parsed mutable parameters: a nil field was not given,
// and the volume keeps what it has (CSI: only the keys given modify).
type Mutable struct {
	ReadBPS, WriteBPS, ReadIOPS, WriteIOPS *int64
	Preallocate                            *bool
}

func (m Mutable) Empty() bool { return m == Mutable{} }

// ParseMutable checks every key and value before anything acts on one:
// an unknown key or a bad value is INVALID_ARGUMENT and nothing changes.
func ParseMutable(in map[string]string) (Mutable, error) {
	var m Mutable
	for k, v := range in {
		var err error
		switch k {
		case MutableReadBPS:
			m.ReadBPS, err = parseBytesPerSecond(v)
		case MutableWriteBPS:
			m.WriteBPS, err = parseBytesPerSecond(v)
		case MutableReadIOPS:
			m.ReadIOPS, err = parseIOPS(v)
		case MutableWriteIOPS:
			m.WriteIOPS, err = parseIOPS(v)
		case MutablePreallocate:
			var b bool
			switch v {
			case "true":
				b = true
			case "false":
			default:
				return m, status.Errorf(codes.InvalidArgument, "mutable parameter %s=%q: want \"true\" or \"false\"", k, v)
			}
			m.Preallocate = &b
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

// ForLayout refuses mutable parameters on a layout that has nothing for them
// to act on.
func (m Mutable) ForLayout(l pool.Layout) error {
	if m.Empty() || l == pool.LayoutImage {
		return nil
	}
	if m.Preallocate != nil && *m.Preallocate {
		return status.Errorf(codes.InvalidArgument, "mutable parameter %s: a %s volume is a directory of the pool's filesystem, with no image to preallocate; use layout image", MutablePreallocate, l)
	}
	if m.ReadBPS != nil || m.WriteBPS != nil || m.ReadIOPS != nil || m.WriteIOPS != nil {
		return status.Errorf(codes.InvalidArgument, "I/O limits: a %s volume is a directory of the pool's filesystem, with no block device of its own to throttle; use layout image", l)
	}
	return nil // preallocate: "false" asks for what a directory is
}

// CreateMutable checks CreateVolume's mutable_parameters for a volume of
// layout l and returns the mutable fields the new volume gets, on an
// otherwise empty record.
func CreateMutable(in map[string]string, l pool.Layout) (pool.Volume, error) {
	var v pool.Volume
	m, err := ParseMutable(in)
	if err != nil {
		return v, err
	}
	if err := m.ForLayout(l); err != nil {
		return v, err
	}
	m.Apply(&v)
	return v, nil
}

// Apply sets the given fields on v.
func (m Mutable) Apply(v *pool.Volume) {
	set := func(dst *int64, src *int64) {
		if src != nil {
			*dst = *src
		}
	}
	set(&v.IOLimits.ReadBytesPerSecond, m.ReadBPS)
	set(&v.IOLimits.WriteBytesPerSecond, m.WriteBPS)
	set(&v.IOLimits.ReadIOPS, m.ReadIOPS)
	set(&v.IOLimits.WriteIOPS, m.WriteIOPS)
	if m.Preallocate != nil {
		v.Preallocate = *m.Preallocate
	}
}
