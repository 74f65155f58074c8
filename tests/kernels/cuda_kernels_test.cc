// CUDA backend tests: every op against a naive double-precision host reference computed on the
// same bf16-rounded inputs. Outputs are poisoned (NaN) before each op so unwritten elements
// fail. Every test skips when no CUDA device is present (CI has none).
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <limits>
#include <numeric>
#include <ostream>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "kernels/backend.h"
#include "kernels/cuda/cuda_backend.h"
#include "kernels/cuda/launch.h"
#include "kernels/cuda/tuning_knobs.h"
#include "kernels/dtype.h"

namespace mobius::kernels {
namespace {

constexpr double kBf16Tol = 1e-2;

bool HaveCudaDevice() {
  int count = 0;
  const bool ok = cudaGetDeviceCount(&count) == cudaSuccess && count > 0;
  cudaGetLastError();
  return ok;
}

float RoundBf16(float v) { return BF16ToFloat(FloatToBF16(v)); }

// max |a - b| / max |b|; infinite when a has a NaN (an unwritten, poisoned element).
double RelErr(const std::vector<float>& a, const std::vector<double>& b) {
  EXPECT_EQ(a.size(), b.size());
  double diff = 0.0, ref = 0.0;
  for (size_t i = 0; i < a.size() && i < b.size(); ++i) {
    if (!std::isfinite(a[i])) return std::numeric_limits<double>::infinity();
    diff = std::max(diff, std::abs(a[i] - b[i]));
    ref = std::max(ref, std::abs(b[i]));
  }
  return ref == 0.0 ? diff : diff / ref;
}

// Prints an error next to the test's output, for the design notes.
double Reported(const char* what, double err) {
  std::printf("  rel err %-40s %.3g\n", what, err);
  return err;
}

class CudaKernelsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!HaveCudaDevice()) GTEST_SKIP() << "no CUDA device";
    auto backend = CreateCudaBackend(0);
    ASSERT_TRUE(backend.ok()) << backend.status();
    backend_ = *std::move(backend);
  }

  // Random values (never zero) rounded to bf16, so host and device see the same numbers.
  std::vector<float> Rand(int64_t n, float lo = -1.0f, float hi = 1.0f) {
    std::uniform_real_distribution<float> dist(lo, hi);
    std::vector<float> v(static_cast<size_t>(n));
    for (float& x : v) {
      do {
        x = RoundBf16(dist(rng_));
      } while (x == 0.0f);
    }
    return v;
  }

  Tensor Make(DType dtype, std::vector<int64_t> shape, const std::vector<float>& values) {
    auto t = backend_->Allocate(dtype, std::move(shape));
    EXPECT_TRUE(t.ok()) << t.status();
    EXPECT_EQ(t->numel(), static_cast<int64_t>(values.size()));
    backend_->CopyFromHost(values.data(), DType::kF32, *t);
    return *t;
  }
  Tensor MakeI32(std::vector<int64_t> shape, const std::vector<int32_t>& values) {
    auto t = backend_->Allocate(DType::kI32, std::move(shape));
    EXPECT_TRUE(t.ok()) << t.status();
    backend_->CopyFromHost(values.data(), DType::kI32, *t);
    return *t;
  }
  // A tensor full of NaN (I32: -12345).
  Tensor Poisoned(DType dtype, std::vector<int64_t> shape) {
    auto t = backend_->Allocate(dtype, std::move(shape));
    EXPECT_TRUE(t.ok()) << t.status();
    if (dtype == DType::kI32) {
      std::vector<int32_t> v(static_cast<size_t>(t->numel()), -12345);
      backend_->CopyFromHost(v.data(), DType::kI32, *t);
    } else {
      std::vector<float> v(static_cast<size_t>(t->numel()), std::nanf(""));
      backend_->CopyFromHost(v.data(), DType::kF32, *t);
    }
    return *t;
  }
  std::vector<float> Host(const Tensor& t) {
    std::vector<float> v(static_cast<size_t>(t.numel()));
    backend_->CopyToHostF32(t, v.data());
    return v;
  }
  // LinearFanOut of `ns` weights of K columns against a double reference at 1, 2, 3 and 8 rows.
  void RunFanOut(int64_t k, const std::vector<int64_t>& ns);
  std::vector<int32_t> HostI32(const Tensor& t) {
    std::vector<int32_t> v(static_cast<size_t>(t.numel()));
    backend_->CopyToHostI32(t, v.data());
    return v;
  }

  // Runs the delta rule over ragged segments with every algorithm, against RefDeltaRule.
  void RunDeltaRuleCase(const DeltaRuleDims& dims, const std::vector<int>& lengths,
                        const std::vector<int>& slot_of, int slots);

  std::mt19937 rng_{1234};
  std::unique_ptr<Backend> backend_;
};

std::vector<SequenceSegment> MakeSegments(const std::vector<int>& lengths,
                                          const std::vector<int>& cached,
                                          const std::vector<int>& slots) {
  std::vector<SequenceSegment> segs;
  int begin = 0;
  for (size_t i = 0; i < lengths.size(); ++i) {
    SequenceSegment s;
    s.token_begin = begin;
    s.num_tokens = lengths[i];
    s.cached_tokens = cached[i];
    s.state_slot = slots[i];
    segs.push_back(s);
    begin += lengths[i];
  }
  return segs;
}

// Paged-KV block tables for `segs` (each needs cached_tokens + num_tokens positions): a random
// permutation of `spare` + the needed blocks, dealt out in order into `tables`, which the
// segments then point into. Returns the number of blocks.
int DealBlockTables(std::vector<SequenceSegment>& segs, int bs, int spare, std::mt19937& rng,
                    std::vector<std::vector<int32_t>>& tables) {
  int num_blocks = spare;
  for (const SequenceSegment& s : segs)
    num_blocks += (s.cached_tokens + s.num_tokens + bs - 1) / bs;
  std::vector<int32_t> perm(num_blocks);
  std::iota(perm.begin(), perm.end(), 0);
  std::shuffle(perm.begin(), perm.end(), rng);
  tables.assign(segs.size(), {});
  int next = 0;
  for (size_t s = 0; s < segs.size(); ++s) {
    const int need = (segs[s].cached_tokens + segs[s].num_tokens + bs - 1) / bs;
    tables[s].assign(perm.begin() + next, perm.begin() + next + need);
    next += need;
    segs[s].kv_blocks = tables[s];
  }
  return num_blocks;
}

// Causal paged GQA attention in float64 over bf16-valued inputs: q [T, nh, hd], caches
// [blocks, bs, nkv, hd].
std::vector<double> RefPagedAttention(const std::vector<float>& q, const std::vector<float>& kc,
                                      const std::vector<float>& vc,
                                      const std::vector<SequenceSegment>& segs, int nh, int nkv,
                                      int hd, int bs, float scale) {
  std::vector<double> ref(q.size(), 0.0);
  for (const auto& s : segs) {
    for (int i = 0; i < s.num_tokens; ++i) {
      const int64_t tok = s.token_begin + i;
      const int n = s.cached_tokens + i + 1;
      for (int h = 0; h < nh; ++h) {
        const int kvh = h / (nh / nkv);
        std::vector<double> sc(n);
        double mx = -1e300;
        for (int pos = 0; pos < n; ++pos) {
          const int64_t base = ((int64_t{s.kv_blocks[pos / bs]} * bs + pos % bs) * nkv + kvh) * hd;
          double dot = 0;
          for (int d = 0; d < hd; ++d) dot += double{q[(tok * nh + h) * hd + d]} * kc[base + d];
          sc[pos] = dot * scale;
          mx = std::max(mx, sc[pos]);
        }
        double sum = 0;
        for (double& x : sc) sum += (x = std::exp(x - mx));
        for (int pos = 0; pos < n; ++pos) {
          const int64_t base = ((int64_t{s.kv_blocks[pos / bs]} * bs + pos % bs) * nkv + kvh) * hd;
          for (int d = 0; d < hd; ++d) ref[(tok * nh + h) * hd + d] += sc[pos] / sum * vc[base + d];
        }
      }
    }
  }
  return ref;
}

// ---------------------------------------------------------------------------------------------
// Memory and copies

TEST_F(CudaKernelsTest, AllocateCopyAndConvert) {
  EXPECT_EQ(backend_->activation_dtype(), DType::kBF16);
  EXPECT_EQ(backend_->device(), Device::kCuda);
  auto zeros = backend_->Allocate(DType::kBF16, {3, 5});
  ASSERT_TRUE(zeros.ok());
  for (float v : Host(*zeros)) EXPECT_EQ(v, 0.0f);

  // F32 -> BF16 rounds to nearest even, exactly like FloatToBF16.
  std::vector<float> src = {1.0f, 1.00390625f, 1.01171875f, -3.3f, 1e-3f, 65504.f, 3.14159f};
  Tensor t = Poisoned(DType::kBF16, {static_cast<int64_t>(src.size())});
  backend_->CopyFromHost(src.data(), DType::kF32, t);
  std::vector<float> back = Host(t);
  for (size_t i = 0; i < src.size(); ++i) EXPECT_EQ(back[i], RoundBf16(src[i])) << i;

  // F16 and BF16 sources.
  std::vector<uint16_t> f16 = {0x3c00, 0xc000, 0x3555, 0x0001};
  Tensor head = t.Rows(0, 4);
  backend_->CopyFromHost(f16.data(), DType::kF16, head);
  back = Host(t);
  for (int i = 0; i < 4; ++i) EXPECT_EQ(back[i], RoundBf16(F16ToFloat(f16[i]))) << i;
  std::vector<uint16_t> bf = {0x3f80, 0xc040, 0x1234};
  Tensor view = t.Rows(4, 3);
  backend_->CopyFromHost(bf.data(), DType::kBF16, view);
  back = Host(t);
  for (int i = 0; i < 3; ++i) EXPECT_EQ(back[4 + i], BF16ToFloat(bf[i])) << i;

  // F32 tensors keep full precision; I32 round-trips; ZeroFill clears.
  Tensor f = Poisoned(DType::kF32, {7});
  backend_->CopyFromHost(src.data(), DType::kF32, f);
  EXPECT_EQ(Host(f), src);
  std::vector<int32_t> ids = {5, -1, 1 << 30};
  Tensor i32 = MakeI32({3}, ids);
  EXPECT_EQ(HostI32(i32), ids);
  backend_->ZeroFill(t);
  for (float v : Host(t)) EXPECT_EQ(v, 0.0f);

  // Too large: ResourceExhausted with sizes, not a crash.
  auto huge = backend_->Allocate(DType::kF32, {int64_t{1} << 46});
  ASSERT_FALSE(huge.ok());
  EXPECT_EQ(huge.status().code(), absl::StatusCode::kResourceExhausted) << huge.status();
  // The backend still works afterwards.
  Tensor again = Make(DType::kBF16, {2}, {1.0f, 2.0f});
  EXPECT_EQ(Host(again), (std::vector<float>{1.0f, 2.0f}));
}

// ---------------------------------------------------------------------------------------------
// Dense

void RefLinear(const std::vector<float>& x, const std::vector<float>& w, int64_t m, int64_t n,
               int64_t k, std::vector<double>& y) {
  y.assign(static_cast<size_t>(m * n), 0.0);
  for (int64_t i = 0; i < m; ++i) {
    for (int64_t j = 0; j < n; ++j) {
      double acc = 0.0;
      for (int64_t l = 0; l < k; ++l) acc += double{x[i * k + l]} * w[j * k + l];
      y[i * n + j] = acc;
    }
  }
}

TEST_F(CudaKernelsTest, Linear) {
  struct Shape {
    int64_t m, n, k;
  };
  // Up to 2 rows with K % 8 == 0 and at most 16M weights take the skinny kernel; the rest
  // cuBLASLt.
  for (const Shape s :
       {Shape{37, 97, 200}, Shape{1, 2560, 256}, Shape{5, 1, 64}, Shape{130, 96, 77},
        Shape{3, 33, 17}, Shape{8, 1030, 2048}, Shape{2, 77, 4096}, Shape{7, 5, 520},
        Shape{1, 3, 8}, Shape{2, 33, 2048}, Shape{1, 1, 4096}}) {
    const std::vector<float> x = Rand(s.m * s.k), w = Rand(s.n * s.k);
    Tensor xt = Make(DType::kBF16, {s.m, s.k}, x), wt = Make(DType::kBF16, {s.n, s.k}, w);
    std::vector<double> ref;
    RefLinear(x, w, s.m, s.n, s.k, ref);
    for (DType out : {DType::kBF16, DType::kF32}) {
      Tensor y = Poisoned(out, {s.m, s.n});
      backend_->Linear(xt, wt, y);
      EXPECT_LT(Reported(out == DType::kF32 ? "linear (f32 out)" : "linear", RelErr(Host(y), ref)),
                out == DType::kF32 ? 1e-4 : kBf16Tol)
          << s.m << "x" << s.n << "x" << s.k << " " << DTypeName(out);
    }
  }
  // A row view starting at an odd row: x is only 2-byte aligned when K is odd.
  {
    const int64_t m = 9, n = 40, k = 31;
    const std::vector<float> x = Rand((m + 1) * k), w = Rand(n * k);
    Tensor xt = Make(DType::kBF16, {m + 1, k}, x), wt = Make(DType::kBF16, {n, k}, w);
    std::vector<float> x_tail(x.begin() + k, x.end());
    std::vector<double> ref;
    RefLinear(x_tail, w, m, n, k, ref);
    Tensor y = Poisoned(DType::kBF16, {m, n});
    backend_->Linear(xt.Rows(1, m), wt, y);
    EXPECT_LT(RelErr(Host(y), ref), kBf16Tol);
  }
  // T == 0 is a no-op.
  Tensor x0 = Poisoned(DType::kBF16, {0, 64});
  Tensor w0 = Make(DType::kBF16, {8, 64}, Rand(8 * 64));
  Tensor y0 = Poisoned(DType::kBF16, {0, 8});
  backend_->Linear(x0, w0, y0);
  backend_->Synchronize();
}

// Several weights over one input, with mixed output dtypes: one skinny launch for up to 2 rows
// (more than kMaxSkinnyTargets weights take two), one Linear each otherwise: K 2048 (the release
// in-projections), 4096 (out-projections), 8192 and 3072 (the skinny kernel's K split over 8 and 2
// warps, two passes of a lane over its pieces at 3072).
TEST_F(CudaKernelsTest, LinearFanOutMatchesSeparateProjections) {
  struct Case {
    int64_t k;
    std::vector<int64_t> ns;
  };
  for (const Case& c : {Case{2048, {8192, 33, 1, 2560, 12}}, Case{4096, {2048, 7, 30}},
                        Case{8192, {130, 1, 9}}, Case{3072, {300, 5}}}) {
    RunFanOut(c.k, c.ns);
  }
}

void CudaKernelsTest::RunFanOut(int64_t k, const std::vector<int64_t>& ns) {
  std::vector<std::vector<float>> w_host;
  std::vector<Tensor> w_dev;
  for (int64_t n : ns) {
    w_host.push_back(Rand(n * k));
    w_dev.push_back(Make(DType::kBF16, {n, k}, w_host.back()));
  }
  for (const int64_t m : {1, 2, 3, 8}) {
    const std::vector<float> x = Rand(m * k);
    Tensor xt = Make(DType::kBF16, {m, k}, x);
    std::vector<Tensor> ys;
    std::vector<const Tensor*> ws;
    std::vector<Tensor*> y_ptrs;
    for (size_t i = 0; i < ns.size(); ++i) {
      ys.push_back(Poisoned(i % 2 == 0 ? DType::kBF16 : DType::kF32, {m, ns[i]}));
      ws.push_back(&w_dev[i]);
    }
    for (Tensor& y : ys) y_ptrs.push_back(&y);
    backend_->LinearFanOut(xt, ws, y_ptrs);
    for (size_t i = 0; i < ns.size(); ++i) {
      std::vector<double> ref;
      RefLinear(x, w_host[i], m, ns[i], k, ref);
      EXPECT_LT(Reported("linear fan-out", RelErr(Host(ys[i]), ref)), i % 2 == 0 ? kBf16Tol : 1e-4)
          << "k " << k << " m " << m << " weight " << i;
    }
  }
}

TEST_F(CudaKernelsTest, EmbeddingLookupAndGatherRows) {
  const int64_t vocab = 1000, h = 136;
  const std::vector<float> table = Rand(vocab * h);
  Tensor tt = Make(DType::kBF16, {vocab, h}, table);
  const std::vector<int32_t> ids = {999, 0, 17, 17, 512};
  Tensor out = Poisoned(DType::kBF16, {5, h});
  backend_->EmbeddingLookup(ids, tt, out);
  std::vector<double> ref;
  for (int32_t id : ids) {
    for (int64_t c = 0; c < h; ++c) ref.push_back(table[id * h + c]);
  }
  EXPECT_EQ(RelErr(Host(out), ref), 0.0);

  const std::vector<int32_t> rows = {4, 1};
  Tensor picked = Poisoned(DType::kBF16, {2, h});
  backend_->GatherRows(out, rows, picked);
  std::vector<double> ref2(ref.begin() + 4 * h, ref.begin() + 5 * h);
  ref2.insert(ref2.end(), ref.begin() + h, ref.begin() + 2 * h);
  EXPECT_EQ(RelErr(Host(picked), ref2), 0.0);
}

std::vector<double> RefRmsNorm(const std::vector<float>& x, const std::vector<float>& w,
                               int64_t rows, int64_t d, float eps, bool one_plus) {
  std::vector<double> out(x.size());
  for (int64_t r = 0; r < rows; ++r) {
    double ss = 0.0;
    for (int64_t c = 0; c < d; ++c) ss += double{x[r * d + c]} * x[r * d + c];
    const double inv = 1.0 / std::sqrt(ss / d + eps);
    for (int64_t c = 0; c < d; ++c) {
      out[r * d + c] = x[r * d + c] * inv * (one_plus ? 1.0 + w[c] : double{w[c]});
    }
  }
  return out;
}

double Silu(double x) { return x / (1.0 + std::exp(-x)); }
double Sigmoid(double x) { return 1.0 / (1.0 + std::exp(-x)); }

// Each op once with shapes whose rows are multiples of 8 elements (the 16-byte kernels) and once
// with odd ones (the scalar kernels).
class CudaElementwiseTest : public CudaKernelsTest, public ::testing::WithParamInterface<bool> {};

TEST_P(CudaElementwiseTest, NormsAndElementwise) {
  const bool vec = GetParam();
  const int64_t rows = 19, d = vec ? 2048 + 24 : 2048 + 21;
  const float eps = 1e-6f;
  const std::vector<float> x = Rand(rows * d, -3, 3), w = Rand(d, -0.5f, 0.5f), y = Rand(rows * d);
  Tensor xt = Make(DType::kBF16, {rows, d}, x), wt = Make(DType::kBF16, {d}, w),
         yt = Make(DType::kBF16, {rows, d}, y);

  Tensor out = Poisoned(DType::kBF16, {rows, d});
  backend_->RmsNorm1p(xt, wt, eps, out);
  EXPECT_LT(Reported("rmsnorm1p", RelErr(Host(out), RefRmsNorm(x, w, rows, d, eps, true))),
            kBf16Tol);
  // F32 norm weights are accepted too.
  Tensor wf = Make(DType::kF32, {d}, w);
  backend_->RmsNorm1p(xt, wf, eps, out);
  EXPECT_LT(RelErr(Host(out), RefRmsNorm(x, w, rows, d, eps, true)), kBf16Tol);

  // AddRmsNorm1p: residual += delta (stored in bf16), then the norm.
  Tensor residual = Make(DType::kBF16, {rows, d}, x);
  backend_->AddRmsNorm1p(residual, yt, wt, eps, out);
  std::vector<float> sum(x.size());
  std::vector<double> sum_d(x.size());
  for (size_t i = 0; i < x.size(); ++i) {
    sum[i] = RoundBf16(x[i] + y[i]);
    sum_d[i] = double{x[i]} + y[i];
  }
  EXPECT_LT(RelErr(Host(residual), sum_d), kBf16Tol);
  EXPECT_LT(RelErr(Host(out), RefRmsNorm(sum, w, rows, d, eps, true)), kBf16Tol);

  // Add.
  Tensor a = Make(DType::kBF16, {rows, d}, x);
  backend_->Add(a, yt);
  EXPECT_LT(RelErr(Host(a), sum_d), kBf16Tol);

  // MulSigmoid.
  Tensor m = Make(DType::kBF16, {rows, d}, x);
  backend_->MulSigmoid(m, yt);
  std::vector<double> ref(x.size());
  for (size_t i = 0; i < x.size(); ++i) ref[i] = x[i] * Sigmoid(y[i]);
  EXPECT_LT(RelErr(Host(m), ref), kBf16Tol);

  // SiluAndMul over [T, 2I].
  const int64_t t = 7, inter = vec ? 512 : 517;
  const std::vector<float> gu = Rand(t * 2 * inter, -4, 4);
  Tensor gut = Make(DType::kBF16, {t, 2 * inter}, gu);
  Tensor act = Poisoned(DType::kBF16, {t, inter});
  backend_->SiluAndMul(gut, act);
  ref.assign(t * inter, 0.0);
  for (int64_t r = 0; r < t; ++r) {
    for (int64_t c = 0; c < inter; ++c) {
      ref[r * inter + c] = Silu(gu[r * 2 * inter + c]) * gu[r * 2 * inter + inter + c];
    }
  }
  EXPECT_LT(RelErr(Host(act), ref), kBf16Tol);

  // AddSigmoidScaled.
  const std::vector<float> gl = Rand(rows, -3, 3);
  Tensor glt = Make(DType::kBF16, {rows, 1}, gl);
  Tensor acc = Make(DType::kBF16, {rows, d}, x);
  backend_->AddSigmoidScaled(acc, yt, glt);
  ref.assign(x.size(), 0.0);
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = 0; c < d; ++c) ref[r * d + c] = x[r * d + c] + Sigmoid(gl[r]) * y[r * d + c];
  }
  EXPECT_LT(RelErr(Host(acc), ref), kBf16Tol);

  // GatedRmsNorm (plain weight) over heads of 128 and 64 (several rows per warp), 264 (a warp
  // per row) and odd sizes (scalar); 23 rows leave a partial warp.
  for (const int64_t hd :
       vec ? std::vector<int64_t>{128, 64, 264} : std::vector<int64_t>{36, 130}) {
    const int64_t hr = 23;
    const std::vector<float> gx = Rand(hr * hd, -2, 2), gz = Rand(hr * hd, -3, 3),
                             gw = Rand(hd, 0.5f, 1.5f);
    Tensor gxt = Make(DType::kBF16, {hr, hd}, gx), gzt = Make(DType::kBF16, {hr, hd}, gz),
           gwt = Make(DType::kBF16, {hd}, gw);
    Tensor gout = Poisoned(DType::kBF16, {hr, hd});
    backend_->GatedRmsNorm(gxt, gzt, gwt, eps, gout);
    ref = RefRmsNorm(gx, gw, hr, hd, eps, false);
    for (size_t i = 0; i < ref.size(); ++i) ref[i] *= Silu(gz[i]);
    EXPECT_LT(RelErr(Host(gout), ref), kBf16Tol) << "head dim " << hd;
  }
}

INSTANTIATE_TEST_SUITE_P(Rows, CudaElementwiseTest, ::testing::Values(true, false),
                         [](const ::testing::TestParamInfo<bool>& info) {
                           return info.param ? "Vec8" : "Odd";
                         });

// ---------------------------------------------------------------------------------------------
// Gated DeltaNet

struct ConvCase {
  int64_t channels;
  std::vector<int> lengths, cached, slot_of;
};

class CudaConvTest : public CudaKernelsTest, public ::testing::WithParamInterface<ConvCase> {};

// Ragged steps (prefill-like) and decode steps (one token per segment, where the state update is
// fused into the conv), with odd channel counts (scalar kernel) and multiples of 8 (16-byte one).
TEST_P(CudaConvTest, CausalConv1dSiluRaggedWithState) {
  const int64_t c = GetParam().channels, kk = 4, slots = 5;
  const std::vector<int>& lengths = GetParam().lengths;
  const std::vector<int>& slot_of = GetParam().slot_of;
  const int64_t t = std::accumulate(lengths.begin(), lengths.end(), 0);
  const std::vector<float> x = Rand(t * c, -2, 2), w = Rand(c * kk);
  std::vector<float> state = Rand(slots * c * (kk - 1));
  Tensor xt = Make(DType::kBF16, {t, c}, x), wt = Make(DType::kBF16, {c, kk}, w);
  Tensor st = Make(DType::kF32, {slots, c, kk - 1}, state);
  const auto segs = MakeSegments(lengths, GetParam().cached, slot_of);
  Tensor out = Poisoned(DType::kBF16, {t, c});
  backend_->CausalConv1dSilu(xt, wt, st, segs, out);

  std::vector<double> ref(t * c);
  std::vector<float> new_state = state;
  for (size_t s = 0; s < segs.size(); ++s) {
    const int b = segs[s].token_begin, n = segs[s].num_tokens, slot = slot_of[s];
    for (int64_t ch = 0; ch < c; ++ch) {
      // history = old state (oldest first) then the segment's inputs
      std::vector<double> hist;
      for (int j = 0; j < kk - 1; ++j) hist.push_back(state[(slot * c + ch) * (kk - 1) + j]);
      for (int i = 0; i < n; ++i) hist.push_back(x[(b + i) * c + ch]);
      for (int i = 0; i < n; ++i) {
        double acc = 0.0;
        for (int j = 0; j < kk; ++j) acc += w[ch * kk + j] * hist[i + j];
        ref[(b + i) * c + ch] = Silu(acc);
      }
      for (int j = 0; j < kk - 1; ++j) {
        new_state[(slot * c + ch) * (kk - 1) + j] = static_cast<float>(hist[n + j]);
      }
    }
  }
  EXPECT_LT(Reported("causal conv", RelErr(Host(out), ref)), kBf16Tol);
  const std::vector<double> state_ref(new_state.begin(), new_state.end());
  EXPECT_EQ(RelErr(Host(st), state_ref), 0.0);  // untouched slots included
}

INSTANTIATE_TEST_SUITE_P(
    Steps, CudaConvTest,
    ::testing::Values(ConvCase{203, {6, 1, 11, 2}, {9, 30, 0, 4}, {3, 0, 4, 1}},
                      ConvCase{264, {6, 1, 11, 2}, {9, 30, 0, 4}, {3, 0, 4, 1}},
                      ConvCase{264, {1, 1, 1}, {9, 0, 2}, {3, 0, 4}},
                      ConvCase{8192, {1}, {40}, {2}}, ConvCase{203, {1, 1}, {5, 1}, {1, 2}},
                      // as many tokens as segments, but not one each: the chunk kernel
                      ConvCase{264, {2, 0, 1}, {3, 5, 0}, {3, 0, 4}},
                      ConvCase{264, {40, 3}, {0, 5}, {1, 2}}),
    [](const ::testing::TestParamInfo<ConvCase>& info) {
      const std::vector<int>& lengths = info.param.lengths;
      const bool empty_segment = std::find(lengths.begin(), lengths.end(), 0) != lengths.end();
      return absl::StrCat("c", info.param.channels, "_seqs", lengths.size(), "_tokens",
                          std::accumulate(lengths.begin(), lengths.end(), 0),
                          empty_segment ? "_with_empty" : "");
    });

TEST_F(CudaKernelsTest, DeltaRuleGates) {
  const int64_t t = 33, hv = 32;
  const std::vector<float> a = Rand(t * hv, -30, 30), b = Rand(t * hv, -5, 5),
                           a_log = Rand(hv, -2, 1), dt = Rand(hv, -1, 1);
  Tensor at = Make(DType::kBF16, {t, hv}, a), bt = Make(DType::kBF16, {t, hv}, b),
         alt = Make(DType::kBF16, {hv}, a_log), dtt = Make(DType::kBF16, {hv}, dt);
  Tensor g = Poisoned(DType::kF32, {t, hv}), beta = Poisoned(DType::kF32, {t, hv});
  backend_->DeltaRuleGates(at, bt, alt, dtt, g, beta);
  std::vector<double> gref(t * hv), bref(t * hv);
  for (int64_t i = 0; i < t * hv; ++i) {
    const double v = double{a[i]} + dt[i % hv];
    const double sp = v > 20.0 ? v : std::log1p(std::exp(v));
    gref[i] = -std::exp(double{a_log[i % hv]}) * sp;
    bref[i] = Sigmoid(b[i]);
  }
  EXPECT_LT(RelErr(Host(g), gref), 1e-5);
  EXPECT_LT(RelErr(Host(beta), bref), 1e-5);
}

// The delta rule in double, updating `state` [slots, Hv, Dk, Dv].
void RefDeltaRule(const std::vector<float>& qkv, const std::vector<float>& g,
                  const std::vector<float>& beta, const DeltaRuleDims& d,
                  const std::vector<SequenceSegment>& segs, std::vector<double>& state,
                  std::vector<double>& out) {
  const int hk = d.num_k_heads, hv = d.num_v_heads, dk = d.k_head_dim, dv = d.v_head_dim;
  const int64_t row = 2LL * hk * dk + int64_t{hv} * dv;
  int64_t t_total = 0;
  for (const auto& s : segs) t_total += s.num_tokens;
  out.assign(t_total * hv * dv, 0.0);
  for (const auto& s : segs) {
    for (int h = 0; h < hv; ++h) {
      double* S = &state[(int64_t{s.state_slot} * hv + h) * dk * dv];
      const int kh = h / (hv / hk);
      for (int i = 0; i < s.num_tokens; ++i) {
        const int64_t t = s.token_begin + i;
        std::vector<double> q(dk), k(dk), v(dv);
        double qs = 0, ks = 0;
        for (int a = 0; a < dk; ++a) {
          q[a] = qkv[t * row + kh * dk + a];
          k[a] = qkv[t * row + hk * dk + kh * dk + a];
          qs += q[a] * q[a];
          ks += k[a] * k[a];
        }
        for (int a = 0; a < dk; ++a) {
          q[a] = q[a] / std::sqrt(qs + 1e-6) / std::sqrt(double(dk));
          k[a] = k[a] / std::sqrt(ks + 1e-6);
        }
        for (int b = 0; b < dv; ++b) v[b] = qkv[t * row + 2 * hk * dk + h * dv + b];
        const double decay = std::exp(double{g[t * hv + h]}), bt = beta[t * hv + h];
        for (int64_t e = 0; e < int64_t{dk} * dv; ++e) S[e] *= decay;
        for (int b = 0; b < dv; ++b) {
          double u = 0;
          for (int a = 0; a < dk; ++a) u += S[a * dv + b] * k[a];
          const double delta = bt * (v[b] - u);
          for (int a = 0; a < dk; ++a) S[a * dv + b] += k[a] * delta;
          double o = 0;
          for (int a = 0; a < dk; ++a) o += S[a * dv + b] * q[a];
          out[(t * hv + h) * dv + b] = o;
        }
      }
    }
  }
}

TEST_F(CudaKernelsTest, GatedDeltaRuleRaggedRealisticDims) {
  DeltaRuleDims d{2, 4, 128, 128};  // Hv / Hk = 2
  RunDeltaRuleCase(d, {7, 1, 23, 1}, {2, 0, 3, 5}, 6);
}

TEST_F(CudaKernelsTest, GatedDeltaRuleOddDims) {
  DeltaRuleDims d{1, 2, 72, 40};
  RunDeltaRuleCase(d, {1, 5}, {1, 0}, 2);
}

void CudaKernelsTest::RunDeltaRuleCase(const DeltaRuleDims& dims, const std::vector<int>& lengths,
                                       const std::vector<int>& slot_of, int slots) {
  CudaKernelsTest* test = this;
  Backend& be = *backend_;
  const int hk = dims.num_k_heads, hv = dims.num_v_heads, dk = dims.k_head_dim,
            dv = dims.v_head_dim;
  const int64_t row = 2LL * hk * dk + int64_t{hv} * dv;
  const int64_t t = std::accumulate(lengths.begin(), lengths.end(), 0);
  const std::vector<float> qkv = test->Rand(t * row, -1, 1);
  std::vector<float> g = test->Rand(t * hv, -0.5f, -0.01f), beta = test->Rand(t * hv, 0.05f, 1);
  const std::vector<float> state0 = test->Rand(int64_t{slots} * hv * dk * dv, -0.3f, 0.3f);
  std::vector<int> cached(lengths.size(), 3);
  const auto segs = MakeSegments(lengths, cached, slot_of);

  std::vector<double> state_ref(state0.begin(), state0.end()), out_ref;
  RefDeltaRule(qkv, g, beta, dims, segs, state_ref, out_ref);

  Tensor qkvt = test->Make(DType::kBF16, {t, row}, qkv);
  Tensor gt = test->Make(DType::kF32, {t, hv}, g), bt = test->Make(DType::kF32, {t, hv}, beta);
  std::vector<std::vector<float>> outs;
  for (DeltaRuleAlgorithm alg :
       {DeltaRuleAlgorithm::kRecurrent, DeltaRuleAlgorithm::kChunked, DeltaRuleAlgorithm::kAuto}) {
    Tensor st = test->Make(DType::kF32, {slots, hv, dk, dv}, state0);
    Tensor out = test->Poisoned(DType::kBF16, {t, int64_t{hv} * dv});
    be.GatedDeltaRule(qkvt, gt, bt, dims, st, segs, alg, out);
    outs.push_back(test->Host(out));
    EXPECT_LT(Reported("delta rule out", RelErr(outs.back(), out_ref)), kBf16Tol)
        << static_cast<int>(alg);
    // The chunked kernels multiply the state in bf16 (fp32 accumulation).
    EXPECT_LT(Reported("delta rule state", RelErr(test->Host(st), state_ref)),
              alg == DeltaRuleAlgorithm::kRecurrent ? 1e-4 : 1e-2)
        << static_cast<int>(alg);
  }
  // Chunked and recurrent agree (to bf16 rounding of the output).
  std::vector<double> rec(outs[0].begin(), outs[0].end());
  EXPECT_LT(RelErr(outs[1], rec), kBf16Tol);

  // Continuing one token at a time from the updated state matches one long segment.
  Tensor st = test->Make(DType::kF32, {slots, hv, dk, dv}, state0);
  const int n = lengths[0];
  std::vector<float> first(qkv.begin(), qkv.begin() + n * row);
  std::vector<double> step_ref_state(state0.begin(), state0.end()), step_ref_out;
  RefDeltaRule(first, g, beta, dims, MakeSegments({n}, {0}, {slot_of[0]}), step_ref_state,
               step_ref_out);
  std::vector<float> got;
  for (int i = 0; i < n; ++i) {
    Tensor row_t = qkvt.Rows(i, 1), g_t = gt.Rows(i, 1), b_t = bt.Rows(i, 1);
    Tensor out = test->Poisoned(DType::kBF16, {1, int64_t{hv} * dv});
    be.GatedDeltaRule(row_t, g_t, b_t, dims, st, MakeSegments({1}, {i}, {slot_of[0]}),
                      DeltaRuleAlgorithm::kAuto, out);
    const std::vector<float> o = test->Host(out);
    got.insert(got.end(), o.begin(), o.end());
  }
  EXPECT_LT(RelErr(got, step_ref_out), kBf16Tol);
}

// ---------------------------------------------------------------------------------------------
// Gated attention

struct AttnShape {
  int nh, nkv, hd, rotary, block_size;
  bool long_context = false;  // hundreds of cached tokens: the split (flash-decoding) path
};
void PrintTo(const AttnShape& p, std::ostream* os) {
  *os << absl::StrCat("nh ", p.nh, " nkv ", p.nkv, " hd ", p.hd, " rotary ", p.rotary, " block ",
                      p.block_size, p.long_context ? " long" : "");
}

class CudaAttentionTest : public CudaKernelsTest,
                          public ::testing::WithParamInterface<AttnShape> {};

TEST_P(CudaAttentionTest, QkNormRopeWriteKvCacheAndPagedAttention) {
  const AttnShape p = GetParam();
  const int nh = p.nh, nkv = p.nkv, hd = p.hd, bs = p.block_size;
  const float eps = 1e-6f, theta = 1e7f;
  const std::vector<int> lengths = {5, 1, 1, 17};
  const std::vector<int> cached =
      p.long_context ? std::vector<int>{0, 1500, 3, 700} : std::vector<int>{0, 40, 3, 21};
  const int64_t t = std::accumulate(lengths.begin(), lengths.end(), 0);
  auto segs = MakeSegments(lengths, cached, {0, 1, 2, 3});
  std::vector<std::vector<int32_t>> tables;
  const int num_blocks = DealBlockTables(segs, bs, /*spare=*/3, rng_, tables);

  // QkNormRope.
  const std::vector<float> qg = Rand(t * nh * 2 * hd, -2, 2), k = Rand(t * nkv * hd, -2, 2),
                           v = Rand(t * nkv * hd, -2, 2), qn = Rand(hd, -0.3f, 0.3f),
                           kn = Rand(hd, -0.3f, 0.3f);
  Tensor qgt = Make(DType::kBF16, {t, nh, 2 * hd}, qg), kt = Make(DType::kBF16, {t, nkv, hd}, k),
         vt = Make(DType::kBF16, {t, nkv, hd}, v), qnt = Make(DType::kBF16, {hd}, qn),
         knt = Make(DType::kBF16, {hd}, kn);
  Tensor q = Poisoned(DType::kBF16, {t, nh, hd}), gate = Poisoned(DType::kBF16, {t, nh, hd});
  RopeParams rope{p.rotary, theta};
  backend_->QkNormRope(qgt, kt, qnt, knt, eps, rope, segs, q, gate);

  auto norm_rope = [&](const float* x, const std::vector<float>& w, int pos, double* y) {
    double ss = 0;
    for (int d = 0; d < hd; ++d) ss += double{x[d]} * x[d];
    const double inv = 1.0 / std::sqrt(ss / hd + eps);
    std::vector<double> n(hd);
    for (int d = 0; d < hd; ++d) n[d] = x[d] * inv * (1.0 + w[d]);
    const int half = p.rotary / 2;
    for (int d = 0; d < hd; ++d) {
      if (d >= p.rotary) {
        y[d] = n[d];
        continue;
      }
      const int j = d < half ? d : d - half;
      const double angle = pos * std::pow(double{theta}, -2.0 * j / p.rotary);
      y[d] = d < half ? n[d] * std::cos(angle) - n[d + half] * std::sin(angle)
                      : n[d] * std::cos(angle) + n[d - half] * std::sin(angle);
    }
  };
  std::vector<double> q_ref(t * nh * hd), k_ref(t * nkv * hd), gate_ref(t * nh * hd);
  for (const auto& s : segs) {
    for (int i = 0; i < s.num_tokens; ++i) {
      const int64_t tok = s.token_begin + i;
      for (int h = 0; h < nh; ++h) {
        norm_rope(&qg[(tok * nh + h) * 2 * hd], qn, s.cached_tokens + i,
                  &q_ref[(tok * nh + h) * hd]);
        for (int d = 0; d < hd; ++d) {
          gate_ref[(tok * nh + h) * hd + d] = qg[(tok * nh + h) * 2 * hd + hd + d];
        }
      }
      for (int h = 0; h < nkv; ++h) {
        norm_rope(&k[(tok * nkv + h) * hd], kn, s.cached_tokens + i, &k_ref[(tok * nkv + h) * hd]);
      }
    }
  }
  const std::vector<float> q_host = Host(q), k_host = Host(kt);
  EXPECT_LT(Reported("qk norm rope (q)", RelErr(q_host, q_ref)), kBf16Tol);
  EXPECT_LT(RelErr(k_host, k_ref), kBf16Tol);
  EXPECT_EQ(RelErr(Host(gate), gate_ref), 0.0);

  // WriteKvCache into caches pre-filled with random history.
  const int64_t cache_elems = int64_t{num_blocks} * bs * nkv * hd;
  std::vector<float> kc = Rand(cache_elems, -2, 2), vc = Rand(cache_elems, -2, 2);
  Tensor kct = Make(DType::kBF16, {num_blocks, bs, nkv, hd}, kc);
  Tensor vct = Make(DType::kBF16, {num_blocks, bs, nkv, hd}, vc);
  backend_->WriteKvCache(kt, vt, segs, kct, vct);
  for (const auto& s : segs) {
    for (int i = 0; i < s.num_tokens; ++i) {
      const int pos = s.cached_tokens + i;
      const int64_t base = (int64_t{s.kv_blocks[pos / bs]} * bs + pos % bs) * nkv * hd;
      for (int64_t e = 0; e < int64_t{nkv} * hd; ++e) {
        kc[base + e] = k_host[(s.token_begin + i) * nkv * hd + e];
        vc[base + e] = v[(s.token_begin + i) * nkv * hd + e];
      }
    }
  }
  EXPECT_EQ(RelErr(Host(kct), std::vector<double>(kc.begin(), kc.end())), 0.0);
  EXPECT_EQ(RelErr(Host(vct), std::vector<double>(vc.begin(), vc.end())), 0.0);

  // PagedAttention over the caches.
  const float scale = 1.0f / std::sqrt(static_cast<float>(hd));
  Tensor out = Poisoned(DType::kBF16, {t, nh, hd});
  backend_->PagedAttention(q, kct, vct, segs, scale, out);
  const std::vector<double> ref = RefPagedAttention(q_host, kc, vc, segs, nh, nkv, hd, bs, scale);
  EXPECT_LT(Reported("paged attention", RelErr(Host(out), ref)), kBf16Tol);
}

INSTANTIATE_TEST_SUITE_P(Shapes, CudaAttentionTest,
                         ::testing::Values(AttnShape{8, 2, 256, 64, 16},  // GQA 4, release dims
                                           AttnShape{4, 2, 256, 256, 8},  // GQA 2, full rotary
                                           AttnShape{6, 3, 96, 32, 5},    // head dim 96
                                           AttnShape{16, 2, 256, 64, 16, true},  // GQA 8, split
                                           AttnShape{4, 2, 256, 64, 32, true},
                                           AttnShape{4, 2, 36, 12, 4, true},  // generic kernel
                                           AttnShape{4, 2, 64, 16, 4, true},  // fixture dims
                                           AttnShape{4, 2, 32, 8, 4, true}),
                         [](const ::testing::TestParamInfo<AttnShape>& info) {
                           const AttnShape& p = info.param;
                           return absl::StrCat("nh", p.nh, "_nkv", p.nkv, "_hd", p.hd, "_rot",
                                               p.rotary, "_bs", p.block_size,
                                               p.long_context ? "_long" : "");
                         });

// Decode steps (at most one token per segment) take the decode attention kernel: contexts from
// one position to thousands (one split to many, empty splits), a segment without tokens, one
// sequence alone (the most splits); against a float64 reference on the bf16 inputs.
struct DecodeAttnShape {
  int nh, nkv, hd, block_size;
};
void PrintTo(const DecodeAttnShape& p, std::ostream* os) {
  *os << absl::StrCat("nh ", p.nh, " nkv ", p.nkv, " hd ", p.hd, " block ", p.block_size);
}

// Random q and caches for `segs` (cached + new positions each), PagedAttention on the backend,
// and its relative error against the float64 reference.
class PagedAttentionCase : public CudaKernelsTest,
                           public ::testing::WithParamInterface<DecodeAttnShape> {
 protected:
  double RelErrOf(const std::vector<int>& lengths, const std::vector<int>& cached) {
    const DecodeAttnShape p = GetParam();
    const int nh = p.nh, nkv = p.nkv, hd = p.hd, bs = p.block_size;
    const int64_t t = std::accumulate(lengths.begin(), lengths.end(), 0);
    auto segs = MakeSegments(lengths, cached, std::vector<int>(lengths.size(), -1));
    std::vector<std::vector<int32_t>> tables;
    const int num_blocks = DealBlockTables(segs, bs, /*spare=*/2, rng_, tables);
    const int64_t cache_elems = int64_t{num_blocks} * bs * nkv * hd;
    const std::vector<float> qv = Rand(t * nh * hd, -2, 2), kc = Rand(cache_elems, -2, 2),
                             vc = Rand(cache_elems, -2, 2);
    Tensor q = Make(DType::kBF16, {t, nh, hd}, qv);
    Tensor kct = Make(DType::kBF16, {num_blocks, bs, nkv, hd}, kc);
    Tensor vct = Make(DType::kBF16, {num_blocks, bs, nkv, hd}, vc);
    const float scale = 1.0f / std::sqrt(static_cast<float>(hd));
    Tensor out = Poisoned(DType::kBF16, {t, nh, hd});
    backend_->PagedAttention(q, kct, vct, segs, scale, out);
    return RelErr(Host(out), RefPagedAttention(qv, kc, vc, segs, nh, nkv, hd, bs, scale));
  }
};

std::string AttnShapeName(const ::testing::TestParamInfo<DecodeAttnShape>& info) {
  const DecodeAttnShape& p = info.param;
  return absl::StrCat("nh", p.nh, "_nkv", p.nkv, "_hd", p.hd, "_bs", p.block_size);
}
const auto kPagedAttentionShapes =
    ::testing::Values(DecodeAttnShape{16, 2, 256, 16},  // release dims
                      DecodeAttnShape{8, 2, 128, 8},    // GQA 4
                      DecodeAttnShape{8, 4, 64, 32},    // GQA 2 (the qwen fixture's head dim)
                      DecodeAttnShape{4, 4, 256, 16});  // MHA

using CudaDecodeAttentionTest = PagedAttentionCase;

TEST_P(CudaDecodeAttentionTest, MatchesReference) {
  // Up to 16 tokens the copy engine fills the warps' rings (block size 16); the 24-sequence step
  // takes the cp.async path, and the 256-sequence one a grid of several blocks per SM, which at
  // head dim 256 runs the kernel's two-blocks-per-SM configuration (DecodeConfigFor).
  std::vector<int> wide(24), many(256);
  for (int i = 0; i < 24; ++i) wide[i] = (i * 397) % 3000;
  for (int i = 0; i < 256; ++i) many[i] = (i * 131) % 600;
  const std::vector<std::vector<int>> steps_cached = {
      {0, 4095, 15, 700, 31, 2000, 16, 1023}, {8191}, {40}, wide, many};
  for (const std::vector<int>& cached : steps_cached) {
    // A segment without tokens after the first (when there are several).
    std::vector<int> lengths(cached.size(), 1);
    std::vector<int> all_cached = cached;
    if (cached.size() > 1) {
      lengths.insert(lengths.begin() + 1, 0);
      all_cached.insert(all_cached.begin() + 1, 5);
    }
    EXPECT_LT(Reported("decode attention", RelErrOf(lengths, all_cached)), kBf16Tol)
        << "contexts " << absl::StrJoin(cached, ",");
  }
}

INSTANTIATE_TEST_SUITE_P(Shapes, CudaDecodeAttentionTest, kPagedAttentionShapes, AttnShapeName);

// Prefill steps (hundreds of tokens, so one split) take the warpgroup (wgmma) kernel on sm_90:
// long and short segments, a one-token segment among them, prefixes already cached (the causal
// mask then falls inside a tile's later rows), GQA 1 to 8; against a float64 reference.
using CudaPrefillAttentionTest = PagedAttentionCase;

TEST_P(CudaPrefillAttentionTest, MatchesReference) {
  EXPECT_LT(Reported("prefill attention", RelErrOf({300, 1, 77, 200, 130}, {0, 50, 5, 1000, 3})),
            kBf16Tol);
}

INSTANTIATE_TEST_SUITE_P(Shapes, CudaPrefillAttentionTest, kPagedAttentionShapes, AttnShapeName);

// ---------------------------------------------------------------------------------------------
// Mixture of experts

// Reference top-k on the same (bf16) logits: by logit descending, ties to the lower id.
void RefTopK(const std::vector<float>& logits, int64_t t, int e, int k, bool renorm,
             std::vector<int32_t>& ids, std::vector<double>& w) {
  ids.clear();
  w.clear();
  for (int64_t r = 0; r < t; ++r) {
    const float* l = &logits[r * e];
    std::vector<int> order(e);
    std::iota(order.begin(), order.end(), 0);
    std::stable_sort(order.begin(), order.end(), [&](int a, int b) { return l[a] > l[b]; });
    const double mx = l[order[0]];
    double sum = 0;
    for (int i = 0; i < e; ++i) sum += std::exp(l[i] - mx);
    double sel = 0;
    for (int j = 0; j < k; ++j) sel += std::exp(l[order[j]] - mx) / sum;
    for (int j = 0; j < k; ++j) {
      ids.push_back(order[j]);
      const double p = std::exp(l[order[j]] - mx) / sum;
      w.push_back(renorm ? p / sel : p);
    }
  }
}

// Every TopKSoftmax kernel: k <= 8 (registers: the threshold filter up to 4096 experts, 4096
// itself included, and the chunked lists from 4097), k of 9-16 (the filter with 16-entry lists,
// Qwen3-Next's 512 experts at k 10), k up to 32 with up to 8192 experts (shared memory), more
// (global memory); few experts (lanes and warps with nothing to offer) and k equal to the expert
// count.
TEST_F(CudaKernelsTest, TopKSoftmaxExpertCountsAndK) {
  struct Case {
    int64_t t;
    int e, k;
  };
  for (const Case c :
       {Case{3, 10, 8}, Case{5, 64, 10}, Case{2, 9000, 4}, Case{4, 300, 32}, Case{1, 2560, 1},
        Case{2, 9000, 12}, Case{7, 8, 8}, Case{3, 4096, 8}, Case{2, 4097, 8}, Case{5, 2560, 8},
        Case{6, 512, 10}, Case{3, 2560, 16}, Case{2, 12, 12}, Case{3, 4096, 9}}) {
    const std::vector<float> logits = Rand(c.t * c.e, -4, 4);
    Tensor lt = Make(DType::kF32, {c.t, c.e}, logits);
    Tensor ids = Poisoned(DType::kI32, {c.t, c.k}), w = Poisoned(DType::kF32, {c.t, c.k});
    backend_->TopKSoftmax(lt, c.k, true, ids, w);
    std::vector<int32_t> ref_ids;
    std::vector<double> ref_w;
    RefTopK(logits, c.t, c.e, c.k, true, ref_ids, ref_w);
    EXPECT_EQ(HostI32(ids), ref_ids) << c.e << " experts, k " << c.k;
    EXPECT_LT(RelErr(Host(w), ref_w), 1e-5) << c.e << " experts, k " << c.k;
  }
}

// Top-k tests that compare every row of a logits matrix with RefTopK, renormalised and not.
class CudaTopKTest : public CudaKernelsTest {
 protected:
  void ExpectTopKMatchesReference(DType dtype, const std::vector<float>& logits, int64_t t, int e,
                                  int k) {
    Tensor lt = Make(dtype, {t, e}, logits);
    for (bool renorm : {true, false}) {
      Tensor ids = Poisoned(DType::kI32, {t, k}), w = Poisoned(DType::kF32, {t, k});
      backend_->TopKSoftmax(lt, k, renorm, ids, w);
      std::vector<int32_t> ref_ids;
      std::vector<double> ref_w;
      RefTopK(logits, t, e, k, renorm, ref_ids, ref_w);
      EXPECT_EQ(HostI32(ids), ref_ids) << renorm;
      EXPECT_LT(RelErr(Host(w), ref_w), 1e-5) << renorm;
    }
  }
};

TEST_F(CudaTopKTest, ManyExpertsWithTies) {
  const int64_t t = 13;
  const int e = 2560, k = 8;
  // bf16 logits in a narrow range: many exact ties, resolved by the lower id.
  std::vector<float> logits = Rand(t * e, -2, 2);
  for (int64_t r = 0; r < t; ++r) {  // force a tie at the very top of some rows
    logits[r * e + 2500] = 3.0f;
    logits[r * e + 7 + r] = 3.0f;
  }
  ExpectTopKMatchesReference(DType::kBF16, logits, t, e, k);
}

// Rows whose threshold admits more candidates than the filter kernel ranks (all logits equal;
// all but three -inf) take its register-list fallback; the rows around them do not.
TEST_F(CudaTopKTest, ManyTiesAtTheThreshold) {
  const int64_t t = 4;
  const int e = 2560, k = 8;
  std::vector<float> logits = Rand(t * e, -3, 3);
  for (int i = 0; i < e; ++i) logits[e + i] = 0.5f;
  for (int i = 0; i < e; ++i) logits[2 * e + i] = -INFINITY;
  logits[2 * e + 2000] = 1.0f;
  logits[2 * e + 17] = -2.0f;
  logits[2 * e + 1300] = 1.0f;
  ExpectTopKMatchesReference(DType::kF32, logits, t, e, k);
}

// Prefill-sized batches (from 1024 tokens a warp per token, TopKSoftmaxWarpKernel, for expert
// counts that are multiples of 8 up to 2560) with ties at the top, a row of all-equal logits, a
// row of -inf but three, fp32 and bf16 logits, and an expert count that is not a multiple of 8
// (the block kernels). The ctest CudaKernelsTest.TopKWarpKernelForced runs every top-k test with
// the warp kernel wherever it applies (MOBIUS_TOPK=warp); TopKKernelSelection says which kernel
// each case takes by default.
TEST_F(CudaTopKTest, ManyTokensOneWarpEach) {
  struct Case {
    DType dtype;
    int64_t t;
    int e, k;
  };
  for (const Case c : {Case{DType::kBF16, 4096, 2560, 8}, Case{DType::kF32, 1024, 2560, 8},
                       Case{DType::kF32, 300, 2560, 8}, Case{DType::kF32, 129, 64, 8},
                       Case{DType::kF32, 70, 1000, 3}, Case{DType::kBF16, 65, 8, 8},
                       Case{DType::kF32, 100, 1004, 8}, Case{DType::kF32, 2048, 512, 10},
                       Case{DType::kBF16, 1030, 2560, 16}, Case{DType::kF32, 90, 512, 10}}) {
    std::vector<float> logits = Rand(c.t * c.e, -2, 2);
    for (int64_t r = 0; r < c.t; r += 7) {  // ties at the top of some rows
      logits[r * c.e + c.e - 1] = 3.0f;
      logits[r * c.e + (r % c.e)] = 3.0f;
    }
    for (int i = 0; i < c.e; ++i) logits[c.e + i] = 0.5f;
    for (int i = 0; i < c.e; ++i) logits[2 * c.e + i] = -INFINITY;
    logits[2 * c.e + c.e / 2] = 1.0f;
    logits[2 * c.e + 3] = -2.0f;
    logits[2 * c.e + c.e - 2] = 1.0f;
    SCOPED_TRACE(::testing::Message() << c.t << " tokens, " << c.e << " experts, k " << c.k);
    ExpectTopKMatchesReference(c.dtype, logits, c.t, c.e, c.k);
  }
}

// Which top-k kernel a call takes (a host function: runs without a GPU too).
TEST(TopKKernelSelection, WarpPerTokenForPrefillBatchesOnly) {
  using cuda::SelectTopKKernel;
  using cuda::TopKKernel;
  using cuda::TopKOverride;
  constexpr auto kNone = TopKOverride::kNone;
  // Release routing (2560 experts, k 8): block per token for decode batches, warp per token from
  // 1024 tokens (the measured crossover, topk_softmax.cu).
  EXPECT_EQ(SelectTopKKernel(1, 2560, 8, true, kNone), TopKKernel::kBlockFilter);
  EXPECT_EQ(SelectTopKKernel(256, 2560, 8, true, kNone), TopKKernel::kBlockFilter);
  EXPECT_EQ(SelectTopKKernel(1023, 2560, 8, true, kNone), TopKKernel::kBlockFilter);
  EXPECT_EQ(SelectTopKKernel(1024, 2560, 8, true, kNone), TopKKernel::kWarpPerToken);
  EXPECT_EQ(SelectTopKKernel(4096, 2560, 8, true, kNone), TopKKernel::kWarpPerToken);
  // The warp kernel's limits: logits 16-byte aligned, experts a multiple of 8 and at most 2560.
  EXPECT_EQ(SelectTopKKernel(4096, 2560, 8, false, kNone), TopKKernel::kBlockFilter);
  EXPECT_EQ(SelectTopKKernel(4096, 1004, 8, true, kNone), TopKKernel::kBlockFilter);
  EXPECT_EQ(SelectTopKKernel(4096, 2568, 8, true, kNone), TopKKernel::kBlockFilter);
  // Overrides apply only where the forced form's limits hold.
  EXPECT_EQ(SelectTopKKernel(1, 2560, 8, true, TopKOverride::kWarp), TopKKernel::kWarpPerToken);
  EXPECT_EQ(SelectTopKKernel(8192, 2560, 8, true, TopKOverride::kBlock), TopKKernel::kBlockFilter);
  EXPECT_EQ(SelectTopKKernel(1, 1004, 8, true, TopKOverride::kWarp), TopKKernel::kBlockFilter);
  // k of 9-16 (Qwen3-Next: 512 experts, k 10) take the same filter and warp forms with 16-entry
  // lists.
  EXPECT_EQ(SelectTopKKernel(1, 512, 10, true, kNone), TopKKernel::kBlockFilter);
  EXPECT_EQ(SelectTopKKernel(8192, 512, 10, true, kNone), TopKKernel::kWarpPerToken);
  EXPECT_EQ(SelectTopKKernel(1, 2560, 16, true, kNone), TopKKernel::kBlockFilter);
  EXPECT_EQ(SelectTopKKernel(4096, 2560, 16, true, kNone), TopKKernel::kWarpPerToken);
  // Past the register forms: more than 4096 experts (the streamed lists: k <= 8 only), or k
  // above 16.
  EXPECT_EQ(SelectTopKKernel(1, 6000, 8, true, kNone), TopKKernel::kBlockRegisterLists);
  EXPECT_EQ(SelectTopKKernel(1, 6000, 10, true, kNone), TopKKernel::kBlockSharedMemory);
  EXPECT_EQ(SelectTopKKernel(4096, 2560, 17, true, kNone), TopKKernel::kBlockSharedMemory);
  EXPECT_EQ(SelectTopKKernel(1, 9000, 16, true, kNone), TopKKernel::kBlockGeneric);
  EXPECT_EQ(SelectTopKKernel(1, 64, 40, true, kNone), TopKKernel::kBlockGeneric);
}

// Which DeltaNet steps the one-launch clustered kernel takes (host functions: run without a GPU
// too). Its layout must be the recurrent warp kernel's for the same sequence count, since the
// two give equal bits only in the same layout (CudaVsCpuTest.DeltaNetMixerDecodeStep).
// The few-token MoE kernels' pair limit: the most pairs (64-256) whose pairs sharing an expert
// cost no more than the grouped path's fixed and per-expert costs (launch.h), fitted to the
// crossovers measured at 2560 and 512 experts. (Without MOBIUS_MOE_FEW_MAX_PAIRS, which
// overrides it.)
TEST(MoeFewTokensSelection, PairLimitFollowsTheExpertCount) {
  if (std::getenv("MOBIUS_MOE_FEW_MAX_PAIRS") != nullptr) GTEST_SKIP() << "limit forced";
  EXPECT_EQ(cuda::MoeFewTokensMaxPairs(2560), 256);     // release banks: 32 tokens at top-8
  EXPECT_EQ(cuda::MoeFewTokensMaxPairs(1 << 20), 256);  // the cap
  EXPECT_EQ(cuda::MoeFewTokensMaxPairs(512), 95);       // Qwen3-Next: 9 tokens at top-10
  EXPECT_EQ(cuda::MoeFewTokensMaxPairs(256), 64);       // the MTP head's bank
  EXPECT_EQ(cuda::MoeFewTokensMaxPairs(16), 64);        // small banks keep the earlier limit
  EXPECT_EQ(cuda::MoeFewTokensMaxPairs(1), 64);
  EXPECT_EQ(cuda::MoeFewTokensMaxPairs(0), 64);
  // Monotone in the expert count.
  for (int e = 2; e < 4096; e += 37) {
    EXPECT_LE(cuda::MoeFewTokensMaxPairs(e), cuda::MoeFewTokensMaxPairs(e + 37)) << e;
  }
}

TEST(DeltaNetStepSelection, FollowsTheDeltaRuleLayout) {
  using cuda::DeltaNetDecodeStepSupports;
  using cuda::SelectDeltaRuleLayout;
  // The warp kernel: 8 columns split over a warp pair below 4 sequences, 16 columns split below
  // 16, whole rows from 16.
  EXPECT_EQ(SelectDeltaRuleLayout(1).cols, 8);
  EXPECT_EQ(SelectDeltaRuleLayout(3).row_split, 2);
  EXPECT_EQ(SelectDeltaRuleLayout(4).cols, 16);
  EXPECT_EQ(SelectDeltaRuleLayout(15).row_split, 2);
  EXPECT_EQ(SelectDeltaRuleLayout(16).row_split, 1);
  EXPECT_EQ(SelectDeltaRuleLayout(256).cols, 16);
  // Any 16-byte aligned address stands in for the operands here.
  alignas(16) static char buffer[64];
  const void* a = buffer;
  const void* misaligned = buffer + 8;
  auto supports = [&](int hk, int hv, int d, int conv, int segments, const void* z) {
    return DeltaNetDecodeStepSupports(hk, hv, d, d, conv, segments, z, a, a, a, a, a);
  };
  // Release shapes (16 key heads, 32 value heads, dims 128) at every batch the engine runs.
  for (int n : {1, 3, 4, 16, 128, 256, 65535}) EXPECT_TRUE(supports(16, 32, 128, 4, n, a)) << n;
  // The fixtures' dims 32: a block holds 8 columns, so only the 8-column layout (below 4).
  EXPECT_TRUE(supports(2, 4, 32, 4, 3, a));
  EXPECT_FALSE(supports(2, 4, 32, 4, 4, a));
  // Outside the kernel: other head ratios, dims, conv sizes, grids, misaligned operands.
  EXPECT_FALSE(supports(16, 16, 128, 4, 1, a));
  EXPECT_FALSE(supports(16, 32, 256, 4, 1, a));
  EXPECT_FALSE(supports(16, 32, 96, 4, 1, a));
  EXPECT_FALSE(supports(16, 32, 128, 3, 1, a));
  EXPECT_FALSE(supports(16, 32, 128, 4, 65536, a));
  EXPECT_FALSE(supports(16, 32, 128, 4, 0, a));
  EXPECT_FALSE(supports(16, 32, 128, 4, 1, misaligned));
  EXPECT_FALSE(DeltaNetDecodeStepSupports(16, 32, 128, 64, 4, 1, a, a, a, a, a, a));
}

// The MOBIUS_* override readers (host functions: run without a GPU too).
TEST(TuningKnobs, ChoicesAndIntegersReportWhatTheyIgnore) {
  constexpr const char* kName = "MOBIUS_TEST_KNOB";
  unsetenv(kName);
  EXPECT_EQ(cuda::KnobChoice(kName, {"block", "warp"}), 0);
  EXPECT_EQ(cuda::KnobInt(kName, 7, 0, 8), 7);
  setenv(kName, "warp", 1);
  EXPECT_EQ(cuda::KnobChoice(kName, {"block", "warp"}), 2);
  setenv(kName, "wrap", 1);
  ::testing::internal::CaptureStderr();
  EXPECT_EQ(cuda::KnobChoice(kName, {"block", "warp"}), 0);
  std::string report = ::testing::internal::GetCapturedStderr();
  EXPECT_NE(report.find("MOBIUS_TEST_KNOB=\"wrap\""), std::string::npos) << report;
  EXPECT_NE(report.find("block, warp"), std::string::npos) << report;
  setenv(kName, "4", 1);
  EXPECT_EQ(cuda::KnobInt(kName, 7, 0, 8), 4);
  for (const char* bad : {"9", "-1", "4x", "many"}) {
    setenv(kName, bad, 1);
    ::testing::internal::CaptureStderr();
    EXPECT_EQ(cuda::KnobInt(kName, 7, 0, 8), 7) << bad;
    report = ::testing::internal::GetCapturedStderr();
    EXPECT_NE(report.find("an integer in [0, 8]"), std::string::npos) << report;
  }
  unsetenv(kName);
}

// The CUDA backend's limits on a model's shapes (checked at load; a host function: runs without a
// GPU too): the release shapes pass, each limit fails with its config field and value named.
TEST(CudaModelOpShapes, LimitsNameTheField) {
  ModelOpShapes release{.head_dim = 256,
                        .linear_key_head_dim = 128,
                        .linear_value_head_dim = 128,
                        .linear_conv_kernel_dim = 4};
  EXPECT_TRUE(CheckCudaModelOpShapes(release).ok());
  EXPECT_TRUE(CheckCudaModelOpShapes(ModelOpShapes{}).ok());  // no attention, no DeltaNet
  ModelOpShapes bad = release;
  bad.head_dim = 288;
  absl::Status s = CheckCudaModelOpShapes(bad);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("head_dim = 288"), std::string_view::npos) << s;
  bad = release;
  bad.linear_key_head_dim = 512;
  s = CheckCudaModelOpShapes(bad);
  EXPECT_NE(s.message().find("linear_key_head_dim = 512"), std::string_view::npos) << s;
  bad = release;
  bad.linear_conv_kernel_dim = 17;
  s = CheckCudaModelOpShapes(bad);
  EXPECT_NE(s.message().find("linear_conv_kernel_dim = 17"), std::string_view::npos) << s;
}

void RefMoe(const std::vector<float>& x, const std::vector<int32_t>& ids,
            const std::vector<float>& w, const std::vector<float>& gate_up,
            const std::vector<float>& down, int64_t t, int k, int experts, int first, int64_t h,
            int64_t inter, std::vector<double>& out, std::vector<int64_t>& counts) {
  for (int64_t r = 0; r < t; ++r) {
    for (int j = 0; j < k; ++j) {
      const int e = ids[r * k + j] - first;
      if (e < 0 || e >= experts) continue;
      ++counts[e];
      std::vector<double> act(inter);
      for (int64_t i = 0; i < inter; ++i) {
        double g = 0, u = 0;
        for (int64_t c = 0; c < h; ++c) {
          g += double{x[r * h + c]} * gate_up[(e * 2 * inter + i) * h + c];
          u += double{x[r * h + c]} * gate_up[(e * 2 * inter + inter + i) * h + c];
        }
        act[i] = Silu(g) * u;
      }
      for (int64_t c = 0; c < h; ++c) {
        double y = 0;
        for (int64_t i = 0; i < inter; ++i) y += act[i] * down[(e * h + c) * inter + i];
        out[r * h + c] += w[r * k + j] * y;
      }
    }
  }
}

TEST_F(CudaKernelsTest, MoeExpertsExpertParallelSlice) {
  const int64_t t = 21, h = 96, inter = 40;
  const int k = 4, experts = 12, first = 100;
  // Global ids in [90, 124): some outside this rank's [100, 112), some local experts untouched.
  std::vector<int32_t> ids(t * k);
  std::uniform_int_distribution<int> pick(90, 123);
  for (int64_t r = 0; r < t; ++r) {
    for (int j = 0; j < k; ++j) {
      int e;
      do {
        e = pick(rng_);
      } while (e == 103 || e == 108 ||  // never routed: untouched experts
               std::find(&ids[r * k], &ids[r * k] + j, e) != &ids[r * k] + j);
      ids[r * k + j] = e;
    }
  }
  ids[0] = 111;  // the last local expert is used
  const std::vector<float> x = Rand(t * h), w = Rand(t * k, 0.05f, 1.0f),
                           gu = Rand(experts * 2 * inter * h, -0.3f, 0.3f),
                           dn = Rand(experts * h * inter, -0.3f, 0.3f), out0 = Rand(t * h);
  Tensor xt = Make(DType::kBF16, {t, h}, x), idt = MakeI32({t, k}, ids),
         wt = Make(DType::kF32, {t, k}, w), gut = Make(DType::kBF16, {experts, 2 * inter, h}, gu),
         dnt = Make(DType::kBF16, {experts, h, inter}, dn), out = Make(DType::kBF16, {t, h}, out0);
  std::vector<int64_t> counts(experts, 5);  // added to, not overwritten
  backend_->MoeExperts(xt, idt, wt, gut, dnt, first, out, counts);

  std::vector<double> ref(out0.begin(), out0.end());
  std::vector<int64_t> ref_counts(experts, 5);
  RefMoe(x, ids, w, gu, dn, t, k, experts, first, h, inter, ref, ref_counts);
  EXPECT_LT(Reported("moe (EP slice)", RelErr(Host(out), ref)), kBf16Tol);
  EXPECT_EQ(counts, ref_counts);
  EXPECT_EQ(counts[3], 5);
  EXPECT_EQ(counts[8], 5);

  // The first three tokens alone without counts (12 pairs): the few-token kernels, which must
  // skip the other ranks' experts just the same; the output accumulates onto what was there.
  const int64_t tf = 3;
  Tensor out_few =
      Make(DType::kBF16, {tf, h}, std::vector<float>(out0.begin(), out0.begin() + tf * h));
  backend_->MoeExperts(xt.Rows(0, tf), idt.Rows(0, tf), wt.Rows(0, tf), gut, dnt, first, out_few,
                       {});
  std::vector<double> ref_few(out0.begin(), out0.begin() + tf * h);
  std::vector<int64_t> unused(experts, 0);
  RefMoe(x, ids, w, gu, dn, tf, k, experts, first, h, inter, ref_few, unused);
  EXPECT_LT(Reported("moe (EP slice, few tokens)", RelErr(Host(out_few), ref_few)), kBf16Tol);
}

// A MoE of 16384 tokens x 8 of 8 experts, whose grouped path asks for ~1.03 GiB of scratch (its
// fp32 pair rows): the operands of the out-of-memory tests below.
struct LargeScratchMoe {
  static constexpr int64_t t = 16384, h = 2048, inter = 64;
  static constexpr int k = 8, experts = 8;
  std::vector<int32_t> ids;
  std::vector<float> x, w, gu, dn;
  Tensor xt, idt, wt, gut, dnt;
};

class CudaOutOfMemoryTest : public CudaKernelsTest {
 protected:
  void SetUp() override {
    CudaKernelsTest::SetUp();
    if (IsSkipped()) return;
    LargeScratchMoe& m = moe_;
    m.ids.resize(m.t * m.k);
    for (int64_t r = 0; r < m.t; ++r) {
      for (int j = 0; j < m.k; ++j) m.ids[r * m.k + j] = static_cast<int32_t>((r + j) % m.experts);
    }
    m.x = Rand(m.t * m.h);
    m.w = Rand(m.t * m.k, 0.1f, 1.0f);
    m.gu = Rand(m.experts * 2 * m.inter * m.h, -0.3f, 0.3f);
    m.dn = Rand(m.experts * m.h * m.inter, -0.3f, 0.3f);
    m.xt = Make(DType::kBF16, {m.t, m.h}, m.x);
    m.idt = MakeI32({m.t, m.k}, m.ids);
    m.wt = Make(DType::kF32, {m.t, m.k}, m.w);
    m.gut = Make(DType::kBF16, {m.experts, 2 * m.inter, m.h}, m.gu);
    m.dnt = Make(DType::kBF16, {m.experts, m.h, m.inter}, m.dn);
  }

  // Takes the device's free memory in 512 MiB tensors, leaving less than the MoE's scratch, and
  // then in `smallest`-byte tensors, leaving less than that.
  std::vector<Tensor> TakeFreeMemory(int64_t smallest = int64_t{1} << 29) {
    std::vector<Tensor> held;
    for (int64_t bytes = int64_t{1} << 29; bytes >= smallest; bytes /= 8) {
      for (;;) {
        auto block = backend_->AllocateUninitialized(DType::kF32, {bytes / 4});
        if (!block.ok()) break;
        held.push_back(*std::move(block));
      }
    }
    return held;
  }

  // The MoE into `out` (zeroed), its first rows against the host reference (all 16384 would
  // take minutes on the host).
  void ExpectFirstRowsRight(const Tensor& out, const char* what) {
    const LargeScratchMoe& m = moe_;
    const int64_t rows = 16;
    std::vector<double> ref(rows * m.h, 0.0);
    std::vector<int64_t> counts(m.experts, 0);
    RefMoe(m.x, m.ids, m.w, m.gu, m.dn, rows, m.k, m.experts, 0, m.h, m.inter, ref, counts);
    std::vector<float> got = Host(out);
    got.resize(rows * m.h);
    EXPECT_LT(Reported(what, RelErr(got, ref)), kBf16Tol);
  }

  LargeScratchMoe moe_;
};

// An op's scratch that does not fit beside the blocks the cache holds for other steps' shapes:
// the cache gives them back to the device and the scratch is allocated, instead of the op
// failing (CudaBackend::TryGrowBuffer). The device's free memory is taken and released into
// the block cache before the MoE asks for its scratch.
TEST_F(CudaOutOfMemoryTest, ScratchFitsOnceTheBlockCacheGivesItsBlocksBack) {
  const LargeScratchMoe& m = moe_;
  auto out = backend_->Allocate(DType::kBF16, {m.t, m.h});
  ASSERT_TRUE(out.ok()) << out.status();
  ASSERT_GT(TakeFreeMemory().size(), 2u);  // into the block cache, not back to the device
  size_t free_bytes = 0, total_bytes = 0;
  ASSERT_EQ(cudaMemGetInfo(&free_bytes, &total_bytes), cudaSuccess);
  ASSERT_LT(free_bytes, size_t{1} << 30) << "the scratch would fit without the cache's blocks";
  backend_->MoeExperts(m.xt, m.idt, m.wt, m.gut, m.dnt, 0, *out, {});
  backend_->Synchronize();
  EXPECT_TRUE(backend_->TakeOpError().ok());
  ExpectFirstRowsRight(*out, "moe (scratch after the cache gave back)");
}

// An op's scratch that the device cannot hold even with the cache's blocks back (live tensors
// hold the memory): the op skips its launches, leaving its output unwritten, and TakeOpError
// reports ResourceExhausted naming the op scratch, once, instead of the process aborting. With
// the memory free again the same op runs and is right.
TEST_F(CudaOutOfMemoryTest, AnOpScratchThatCannotFitFailsInsteadOfAborting) {
  const LargeScratchMoe& m = moe_;
  auto out = backend_->Allocate(DType::kBF16, {m.t, m.h});
  ASSERT_TRUE(out.ok()) << out.status();
  {
    const std::vector<Tensor> held = TakeFreeMemory();
    ASSERT_GT(held.size(), 2u);
    size_t free_bytes = 0, total_bytes = 0;
    ASSERT_EQ(cudaMemGetInfo(&free_bytes, &total_bytes), cudaSuccess);
    ASSERT_LT(free_bytes, size_t{1} << 30) << "the scratch would fit";
    backend_->MoeExperts(m.xt, m.idt, m.wt, m.gut, m.dnt, 0, *out, {});
    backend_->Synchronize();
    const absl::Status error = backend_->TakeOpError();
    EXPECT_TRUE(absl::IsResourceExhausted(error)) << error;
    EXPECT_NE(std::string(error.message()).find("op scratch"), std::string::npos) << error;
    EXPECT_TRUE(backend_->TakeOpError().ok()) << "taken once";
    const std::vector<float> unwritten = Host(*out);
    EXPECT_TRUE(std::all_of(unwritten.begin(), unwritten.end(), [](float v) { return v == 0.f; }))
        << "the op launched without its scratch";
  }  // the held tensors go to the block cache, which gives them back on the next miss
  backend_->MoeExperts(m.xt, m.idt, m.wt, m.gut, m.dnt, 0, *out, {});
  backend_->Synchronize();
  EXPECT_TRUE(backend_->TakeOpError().ok());
  ExpectFirstRowsRight(*out, "moe (after an op scratch that did not fit)");
}

// The metadata buffers that cannot grow (an op's uploaded rows, a step's staged ids and
// segments; live tensors hold the memory): the op skips its launches and StageStep stages
// nothing, and TakeOpError reports ResourceExhausted naming the buffer, instead of the process
// aborting. With the memory free again both work.
TEST_F(CudaOutOfMemoryTest, MetadataThatCannotGrowFailsInsteadOfAborting) {
  const int64_t n = int64_t{1} << 22, width = 8;  // 16 MiB of row ids
  const std::vector<float> src_host = Rand(4 * width);
  const Tensor src = Make(DType::kBF16, {4, width}, src_host);
  auto out = backend_->Allocate(DType::kBF16, {n, width});
  ASSERT_TRUE(out.ok()) << out.status();
  std::vector<int32_t> rows(n);
  for (int64_t i = 0; i < n; ++i) rows[i] = static_cast<int32_t>((i * 7) % 4);
  const SequenceSegment segment{0, static_cast<int32_t>(n), 0, 0, {}};
  {
    const std::vector<Tensor> held = TakeFreeMemory(int64_t{1} << 20);
    ASSERT_GT(held.size(), 2u);
    size_t free_bytes = 0, total_bytes = 0;
    ASSERT_EQ(cudaMemGetInfo(&free_bytes, &total_bytes), cudaSuccess);
    ASSERT_LT(free_bytes, size_t{8} << 20) << "the metadata would fit";
    backend_->GatherRows(src, rows, *out);
    backend_->Synchronize();
    absl::Status error = backend_->TakeOpError();
    EXPECT_TRUE(absl::IsResourceExhausted(error)) << error;
    EXPECT_NE(std::string(error.message()).find("op metadata"), std::string::npos) << error;
    const std::vector<float> unwritten = Host(*out);
    EXPECT_TRUE(std::all_of(unwritten.begin(), unwritten.end(), [](float v) { return v == 0.f; }))
        << "the op launched without its metadata";
    backend_->StageStep(rows, std::span(&segment, 1), static_cast<int>(n));
    error = backend_->TakeOpError();
    EXPECT_TRUE(absl::IsResourceExhausted(error)) << error;
    EXPECT_NE(std::string(error.message()).find("step metadata"), std::string::npos) << error;
    backend_->ClearStep();
  }  // the held tensors go to the block cache, which gives them back on the next miss
  backend_->StageStep(rows, std::span(&segment, 1), static_cast<int>(n));
  EXPECT_TRUE(backend_->TakeOpError().ok());
  backend_->GatherRows(src, rows, *out);  // reads the staged rows
  backend_->Synchronize();
  backend_->ClearStep();
  EXPECT_TRUE(backend_->TakeOpError().ok());
  const std::vector<float> got = Host(*out), src_rounded = Host(src);
  for (int64_t i : {int64_t{0}, int64_t{1}, n / 2 + 1, n - 1}) {
    for (int64_t c = 0; c < width; ++c) {
      EXPECT_EQ(got[i * width + c], src_rounded[rows[i] * width + c]) << "row " << i;
    }
  }
}

TEST_F(CudaKernelsTest, RoutingOver2560ExpertsThroughMoeExperts) {
  const int64_t t = 150, h = 64, inter = 32;
  const int k = 8, experts = 2560;
  const std::vector<float> logits = Rand(t * experts, -3, 3);
  Tensor lt = Make(DType::kBF16, {t, experts}, logits);
  Tensor ids = Poisoned(DType::kI32, {t, k}), w = Poisoned(DType::kF32, {t, k});
  backend_->TopKSoftmax(lt, k, true, ids, w);
  std::vector<int32_t> ref_ids;
  std::vector<double> ref_w;
  RefTopK(logits, t, experts, k, true, ref_ids, ref_w);
  ASSERT_EQ(HostI32(ids), ref_ids);

  const std::vector<float> x = Rand(t * h),
                           gu = Rand(int64_t{experts} * 2 * inter * h, -0.3f, 0.3f),
                           dn = Rand(int64_t{experts} * h * inter, -0.3f, 0.3f);
  Tensor xt = Make(DType::kBF16, {t, h}, x), gut = Make(DType::kBF16, {experts, 2 * inter, h}, gu),
         dnt = Make(DType::kBF16, {experts, h, inter}, dn);
  Tensor out = Make(DType::kBF16, {t, h}, std::vector<float>(t * h, 0.0f));
  std::vector<int64_t> counts(experts, 0);
  backend_->MoeExperts(xt, ids, w, gut, dnt, 0, out, counts);
  const std::vector<float> host_w = Host(w);
  std::vector<double> ref(t * h, 0.0);
  std::vector<int64_t> ref_counts(experts, 0);
  RefMoe(x, ref_ids, host_w, gu, dn, t, k, experts, 0, h, inter, ref, ref_counts);
  EXPECT_LT(Reported("moe (2560 experts)", RelErr(Host(out), ref)), kBf16Tol);
  EXPECT_EQ(counts, ref_counts);
  EXPECT_EQ(std::accumulate(counts.begin(), counts.end(), int64_t{0}), t * k);
}

class CudaMoeSkewTest : public CudaKernelsTest,
                        public ::testing::WithParamInterface<std::pair<int, int>> {};

TEST_P(CudaMoeSkewTest, SkewedRoutingManyTilesPerExpert) {
  // Every token routes to the same two experts: several 32-row tiles per expert. Odd sizes take
  // the scalar-load path of the grouped GEMM; h = 320 gives the down GEMM two and a half 128-row
  // slices (a partial last slice).
  const int64_t t = 77, h = GetParam().first, inter = GetParam().second;
  const int k = 2, experts = 4;
  std::vector<int32_t> ids;
  for (int64_t r = 0; r < t; ++r) {
    ids.push_back(2);
    ids.push_back(r % 3 == 0 ? 0 : 3);
  }
  const std::vector<float> x = Rand(t * h), w = Rand(t * k, 0.1f, 1.0f),
                           gu = Rand(experts * 2 * inter * h, -0.3f, 0.3f),
                           dn = Rand(experts * h * inter, -0.3f, 0.3f), out0 = Rand(t * h);
  Tensor xt = Make(DType::kBF16, {t, h}, x), idt = MakeI32({t, k}, ids),
         wt = Make(DType::kF32, {t, k}, w), gut = Make(DType::kBF16, {experts, 2 * inter, h}, gu),
         dnt = Make(DType::kBF16, {experts, h, inter}, dn), out = Make(DType::kBF16, {t, h}, out0);
  backend_->MoeExperts(xt, idt, wt, gut, dnt, 0, out, {});
  std::vector<double> ref(out0.begin(), out0.end());
  std::vector<int64_t> ref_counts(experts, 0);
  RefMoe(x, ids, w, gu, dn, t, k, experts, 0, h, inter, ref, ref_counts);
  EXPECT_LT(Reported("moe (skewed)", RelErr(Host(out), ref)), kBf16Tol);
}

INSTANTIATE_TEST_SUITE_P(Sizes, CudaMoeSkewTest,
                         ::testing::Values(std::pair<int, int>{48, 24}, std::pair<int, int>{45, 21},
                                           std::pair<int, int>{320, 40}),
                         [](const ::testing::TestParamInfo<std::pair<int, int>>& info) {
                           return absl::StrCat("h", info.param.first, "_i", info.param.second);
                         });

struct MoeFewCase {
  int64_t t, h, inter;
  int k;
};

class CudaMoeFewTokensTest : public CudaKernelsTest,
                             public ::testing::WithParamInterface<MoeFewCase> {};

TEST_P(CudaMoeFewTokensTest, MatchesReference) {
  // At most MoeFewTokensMaxPairs pairs and no counts: the few-token kernels. Release dims at one
  // token, a full 64 pairs (the limit for these 16 experts), and k > 8 (a warp of the down kernel
  // takes two expert slots); 128 and 256 pairs, the grouped path by default and the few-token
  // kernels under the ctest variant CudaMoeFewTokensTest.UpTo256Pairs
  // (MOBIUS_MOE_FEW_MAX_PAIRS=256, the limit at 2560 experts). Ids below `first` or past the
  // local experts belong to other ranks and are skipped.
  const MoeFewCase p = GetParam();
  const int experts = 16, first = 4;
  std::vector<int32_t> ids(p.t * p.k);
  std::uniform_int_distribution<int> pick(0, first + experts + 3);
  for (int64_t r = 0; r < p.t; ++r) {
    for (int j = 0; j < p.k; ++j) {
      int e;
      do {
        e = pick(rng_);
      } while (std::find(&ids[r * p.k], &ids[r * p.k] + j, e) != &ids[r * p.k] + j);
      ids[r * p.k + j] = e;
    }
  }
  const std::vector<float> x = Rand(p.t * p.h), w = Rand(p.t * p.k, 0.05f, 1.0f),
                           gu = Rand(experts * 2 * p.inter * p.h, -0.1f, 0.1f),
                           dn = Rand(experts * p.h * p.inter, -0.1f, 0.1f), out0 = Rand(p.t * p.h);
  Tensor xt = Make(DType::kBF16, {p.t, p.h}, x), idt = MakeI32({p.t, p.k}, ids),
         wt = Make(DType::kF32, {p.t, p.k}, w),
         gut = Make(DType::kBF16, {experts, 2 * p.inter, p.h}, gu),
         dnt = Make(DType::kBF16, {experts, p.h, p.inter}, dn),
         out = Make(DType::kBF16, {p.t, p.h}, out0);
  backend_->MoeExperts(xt, idt, wt, gut, dnt, first, out, {});
  std::vector<double> ref(out0.begin(), out0.end());
  std::vector<int64_t> unused(experts, 0);
  RefMoe(x, ids, w, gu, dn, p.t, p.k, experts, first, p.h, p.inter, ref, unused);
  EXPECT_LT(Reported(p.t * p.k <= cuda::MoeFewTokensMaxPairs(experts)
                         ? "moe (few tokens)"
                         : "moe (grouped, over the pair limit)",
                     RelErr(Host(out), ref)),
            kBf16Tol);
}

INSTANTIATE_TEST_SUITE_P(Shapes, CudaMoeFewTokensTest,
                         ::testing::Values(MoeFewCase{1, 2048, 512, 8}, MoeFewCase{8, 256, 128, 8},
                                           MoeFewCase{2, 264, 136, 12}, MoeFewCase{16, 256, 128, 8},
                                           MoeFewCase{32, 256, 128, 8}),
                         [](const ::testing::TestParamInfo<MoeFewCase>& info) {
                           return absl::StrCat("t", info.param.t, "_h", info.param.h, "_i",
                                               info.param.inter, "_k", info.param.k);
                         });

TEST_F(CudaKernelsTest, SegmentWithoutStateSlotStartsFromZero) {
  // state_slot < 0 (as the CPU backend treats it): zero history, and no state is written.
  const int64_t c = 24, kk = 4;
  const DeltaRuleDims dims{1, 2, 32, 16};
  const int64_t row = 2 * 32 + 2 * 16;
  const std::vector<float> x = Rand(3 * c), w = Rand(c * kk), qkv = Rand(3 * row);
  const std::vector<float> conv0 = Rand(c * (kk - 1)), rec0 = Rand(2 * 32 * 16);
  Tensor xt = Make(DType::kBF16, {3, c}, x), wt = Make(DType::kBF16, {c, kk}, w);
  Tensor cs = Make(DType::kF32, {1, c, kk - 1}, conv0),
         rs = Make(DType::kF32, {1, 2, 32, 16}, rec0);
  const auto segs = MakeSegments({3}, {0}, {-1});
  Tensor out = Poisoned(DType::kBF16, {3, c});
  backend_->CausalConv1dSilu(xt, wt, cs, segs, out);
  std::vector<double> ref(3 * c);
  for (int i = 0; i < 3; ++i) {
    for (int64_t ch = 0; ch < c; ++ch) {
      double acc = 0;
      for (int j = 0; j < kk; ++j) {
        const int p = i - (kk - 1) + j;
        if (p >= 0) acc += double{w[ch * kk + j]} * x[p * c + ch];
      }
      ref[i * c + ch] = Silu(acc);
    }
  }
  EXPECT_LT(RelErr(Host(out), ref), kBf16Tol);
  EXPECT_EQ(Host(cs), conv0);

  Tensor qt = Make(DType::kBF16, {3, row}, qkv);
  Tensor g = Make(DType::kF32, {3, 2}, Rand(6, -0.5f, -0.1f)),
         beta = Make(DType::kF32, {3, 2}, Rand(6, 0.1f, 0.9f));
  Tensor o = Poisoned(DType::kBF16, {3, 32});
  backend_->GatedDeltaRule(qt, g, beta, dims, rs, segs, DeltaRuleAlgorithm::kAuto, o);
  std::vector<double> zero_state(2 * 32 * 16, 0.0), o_ref;
  RefDeltaRule(qkv, Host(g), Host(beta), dims, MakeSegments({3}, {0}, {0}), zero_state, o_ref);
  EXPECT_LT(RelErr(Host(o), o_ref), kBf16Tol);
  EXPECT_EQ(Host(rs), rec0);
}

// The tensor-core GEMV (tc_gemv.cu) for every row count it takes (ceil(m / 8) tiles of x, 1-5),
// two targets (one bf16 and one fp32 output, row counts that are not multiples of its 16-row
// groups), against a double reference. K = 96 (3 steps, fewer than a round of loads, no split),
// 512, 1024 and 4096 (K split over 2, 4 and 8 warps by TcGemvSplit at these 68 row groups). Each
// form gives the first rows the bits the one-tile kernel gives them (a verify step's rows equal a
// one-token step's).
TEST_F(CudaKernelsTest, TcGemvMatchesReference) {
  for (const int64_t k : {96, 512, 1024, 4096}) {
    const int64_t n0 = 40, n1 = 1037;
    const int max_m = cuda::kMaxTcGemvRows;
    const std::vector<float> x = Rand(max_m * k), w0 = Rand(n0 * k), w1 = Rand(n1 * k);
    Tensor xt = Make(DType::kBF16, {max_m, k}, x), w0t = Make(DType::kBF16, {n0, k}, w0),
           w1t = Make(DType::kBF16, {n1, k}, w1);
    std::vector<float> tile0, tile1;  // the first 8 rows' outputs from the one-tile kernel
    for (int m = 1; m <= max_m; ++m) {
      Tensor y0 = Poisoned(DType::kBF16, {m, n0}), y1 = Poisoned(DType::kF32, {m, n1});
      ASSERT_TRUE(cuda::TcGemvSupports(m, k, xt.raw(), w0t.raw()));
      const cuda::SkinnyTarget targets[2] = {
          {static_cast<const uint16_t*>(w0t.raw()), n0, cuda::AnyMutPtr{y0.raw(), false}},
          {static_cast<const uint16_t*>(w1t.raw()), n1, cuda::AnyMutPtr{y1.raw(), true}}};
      backend_->Synchronize();
      cuda::LaunchTcGemv(static_cast<const uint16_t*>(xt.raw()), m, k, targets, 2, nullptr);
      ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
      auto reference = [&](const std::vector<float>& w, int64_t n) {
        std::vector<double> ref;
        RefLinear(x, w, m, n, k, ref);  // the first m rows of x
        return ref;
      };
      const std::string what = absl::StrCat("m ", m, " k ", k);
      const std::vector<float> h0 = Host(y0), h1 = Host(y1);
      EXPECT_LT(RelErr(h0, reference(w0, n0)), kBf16Tol) << what;
      EXPECT_LT(RelErr(h1, reference(w1, n1)), 1e-4) << what << " (fp32 output)";
      if (m == 8) {
        tile0 = h0;
        tile1 = h1;
      } else if (m > 8) {
        EXPECT_TRUE(std::equal(tile0.begin(), tile0.end(), h0.begin())) << what;
        EXPECT_TRUE(std::equal(tile1.begin(), tile1.end(), h1.begin())) << what;
      }
    }
  }
}

// The skinny GEMM (skinny_gemm.cu) at every row count it takes (1 and 2), two targets (bf16 and
// fp32 outputs), against a double reference, and each row bit for bit as a launch of that row
// alone gives it. K = 96 (fewer pieces than a
// lane's round), 2048, 3072 and 4096 (K split over 1, 4, 2 and 8 warps).
TEST_F(CudaKernelsTest, SkinnyGemmMatchesReferenceAndRowsAlone) {
  for (const int64_t k : {96, 2048, 3072, 4096}) {
    const int64_t n0 = 40, n1 = 1037;
    const int rows = cuda::kMaxSkinnyRows;
    const std::vector<float> x = Rand(rows * k), w0 = Rand(n0 * k), w1 = Rand(n1 * k);
    Tensor xt = Make(DType::kBF16, {rows, k}, x), w0t = Make(DType::kBF16, {n0, k}, w0),
           w1t = Make(DType::kBF16, {n1, k}, w1);
    auto run = [&](const uint16_t* xs, int m, Tensor& y0, Tensor& y1) {
      const cuda::SkinnyTarget targets[2] = {
          {static_cast<const uint16_t*>(w0t.raw()), n0, cuda::AnyMutPtr{y0.raw(), false}},
          {static_cast<const uint16_t*>(w1t.raw()), n1, cuda::AnyMutPtr{y1.raw(), true}}};
      backend_->Synchronize();
      cuda::LaunchSkinnyGemm(xs, m, k, targets, 2, nullptr);
      ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    };
    // Each row alone.
    std::vector<std::vector<float>> alone0, alone1;
    for (int r = 0; r < cuda::kMaxSkinnyRows; ++r) {
      Tensor y0 = Poisoned(DType::kBF16, {1, n0}), y1 = Poisoned(DType::kF32, {1, n1});
      run(static_cast<const uint16_t*>(xt.raw()) + r * k, 1, y0, y1);
      alone0.push_back(Host(y0));
      alone1.push_back(Host(y1));
    }
    for (int m = 1; m <= cuda::kMaxSkinnyRows; ++m) {
      ASSERT_TRUE(cuda::SkinnyGemmSupports(m, k, xt.raw(), w0t.raw()));
      Tensor y0 = Poisoned(DType::kBF16, {m, n0}), y1 = Poisoned(DType::kF32, {m, n1});
      run(static_cast<const uint16_t*>(xt.raw()), m, y0, y1);
      auto reference = [&](const std::vector<float>& w, int64_t n) {
        std::vector<double> ref;
        RefLinear(x, w, m, n, k, ref);  // the first m rows of x
        return ref;
      };
      const std::string what = absl::StrCat("m ", m, " k ", k);
      const std::vector<float> h0 = Host(y0), h1 = Host(y1);
      EXPECT_LT(RelErr(h0, reference(w0, n0)), kBf16Tol) << what;
      EXPECT_LT(RelErr(h1, reference(w1, n1)), 1e-4) << what << " (fp32 output)";
      for (int r = 0; r < m; ++r) {
        EXPECT_TRUE(std::equal(alone0[r].begin(), alone0[r].end(), h0.begin() + r * n0))
            << what << " row " << r;
        EXPECT_TRUE(std::equal(alone1[r].begin(), alone1[r].end(), h1.begin() + r * n1))
            << what << " row " << r << " (fp32 output)";
      }
    }
  }
  EXPECT_FALSE(cuda::SkinnyGemmSupports(cuda::kMaxSkinnyRows + 1, 2048, nullptr, nullptr));
}

// The shared expert's down projection fused into the few-token MoE kernels: computed by the
// gate-up kernel (the default) or by the down kernel, the same bits, at 1, 2, 5 and 8 tokens (the
// gate-up kernel's two distributions of the rows over its blocks), with
// one (row, piece) pair per thread (I = 512) and more pairs than threads (I = 1040), an expert
// of another rank (-1) in the routing, and hidden 2048 with few gate-up blocks (each then
// computes many four-row pieces). The scratch's shared-row part shows which kernel ran.
TEST_F(CudaKernelsTest, MoeSharedExpertRowsSameInGateUpAndDown) {
  const bool forced = std::getenv("MOBIUS_MOE_SHARED_IN_GATEUP") != nullptr ||
                      std::getenv("MOBIUS_MOE_FEW") != nullptr;
  struct Dims {
    int64_t h, inter;
    int k, experts;
  };
  for (const Dims d : {Dims{256, 128, 8, 40}, Dims{2048, 64, 2, 16}}) {
    const int64_t h = d.h, inter = d.inter;
    const int k = d.k, experts = d.experts;
    Tensor gut =
        Make(DType::kBF16, {experts, 2 * inter, h}, Rand(experts * 2 * inter * h, -0.2f, 0.2f));
    Tensor dnt = Make(DType::kBF16, {experts, h, inter}, Rand(experts * h * inter, -0.2f, 0.2f));
    // Up to two tokens every gate-up block takes (token, rows) units; beyond, the first wave's
    // blocks take rows of every token (SharedExpertInGateUp).
    for (const int t : {1, 2, 5, 8}) {
      for (const int64_t s_inter : {int64_t{512}, int64_t{1040}}) {
        std::vector<int32_t> ids;
        for (int r = 0; r < t; ++r) {
          for (int j = 0; j < k; ++j) ids.push_back(j == 1 ? -1 : (r * 11 + j * 5) % experts);
        }
        Tensor xt = Make(DType::kBF16, {t, h}, Rand(t * h));
        Tensor idt = MakeI32({t, k}, ids);
        Tensor wt = Make(DType::kF32, {t, k}, Rand(t * k, 0.05f, 0.5f));
        Tensor sgu = Make(DType::kBF16, {t, 2 * s_inter}, Rand(t * 2 * s_inter, -3.0f, 3.0f));
        Tensor sdn = Make(DType::kBF16, {h, s_inter}, Rand(h * s_inter, -0.1f, 0.1f));
        Tensor gate = Make(DType::kF32, {t, 1}, Rand(t, -3.0f, 3.0f));
        Tensor in_gate_up = Poisoned(DType::kBF16, {t, h});
        Tensor in_down = Poisoned(DType::kBF16, {t, h});
        const int64_t elems = cuda::MoeFewTokensScratchElems(t, k, h, inter);
        const int64_t rows_at = cuda::MoeFewTokensSharedRowsOffset(t, k, inter);
        Tensor act = Make(DType::kBF16, {elems}, std::vector<float>(elems, 0.0f));
        backend_->Synchronize();
        cuda::MoeSharedTerm term;
        term.gate_logits = cuda::AnyPtr{gate.raw(), true};
        term.gate_up = static_cast<const uint16_t*>(sgu.raw());
        term.down = static_cast<const uint16_t*>(sdn.raw());
        term.inter = s_inter;
        term.fused_max_tokens = 8;
        const std::string what = absl::StrCat("h ", h, " t ", t, " shared inter ", s_inter);
        for (const bool gate_up_side : {false, true}) {
          term.rows_in_gate_up = gate_up_side;
          ASSERT_TRUE(cuda::LaunchMoeExpertsFewTokens(
              static_cast<const uint16_t*>(xt.raw()), static_cast<const int32_t*>(idt.raw()),
              static_cast<const float*>(wt.raw()), static_cast<const uint16_t*>(gut.raw()),
              static_cast<const uint16_t*>(dnt.raw()), t, k, experts, 0, h, inter,
              static_cast<uint16_t*>(act.raw()),
              static_cast<uint16_t*>((gate_up_side ? in_gate_up : in_down).raw()), &term, nullptr));
          ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
          const std::vector<float> scratch = Host(act);
          const bool rows_written = std::any_of(scratch.begin() + rows_at, scratch.end(),
                                                [](float v) { return v != 0.0f; });
          if (!forced) {
            EXPECT_EQ(rows_written, gate_up_side) << what << ": which kernel ran";
          }
        }
        const std::vector<float> a = Host(in_gate_up), b = Host(in_down);
        EXPECT_EQ(a, b) << what;
        EXPECT_TRUE(std::all_of(a.begin(), a.end(), [](float v) { return std::isfinite(v); }))
            << what;
      }
    }
  }
}

// The shared expert's rows computed beside the top-k (LaunchTopKSoftmaxWithSharedRows): the
// same ids and weights as the top-k alone, and the same row bits as the gate-up kernel's
// placement (SharedExpertInGateUp). Shared inter 512 (a warp's pairs in one row), 64 (four rows
// a warp) and 40 (rows straddling warps); hidden 2048 (the release size) and 264; 1, 3, 6 and 8
// tokens; hidden 260 (the last block's second group without rows) against a host reference;
// and the shapes it declines.
TEST_F(CudaKernelsTest, TopKWithSharedRowsMatchesTopKAndGateUpRows) {
  // Knobs that move the rows out of the gate-up kernel or force another top-k or MoE form make
  // the comparisons below meaningless.
  for (const char* knob : {"MOBIUS_MOE_SHARED_IN_GATEUP", "MOBIUS_MOE_FEW", "MOBIUS_TOPK",
                           "MOBIUS_MOE_GEMM", "MOBIUS_MOE_SHARED_SPREAD"}) {
    if (std::getenv(knob) != nullptr) GTEST_SKIP() << knob << " is set";
  }
  const int k = 8, experts = 64, num_experts = 2560;
  for (const int64_t h : {int64_t{2048}, int64_t{264}}) {
    for (const int64_t s_inter : {int64_t{512}, int64_t{64}, int64_t{40}}) {
      const int64_t inter = 64;  // the routed experts' (the gate-up kernel needs some)
      Tensor gut =
          Make(DType::kBF16, {experts, 2 * inter, h}, Rand(experts * 2 * inter * h, -0.2f, 0.2f));
      Tensor sdn = Make(DType::kBF16, {h, s_inter}, Rand(h * s_inter, -0.1f, 0.1f));
      for (const int t : {1, 3, 6, 8}) {
        const std::string what = absl::StrCat("h ", h, " shared inter ", s_inter, " t ", t);
        Tensor logits = Make(DType::kF32, {t, num_experts}, Rand(t * num_experts, -4.0f, 4.0f));
        Tensor sgu = Make(DType::kBF16, {t, 2 * s_inter}, Rand(t * 2 * s_inter, -3.0f, 3.0f));
        Tensor ids = MakeI32({t, k}, std::vector<int32_t>(t * k, -7));
        Tensor ids_alone = MakeI32({t, k}, std::vector<int32_t>(t * k, -7));
        Tensor wts = Poisoned(DType::kF32, {t, k}), wts_alone = Poisoned(DType::kF32, {t, k});
        Tensor rows = Poisoned(DType::kBF16, {t, h});
        cuda::MoeSharedTerm term;
        term.gate_up = static_cast<const uint16_t*>(sgu.raw());
        term.down = static_cast<const uint16_t*>(sdn.raw());
        term.inter = s_inter;
        term.fused_max_tokens = 8;
        const cuda::AnyPtr lp{logits.raw(), true};
        backend_->Synchronize();
        ASSERT_TRUE(cuda::LaunchTopKSoftmaxWithSharedRows(
            lp, t, num_experts, k, true, static_cast<int32_t*>(ids.raw()),
            static_cast<float*>(wts.raw()), term, h, static_cast<uint16_t*>(rows.raw()), nullptr))
            << what;
        cuda::LaunchTopKSoftmax(lp, t, num_experts, k, true, static_cast<int32_t*>(ids_alone.raw()),
                                static_cast<float*>(wts_alone.raw()), nullptr);
        ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess) << what;
        EXPECT_EQ(HostI32(ids), HostI32(ids_alone)) << what;
        EXPECT_EQ(Host(wts), Host(wts_alone)) << what;
        // The gate-up kernel's rows (into its scratch) for the same shared operands.
        std::vector<int32_t> routed(t * k);
        for (int i = 0; i < t * k; ++i) routed[i] = (i * 7) % experts;
        Tensor xt = Make(DType::kBF16, {t, h}, Rand(t * h));
        Tensor idt = MakeI32({t, k}, routed);
        Tensor wt = Make(DType::kF32, {t, k}, Rand(t * k, 0.05f, 0.5f));
        Tensor gate = Make(DType::kF32, {t, 1}, Rand(t, -3.0f, 3.0f));
        term.gate_logits = cuda::AnyPtr{gate.raw(), true};
        Tensor dnt =
            Make(DType::kBF16, {experts, h, inter}, Rand(experts * h * inter, -0.2f, 0.2f));
        Tensor out = Poisoned(DType::kBF16, {t, h});
        const int64_t elems = cuda::MoeFewTokensScratchElems(t, k, h, inter);
        Tensor act = Make(DType::kBF16, {elems}, std::vector<float>(elems, 0.0f));
        backend_->Synchronize();
        if (!cuda::LaunchMoeExpertsFewTokens(
                static_cast<const uint16_t*>(xt.raw()), static_cast<const int32_t*>(idt.raw()),
                static_cast<const float*>(wt.raw()), static_cast<const uint16_t*>(gut.raw()),
                static_cast<const uint16_t*>(dnt.raw()), t, k, experts, 0, h, inter,
                static_cast<uint16_t*>(act.raw()), static_cast<uint16_t*>(out.raw()), &term,
                nullptr)) {
          ADD_FAILURE() << what << ": the few-token kernels declined";
          continue;
        }
        ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess) << what;
        const std::vector<float> scratch = Host(act), beside = Host(rows);
        const int64_t at = cuda::MoeFewTokensSharedRowsOffset(t, k, inter);
        const std::vector<float> in_gate_up(scratch.begin() + at, scratch.begin() + at + t * h);
        EXPECT_EQ(beside, in_gate_up) << what;
        EXPECT_TRUE(std::all_of(beside.begin(), beside.end(), [](float v) {
          return std::isfinite(v) && v != 0.0f;
        })) << what;
      }
    }
  }
  // Hidden 260: 65 four-row units, so the last block's second group has none. Against the
  // host (double sums of the bf16 act that SiluMulPiece rounds); every row written.
  for (const int64_t s_inter : {int64_t{512}, int64_t{40}}) {
    for (const int t : {3, 8}) {
      const int64_t h = 260;
      const std::string what = absl::StrCat("h ", h, " shared inter ", s_inter, " t ", t);
      const std::vector<float> gu = Rand(t * 2 * s_inter, -3.0f, 3.0f),
                               dn = Rand(h * s_inter, -0.1f, 0.1f);
      Tensor logits = Make(DType::kF32, {t, num_experts}, Rand(t * num_experts, -4.0f, 4.0f));
      Tensor sgu = Make(DType::kBF16, {t, 2 * s_inter}, gu);
      Tensor sdn = Make(DType::kBF16, {h, s_inter}, dn);
      Tensor ids = MakeI32({t, k}, std::vector<int32_t>(t * k, -7));
      Tensor wts = Poisoned(DType::kF32, {t, k}), rows = Poisoned(DType::kBF16, {t, h});
      cuda::MoeSharedTerm term;
      term.gate_up = static_cast<const uint16_t*>(sgu.raw());
      term.down = static_cast<const uint16_t*>(sdn.raw());
      term.inter = s_inter;
      backend_->Synchronize();
      ASSERT_TRUE(cuda::LaunchTopKSoftmaxWithSharedRows(
          cuda::AnyPtr{logits.raw(), true}, t, num_experts, k, true,
          static_cast<int32_t*>(ids.raw()), static_cast<float*>(wts.raw()), term, h,
          static_cast<uint16_t*>(rows.raw()), nullptr))
          << what;
      ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess) << what;
      std::vector<double> ref(t * h);
      for (int r = 0; r < t; ++r) {
        for (int64_t o = 0; o < h; ++o) {
          double acc = 0;
          for (int64_t i = 0; i < s_inter; ++i) {
            const float g = gu[r * 2 * s_inter + i], u = gu[r * 2 * s_inter + s_inter + i];
            const float act = RoundBf16(static_cast<float>(Silu(g)) * u);
            acc += double{dn[o * s_inter + i]} * act;
          }
          ref[r * h + o] = acc;
        }
      }
      EXPECT_LT(RelErr(Host(rows), ref), kBf16Tol) << what;
    }
  }
  // Declined: more than 8 tokens, shared inter above 512, a misaligned operand.
  Tensor logits = Make(DType::kF32, {9, 2560}, Rand(9 * 2560));
  Tensor sgu = Make(DType::kBF16, {9, 2 * 1040}, Rand(9 * 2 * 1040));
  Tensor sdn = Make(DType::kBF16, {64, 1040}, Rand(64 * 1040));
  Tensor ids = MakeI32({9, 8}, std::vector<int32_t>(72, 0));
  Tensor wts = Poisoned(DType::kF32, {9, 8}), rows = Poisoned(DType::kBF16, {9, 64});
  cuda::MoeSharedTerm term;
  term.gate_up = static_cast<const uint16_t*>(sgu.raw());
  term.down = static_cast<const uint16_t*>(sdn.raw());
  const cuda::AnyPtr lp{logits.raw(), true};
  auto launch = [&](int64_t t, int64_t s_inter) {
    term.inter = s_inter;
    return cuda::LaunchTopKSoftmaxWithSharedRows(
        lp, t, 2560, 8, true, static_cast<int32_t*>(ids.raw()), static_cast<float*>(wts.raw()),
        term, 64, static_cast<uint16_t*>(rows.raw()), nullptr);
  };
  EXPECT_FALSE(launch(9, 512));
  EXPECT_FALSE(launch(2, 1040));
  term.gate_up = static_cast<const uint16_t*>(sgu.raw()) + 1;
  EXPECT_FALSE(launch(2, 512));
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
}

TEST_F(CudaKernelsTest, DecodeConvWithoutStateSlotStartsFromZero) {
  // A decode step (one token per segment, the decode conv kernel) where one segment has no state
  // slot: zero history for it, its slot-less state untouched, the other segment's state shifted.
  const int64_t c = 24, kk = 4;
  const std::vector<float> x = Rand(2 * c), w = Rand(c * kk), conv0 = Rand(2 * c * (kk - 1));
  Tensor xt = Make(DType::kBF16, {2, c}, x), wt = Make(DType::kBF16, {c, kk}, w);
  Tensor cs = Make(DType::kF32, {2, c, kk - 1}, conv0);
  const auto segs = MakeSegments({1, 1}, {0, 7}, {-1, 1});
  Tensor out = Poisoned(DType::kBF16, {2, c});
  backend_->CausalConv1dSilu(xt, wt, cs, segs, out);
  std::vector<double> ref(2 * c);
  std::vector<float> state = conv0;
  for (int64_t ch = 0; ch < c; ++ch) {
    ref[ch] = Silu(double{w[ch * kk + kk - 1]} * x[ch]);
    const float* h = &conv0[(c + ch) * (kk - 1)];
    double acc = double{w[ch * kk + kk - 1]} * x[c + ch];
    for (int j = 0; j < kk - 1; ++j) acc += double{w[ch * kk + j]} * h[j];
    ref[c + ch] = Silu(acc);
    float* s = &state[(c + ch) * (kk - 1)];
    s[0] = h[1], s[1] = h[2], s[2] = x[c + ch];
  }
  EXPECT_LT(RelErr(Host(out), ref), kBf16Tol);
  const std::vector<float> got = Host(cs);
  for (size_t i = 0; i < state.size(); ++i) {
    // the new inputs were stored from bf16: compare within the input's rounding
    EXPECT_NEAR(got[i], state[i], 1e-2 * std::fabs(state[i]) + 1e-6) << i;
  }
}

// The grouping and the grouped GEMM launch a grid fixed by the shapes and never read the
// routing on the host: the whole op captures into a CUDA graph, and replays with new routings
// and inputs give the direct launch's results bit for bit (the combine is deterministic).
TEST_F(CudaKernelsTest, MoeExpertsCapturedInGraphMatchesDirectLaunch) {
  const int64_t h = 256, inter = 128;
  const int t = 200, k = 8, experts = 300;
  const std::vector<float> gu = Rand(int64_t{experts} * 2 * inter * h, -0.2f, 0.2f),
                           dn = Rand(int64_t{experts} * h * inter, -0.2f, 0.2f);
  Tensor gut = Make(DType::kBF16, {experts, 2 * inter, h}, gu),
         dnt = Make(DType::kBF16, {experts, h, inter}, dn);
  Tensor xt = Make(DType::kBF16, {t, h}, Rand(t * h)), wt = Make(DType::kF32, {t, k}, Rand(t * k));
  Tensor idt = MakeI32({t, k}, std::vector<int32_t>(t * k, 0));
  Tensor out_graph = Make(DType::kBF16, {t, h}, std::vector<float>(t * h, 0.0f));
  Tensor out_direct = Make(DType::kBF16, {t, h}, std::vector<float>(t * h, 0.0f));
  backend_->Synchronize();
  cudaStream_t stream;
  ASSERT_EQ(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), cudaSuccess);
  void* scratch = nullptr;
  ASSERT_EQ(cudaMalloc(&scratch, cuda::MoeScratchBytes(t, k, experts, h, inter)), cudaSuccess);
  auto launch = [&](Tensor& out) {
    cuda::LaunchMoeExperts(
        static_cast<const uint16_t*>(xt.raw()), static_cast<const int32_t*>(idt.raw()),
        static_cast<const float*>(wt.raw()), static_cast<const uint16_t*>(gut.raw()),
        static_cast<const uint16_t*>(dnt.raw()), t, k, experts, 0, h, inter, scratch, nullptr,
        static_cast<uint16_t*>(out.raw()), stream);
  };
  cudaGraph_t graph;
  ASSERT_EQ(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal), cudaSuccess);
  launch(out_graph);
  ASSERT_EQ(cudaStreamEndCapture(stream, &graph), cudaSuccess);
  cudaGraphExec_t exec;
  ASSERT_EQ(cudaGraphInstantiate(&exec, graph, 0), cudaSuccess);
  for (int round = 0; round < 3; ++round) {
    // Round 1 sends every token to expert 7 first (skewed); others are uniform.
    std::vector<int32_t> ids;
    std::uniform_int_distribution<int> pick(0, experts - 1);
    for (int r = 0; r < t; ++r) {
      for (int j = 0; j < k; ++j) {
        int e;
        do {
          e = round == 1 && j == 0 ? 7 : pick(rng_);
        } while (std::find(ids.end() - j, ids.end(), e) != ids.end());
        ids.push_back(e);
      }
    }
    backend_->CopyFromHost(ids.data(), DType::kI32, idt);
    backend_->CopyFromHost(Rand(t * h).data(), DType::kF32, xt);
    backend_->Synchronize();
    ASSERT_EQ(cudaGraphLaunch(exec, stream), cudaSuccess);
    launch(out_direct);
    ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
    const std::vector<float> a = Host(out_graph), b = Host(out_direct);
    EXPECT_EQ(a, b) << "round " << round;
    EXPECT_TRUE(std::all_of(a.begin(), a.end(), [](float v) { return std::isfinite(v); }));
  }
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
  cudaFree(scratch);
  cudaStreamDestroy(stream);
}

// ---------------------------------------------------------------------------------------------
// Timings at release dimensions (not a correctness test): MOBIUS_CUDA_BENCH=1 to run.

class CudaTimingTest : public CudaKernelsTest {
 protected:
  void SetUp() override {
    const char* env = std::getenv("MOBIUS_CUDA_BENCH");
    if (env == nullptr || std::string(env) != "1") GTEST_SKIP() << "set MOBIUS_CUDA_BENCH=1";
    CudaKernelsTest::SetUp();
  }
  // Fills a large bf16/f32 tensor with random data by repeating a random 16 MiB chunk.
  void FillRandom(Tensor& t) {
    const int64_t n = t.numel();
    const int64_t chunk = std::min<int64_t>(n, int64_t{8} << 20);
    Tensor head = t.Rows(0, t.dim(0)).Reshape({n}).Rows(0, chunk);
    std::vector<float> v = Rand(chunk, -0.5f, 0.5f);
    backend_->CopyFromHost(v.data(), DType::kF32, head);
    const size_t elem = DTypeSize(t.dtype());
    for (int64_t off = chunk; off < n; off += chunk) {
      const int64_t len = std::min(chunk, n - off);
      ASSERT_EQ(cudaMemcpy(static_cast<char*>(t.raw()) + off * elem, t.raw(), len * elem,
                           cudaMemcpyDeviceToDevice),
                cudaSuccess);
    }
  }
  template <typename F>
  double TimeUs(F&& f, int iters = 20) {
    f();
    f();
    backend_->Synchronize();
    const auto start = std::chrono::steady_clock::now();
    for (int i = 0; i < iters; ++i) f();
    backend_->Synchronize();
    const auto end = std::chrono::steady_clock::now();
    return std::chrono::duration<double, std::micro>(end - start).count() / iters;
  }
  Tensor Alloc(DType dtype, std::vector<int64_t> shape) {
    auto t = backend_->Allocate(dtype, std::move(shape));
    EXPECT_TRUE(t.ok()) << t.status();
    return *t;
  }
};

TEST_F(CudaTimingTest, ReleaseDims) {
  // Gated delta rule, decode: 64 sequences x 1 token, Hk 16, Hv 32, Dk = Dv = 128.
  {
    const int batch = 64;
    const DeltaRuleDims d{16, 32, 128, 128};
    const int64_t row = 2 * 16 * 128 + 32 * 128;
    Tensor qkv = Alloc(DType::kBF16, {batch, row}), g = Alloc(DType::kF32, {batch, 32}),
           beta = Alloc(DType::kF32, {batch, 32}), st = Alloc(DType::kF32, {batch, 32, 128, 128}),
           out = Alloc(DType::kBF16, {batch, 32 * 128});
    FillRandom(qkv);
    backend_->CopyFromHost(Rand(batch * 32, -0.3f, -0.01f).data(), DType::kF32, g);
    backend_->CopyFromHost(Rand(batch * 32, 0.1f, 0.9f).data(), DType::kF32, beta);
    FillRandom(st);
    std::vector<int> ones(batch, 1), cached(batch, 100), slots(batch);
    std::iota(slots.begin(), slots.end(), 0);
    const auto segs = MakeSegments(ones, cached, slots);
    const double us = TimeUs([&] {
      backend_->GatedDeltaRule(qkv, g, beta, d, st, segs, DeltaRuleAlgorithm::kAuto, out);
    });
    const double bytes = 2.0 * st.nbytes();
    std::printf("TIMING delta rule decode 64x1 tok: %.1f us (%.0f GB/s of state traffic)\n", us,
                bytes / us * 1e-3);
    // Prefill: one 4096-token segment (kAuto: the chunked kernels).
    Tensor qkv_p = Alloc(DType::kBF16, {4096, row}), g_p = Alloc(DType::kF32, {4096, 32}),
           b_p = Alloc(DType::kF32, {4096, 32}), out_p = Alloc(DType::kBF16, {4096, 32 * 128});
    FillRandom(qkv_p);
    backend_->CopyFromHost(Rand(4096 * 32, -0.3f, -0.01f).data(), DType::kF32, g_p);
    backend_->CopyFromHost(Rand(4096 * 32, 0.1f, 0.9f).data(), DType::kF32, b_p);
    const auto seg1 = MakeSegments({4096}, {0}, {0});
    const double us_p = TimeUs(
        [&] {
          backend_->GatedDeltaRule(qkv_p, g_p, b_p, d, st, seg1, DeltaRuleAlgorithm::kAuto, out_p);
        },
        3);
    std::printf("TIMING delta rule prefill 1x4096 tok (kAuto: chunked): %.1f us\n", us_p);
  }
  // Paged attention, decode: 64 sequences at 4096 cached tokens, 16 q / 2 kv heads of 256.
  {
    const int batch = 64, ctx = 4096, bs = 16, nh = 16, nkv = 2, hd = 256;
    const int blocks_per = (ctx + 1 + bs - 1) / bs;
    Tensor kc = Alloc(DType::kBF16, {batch * blocks_per, bs, nkv, hd}),
           vc = Alloc(DType::kBF16, {batch * blocks_per, bs, nkv, hd}),
           q = Alloc(DType::kBF16, {batch, nh, hd}), out = Alloc(DType::kBF16, {batch, nh, hd});
    FillRandom(kc);
    FillRandom(vc);
    FillRandom(q);
    std::vector<std::vector<int32_t>> tables(batch);
    std::vector<int> ones(batch, 1), cached(batch, ctx), slots(batch, 0);
    auto segs = MakeSegments(ones, cached, slots);
    for (int b = 0; b < batch; ++b) {
      for (int i = 0; i < blocks_per; ++i) tables[b].push_back(b * blocks_per + i);
      segs[b].kv_blocks = tables[b];
    }
    const double us = TimeUs([&] { backend_->PagedAttention(q, kc, vc, segs, 0.0625f, out); });
    const double bytes = 2.0 * batch * (ctx + 1) * nkv * hd * 2;
    std::printf("TIMING paged attention decode 64 x ctx %d: %.1f us (%.0f GB/s of KV)\n", ctx, us,
                bytes / us * 1e-3);
  }
  // MoE, decode batch of 64 tokens over a 2560-expert bank (H 2048, I 512, top-8).
  {
    const int64_t t = 64, h = 2048, inter = 512;
    const int e = 2560, k = 8;
    Tensor gu = Alloc(DType::kBF16, {e, 2 * inter, h}), dn = Alloc(DType::kBF16, {e, h, inter});
    FillRandom(gu);
    FillRandom(dn);
    Tensor x = Alloc(DType::kBF16, {t, h}), out = Alloc(DType::kBF16, {t, h});
    FillRandom(x);
    Tensor logits = Make(DType::kBF16, {t, e}, Rand(t * e, -3, 3));
    Tensor ids = Alloc(DType::kI32, {t, k}), w = Alloc(DType::kF32, {t, k});
    const double us_topk = TimeUs([&] { backend_->TopKSoftmax(logits, k, true, ids, w); });
    std::printf("TIMING topk softmax 64 x 2560, k 8: %.1f us\n", us_topk);
    std::vector<int32_t> host_ids = std::vector<int32_t>(t * k);
    backend_->CopyToHostI32(ids, host_ids.data());
    std::sort(host_ids.begin(), host_ids.end());
    const int64_t touched = std::unique(host_ids.begin(), host_ids.end()) - host_ids.begin();
    const double us = TimeUs([&] { backend_->MoeExperts(x, ids, w, gu, dn, 0, out, {}); });
    const double bytes = touched * 3.0 * h * inter * 2;
    std::printf("TIMING moe decode 64 tok, %lld experts touched: %.1f us (%.0f GB/s of weights)\n",
                static_cast<long long>(touched), us, bytes / us * 1e-3);
    Tensor xp = Alloc(DType::kBF16, {4096, h}), outp = Alloc(DType::kBF16, {4096, h});
    FillRandom(xp);
    Tensor lp = Alloc(DType::kBF16, {4096, e});
    FillRandom(lp);
    Tensor idp = Alloc(DType::kI32, {4096, k}), wp = Alloc(DType::kF32, {4096, k});
    backend_->TopKSoftmax(lp, k, true, idp, wp);
    const double us_p = TimeUs([&] { backend_->MoeExperts(xp, idp, wp, gu, dn, 0, outp, {}); }, 3);
    const double flops = 4096.0 * k * 3 * 2 * h * inter;
    std::printf("TIMING moe prefill 4096 tok: %.1f us (%.1f TFLOP/s)\n", us_p, flops / us_p * 1e-6);
  }
  // Linear through cuBLASLt: decode and prefill shapes of a 2048 -> 8192 projection.
  {
    Tensor w = Alloc(DType::kBF16, {8192, 2048});
    FillRandom(w);
    for (int64_t t : {64, 4096}) {
      Tensor x = Alloc(DType::kBF16, {t, 2048}), y = Alloc(DType::kBF16, {t, 8192});
      FillRandom(x);
      const double us = TimeUs([&] { backend_->Linear(x, w, y); });
      std::printf("TIMING linear %lld x 2048 -> 8192: %.1f us (%.1f TFLOP/s)\n",
                  static_cast<long long>(t), us, 2.0 * t * 2048 * 8192 / us * 1e-6);
    }
  }
}

// MoE grouped GEMM at release dims (H 2048, I 512, top 8 over a 2560-expert bank) for T = 1 ..
// 4096, timed with CUDA events on a stream of our own (median of per-call times; routings
// rotate over 4 sets so repeated calls do not hit L2 for the same experts), and as graph
// replays. Bound: bytes of the touched experts' weights over 4.3 TB/s; FLOPs over 790 TFLOP/s.
TEST_F(CudaTimingTest, MoeGroupedGemmReleaseDims) {
  const int64_t h = 2048, inter = 512;
  const int e = 2560, k = 8, sets = 4;
  Tensor gu = Alloc(DType::kBF16, {e, 2 * inter, h}), dn = Alloc(DType::kBF16, {e, h, inter});
  FillRandom(gu);
  FillRandom(dn);
  backend_->Synchronize();
  cudaStream_t stream;
  ASSERT_EQ(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), cudaSuccess);
  void* scratch = nullptr;
  ASSERT_EQ(cudaMalloc(&scratch, cuda::MoeScratchBytes(4096, k, e, h, inter)), cudaSuccess);
  cudaEvent_t start, stop;
  cudaEventCreate(&start);
  cudaEventCreate(&stop);
  const char* tile = std::getenv("MOBIUS_MOE_TILE_N");
  const char* gemm = std::getenv("MOBIUS_MOE_GEMM");
  std::printf("MOE GEMM=%s TILE_N=%s\n", gemm != nullptr ? gemm : "tc",
              tile != nullptr ? tile : "auto");
  for (int64_t t : {1, 8, 64, 256, 4096}) {
    Tensor x = Alloc(DType::kBF16, {t, h}), out = Alloc(DType::kBF16, {t, h});
    FillRandom(x);
    FillRandom(out);
    std::vector<Tensor> ids, w;
    double touched_sum = 0;
    for (int s = 0; s < sets; ++s) {
      Tensor logits = Alloc(DType::kBF16, {t, e});
      FillRandom(logits);
      ids.push_back(Alloc(DType::kI32, {t, k}));
      w.push_back(Alloc(DType::kF32, {t, k}));
      backend_->TopKSoftmax(logits, k, true, ids.back(), w.back());
      std::vector<int32_t> host(t * k);
      backend_->CopyToHostI32(ids.back(), host.data());
      std::sort(host.begin(), host.end());
      touched_sum += std::unique(host.begin(), host.end()) - host.begin();
    }
    backend_->Synchronize();
    auto launch = [&](int s) {
      cuda::LaunchMoeExperts(
          static_cast<const uint16_t*>(x.raw()), static_cast<const int32_t*>(ids[s].raw()),
          static_cast<const float*>(w[s].raw()), static_cast<const uint16_t*>(gu.raw()),
          static_cast<const uint16_t*>(dn.raw()), t, k, e, 0, h, inter, scratch, nullptr,
          static_cast<uint16_t*>(out.raw()), stream);
    };
    const int iters = t >= 4096 ? 12 : 40;
    for (int i = 0; i < 2 * sets; ++i) launch(i % sets);
    std::vector<float> ms;
    for (int i = 0; i < iters; ++i) {
      cudaEventRecord(start, stream);
      launch(i % sets);
      cudaEventRecord(stop, stream);
      cudaEventSynchronize(stop);
      float v = 0;
      cudaEventElapsedTime(&v, start, stop);
      ms.push_back(v);
    }
    std::sort(ms.begin(), ms.end());
    const double us = ms[ms.size() / 2] * 1e3;
    // Graph replays: one graph per routing set, replayed in rotation, 10 per event pair.
    std::vector<cudaGraphExec_t> execs;
    for (int s = 0; s < sets; ++s) {
      cudaGraph_t g;
      ASSERT_EQ(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal), cudaSuccess);
      launch(s);
      ASSERT_EQ(cudaStreamEndCapture(stream, &g), cudaSuccess);
      cudaGraphExec_t exec;
      ASSERT_EQ(cudaGraphInstantiate(&exec, g, 0), cudaSuccess);
      cudaGraphDestroy(g);
      execs.push_back(exec);
    }
    std::vector<float> gms;
    for (int i = 0; i < 5; ++i) {
      cudaEventRecord(start, stream);
      for (int r = 0; r < 8; ++r) cudaGraphLaunch(execs[r % sets], stream);
      cudaEventRecord(stop, stream);
      cudaEventSynchronize(stop);
      float v = 0;
      cudaEventElapsedTime(&v, start, stop);
      gms.push_back(v / 8);
    }
    for (auto exec : execs) cudaGraphExecDestroy(exec);
    std::sort(gms.begin(), gms.end());
    const double gus = gms[gms.size() / 2] * 1e3;
    ASSERT_EQ(cudaGetLastError(), cudaSuccess);
    const double touched = touched_sum / sets;
    const double bytes = touched * 3.0 * h * inter * 2, flops = 2.0 * t * k * 3 * h * inter;
    const double bound_us = std::max(bytes / 4.3e6, flops / 790e6);
    std::printf(
        "MOE T=%5lld touched %6.0f: %9.1f us (graph %9.1f us) | %6.0f GB/s | %6.1f TFLOP/s | "
        "bound %7.1f us | graph/bound %5.2fx\n",
        static_cast<long long>(t), touched, us, gus, bytes / gus * 1e-3, flops / gus * 1e-6,
        bound_us, gus / bound_us);
  }
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  cudaFree(scratch);
  cudaStreamDestroy(stream);
}

}  // namespace
}  // namespace mobius::kernels
