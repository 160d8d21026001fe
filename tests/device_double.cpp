#include "device_double.h"

#include <sys/mman.h>
#include <unistd.h>

#include <cstring>
#include <map>
#include <mutex>
#include <new>
#include <string>

#include "common/error.h"

namespace malleus::testing {

namespace {

// The double's memory: one reserved range, handed out in whole pages (released pages are reused
// for allocations of the same size), inaccessible while no call of the double runs.
class Arena {
 public:
  static Arena& get() {
    static auto* arena = new Arena;  // never destroyed: buffers may be released at exit
    return *arena;
  }

  void* allocate(size_t bytes) {
    const size_t size = pages(bytes);
    std::lock_guard lock(mutex_);
    char* data = nullptr;
    if (auto it = free_.find(size); it != free_.end()) {
      data = it->second;
      free_.erase(it);
    } else {
      check(top_ + size <= kReserve,
            "device double: arena of " + std::to_string(kReserve) + " bytes is full");
      data = base_ + top_;
      top_ += size;
      if (open_ > 0) protect(data, size, PROT_READ | PROT_WRITE);
    }
    sizes_[data] = size;
    held_ += static_cast<int64_t>(size);
    return data;
  }

  void release(void* pointer) {
    std::lock_guard lock(mutex_);
    auto* data = static_cast<char*>(pointer);
    const auto it = sizes_.find(data);
    check(it != sizes_.end(), "device double: release of a pointer it did not allocate");
    ::madvise(data, it->second, MADV_DONTNEED);  // zero when handed out again
    free_.emplace(it->second, data);
    held_ -= static_cast<int64_t>(it->second);
    sizes_.erase(it);
  }

  // Inside a buffer allocated and not yet released: what a GPU backend's pointers must be (the
  // CUDA backend's storage map refuses the rest, a released buffer's included).
  bool holds(const void* pointer) {
    auto* p = const_cast<char*>(static_cast<const char*>(pointer));
    std::lock_guard lock(mutex_);
    auto above = sizes_.upper_bound(p);
    if (above == sizes_.begin()) return false;
    --above;
    return p < above->first + above->second;
  }

  // While a call runs: the arena readable and writable (nested calls and threads counted).
  void open() {
    std::lock_guard lock(mutex_);
    if (open_++ == 0) protect(base_, top_, PROT_READ | PROT_WRITE);
  }
  void close() {
    std::lock_guard lock(mutex_);
    if (--open_ == 0) protect(base_, top_, PROT_NONE);
  }

  int64_t held() {
    std::lock_guard lock(mutex_);
    return held_;
  }

 private:
  static constexpr size_t kReserve = size_t{64} << 30;

  Arena() {
    void* base =
        ::mmap(nullptr, kReserve, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (base == MAP_FAILED) throw std::bad_alloc();
    base_ = static_cast<char*>(base);
  }
  static size_t pages(size_t bytes) {
    const auto page = static_cast<size_t>(::sysconf(_SC_PAGESIZE));
    return (std::max<size_t>(bytes, 1) + page - 1) / page * page;
  }
  static void protect(void* data, size_t bytes, int mode) {
    if (bytes == 0) return;
    check(::mprotect(data, bytes, mode) == 0,
          std::string("device double: mprotect failed: ") + std::strerror(errno));
  }

  std::mutex mutex_;
  char* base_ = nullptr;
  size_t top_ = 0;
  int open_ = 0;
  int64_t held_ = 0;
  std::map<char*, size_t> sizes_;
  std::multimap<size_t, char*> free_;
};

// The arena open for the scope of one call of the double.
class Open {
 public:
  Open() { Arena::get().open(); }
  ~Open() { Arena::get().close(); }
  Open(const Open&) = delete;
  Open& operator=(const Open&) = delete;
};

class DoubleMemory final : public DeviceMemory {
 public:
  std::string name() const override { return "the device double"; }
  bool is_cuda() const override { return false; }
  bool holds(const void* data) const override { return Arena::get().holds(data); }
  void to_host(void* host, const void* device, size_t row_bytes, size_t rows,
               size_t device_pitch) const override {
    check(!holds(host) && holds(device),
          "device double: to_host from " + where(device) + " to " + where(host));
    Open open;
    for (size_t r = 0; r < rows; ++r) {
      std::memcpy(static_cast<char*>(host) + r * row_bytes,
                  static_cast<const char*>(device) + r * device_pitch, row_bytes);
    }
  }
  void from_host(void* device, const void* host, size_t row_bytes, size_t rows,
                 size_t device_pitch) const override {
    check(!holds(host) && holds(device),
          "device double: from_host from " + where(host) + " to " + where(device));
    Open open;
    for (size_t r = 0; r < rows; ++r) {
      std::memcpy(static_cast<char*>(device) + r * device_pitch,
                  static_cast<const char*>(host) + r * row_bytes, row_bytes);
    }
  }

 private:
  std::string where(const void* p) const { return holds(p) ? "device memory" : "host memory"; }
};

// Throws unless every non-null pointer lies in the arena.
void on_device(const char* call) {
  (void)call;
}
template <typename P, typename... Rest>
void on_device(const char* call, const P* pointer, const Rest*... rest) {
  check(pointer == nullptr || Arena::get().holds(pointer),
        std::string("device double: ") + call + " was given host memory");
  on_device(call, rest...);
}

class DeviceDouble final : public backend::Backend<float> {
 public:
  explicit DeviceDouble(int threads) : cpu_(backend::make_cpu_backend<float>(threads)) {
    set_device_memory(device_double_memory());
  }

  std::string name() const override { return "device double over " + cpu_->name(); }
  void set_num_threads(int threads) override { cpu_->set_num_threads(threads); }
  int num_threads() const override { return cpu_->num_threads(); }

  float* allocate(size_t count, backend::MemoryKind, backend::Precision) override {
    return static_cast<float*>(Arena::get().allocate(count * sizeof(float)));
  }
  int32_t* allocate_tokens(size_t count) override {
    return static_cast<int32_t*>(Arena::get().allocate(count * sizeof(int32_t)));
  }
  void release(void* pointer) override { Arena::get().release(pointer); }
  void discard_pages(void* data, size_t bytes) override {
    on_device("discard_pages", static_cast<const char*>(data));
    const auto page = static_cast<uintptr_t>(::sysconf(_SC_PAGESIZE));
    const uintptr_t begin = (reinterpret_cast<uintptr_t>(data) + page - 1) / page * page;
    const uintptr_t end = (reinterpret_cast<uintptr_t>(data) + bytes) / page * page;
    if (end > begin) ::madvise(reinterpret_cast<void*>(begin), end - begin, MADV_DONTNEED);
  }
  void copy_to_host(float* host, const float* source, size_t count) override {
    device_memory()->to_host(host, source, count * sizeof(float));
  }
  void copy_from_host(float* destination, const float* host, size_t count) override {
    device_memory()->from_host(destination, host, count * sizeof(float));
  }
  void copy_tokens_from_host(int32_t* destination, const int32_t* host, size_t count) override {
    device_memory()->from_host(destination, host, count * sizeof(int32_t));
  }

  void fill_zero(float* x, size_t count) override {
    on_device("fill_zero", x);
    Open open;
    cpu_->fill_zero(x, count);
  }
  void copy(float* destination, const float* source, size_t count) override {
    on_device("copy", destination, source);
    Open open;
    cpu_->copy(destination, source, count);
  }
  void add(float* y, const float* x, size_t count) override {
    on_device("add", y, x);
    Open open;
    cpu_->add(y, x, count);
  }
  void scale(float* x, float factor, size_t count) override {
    on_device("scale", x);
    Open open;
    cpu_->scale(x, factor, count);
  }
  double sum_squares(const float* x, size_t count) override {
    on_device("sum_squares", x);
    Open open;
    return cpu_->sum_squares(x, count);
  }

  void embedding_forward(float* out, const int32_t* tokens, const float* table, int vocab_begin,
                         int rows, int n, int c) override {
    on_device("embedding_forward", out, table);
    on_device("embedding_forward", tokens);
    Open open;
    cpu_->embedding_forward(out, tokens, table, vocab_begin, rows, n, c);
  }
  void embedding_backward(float* dtable, const float* dout, const int32_t* tokens, int vocab_begin,
                          int rows, int n, int c) override {
    on_device("embedding_backward", dtable, dout);
    on_device("embedding_backward", tokens);
    Open open;
    cpu_->embedding_backward(dtable, dout, tokens, vocab_begin, rows, n, c);
  }
  void rmsnorm_forward(float* out, float* rstd, const float* in, const float* weight, int n, int c,
                       float eps) override {
    on_device("rmsnorm_forward", out, rstd, in, weight);
    Open open;
    cpu_->rmsnorm_forward(out, rstd, in, weight, n, c, eps);
  }
  void rmsnorm_backward(float* din, float* dweight, const float* dout, const float* in,
                        const float* weight, const float* rstd, int n, int c) override {
    on_device("rmsnorm_backward", din, dweight, dout, in, weight, rstd);
    Open open;
    cpu_->rmsnorm_backward(din, dweight, dout, in, weight, rstd, n, c);
  }
  void add_rmsnorm_forward(float* sum, float* out, float* rstd, const float* residual,
                           const float* weight, int n, int c, float eps) override {
    on_device("add_rmsnorm_forward", sum, out, rstd, residual, weight);
    Open open;
    cpu_->add_rmsnorm_forward(sum, out, rstd, residual, weight, n, c, eps);
  }
  void matmul_forward(float* out, const float* in, const float* weight, int n, int ic,
                      int oc) override {
    on_device("matmul_forward", out, in, weight);
    Open open;
    cpu_->matmul_forward(out, in, weight, n, ic, oc);
  }
  void matmul_backward(float* din, float* dweight, const float* dout, const float* in,
                       const float* weight, int n, int ic, int oc) override {
    on_device("matmul_backward", din, dweight, dout, in, weight);
    Open open;
    cpu_->matmul_backward(din, dweight, dout, in, weight, n, ic, oc);
  }
  void rope_forward(float* x, int batch, int seq, int heads, int head_dim, float theta,
                    int first_position) override {
    on_device("rope_forward", x);
    Open open;
    cpu_->rope_forward(x, batch, seq, heads, head_dim, theta, first_position);
  }
  void rope_backward(float* dx, int batch, int seq, int heads, int head_dim, float theta) override {
    on_device("rope_backward", dx);
    Open open;
    cpu_->rope_backward(dx, batch, seq, heads, head_dim, theta);
  }
  size_t attention_state_size(int batch, int seq, int keys, int q_heads) const override {
    return cpu_->attention_state_size(batch, seq, keys, q_heads);
  }
  void attention_forward(float* out, float* state, const float* q, const float* k, const float* v,
                         int batch, int seq, int past, int q_heads, int kv_heads,
                         int head_dim) override {
    on_device("attention_forward", out, state, q, k, v);
    Open open;
    cpu_->attention_forward(out, state, q, k, v, batch, seq, past, q_heads, kv_heads, head_dim);
  }
  void attention_backward(float* dq, float* dk, float* dv, const float* dout, const float* out,
                          const float* state, const float* q, const float* k, const float* v,
                          int batch, int seq, int q_heads, int kv_heads, int head_dim) override {
    on_device("attention_backward", dq, dk, dv, dout, out, state, q, k, v);
    Open open;
    cpu_->attention_backward(dq, dk, dv, dout, out, state, q, k, v, batch, seq, q_heads, kv_heads,
                             head_dim);
  }
  void swiglu_forward(float* out, const float* gate, const float* up, size_t count) override {
    on_device("swiglu_forward", out, gate, up);
    Open open;
    cpu_->swiglu_forward(out, gate, up, count);
  }
  void swiglu_backward(float* dgate, float* dup, const float* dout, const float* gate,
                       const float* up, size_t count) override {
    on_device("swiglu_backward", dgate, dup, dout, gate, up);
    Open open;
    cpu_->swiglu_backward(dgate, dup, dout, gate, up, count);
  }
  void logits_row_max(float* row_max, const float* logits, int n, int vocab) override {
    on_device("logits_row_max", row_max, logits);
    Open open;
    cpu_->logits_row_max(row_max, logits, n, vocab);
  }
  void logits_softmax_sums(float* sum_exp, float* target_logit, const float* logits,
                           const float* row_max, const int32_t* targets, int vocab_begin, int n,
                           int vocab) override {
    on_device("logits_softmax_sums", sum_exp, target_logit, logits, row_max);
    on_device("logits_softmax_sums", targets);
    Open open;
    cpu_->logits_softmax_sums(sum_exp, target_logit, logits, row_max, targets, vocab_begin, n,
                              vocab);
  }
  void cross_entropy_loss(float* losses, const float* row_max, const float* sum_exp,
                          const float* target_logit, int n) override {
    on_device("cross_entropy_loss", losses, row_max, sum_exp, target_logit);
    Open open;
    cpu_->cross_entropy_loss(losses, row_max, sum_exp, target_logit, n);
  }
  void cross_entropy_backward(float* dlogits, const float* logits, const float* row_max,
                              const float* sum_exp, const int32_t* targets, int vocab_begin,
                              float loss_scale, int n, int vocab) override {
    on_device("cross_entropy_backward", dlogits, logits, row_max, sum_exp);
    on_device("cross_entropy_backward", targets);
    Open open;
    cpu_->cross_entropy_backward(dlogits, logits, row_max, sum_exp, targets, vocab_begin,
                                 loss_scale, n, vocab);
  }
  void adamw_update(float* param, const float* grad, float* m, float* v, size_t count,
                    const backend::AdamWStep& step) override {
    on_device("adamw_update", param, grad, m, v);
    Open open;
    cpu_->adamw_update(param, grad, m, v, count, step);
  }

 private:
  std::unique_ptr<backend::Backend<float>> cpu_;
};

}  // namespace

std::unique_ptr<backend::Backend<float>> make_device_double(int threads) {
  return std::make_unique<DeviceDouble>(threads);
}

std::shared_ptr<const DeviceMemory> device_double_memory() {
  static const auto memory = std::make_shared<const DoubleMemory>();
  return memory;
}

int64_t device_double_bytes() {
  return Arena::get().held();
}

}  // namespace malleus::testing
