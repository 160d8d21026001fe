// Large host buffers as anonymous mappings of their own, asking the kernel for transparent huge
// pages (MADV_HUGEPAGE; the common THP setting "madvise" gives them only to mappings that ask).
// The engine's parameter, gradient and optimizer buffers, an asynchronous checkpoint's copy and a
// load's staging all come from here, for two reasons:
//
// - pages are zero and taken only when first touched, and ranges can be given back
//   (MADV_DONTNEED), which a live migration needs to hold its memory under the bucket bound;
// - with 4 KiB pages, first touch and the kernel's copies into and out of the buffer (read(),
//   write()) pay per page. On the 2-core test VM (bench/bench_checkpoint.sh's figures in
//   docs/performance.md) a first touch ran at about 0.3 GB/s with 4 KiB pages and 9.8 GB/s with
//   huge pages, and a read() from the page cache into a 635 MB buffer at 1.1–1.4 GB/s against
//   12–14 GB/s. Fewer TLB misses help the kernels on bare metal too.
//
// Where the kernel has no huge pages (THP "never", or no 2 MiB-aligned run inside the mapping)
// the advice does nothing and the buffer is ordinary memory.
#pragma once

#include <cstddef>
#include <utility>

namespace malleus {

// A zeroed mapping of `bytes` (> 0), huge pages asked for; throws std::bad_alloc when the system
// has no memory for it. Give it back with unmap_pages(data, bytes).
void* map_pages(size_t bytes);
void unmap_pages(void* data, size_t bytes);

// Makes sure every page of [data, data + bytes) is present before the kernel writes there (a
// read() into a fresh buffer): writes a zero into each 4 KiB of the range from this thread, so
// call it only on a range about to be overwritten whole. On the test VM a page first touched by
// the kernel's copy inside read() cost 6–10× one touched here (reading a 635 MB file into a
// fresh huge-page buffer: 0.5–0.7 GB/s, against 2.9–3.4 GB/s with this first); elsewhere it
// moves the same page faults earlier.
void prefault_for_overwrite(void* data, size_t bytes);

// Owns one map_pages mapping of `count` elements of T (none when empty). Move-only.
template <typename T>
class PageBuffer {
 public:
  PageBuffer() = default;
  explicit PageBuffer(size_t count)
      : data_(count > 0 ? static_cast<T*>(map_pages(count * sizeof(T))) : nullptr), count_(count) {}
  ~PageBuffer() {
    if (data_ != nullptr) unmap_pages(data_, count_ * sizeof(T));
  }
  PageBuffer(PageBuffer&& other) noexcept
      : data_(std::exchange(other.data_, nullptr)), count_(std::exchange(other.count_, 0)) {}
  PageBuffer& operator=(PageBuffer&& other) noexcept {
    PageBuffer gone(std::move(*this));
    data_ = std::exchange(other.data_, nullptr);
    count_ = std::exchange(other.count_, 0);
    return *this;
  }
  PageBuffer(const PageBuffer&) = delete;
  PageBuffer& operator=(const PageBuffer&) = delete;

  T* data() const { return data_; }
  size_t size() const { return count_; }
  T& operator[](size_t i) const { return data_[i]; }

 private:
  T* data_ = nullptr;
  size_t count_ = 0;
};

}  // namespace malleus
