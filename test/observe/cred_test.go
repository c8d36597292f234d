package observe

import "syscall"

// syscallCred runs a child as nobody, to see the demo refuse without root.
var syscallCred = syscall.SysProcAttr{Credential: &syscall.Credential{Uid: 65534, Gid: 65534}}
