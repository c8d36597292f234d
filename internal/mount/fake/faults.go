package fake

import "sync"

// Faults fails chosen calls of a fake Host: the Nth call (counting from 1) of
// a method, or every call from the Nth on, returns a given error. It counts
// every call, so a test can also assert what was called.
type Faults struct {
	mu    sync.Mutex
	calls map[string]int
	rules []rule
	hooks map[string]func()
}

// OnCall runs fn at every call of method, before it does anything (to make a
// call slow, or to act in the middle of another call).
func (f *Faults) OnCall(method string, fn func()) {
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.hooks == nil {
		f.hooks = map[string]func(){}
	}
	f.hooks[method] = fn
}

type rule struct {
	method string
	nth    int
	always bool
	err    error
}

// FailNth makes the nth call of method (1 = the next one is the first
// counted) return err.
func (f *Faults) FailNth(method string, nth int, err error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.rules = append(f.rules, rule{method: method, nth: f.calls[method] + nth, err: err})
}

// FailFrom makes every call of method from the nth on return err.
func (f *Faults) FailFrom(method string, nth int, err error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.rules = append(f.rules, rule{method: method, nth: f.calls[method] + nth, always: true, err: err})
}

// Reset forgets every rule.
func (f *Faults) Reset() {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.rules = nil
}

// Calls is how many times method was called.
func (f *Faults) Calls(method string) int {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.calls[method]
}

func (f *Faults) hit(method string) error {
	f.mu.Lock()
	hook := f.hooks[method]
	f.mu.Unlock()
	if hook != nil {
		hook()
	}
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.calls == nil {
		f.calls = map[string]int{}
	}
	f.calls[method]++
	n := f.calls[method]
	for _, r := range f.rules {
		if r.method == method && (n == r.nth || (r.always && n >= r.nth)) {
			return r.err
		}
	}
	return nil
}
