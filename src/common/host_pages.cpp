#include "common/host_pages.h"

#include <sys/mman.h>

#include <new>

namespace malleus {

void* map_pages(size_t bytes) {
  void* data = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (data == MAP_FAILED) throw std::bad_alloc();
  // Advice, not a demand: without huge pages (THP off, or a kernel without it) it fails and the
  // mapping keeps 4 KiB pages, which is still correct.
  ::madvise(data, bytes, MADV_HUGEPAGE);
  return data;
}

void unmap_pages(void* data, size_t bytes) {
  ::munmap(data, bytes);
}

void prefault_for_overwrite(void* data, size_t bytes) {
  constexpr size_t kPage = 4096;  // the smallest page: one write per page of any size
  auto* bytes_at = static_cast<volatile char*>(data);
  for (size_t at = 0; at < bytes; at += kPage) bytes_at[at] = 0;
}

}  // namespace malleus
