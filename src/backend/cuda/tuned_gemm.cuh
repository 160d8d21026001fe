// bf16 matrix products through cuBLASLt with the algorithm chosen by measurement: the first product
// of each shape times every algorithm the heuristic offers (up to kCandidates) on a scratch copy of
// its output and keeps the fastest for that shape from then on, so a shape always runs the same
// algorithm (and the step stays deterministic). The CUDA backend uses it in bf16 mode when
// MALLEUS_CUDA_GEMM_TUNING=1; otherwise cublasGemmEx picks by its heuristic alone.
#pragma once

#include <cublasLt.h>

#include <map>
#include <tuple>

#include "backend/cuda/cuda_common.cuh"

namespace malleus::backend::cuda {

// A row-major product C[m, n] = op(A)[m, k] · op(B)[k, n] + beta · C of bf16 A and B (leading
// dimensions lda, ldb, ldc), C in bf16 or fp32, fp32 accumulation.
struct GemmShape {
  bool trans_a = false, trans_b = false;
  int m = 0, n = 0, k = 0, lda = 0, ldb = 0, ldc = 0;
  bool c_bf16 = false;
  float beta = 0;
  auto key() const {
    return std::make_tuple(trans_a, trans_b, m, n, k, lda, ldb, ldc, c_bf16, beta != 0.f);
  }
};

class TunedGemm {
 public:
  TunedGemm();
  ~TunedGemm();
  TunedGemm(const TunedGemm&) = delete;
  TunedGemm& operator=(const TunedGemm&) = delete;

  // Runs the product; returns false (having done nothing) where cuBLASLt offers no algorithm.
  bool run(const GemmShape& shape, const void* a, const void* b, void* c);
  // The shapes tuned so far.
  int tuned_shapes() const { return int(choices_.size()); }

 private:
  struct Descriptors;
  struct Choice {
    bool usable = false;
    cublasLtMatmulAlgo_t algo{};
    size_t workspace = 0;
  };
  Choice tune(const GemmShape& shape, const Descriptors& d, const void* a, const void* b);

  cublasLtHandle_t handle_ = nullptr;
  Scratch<unsigned char> workspace_;
  Scratch<unsigned char> trial_output_;
  std::map<decltype(GemmShape{}.key()), Choice> choices_;
};

}  // namespace malleus::backend::cuda
