// bf16 products through cuBLASLt, the algorithm measured per shape: see tuned_gemm.cuh.
#include <cstdio>
#include <vector>

#include "backend/cuda/tuned_gemm.cuh"

namespace malleus::backend::cuda {
namespace {

constexpr int kCandidates = 8;
constexpr size_t kWorkspaceBytes = size_t(32) << 20;
constexpr int kTrials = 3;

void lt_check(cublasStatus_t status, const char* what) {
  cublas_check(status, what);
}

}  // namespace

// The descriptors of one product, as cuBLASLt (column-major) sees it: Cᵀ = op(B)ᵀ · op(A)ᵀ.
struct TunedGemm::Descriptors {
  cublasLtMatmulDesc_t op = nullptr;
  cublasLtMatrixLayout_t first = nullptr, second = nullptr, out = nullptr;

  explicit Descriptors(const GemmShape& s) {
    lt_check(cublasLtMatmulDescCreate(&op, CUBLAS_COMPUTE_32F, CUDA_R_32F),
             "cublasLtMatmulDescCreate");
    const cublasOperation_t op_first = s.trans_b ? CUBLAS_OP_T : CUBLAS_OP_N;
    const cublasOperation_t op_second = s.trans_a ? CUBLAS_OP_T : CUBLAS_OP_N;
    lt_check(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_TRANSA, &op_first,
                                            sizeof(op_first)),
             "cublasLtMatmulDescSetAttribute");
    lt_check(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_TRANSB, &op_second,
                                            sizeof(op_second)),
             "cublasLtMatmulDescSetAttribute");
    // The first operand is B (n × k as stored, or k × n transposed), the second A.
    const uint64_t first_rows = s.trans_b ? s.k : s.n, first_cols = s.trans_b ? s.n : s.k;
    const uint64_t second_rows = s.trans_a ? s.m : s.k, second_cols = s.trans_a ? s.k : s.m;
    lt_check(cublasLtMatrixLayoutCreate(&first, CUDA_R_16BF, first_rows, first_cols, s.ldb),
             "cublasLtMatrixLayoutCreate");
    lt_check(cublasLtMatrixLayoutCreate(&second, CUDA_R_16BF, second_rows, second_cols, s.lda),
             "cublasLtMatrixLayoutCreate");
    lt_check(cublasLtMatrixLayoutCreate(&out, s.c_bf16 ? CUDA_R_16BF : CUDA_R_32F, uint64_t(s.n),
                                        uint64_t(s.m), s.ldc),
             "cublasLtMatrixLayoutCreate");
  }
  ~Descriptors() {
    if (out != nullptr) cublasLtMatrixLayoutDestroy(out);
    if (second != nullptr) cublasLtMatrixLayoutDestroy(second);
    if (first != nullptr) cublasLtMatrixLayoutDestroy(first);
    if (op != nullptr) cublasLtMatmulDescDestroy(op);
  }
  Descriptors(const Descriptors&) = delete;
  Descriptors& operator=(const Descriptors&) = delete;
};

TunedGemm::TunedGemm() {
  lt_check(cublasLtCreate(&handle_), "cublasLtCreate");
  workspace_.at_least(kWorkspaceBytes);
}

TunedGemm::~TunedGemm() {
  if (handle_ != nullptr) cublasLtDestroy(handle_);
}

TunedGemm::Choice TunedGemm::tune(const GemmShape& s, const Descriptors& d, const void* a,
                                  const void* b) {
  cublasLtMatmulPreference_t preference = nullptr;
  lt_check(cublasLtMatmulPreferenceCreate(&preference), "cublasLtMatmulPreferenceCreate");
  const size_t limit = kWorkspaceBytes;
  cublasLtMatmulPreferenceSetAttribute(preference, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &limit,
                                       sizeof(limit));
  cublasLtMatmulHeuristicResult_t results[kCandidates];
  int found = 0;
  const cublasStatus_t status = cublasLtMatmulAlgoGetHeuristic(
      handle_, d.op, d.first, d.second, d.out, d.out, preference, kCandidates, results, &found);
  cublasLtMatmulPreferenceDestroy(preference);
  Choice best;
  if (status != CUBLAS_STATUS_SUCCESS || found == 0) return best;

  // Each candidate runs on a scratch output (the real C may be accumulated into).
  const size_t out_bytes = size_t(s.ldc) * s.m * (s.c_bf16 ? 2 : 4);
  void* trial = trial_output_.at_least(out_bytes);
  cuda_check(cudaMemsetAsync(trial, 0, out_bytes, nullptr), "cudaMemsetAsync (gemm tuning)");
  cudaEvent_t start = nullptr, stop = nullptr;
  cuda_check(cudaEventCreate(&start), "cudaEventCreate");
  cuda_check(cudaEventCreate(&stop), "cudaEventCreate");
  const float alpha = 1;
  float best_ms = 0;
  for (int i = 0; i < found; ++i) {
    if (results[i].state != CUBLAS_STATUS_SUCCESS) continue;
    bool ok = true;
    float total = 0;
    for (int trial_run = 0; trial_run <= kTrials && ok; ++trial_run) {
      cudaEventRecord(start, nullptr);
      ok = cublasLtMatmul(handle_, d.op, &alpha, b, d.first, a, d.second, &s.beta, trial, d.out,
                          trial, d.out, &results[i].algo, workspace_.data, results[i].workspaceSize,
                          nullptr) == CUBLAS_STATUS_SUCCESS;
      cudaEventRecord(stop, nullptr);
      cudaEventSynchronize(stop);
      float ms = 0;
      cudaEventElapsedTime(&ms, start, stop);
      if (trial_run > 0) total += ms;  // the first run warms up
    }
    if (ok && (!best.usable || total < best_ms)) {
      best = {true, results[i].algo, results[i].workspaceSize};
      best_ms = total;
    }
  }
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  cudaGetLastError();  // a candidate that failed to launch leaves no sticky error behind
  return best;
}

bool TunedGemm::run(const GemmShape& s, const void* a, const void* b, void* c) {
  const Descriptors d(s);
  auto found = choices_.find(s.key());
  if (found == choices_.end()) found = choices_.emplace(s.key(), tune(s, d, a, b)).first;
  const Choice& choice = found->second;
  if (!choice.usable) return false;
  const float alpha = 1;
  lt_check(cublasLtMatmul(handle_, d.op, &alpha, b, d.first, a, d.second, &s.beta, c, d.out, c,
                          d.out, &choice.algo, workspace_.data, choice.workspace, nullptr),
           "cublasLtMatmul");
  return true;
}

}  // namespace malleus::backend::cuda
