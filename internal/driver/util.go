package driver

import (
	"google.golang.org/protobuf/types/known/wrapperspb"
)

func wrapInt64(v int64) *wrapperspb.Int64Value { return wrapperspb.Int64(v) }
