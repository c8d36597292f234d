package mount

import (
	"errors"
	"fmt"
	"regexp"
	"strings"
)

// ErrOptionRefused marks a mount option poolcsi does not pass on.
var ErrOptionRefused = errors.New("mount option refused")

// Mount options are request input (a PV's mountOptions, a StorageClass's):
// each is checked against an allow-list of the filesystem's own options plus
// the generic ones, never passed through as-is. Options that would mount
// something other than the volume (loop, offset=, sizelimit=, btrfs subvol=,
// device=) or take the node down (errors=panic) are not on any list.
var (
	// The generic options are the keys of genericFlags (syscall.go), which
	// says what each does to the mount flags: one list for both.
	fsOptions = map[string]map[string]bool{
		"ext4": {
			"discard": true, "nodiscard": true, "barrier": true, "nobarrier": true,
			"auto_da_alloc": true, "noauto_da_alloc": true, "delalloc": true, "nodelalloc": true,
			"dioread_nolock": true, "dioread_lock": true, "journal_checksum": true, "nojournal_checksum": true,
			"user_xattr": true, "acl": true, "noacl": true, "noinit_itable": true, "init_itable": true,
			"block_validity": true, "noblock_validity": true, "grpid": true, "nogrpid": true,
		},
		"xfs": {
			"discard": true, "nodiscard": true, "inode32": true, "inode64": true,
			"largeio": true, "nolargeio": true, "nouuid": true, "wsync": true, "swalloc": true,
			"noalign": true, "attr2": true, "noattr2": true, "filestreams": true,
			"grpid": true, "nogrpid": true, "ikeep": true, "noikeep": true, "noquota": true,
		},
		"btrfs": {
			"compress": true, "compress-force": true, "discard": true, "nodiscard": true,
			"space_cache": true, "nospace_cache": true, "ssd": true, "nossd": true, "ssd_spread": true,
			"autodefrag": true, "noautodefrag": true, "flushoncommit": true, "noflushoncommit": true,
			"datacow": true, "nodatacow": true, "datasum": true, "nodatasum": true,
			"barrier": true, "nobarrier": true, "treelog": true, "notreelog": true, "acl": true, "noacl": true,
		},
	}
	number = regexp.MustCompile(`^[0-9]{1,10}$`)
	size   = regexp.MustCompile(`^[0-9]{1,10}[kKmMgG]?$`)
	// fsValued are options with a value, and the values each accepts.
	fsValued = map[string]map[string]*regexp.Regexp{
		"ext4": {
			"data":           regexp.MustCompile(`^(ordered|writeback|journal)$`),
			"commit":         number,
			"errors":         regexp.MustCompile(`^(remount-ro|continue)$`),
			"barrier":        regexp.MustCompile(`^[01]$`),
			"init_itable":    number,
			"stripe":         number,
			"max_batch_time": number,
			"min_batch_time": number,
			"journal_ioprio": regexp.MustCompile(`^[0-7]$`),
		},
		"xfs": {
			"logbufs":   number,
			"logbsize":  size,
			"allocsize": size,
		},
		"btrfs": {
			"compress":       regexp.MustCompile(`^(zlib|lzo|zstd|no)(:[0-9]{1,2})?$`),
			"compress-force": regexp.MustCompile(`^(zlib|lzo|zstd)(:[0-9]{1,2})?$`),
			"discard":        regexp.MustCompile(`^(sync|async)$`),
			"space_cache":    regexp.MustCompile(`^v[12]$`),
			"commit":         number,
			"max_inline":     size,
			"thread_pool":    number,
		},
	}
)

// CheckOptions refuses any option that is not on the allow-list of fsType
// ("" for a bind mount of a directory, which takes the generic ones only).
func CheckOptions(fsType string, options []string) error {
	for _, o := range options {
		if !optionAllowed(fsType, o) {
			what := fsType
			if what == "" {
				what = "a bind mount"
			}
			return fmt.Errorf("%w: %q is not an option poolcsi passes for %s (allowed: the generic atime, sync, nodev/nosuid/noexec and ro/rw options, and the filesystem's own tuning options)", ErrOptionRefused, o, what)
		}
	}
	return nil
}

func optionAllowed(fsType, o string) bool {
	if o == "" || len(o) > 64 || strings.ContainsAny(o, ",\x00 \t\n") {
		return false
	}
	if isGeneric(o) || fsOptions[fsType][o] {
		return true
	}
	key, val, ok := strings.Cut(o, "=")
	if !ok {
		return false
	}
	re := fsValued[fsType][key]
	return re != nil && re.MatchString(val)
}

// isGeneric tells whether o is an option of every mount, not a filesystem's.
func isGeneric(o string) bool {
	_, ok := genericFlags[o]
	return ok
}

// BindOptions keeps what a bind mount honours of options checked for a
// filesystem: the generic ones (a publish of a staged filesystem gets the
// same mountOptions as its stage, and the filesystem's own options belong to
// the stage).
func BindOptions(options []string) []string {
	var out []string
	for _, o := range options {
		if isGeneric(o) {
			out = append(out, o)
		}
	}
	return out
}
