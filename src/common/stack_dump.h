// Another thread's call stack, as text: what a hang report adds so that the call a rank is stuck
// in (a collective, a lock, a file) is named in the log and not only its phase.
//
// prepare_stack_dumps() installs a signal handler (one real-time signal) and warms glibc's
// backtrace() up, so that the handler itself neither allocates nor loads libraries. stack_of()
// sends that signal to the thread, whose handler records its return addresses; the calling thread
// then names them (dladdr and the demangler, outside the handler). Functions the executable does
// not export show as the binary plus an offset (addr2line -f -C -e <binary> <offset> names them);
// the malleus executable exports its functions (ENABLE_EXPORTS) for that reason.
#pragma once

#include <pthread.h>

#include <string>

namespace malleus {

// Idempotent; safe to call from any thread.
void prepare_stack_dumps();

// The frames of `thread` (innermost first, one per line, each prefixed with `indent`), or a line
// saying why there are none: dumps not prepared, or the thread did not answer within `wait_s`
// (it has signals blocked, or is stopped). One dump at a time in the process.
std::string stack_of(pthread_t thread, double wait_s = 2.0, const std::string& indent = "  ");

}  // namespace malleus
