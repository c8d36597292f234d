package poolset

import (
	"slices"
	"testing"

	"github.com/poolcsi/poolcsi/internal/params"
)

// TestAccessOptions: what each kind of call brings to mount a share with.
func TestAccessOptions(t *testing.T) {
	secrets := map[string]string{params.SecretMountOptions: "secret=1,other=2"}
	for _, tt := range []struct {
		name                    string
		acc                     Access
		wantOptions, wantSecret []string
	}{
		{"a read brings nothing", Access{}, nil, nil},
		{"secrets only", Access{Secrets: secrets}, nil, []string{"secret=1", "other=2"}},
		{"volume context of a dir volume, with mount flags", Access{Secrets: secrets, VolumeContext: map[string]string{params.ParamShareOptions: "vers=4.1", params.ParamLayout: "dir"}, MountFlags: []string{"ro", "nconnect=4"}},
			[]string{"vers=4.1", "nconnect=4"}, []string{"secret=1", "other=2"}},
		{"volume context without a layout is a dir volume's", Access{VolumeContext: map[string]string{}, MountFlags: []string{"nconnect=4"}}, []string{"nconnect=4"}, nil},
		{"an image volume's mount flags are its own", Access{VolumeContext: map[string]string{params.ParamLayout: "image"}, MountFlags: []string{"nconnect=4"}}, nil, nil},
		{"a StorageClass's options come last", Access{VolumeContext: map[string]string{params.ParamShareOptions: "vers=4.1"}, scOptions: []string{"hard"}}, []string{"vers=4.1", "hard"}, nil},
	} {
		t.Run(tt.name, func(t *testing.T) {
			o, s := tt.acc.options()
			if !slices.Equal(o, tt.wantOptions) || !slices.Equal(s, tt.wantSecret) {
				t.Fatalf("options() = %q, %q; want %q, %q", o, s, tt.wantOptions, tt.wantSecret)
			}
		})
	}
}
