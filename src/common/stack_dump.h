// Another thread's call stack, as text: what a hang report adds so that the call a rank is stuck
// in (a collective, a lock, a file) is named in the log and not only its phase.
//
// prepare_stack_dumps() installs a signal handler (one real-time signal) and warms glibc's
// backtrace() up, so that the handler itself neither allocates nor loads libraries. stack_of()
// sends that signal to the thread, whose handler records its return addresses; the calling thread
// then names them (dladdr and the demangler, outside the handler). Functions the executable does
// not export show as the binary plus an offset (addr2line -f -C -e <binary> <offset> names them);
// the malleus executable exports its functions (ENABLE_EXPORTS) for that reason.
//
// A thread inside a system call answers only when the call returns, so its stack names the call
// it was in, not how long it has been there. kernel_state_of() adds what the kernel says of the
// thread: its state, where it sleeps, the CPU time it has had (a thread that waits has little;
// one denied its core by other work, none more) and, where this process may read it (root), its
// kernel stack.
#pragma once

#include <pthread.h>
#include <sys/types.h>

#include <string>

namespace malleus {

// Idempotent; safe to call from any thread.
void prepare_stack_dumps();

// The frames of `thread` (innermost first, one per line, each prefixed with `indent`), or a line
// saying why there are none: dumps not prepared, or the thread did not answer within `wait_s`
// (it has signals blocked, or is stopped). One dump at a time in the process.
std::string stack_of(pthread_t thread, double wait_s = 2.0, const std::string& indent = "  ");

// The kernel's view of thread `tid` of this process (gettid()), one line plus its kernel stack
// where readable, each line prefixed with `indent`: "kernel: state S (sleeping) in
// futex_wait_queue, 1.25 s of CPU (user 1.02 s, system 0.23 s)". Reads /proc; says so when the
// thread is gone.
std::string kernel_state_of(pid_t tid, const std::string& indent = "  ");

}  // namespace malleus
