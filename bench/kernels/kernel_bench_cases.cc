// mobius_kernel_bench's cases: every custom op of the CUDA backend at the release shapes of
// Intern-S2-Mobius 35B (or the smoke shapes), each with the bytes and FLOPs its bound counts and
// enough input sets to rotate past the L2.
#include <algorithm>
#include <array>
#include <cstdint>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "bench/kernels/kernel_bench.h"

namespace mobius::bench {
namespace {

std::string AlgoName(DeltaRuleAlgorithm a) {
  switch (a) {
    case DeltaRuleAlgorithm::kAuto:
      return "auto";
    case DeltaRuleAlgorithm::kRecurrent:
      return "recurrent";
    case DeltaRuleAlgorithm::kChunked:
      return "chunked";
  }
  return "?";
}

std::string K(int n) {  // 1024 -> "1K", 4096 -> "4K"
  return n % 1024 == 0 ? absl::StrFormat("%dK", n / 1024) : absl::StrFormat("%d", n);
}

}  // namespace

// Segments of `seqs` sequences of `len` new tokens after `cached` tokens, state slots from
// `slot0`, with `blocks_per_seq` blocks each taken from `table` starting at `table_off`.

SegmentSet MakeSegments(int seqs, int len, int cached, int slot0, int blocks_per_seq,
                        const std::vector<int32_t>* table, size_t table_off) {
  SegmentSet s;
  s.tables.resize(seqs);
  for (int i = 0; i < seqs; ++i) {
    if (table != nullptr) {
      s.tables[i].assign(table->begin() + table_off + static_cast<size_t>(i) * blocks_per_seq,
                         table->begin() + table_off + static_cast<size_t>(i + 1) * blocks_per_seq);
    }
  }
  for (int i = 0; i < seqs; ++i) {
    SequenceSegment g;
    g.token_begin = i * len;
    g.num_tokens = len;
    g.cached_tokens = cached;
    g.state_slot = slot0 + i;
    g.kv_blocks = s.tables[i];
    s.segs.push_back(g);
  }
  return s;
}

std::function<void()> Bench::Stager(std::shared_ptr<SegmentSet> segs, int64_t tokens,
                                    int max_positions) {
  auto ids = std::make_shared<std::vector<int32_t>>(static_cast<size_t>(tokens), 0);
  return [this, segs, ids, max_positions] { be_->StageStep(*ids, segs->segs, max_positions); };
}

Case Bench::DeltaRule(int seqs, int len, DeltaRuleAlgorithm algo) {
  const int64_t t = static_cast<int64_t>(seqs) * len;
  const int conv_dim = d_.conv_dim();
  const double state_bytes = 4.0 * d_.hv * d_.dk * d_.dv;
  Case c;
  c.op = "GatedDeltaRule";
  c.shape = absl::StrFormat("%d seq x %d tok, Hk %d Hv %d Dk %d Dv %d, %s", seqs, len, d_.hk, d_.hv,
                            d_.dk, d_.dv, AlgoName(algo));
  c.bytes = t * conv_dim * ActSize() + t * d_.hv * 8.0 + 2.0 * seqs * state_bytes +
            t * d_.hv * d_.dv * ActSize();
  // Recurrent form per token and value head: decay Dk*Dv, S^T k and the rank-1 update 2 Dk*Dv
  // each, o = S^T q 2 Dk*Dv (the chunked form does a little more, on tensor cores).
  c.flops = 7.0 * t * d_.hv * d_.dk * d_.dv;
  c.sets = Sets(c.bytes);
  // One step's segments for every set; each set has its own states (as each layer in the engine).
  struct Set {
    Tensor qkv, g, beta, states, out;
  };
  auto sets = std::make_shared<std::vector<Set>>();
  const int cached = len == 1 ? 100 : 0;
  auto segs = std::make_shared<SegmentSet>(MakeSegments(seqs, len, cached, 0, 0, nullptr, 0));
  for (int s = 0; s < c.sets; ++s) {
    Set x;
    x.qkv = Rand(act_, {t, conv_dim});
    x.g = Rand(DType::kF32, {t, d_.hv}, -0.5f, -0.01f);  // log-space decay
    x.beta = Rand(DType::kF32, {t, d_.hv}, 0.05f, 0.95f);
    x.states = Rand(DType::kF32, {seqs, d_.hv, d_.dk, d_.dv}, -0.05f, 0.05f);
    x.out = Act({t, d_.hv * d_.dv});
    sets->push_back(std::move(x));
  }
  const DeltaRuleDims dims{d_.hk, d_.hv, d_.dk, d_.dv};
  c.run = [this, sets, segs, dims, algo](int s) {
    Set& x = (*sets)[s];
    be_->GatedDeltaRule(x.qkv, x.g, x.beta, dims, x.states, segs->segs, algo, x.out);
  };
  c.stage = Stager(segs, t, cached + len);
  return c;
}

Case Bench::Conv(int seqs, int len) {
  const int64_t t = static_cast<int64_t>(seqs) * len;
  const int cd = d_.conv_dim();
  Case c;
  c.op = "CausalConv1dSilu";
  c.shape = absl::StrFormat("%d seq x %d tok, C %d, K %d", seqs, len, cd, d_.conv_k);
  c.bytes = 2.0 * t * cd * ActSize() + cd * d_.conv_k * ActSize() +
            2.0 * seqs * cd * (d_.conv_k - 1) * 4.0;
  c.flops = 2.0 * t * cd * d_.conv_k;
  c.sets = Sets(c.bytes);
  struct Set {
    Tensor x, states, out;
  };
  auto sets = std::make_shared<std::vector<Set>>();
  auto w = std::make_shared<Tensor>(Rand(act_, {cd, d_.conv_k}, -0.5f, 0.5f));
  const int cached = len == 1 ? 100 : 0;
  auto segs = std::make_shared<SegmentSet>(MakeSegments(seqs, len, cached, 0, 0, nullptr, 0));
  for (int s = 0; s < c.sets; ++s) {
    Set x;
    x.x = Rand(act_, {t, cd});
    x.states = Rand(DType::kF32, {seqs, cd, d_.conv_k - 1});
    x.out = Act({t, cd});
    sets->push_back(std::move(x));
  }
  c.run = [this, sets, segs, w](int s) {
    Set& x = (*sets)[s];
    be_->CausalConv1dSilu(x.x, *w, x.states, segs->segs, x.out);
  };
  c.stage = Stager(segs, t, cached + len);
  return c;
}

Case Bench::DeltaNetMixerStep(int seqs, int len) {
  const int64_t t = static_cast<int64_t>(seqs) * len;
  const int cd = d_.conv_dim(), vd = d_.hv * d_.dv;
  Case c;
  c.op = "GatedDeltaNetMixer";
  c.shape = absl::StrFormat("%d seq x %d tok, Hk %d Hv %d Dk %d Dv %d, conv K %d", seqs, len, d_.hk,
                            d_.hv, d_.dk, d_.dv, d_.conv_k);
  // In: q, k, v, z, a, b; the conv and norm weights; both states read and written. Out: the
  // normed rows and the gates.
  c.bytes = t * (cd + vd + 2.0 * d_.hv) * ActSize() + (cd * d_.conv_k + d_.dv) * ActSize() +
            2.0 * seqs * (cd * (d_.conv_k - 1) + static_cast<double>(d_.hv) * d_.dk * d_.dv) * 4.0 +
            t * vd * ActSize() + 2.0 * t * d_.hv * 4.0;
  c.flops = 2.0 * t * cd * d_.conv_k + 7.0 * t * d_.hv * d_.dk * d_.dv + 8.0 * t * vd;
  c.sets = Sets(c.bytes);
  struct Set {
    Tensor mixed, z, a, b, conv_states, states, g, beta, conv_out, core, out;
  };
  auto sets = std::make_shared<std::vector<Set>>();
  auto conv_w = std::make_shared<Tensor>(Rand(act_, {cd, d_.conv_k}, -0.5f, 0.5f));
  auto a_log = std::make_shared<Tensor>(Rand(act_, {d_.hv}, 0.f, 2.f));
  auto dt_bias = std::make_shared<Tensor>(Rand(act_, {d_.hv}, -1.f, 1.f));
  auto norm_w = std::make_shared<Tensor>(Rand(act_, {d_.dv}, 0.5f, 1.5f));
  auto segs = std::make_shared<SegmentSet>(MakeSegments(seqs, len, 100, 0, 0, nullptr, 0));
  for (int s = 0; s < c.sets; ++s) {
    Set x;
    x.mixed = Rand(act_, {t, cd});
    x.z = Rand(act_, {t, vd});
    x.a = Rand(act_, {t, d_.hv});
    x.b = Rand(act_, {t, d_.hv});
    x.conv_states = Rand(DType::kF32, {seqs, cd, d_.conv_k - 1});
    x.states = Rand(DType::kF32, {seqs, d_.hv, d_.dk, d_.dv}, -0.05f, 0.05f);
    x.g = F32({t, d_.hv});
    x.beta = F32({t, d_.hv});
    x.conv_out = Act({t, cd});
    x.core = Act({t, vd});
    x.out = Act({t, vd});
    sets->push_back(std::move(x));
  }
  const DeltaRuleDims dims{d_.hk, d_.hv, d_.dk, d_.dv};
  c.run = [this, sets, segs, dims, conv_w, a_log, dt_bias, norm_w](int s) {
    Set& x = (*sets)[s];
    const kernels::DeltaNetMixerOperands op{
        x.mixed, x.z,  x.a,           x.b,      *conv_w, *a_log, *dt_bias,   *norm_w,
        d_.eps,  dims, x.conv_states, x.states, x.g,     x.beta, x.conv_out, x.core};
    be_->GatedDeltaNetMixer(op, segs->segs, DeltaRuleAlgorithm::kAuto, x.out);
  };
  c.stage = Stager(segs, t, 100 + len);
  return c;
}

Case Bench::Attention(int seqs, int ctx, bool prefill, bool gated) {
  // Decode: each sequence has ctx - 1 cached positions and one new token (attends ctx positions).
  // Prefill: one sequence of ctx new tokens, causal. Gated: GatedPagedAttention (the output gate
  // in the attention's last write) instead of PagedAttention.
  const int len = prefill ? ctx : 1;
  const int cached = ctx - len;
  const int64_t t = static_cast<int64_t>(seqs) * len;
  const int blocks_per_seq = (ctx + d_.block - 1) / d_.block;
  const double kv_row = 2.0 * d_.nkv * d_.hd * ActSize();  // K and V of one position
  Case c;
  c.op = gated ? "GatedPagedAttention" : "PagedAttention";
  c.shape = absl::StrFormat("%d seq x %d tok, ctx %d, %d/%d heads, hd %d, block %d", seqs, len, ctx,
                            d_.nh, d_.nkv, d_.hd, d_.block);
  c.bytes = (gated ? 3.0 : 2.0) * t * d_.nh * d_.hd * ActSize() +
            static_cast<double>(seqs) * ctx * kv_row;
  // QK^T and PV: 4 FLOPs per (query head, attended position, dim).
  const double attended =
      prefill ? static_cast<double>(ctx) * (ctx + 1) / 2.0 : static_cast<double>(seqs) * ctx;
  c.flops = 4.0 * d_.nh * d_.hd * attended;
  c.sets = Sets(c.bytes);
  // One step's block tables (a random permutation) for every set; each set has its own K/V cache
  // (as each attention layer in the engine).
  const int num_blocks = seqs * blocks_per_seq;
  const std::vector<int32_t> table = Permutation(num_blocks);
  auto segs =
      std::make_shared<SegmentSet>(MakeSegments(seqs, len, cached, -1, blocks_per_seq, &table, 0));
  struct Set {
    Tensor q, gate, kc, vc, out;
  };
  auto sets = std::make_shared<std::vector<Set>>();
  for (int s = 0; s < c.sets; ++s) {
    Set x;
    x.q = Rand(act_, {t, d_.nh, d_.hd});
    if (gated) x.gate = Rand(act_, {t, d_.nh, d_.hd});
    x.kc = Rand(act_, {num_blocks, d_.block, d_.nkv, d_.hd});
    x.vc = Rand(act_, {num_blocks, d_.block, d_.nkv, d_.hd});
    x.out = Act({t, d_.nh, d_.hd});
    sets->push_back(std::move(x));
  }
  const float scale = 1.0f / std::sqrt(static_cast<float>(d_.hd));
  c.run = [this, sets, segs, scale, gated](int s) {
    Set& x = (*sets)[s];
    if (gated) {
      be_->GatedPagedAttention(x.q, x.gate, x.kc, x.vc, segs->segs, scale, x.out);
    } else {
      be_->PagedAttention(x.q, x.kc, x.vc, segs->segs, scale, x.out);
    }
  };
  c.stage = Stager(segs, t, ctx);
  return c;
}

std::shared_ptr<std::pair<Tensor, Tensor>> Bench::MoeBank() {
  const int64_t h = d_.hidden, inter = d_.inter, e = d_.experts;
  if (!moe_bank_) {
    moe_bank_ = std::make_shared<std::pair<Tensor, Tensor>>(
        Rand(act_, {e, 2 * inter, h}, -0.03f, 0.03f), Rand(act_, {e, h, inter}, -0.03f, 0.03f));
  }
  return moe_bank_;
}

Case Bench::Moe(int tokens, int experts, int topk) {
  const int64_t h = d_.hidden, inter = d_.inter;
  const int64_t e = experts > 0 ? experts : d_.experts, k = topk > 0 ? topk : d_.topk;
  // Another bank size gets a bank of its own, freed with the case.
  auto bank = e == d_.experts ? MoeBank()
                              : std::make_shared<std::pair<Tensor, Tensor>>(
                                    Rand(act_, {e, 2 * inter, h}, -0.03f, 0.03f),
                                    Rand(act_, {e, h, inter}, -0.03f, 0.03f));
  const double expert_bytes = 3.0 * inter * h * ActSize();
  Case c;
  c.op = "MoeExperts";
  c.sets = 0;
  struct Set {
    Tensor x, ids, weights, out;
  };
  auto sets = std::make_shared<std::vector<Set>>();
  // Uniform routing: k distinct experts per token. Sets until 4 x L2 of touched weights.
  double touched_sum = 0;
  int touched_first = 0;
  std::vector<char> seen(e);
  while (c.sets == 0 || (c.sets < 64 && touched_sum < rotate_bytes_ && cuda_) ||
         (!cuda_ && c.sets < 2)) {
    std::vector<int32_t> ids(tokens * k);
    std::vector<float> w(tokens * k);
    std::fill(seen.begin(), seen.end(), 0);
    int touched = 0;
    for (int t = 0; t < tokens; ++t) {
      std::vector<int32_t> pick;
      while (static_cast<int64_t>(pick.size()) < k) {
        const int32_t id = static_cast<int32_t>(rng_() % e);
        if (std::find(pick.begin(), pick.end(), id) == pick.end()) pick.push_back(id);
      }
      float sum = 0;
      for (int j = 0; j < k; ++j) {
        ids[t * k + j] = pick[j];
        w[t * k + j] = 0.05f + static_cast<float>(rng_() % 1000) / 1000.f;
        sum += w[t * k + j];
        if (!seen[pick[j]]) ++touched;
        seen[pick[j]] = 1;
      }
      for (int j = 0; j < k; ++j) w[t * k + j] /= sum;
    }
    Set x;
    x.x = Rand(act_, {tokens, h});
    x.ids = Ints(ids, {tokens, k});
    x.weights = F32({tokens, k});
    be_->CopyFromHost(w.data(), DType::kF32, x.weights);
    x.out = Rand(act_, {tokens, h});
    sets->push_back(std::move(x));
    if (c.sets == 0) touched_first = touched;
    touched_sum += touched * expert_bytes;
    ++c.sets;
  }
  c.shape = absl::StrFormat("%d tok, top-%d of %d experts (%d touched), H %d, I %d", tokens, k, e,
                            touched_first, h, inter);
  c.note = absl::StrFormat("touched %d", touched_first);
  c.bytes = touched_sum / c.sets + tokens * h * ActSize() * 3.0 + tokens * k * 8.0;
  c.flops = 2.0 * tokens * k * 3.0 * inter * h;
  c.run = [this, sets, bank](int s) {
    Set& x = (*sets)[s];
    be_->MoeExperts(x.x, x.ids, x.weights, bank->first, bank->second, 0, x.out, {});
  };
  return c;
}

Case Bench::RoutedMoeShared(int tokens) {
  const int64_t h = d_.hidden, inter = d_.inter, e = d_.experts, k = d_.topk;
  const int64_t si = d_.shared_inter;
  const auto bank = MoeBank();
  const double expert_bytes = 3.0 * inter * h * ActSize();
  Case c;
  c.op = "RoutedMoeWithSharedExpert";
  c.sets = 0;
  struct Set {
    Tensor logits, x, ids, weights, shared_gate_up, shared_down, gate, act, shared, out;
  };
  auto sets = std::make_shared<std::vector<Set>>();
  // Random router logits; the experts they pick are counted on the host for the bound. Each set
  // has its own shared expert (2 MB at release shapes), as each layer does, so that it is not
  // read from L2.
  std::uniform_real_distribution<float> logit(-4.f, 4.f);
  std::vector<int32_t> order(e);
  std::vector<char> seen(e);
  double touched_sum = 0;
  int touched_first = 0;
  while (c.sets == 0 || (c.sets < 64 && touched_sum < rotate_bytes_ && cuda_) ||
         (!cuda_ && c.sets < 2)) {
    std::vector<float> logits(tokens * e);
    for (float& v : logits) v = logit(rng_);
    std::fill(seen.begin(), seen.end(), 0);
    int touched = 0;
    for (int t = 0; t < tokens; ++t) {
      const float* row = &logits[static_cast<size_t>(t) * e];
      for (int32_t i = 0; i < e; ++i) order[i] = i;
      std::partial_sort(order.begin(), order.begin() + k, order.end(),
                        [row](int32_t a, int32_t b) { return row[a] > row[b]; });
      for (int j = 0; j < k; ++j) {
        if (!seen[order[j]]) ++touched;
        seen[order[j]] = 1;
      }
    }
    Set x;
    x.logits = F32({tokens, e});
    be_->CopyFromHost(logits.data(), DType::kF32, x.logits);
    x.x = Rand(act_, {tokens, h});
    x.ids = Alloc(DType::kI32, {tokens, k});
    x.weights = F32({tokens, k});
    x.shared_gate_up = Rand(act_, {tokens, 2 * si}, -3.f, 3.f);
    x.shared_down = Rand(act_, {h, si}, -0.03f, 0.03f);
    x.gate = Rand(DType::kF32, {tokens, 1}, -3.f, 3.f);
    x.act = Act({tokens, si});
    x.shared = Act({tokens, h});
    x.out = Act({tokens, h});
    sets->push_back(std::move(x));
    if (c.sets == 0) touched_first = touched;
    touched_sum += touched * expert_bytes + static_cast<double>(h) * si * ActSize();
    ++c.sets;
  }
  c.shape = absl::StrFormat(
      "%d tok, top-%d of %d experts (%d touched), H %d, I %d, shared I %d, router logits fp32",
      tokens, k, e, touched_first, h, inter, si);
  c.note = absl::StrFormat("touched %d", touched_first);
  c.bytes = touched_sum / c.sets + tokens * e * 4.0 + tokens * (3.0 * h + 2.0 * si) * ActSize() +
            tokens * k * 8.0;
  c.flops = 2.0 * tokens * (k * 3.0 * inter + si) * h;
  c.run = [this, sets, bank, k](int s) {
    Set& x = (*sets)[s];
    const kernels::SharedExpertOperands shared{x.shared_gate_up, x.shared_down, x.gate, x.act,
                                               x.shared};
    be_->RoutedMoeWithSharedExpert(x.x, x.logits, static_cast<int>(k), true, x.ids, x.weights,
                                   bank->first, bank->second, 0, shared, x.out, {});
  };
  return c;
}

Case Bench::Linear(int m, int n, int k) {
  Case c;
  c.op = "Linear";
  c.shape = absl::StrFormat("[%d, %d] x [%d, %d]^T (cuBLASLt)", m, k, n, k);
  c.bytes = (static_cast<double>(m) * k + static_cast<double>(n) * k + static_cast<double>(m) * n) *
            ActSize();
  c.flops = 2.0 * m * static_cast<double>(n) * k;
  c.sets = Sets(c.bytes);
  auto w = std::make_shared<std::vector<Tensor>>();
  auto x = std::make_shared<std::vector<Tensor>>();
  auto y = std::make_shared<std::vector<Tensor>>();
  for (int s = 0; s < c.sets; ++s) {
    x->push_back(Rand(act_, {m, k}));
    w->push_back(Rand(act_, {n, k}, -0.05f, 0.05f));
    y->push_back(Act({m, n}));
  }
  c.run = [this, x, w, y](int s) { be_->Linear((*x)[s], (*w)[s], (*y)[s]); };
  return c;
}

// Several projections of one input through Backend::LinearFanOut (bf16 outputs).
Case Bench::LinearFanOut(int m, std::vector<int> ns, int k) {
  Case c;
  c.op = "LinearFanOut";
  double n_total = 0;
  for (int n : ns) n_total += n;
  c.shape = absl::StrFormat("[%d, %d] x %d weights [%s, %d]^T", m, k, ns.size(),
                            absl::StrJoin(ns, "|"), k);
  c.bytes = (static_cast<double>(m) * k + n_total * k + m * n_total) * ActSize();
  c.flops = 2.0 * m * n_total * k;
  c.sets = Sets(c.bytes);
  struct Set {
    Tensor x;
    std::vector<Tensor> w, y;
  };
  auto v = std::make_shared<std::vector<Set>>();
  for (int s = 0; s < c.sets; ++s) {
    Set set;
    set.x = Rand(act_, {m, k});
    for (int n : ns) {
      set.w.push_back(Rand(act_, {n, k}, -0.05f, 0.05f));
      set.y.push_back(Act({m, n}));
    }
    v->push_back(std::move(set));
  }
  c.run = [this, v](int s) {
    Set& set = (*v)[s];
    std::vector<const Tensor*> ws;
    std::vector<Tensor*> ys;
    for (size_t i = 0; i < set.w.size(); ++i) {
      ws.push_back(&set.w[i]);
      ys.push_back(&set.y[i]);
    }
    be_->LinearFanOut(set.x, ws, ys);
  };
  return c;
}

void Bench::BuildSpecs() {
  const Dims& d = d_;
  // Gated DeltaNet.
  for (int b : d.decode_batches) {
    Add(absl::StrFormat("gdr.decode.B%d", b),
        [=, this] { return DeltaRule(b, 1, DeltaRuleAlgorithm::kAuto); });
  }
  for (auto algo :
       {DeltaRuleAlgorithm::kAuto, DeltaRuleAlgorithm::kRecurrent, DeltaRuleAlgorithm::kChunked}) {
    Add(absl::StrFormat("gdr.prefill.1x%s.%s", K(d.prefill), AlgoName(algo)),
        [=, this] { return DeltaRule(1, d.prefill, algo); });
    Add(absl::StrFormat("gdr.prefill.%dx%s.%s", d.multi_seqs, K(d.multi_len), AlgoName(algo)),
        [=, this] { return DeltaRule(d.multi_seqs, d.multi_len, algo); });
  }
  std::vector<int> conv_batches = {d.decode_batches.front(),
                                   d.decode_batches[d.decode_batches.size() / 2],
                                   d.decode_batches.back()};
  conv_batches.erase(std::unique(conv_batches.begin(), conv_batches.end()), conv_batches.end());
  for (int b : conv_batches) {
    Add(absl::StrFormat("conv.decode.B%d", b), [=, this] { return Conv(b, 1); });
  }
  for (int b : d.decode_batches) {
    Add(absl::StrFormat("deltanet_mixer.decode.B%d", b),
        [=, this] { return DeltaNetMixerStep(b, 1); });
  }
  // A speculative verify step with 4 drafts at batch 1.
  Add("deltanet_mixer.verify.1x5", [=, this] { return DeltaNetMixerStep(1, 5); });
  Add(absl::StrFormat("conv.prefill.1x%s", K(d.prefill)), [=, this] { return Conv(1, d.prefill); });
  Add(absl::StrFormat("conv.prefill.%dx%s", d.multi_seqs, K(d.multi_len)),
      [=, this] { return Conv(d.multi_seqs, d.multi_len); });
  for (int t : d.rows) {
    Add(absl::StrFormat("gates.T%d", t), [=, this] {
      Case c;
      c.op = "DeltaRuleGates";
      c.shape = absl::StrFormat("[%d, %d]", t, d.hv);
      c.bytes = 2.0 * t * d.hv * ActSize() + 2.0 * d.hv * ActSize() + 2.0 * t * d.hv * 4;
      c.flops = 10.0 * t * d.hv;
      c.sets = Sets(c.bytes);
      auto a_log = std::make_shared<Tensor>(Rand(act_, {d.hv}, -1.f, 1.f));
      auto dt_bias = std::make_shared<Tensor>(Rand(act_, {d.hv}, -1.f, 1.f));
      auto v = std::make_shared<std::vector<std::array<Tensor, 4>>>();
      for (int s = 0; s < c.sets; ++s) {
        v->push_back(
            {Rand(act_, {t, d.hv}), Rand(act_, {t, d.hv}), F32({t, d.hv}), F32({t, d.hv})});
      }
      c.run = [this, v, a_log, dt_bias](int s) {
        auto& x = (*v)[s];
        be_->DeltaRuleGates(x[0], x[1], *a_log, *dt_bias, x[2], x[3]);
      };
      return c;
    });
    Add(absl::StrFormat("gated_rmsnorm.T%d", t), [=, this] {
      const int64_t r = static_cast<int64_t>(t) * d.hv;
      Case c;
      c.op = "GatedRmsNorm";
      c.shape = absl::StrFormat("[%d, %d] (T %d x Hv %d)", r, d.dv, t, d.hv);
      c.bytes = 3.0 * r * d.dv * ActSize() + d.dv * ActSize();
      c.flops = 8.0 * r * d.dv;
      c.sets = Sets(c.bytes);
      auto w = std::make_shared<Tensor>(Rand(act_, {d.dv}, 0.5f, 1.5f));
      auto v = std::make_shared<std::vector<std::array<Tensor, 3>>>();
      for (int s = 0; s < c.sets; ++s) {
        v->push_back({Rand(act_, {r, d.dv}), Rand(act_, {r, d.dv}), Act({r, d.dv})});
      }
      c.run = [this, v, w, d](int s) {
        auto& x = (*v)[s];
        be_->GatedRmsNorm(x[0], x[1], *w, d.eps, x[2]);
      };
      return c;
    });
  }
  // Gated attention.
  for (int t : d.rows) {
    const bool decode = t == d.rows.front();
    Add(absl::StrFormat("qknorm_rope.T%d", t), [=, this] {
      Case c;
      c.op = "QkNormRope";
      c.shape = absl::StrFormat("%s, q_gate [%d, %d, %d], k [%d, %d, %d], rotary %d",
                                decode ? "decode" : "prefill", t, d.nh, 2 * d.hd, t, d.nkv, d.hd,
                                d.rotary);
      c.bytes = (static_cast<double>(t) * d.nh * 2 * d.hd + 2.0 * t * d.nkv * d.hd +
                 2.0 * t * d.nh * d.hd + 2.0 * d.hd) *
                ActSize();
      c.flops = 10.0 * t * (d.nh + d.nkv) * d.hd;
      c.sets = Sets(c.bytes);
      struct Set {
        Tensor qg, k, q, gate;
      };
      auto v = std::make_shared<std::vector<Set>>();
      auto qn = std::make_shared<Tensor>(Rand(act_, {d.hd}, -0.1f, 0.1f));
      auto kn = std::make_shared<Tensor>(Rand(act_, {d.hd}, -0.1f, 0.1f));
      auto segs = std::make_shared<SegmentSet>(decode ? MakeSegments(t, 1, 1000, -1, 0, nullptr, 0)
                                                      : MakeSegments(1, t, 0, -1, 0, nullptr, 0));
      for (int s = 0; s < c.sets; ++s) {
        Set x;
        x.qg = Rand(act_, {t, d.nh, 2 * d.hd});
        x.k = Rand(act_, {t, d.nkv, d.hd});
        x.q = Act({t, d.nh, d.hd});
        x.gate = Act({t, d.nh, d.hd});
        v->push_back(std::move(x));
      }
      const RopeParams rope{d.rotary, d.rope_theta};
      c.run = [this, v, segs, qn, kn, rope, d](int s) {
        Set& x = (*v)[s];
        be_->QkNormRope(x.qg, x.k, *qn, *kn, d.eps, rope, segs->segs, x.q, x.gate);
      };
      c.stage = Stager(segs, t, decode ? 1001 : t);
      return c;
    });
    // The engine's form of the two above: one launch (Backend::QkNormRopeWriteKv).
    Add(absl::StrFormat("qknorm_rope_write_kv.T%d", t), [=, this] {
      const int seqs = decode ? t : 1, len = decode ? 1 : t, cached = decode ? 1000 : 0;
      const int bps = (cached + len + d.block - 1) / d.block;
      Case c;
      c.op = "QkNormRopeWriteKv";
      c.shape = absl::StrFormat("%s, q_gate [%d, %d, %d], k/v [%d, %d, %d], rotary %d, block %d",
                                decode ? "decode" : "prefill", t, d.nh, 2 * d.hd, t, d.nkv, d.hd,
                                d.rotary, d.block);
      // q_gate read, q and gate written; k read and written back, v read, both cache rows
      // written.
      c.bytes = (static_cast<double>(t) * d.nh * 2 * d.hd + 2.0 * t * d.nh * d.hd +
                 5.0 * t * d.nkv * d.hd + 2.0 * d.hd) *
                ActSize();
      c.flops = 10.0 * t * (d.nh + d.nkv) * d.hd;
      c.sets = Sets(c.bytes);
      const int num_blocks = seqs * bps;
      const std::vector<int32_t> table = Permutation(num_blocks);
      auto segs = std::make_shared<SegmentSet>(MakeSegments(seqs, len, cached, -1, bps, &table, 0));
      struct Set {
        Tensor qg, k, v, q, gate, kc, vc;
      };
      auto v = std::make_shared<std::vector<Set>>();
      auto qn = std::make_shared<Tensor>(Rand(act_, {d.hd}, -0.1f, 0.1f));
      auto kn = std::make_shared<Tensor>(Rand(act_, {d.hd}, -0.1f, 0.1f));
      for (int s = 0; s < c.sets; ++s) {
        Set x;
        x.qg = Rand(act_, {t, d.nh, 2 * d.hd});
        x.k = Rand(act_, {t, d.nkv, d.hd});
        x.v = Rand(act_, {t, d.nkv, d.hd});
        x.q = Act({t, d.nh, d.hd});
        x.gate = Act({t, d.nh, d.hd});
        x.kc = Act({num_blocks, d.block, d.nkv, d.hd});
        x.vc = Act({num_blocks, d.block, d.nkv, d.hd});
        v->push_back(std::move(x));
      }
      const RopeParams rope{d.rotary, d.rope_theta};
      c.run = [this, v, segs, qn, kn, rope, d](int s) {
        Set& x = (*v)[s];
        be_->QkNormRopeWriteKv(x.qg, x.k, x.v, *qn, *kn, d.eps, rope, segs->segs, x.q, x.gate, x.kc,
                               x.vc);
      };
      c.stage = Stager(segs, t, cached + len);
      return c;
    });
    Add(absl::StrFormat("write_kv.T%d", t), [=, this] {
      const int seqs = decode ? t : 1, len = decode ? 1 : t, cached = decode ? 1000 : 0;
      const int bps = (cached + len + d.block - 1) / d.block;
      Case c;
      c.op = "WriteKvCache";
      c.shape = absl::StrFormat("%s, k/v [%d, %d, %d], block %d", decode ? "decode" : "prefill", t,
                                d.nkv, d.hd, d.block);
      c.bytes = 4.0 * t * d.nkv * d.hd * ActSize();
      c.flops = 0;
      c.sets = Sets(c.bytes);
      // One step's block tables for every set, a K/V cache per set (as per layer in the engine).
      const int num_blocks = seqs * bps;
      const std::vector<int32_t> table = Permutation(num_blocks);
      auto segs = std::make_shared<SegmentSet>(MakeSegments(seqs, len, cached, -1, bps, &table, 0));
      struct Set {
        Tensor k, v, kc, vc;
      };
      auto v = std::make_shared<std::vector<Set>>();
      for (int s = 0; s < c.sets; ++s) {
        Set x;
        x.k = Rand(act_, {t, d.nkv, d.hd});
        x.v = Rand(act_, {t, d.nkv, d.hd});
        x.kc = Act({num_blocks, d.block, d.nkv, d.hd});
        x.vc = Act({num_blocks, d.block, d.nkv, d.hd});
        v->push_back(std::move(x));
      }
      c.run = [this, v, segs](int s) {
        Set& x = (*v)[s];
        be_->WriteKvCache(x.k, x.v, segs->segs, x.kc, x.vc);
      };
      c.stage = Stager(segs, t, cached + len);
      return c;
    });
  }
  for (int b : d.decode_batches) {
    for (int ctx : d.contexts) {
      Add(absl::StrFormat("attn.decode.B%d.ctx%s", b, K(ctx)),
          [=, this] { return Attention(b, ctx, false); });
      // The engine's form: the output gate applied in the attention's last write (against
      // attn.decode + mul_sigmoid).
      Add(absl::StrFormat("attn.decode_gated.B%d.ctx%s", b, K(ctx)),
          [=, this] { return Attention(b, ctx, false, /*gated=*/true); });
    }
  }
  Add(absl::StrFormat("attn.prefill.1x%s", K(d.prefill)),
      [=, this] { return Attention(1, d.prefill, true); });
  for (int t : d.rows) {
    Add(absl::StrFormat("mul_sigmoid.T%d", t), [=, this] {
      const int64_t n = static_cast<int64_t>(d.nh) * d.hd;
      Case c;
      c.op = "MulSigmoid";
      c.shape = absl::StrFormat("[%d, %d]", t, n);
      c.bytes = 3.0 * t * n * ActSize();
      c.flops = 4.0 * t * n;
      c.sets = Sets(c.bytes);
      auto v = std::make_shared<std::vector<std::array<Tensor, 2>>>();
      for (int s = 0; s < c.sets; ++s) v->push_back({Rand(act_, {t, n}), Rand(act_, {t, n})});
      c.run = [this, v](int s) { be_->MulSigmoid((*v)[s][0], (*v)[s][1]); };
      return c;
    });
  }
  // MoE. Top-k over fp32 logits, as the engine's router writes them, from one token to a long
  // prefill (the block- and warp-per-token kernels cross over in between; MOBIUS_TOPK).
  for (int t : d.topk_tokens) {
    Add(absl::StrFormat("topk_softmax.T%d", t), [=, this] {
      Case c;
      c.op = "TopKSoftmax";
      c.shape = absl::StrFormat("[%d, %d] fp32, k %d", t, d.experts, d.topk);
      c.bytes = static_cast<double>(t) * d.experts * 4.0 + 8.0 * t * d.topk;
      c.flops = 4.0 * t * d.experts;
      c.sets = Sets(c.bytes);
      auto v = std::make_shared<std::vector<std::array<Tensor, 3>>>();
      for (int s = 0; s < c.sets; ++s) {
        v->push_back({Rand(DType::kF32, {t, d.experts}, -4.f, 4.f), Alloc(DType::kI32, {t, d.topk}),
                      F32({t, d.topk})});
      }
      c.run = [this, v, d](int s) {
        auto& x = (*v)[s];
        be_->TopKSoftmax(x[0], d.topk, true, x[1], x[2]);
      };
      return c;
    });
  }
  for (int t : d.moe_tokens) {
    Add(absl::StrFormat("moe.T%d", t), [=, this] { return Moe(t); });
  }
  // Qwen3-Next's bank (512 experts, top-10, the same H and I) at prefill sizes: 40-160 pairs an
  // expert, the 64- and 128-token tiles' regime, where the products rather than the weights set
  // the time.
  if (d.experts > 512) {
    for (int t : {2048, 3072, 4096, 8192}) {
      Add(absl::StrFormat("moe.E512k10.T%d", t), [=, this] { return Moe(t, 512, 10); });
    }
  }
  // The decode batches where the shared expert's down projection moves between kernels (the
  // gate-up kernel at 1-3 tokens, beside the top-k at 4-8).
  for (int t : {1, 4, 8}) {
    Add(absl::StrFormat("moe_shared.T%d", t), [=, this] { return RoutedMoeShared(t); });
  }
  // Dense. The norms also at one row: the one-block kernel between a decode step's projections.
  std::vector<int> norm_rows = d.rows;
  norm_rows.insert(norm_rows.begin(), 1);
  for (int t : norm_rows) {
    Add(absl::StrFormat("rmsnorm1p.T%d", t), [=, this] {
      Case c;
      c.op = "RmsNorm1p";
      c.shape = absl::StrFormat("[%d, %d]", t, d.hidden);
      c.bytes = 2.0 * t * d.hidden * ActSize() + d.hidden * ActSize();
      c.flops = 4.0 * t * d.hidden;
      c.sets = Sets(c.bytes);
      auto w = std::make_shared<Tensor>(Rand(act_, {d.hidden}, -0.1f, 0.1f));
      auto v = std::make_shared<std::vector<std::array<Tensor, 2>>>();
      for (int s = 0; s < c.sets; ++s)
        v->push_back({Rand(act_, {t, d.hidden}), Act({t, d.hidden})});
      c.run = [this, v, w, d](int s) { be_->RmsNorm1p((*v)[s][0], *w, d.eps, (*v)[s][1]); };
      return c;
    });
    Add(absl::StrFormat("add_rmsnorm1p.T%d", t), [=, this] {
      Case c;
      c.op = "AddRmsNorm1p";
      c.shape = absl::StrFormat("[%d, %d]", t, d.hidden);
      c.bytes = 4.0 * t * d.hidden * ActSize() + d.hidden * ActSize();
      c.flops = 5.0 * t * d.hidden;
      c.sets = Sets(c.bytes);
      auto w = std::make_shared<Tensor>(Rand(act_, {d.hidden}, -0.1f, 0.1f));
      auto v = std::make_shared<std::vector<std::array<Tensor, 3>>>();
      for (int s = 0; s < c.sets; ++s) {
        v->push_back({Rand(act_, {t, d.hidden}), Rand(act_, {t, d.hidden}), Act({t, d.hidden})});
      }
      c.run = [this, v, w, d](int s) {
        auto& x = (*v)[s];
        be_->AddRmsNorm1p(x[0], x[1], *w, d.eps, x[2]);
      };
      return c;
    });
    Add(absl::StrFormat("add.T%d", t), [=, this] {
      Case c;
      c.op = "Add";
      c.shape = absl::StrFormat("[%d, %d]", t, d.hidden);
      c.bytes = 3.0 * t * d.hidden * ActSize();
      c.flops = 1.0 * t * d.hidden;
      c.sets = Sets(c.bytes);
      auto v = std::make_shared<std::vector<std::array<Tensor, 2>>>();
      for (int s = 0; s < c.sets; ++s) {
        v->push_back({Rand(act_, {t, d.hidden}), Rand(act_, {t, d.hidden}, -1e-3f, 1e-3f)});
      }
      c.run = [this, v](int s) { be_->Add((*v)[s][0], (*v)[s][1]); };
      return c;
    });
    Add(absl::StrFormat("add_sigmoid_scaled.T%d", t), [=, this] {
      Case c;
      c.op = "AddSigmoidScaled";
      c.shape = absl::StrFormat("[%d, %d], gate [%d, 1]", t, d.hidden, t);
      c.bytes = 3.0 * t * d.hidden * ActSize() + t * ActSize();
      c.flops = 2.0 * t * d.hidden;
      c.sets = Sets(c.bytes);
      auto v = std::make_shared<std::vector<std::array<Tensor, 3>>>();
      for (int s = 0; s < c.sets; ++s) {
        v->push_back({Rand(act_, {t, d.hidden}), Rand(act_, {t, d.hidden}, -1e-3f, 1e-3f),
                      Rand(act_, {t, 1}, -2.f, 2.f)});
      }
      c.run = [this, v](int s) {
        auto& x = (*v)[s];
        be_->AddSigmoidScaled(x[0], x[1], x[2]);
      };
      return c;
    });
    Add(absl::StrFormat("silu_mul.T%d", t), [=, this] {
      Case c;
      c.op = "SiluAndMul";
      c.shape = absl::StrFormat("[%d, %d] -> [%d, %d]", t, 2 * d.shared_inter, t, d.shared_inter);
      c.bytes = 3.0 * t * d.shared_inter * ActSize();
      c.flops = 6.0 * t * d.shared_inter;
      c.sets = Sets(c.bytes);
      auto v = std::make_shared<std::vector<std::array<Tensor, 2>>>();
      for (int s = 0; s < c.sets; ++s) {
        v->push_back({Rand(act_, {t, 2 * d.shared_inter}), Act({t, d.shared_inter})});
      }
      c.run = [this, v](int s) { be_->SiluAndMul((*v)[s][0], (*v)[s][1]); };
      return c;
    });
    Add(absl::StrFormat("embedding.T%d", t), [=, this] {
      Case c;
      c.op = "EmbeddingLookup";
      c.shape = absl::StrFormat("%d ids, table [%d, %d]", t, d.vocab, d.hidden);
      c.bytes = 2.0 * t * d.hidden * ActSize() + 4.0 * t;
      c.flops = 0;
      c.sets = Sets(c.bytes);
      auto table = std::make_shared<Tensor>(Rand(act_, {d.vocab, d.hidden}));
      struct Set {
        std::vector<int32_t> ids;
        Tensor out;
      };
      auto v = std::make_shared<std::vector<Set>>();
      for (int s = 0; s < c.sets; ++s) {
        Set x;
        for (int i = 0; i < t; ++i) x.ids.push_back(static_cast<int32_t>(rng_() % d.vocab));
        x.out = Act({t, d.hidden});
        v->push_back(std::move(x));
      }
      c.run = [this, v, table](int s) { be_->EmbeddingLookup((*v)[s].ids, *table, (*v)[s].out); };
      return c;
    });
    Add(absl::StrFormat("gather_rows.T%d", t), [=, this] {
      Case c;
      c.op = "GatherRows";
      c.shape = absl::StrFormat("%d of %d rows of %d", t, t, d.hidden);
      c.bytes = 2.0 * t * d.hidden * ActSize() + 4.0 * t;
      c.flops = 0;
      c.sets = Sets(c.bytes);
      struct Set {
        std::vector<int32_t> rows;
        Tensor x, out;
      };
      auto v = std::make_shared<std::vector<Set>>();
      for (int s = 0; s < c.sets; ++s) {
        Set x;
        x.rows = Permutation(t);
        x.x = Rand(act_, {t, d.hidden});
        x.out = Act({t, d.hidden});
        v->push_back(std::move(x));
      }
      c.run = [this, v](int s) { be_->GatherRows((*v)[s].x, (*v)[s].rows, (*v)[s].out); };
      return c;
    });
  }
  // Dense projections through cuBLASLt, for reference (the in-projection of a DeltaNet layer is
  // [T, 2048] -> 12352; 8192 is a round stand-in), the lm_head, and the matrix-rate probe.
  const int in_proj = 2 * d.hk * d.dk + 2 * d.hv * d.dv + 2 * d.hv;
  for (int t : {1, d.rows.front(), d.rows.back()}) {
    Add(absl::StrFormat("linear.%dx%dx%d", t, in_proj, d.hidden),
        [=, this] { return Linear(t, in_proj, d.hidden); });
  }
  // The DeltaNet out-projection at decode batches 1 and 8 (K = 4096: split K in the skinny
  // kernel) and the in-projection at batch 8.
  for (int t : {1, 8}) {
    Add(absl::StrFormat("linear.%dx%dx%d", t, d.hidden, d.hv * d.dv),
        [=, this] { return Linear(t, d.hidden, d.hv * d.dv); });
  }
  Add(absl::StrFormat("linear.%dx%dx%d", 8, in_proj, d.hidden),
      [=, this] { return Linear(8, in_proj, d.hidden); });
  // The fan-outs of a decode step (skinny kernel at 1 row, tensor-core GEMV at 2-32, at 33-40
  // under MOBIUS_TC_GEMV_MAX_ROWS=40; 12-40 rows are also verify steps of 2-8 sequences): a
  // DeltaNet layer's four in-projections, and the shared expert's gate_up + its gate + the
  // router.
  for (int t : {1, 2, 4, 8, 12, 16, 24, 32, 40}) {
    Add(absl::StrFormat("fanout.deltanet_in.T%d", t), [=, this] {
      return LinearFanOut(t, {2 * d.hk * d.dk + d.hv * d.dv, d.hv * d.dv, d.hv, d.hv}, d.hidden);
    });
    Add(absl::StrFormat("fanout.ffn_in.T%d", t), [=, this] {
      return LinearFanOut(t, {2 * d.shared_inter, 1, d.experts}, d.hidden);
    });
  }
  // Single projections through the skinny kernel (a fan-out of one), beside linear.* (cuBLASLt):
  // the DeltaNet out-projection and the shared expert's down projection at batch 1.
  for (int t : {1, 4, 8, 12, 16, 24, 32, 40}) {
    Add(absl::StrFormat("fanout.single.%dx%dx%d", t, d.hidden, d.hv * d.dv),
        [=, this] { return LinearFanOut(t, {d.hidden}, d.hv * d.dv); });
  }
  Add("fanout.single.1x2048x512",
      [=, this] { return LinearFanOut(1, {d.hidden}, d.shared_inter); });
  Add("linear.1x2048x512", [=, this] { return Linear(1, d.hidden, d.shared_inter); });
  Add(absl::StrFormat("linear.lm_head.%dx%dx%d", 1, d.vocab, d.hidden),
      [=, this] { return Linear(1, d.vocab, d.hidden); });
  Add(absl::StrFormat("linear.%dx%dx%d", d.gemm, d.gemm, d.gemm),
      [=, this] { return Linear(d.gemm, d.gemm, d.gemm); });
  // Tokens from fp32 logits: the greedy argmax and draws under sampling rules (temperature alone:
  // the walk over the whole row; top-k 50 with top-p 0.95: bins, candidate sort and the rule;
  // uniform logits would leave a top-p nucleus too wide for the kernel's sort), each with its
  // copy of the tokens to the host (SampleRows returns them there). Bytes: the logits, read once
  // (the kernels read a row three times; the rereads may hit L2).
  for (int b : d.decode_batches) {
    Add(absl::StrFormat("argmax_rows.B%d", b), [=, this] {
      Case c;
      c.op = "ArgmaxRows";
      c.shape = absl::StrFormat("[%d, %d] fp32", b, d.vocab);
      c.bytes = 4.0 * b * d.vocab;
      c.sets = Sets(c.bytes);
      auto v = std::make_shared<std::vector<std::array<Tensor, 2>>>();
      for (int s = 0; s < c.sets; ++s) {
        v->push_back({Rand(DType::kF32, {b, d.vocab}, -8.f, 8.f), Alloc(DType::kI32, {b})});
      }
      c.run = [this, v](int s) { be_->ArgmaxRows((*v)[s][0], (*v)[s][1]); };
      return c;
    });
    // Plain draws, and (".check") each row checking a draft as a speculative verify row does
    // (the draft's probability and a draw from the rest; truncated: the kept set sorted again).
    for (const bool truncated : {false, true}) {
      for (const bool check : {false, true}) {
        Add(absl::StrFormat("sample_rows.B%d.%s%s", b, truncated ? "top_k_top_p" : "temperature",
                            check ? ".check" : ""),
            [=, this] {
              Case c;
              c.op = "SampleRows";
              c.shape = absl::StrFormat("[%d, %d] fp32, T 0.8%s%s", b, d.vocab,
                                        truncated ? ", top-k 50, top-p 0.95" : "",
                                        check ? ", drafts checked" : "");
              c.bytes = 4.0 * b * d.vocab;
              c.sets = Sets(c.bytes);
              auto v = std::make_shared<std::vector<Tensor>>();
              for (int s = 0; s < c.sets; ++s)
                v->push_back(Rand(DType::kF32, {b, d.vocab}, -8.f, 8.f));
              auto rules = std::make_shared<std::vector<kernels::SamplingRule>>(
                  b, truncated ? kernels::SamplingRule{0.8f, 50, 0.95f, 0.0f}
                               : kernels::SamplingRule{0.8f, 0, 1.0f, 0.0f});
              auto uniforms = std::make_shared<std::vector<double>>(b);
              auto drafts = std::make_shared<std::vector<int32_t>>();
              for (int i = 0; i < b; ++i) {
                (*uniforms)[i] = (i + 0.5) / b;
                if (check) drafts->push_back((i * 7919) % d.vocab);
              }
              auto out = std::make_shared<std::vector<kernels::DrawnToken>>(b);
              c.run = [this, v, rules, uniforms, drafts, out](int s) {
                be_->SampleRows((*v)[s], *rules, *uniforms, *drafts, *out);
              };
              return c;
            });
      }
    }
    // Penalties over 1000 seen tokens a row (repetition 1.1, frequency 0.5, presence 0.3), in
    // place; bytes: the entries uploaded and each penalised logit read and written.
    Add(absl::StrFormat("penalize_rows.B%d", b), [=, this] {
      constexpr int kSeen = 1000;
      Case c;
      c.op = "PenalizeRows";
      c.shape = absl::StrFormat("[%d, %d] fp32, %d seen tokens a row", b, d.vocab, kSeen);
      c.bytes = (8.0 + 8.0) * b * kSeen;
      c.sets = Sets(4.0 * b * d.vocab);
      auto v = std::make_shared<std::vector<Tensor>>();
      for (int s = 0; s < c.sets; ++s) v->push_back(Rand(DType::kF32, {b, d.vocab}, -8.f, 8.f));
      auto tokens = std::make_shared<std::vector<int32_t>>();
      auto counts = std::make_shared<std::vector<int32_t>>();
      for (int i = 0; i < b; ++i) {
        for (int j = 0; j < kSeen; ++j) {
          tokens->push_back(static_cast<int32_t>((int64_t{i} * 31 + int64_t{j} * 97) % d.vocab));
          counts->push_back(j % 3 == 0 ? 1 + j % 4 : 0);
        }
      }
      auto rows = std::make_shared<std::vector<kernels::LogitPenalties>>();
      for (int i = 0; i < b; ++i) {
        rows->push_back({1.1f,
                         0.5f,
                         0.3f,
                         std::span<const int32_t>(*tokens).subspan(int64_t{i} * kSeen, kSeen),
                         std::span<const int32_t>(*counts).subspan(int64_t{i} * kSeen, kSeen),
                         {},
                         {}});
      }
      c.run = [this, v, tokens, counts, rows](int s) { be_->PenalizeRows((*v)[s], *rows); };
      return c;
    });
    // A structured-output mask a row (a JSON string's with the Qwen3 tokenizer: 151,669 ids,
    // every 32nd of them not allowed, none past them), in place; bytes: the masks uploaded and
    // each banned logit written.
    Add(absl::StrFormat("penalize_rows.B%d.masked", b), [=, this] {
      constexpr int kTokenizerVocab = 151669;
      auto mask = std::make_shared<std::vector<uint64_t>>((d.vocab + 63) / 64, 0);
      int64_t banned = 0;
      for (int t = 0; t < d.vocab; ++t) {
        const bool allowed = t < kTokenizerVocab && t % 32 != 31;
        if (allowed) (*mask)[t / 64] |= uint64_t{1} << (t % 64);
        banned += !allowed;
      }
      Case c;
      c.op = "PenalizeRows";
      c.shape = absl::StrFormat("[%d, %d] fp32, a %d-word mask a row", b, d.vocab, mask->size());
      c.bytes = (8.0 * mask->size() + 4.0 * banned) * b;
      c.sets = Sets(4.0 * b * d.vocab);
      auto v = std::make_shared<std::vector<Tensor>>();
      for (int s = 0; s < c.sets; ++s) v->push_back(Rand(DType::kF32, {b, d.vocab}, -8.f, 8.f));
      auto rows = std::make_shared<std::vector<kernels::LogitPenalties>>(b);
      for (kernels::LogitPenalties& p : *rows) p.allowed_mask = *mask;
      c.run = [this, v, mask, rows](int s) { be_->PenalizeRows((*v)[s], *rows); };
      return c;
    });
    // The 5 best tokens of every row for top-n logprobs, with the copy to the host.
    Add(absl::StrFormat("top_logits_rows.B%d.n5", b), [=, this] {
      Case c;
      c.op = "TopLogitsRows";
      c.shape = absl::StrFormat("[%d, %d] fp32, 5 a row", b, d.vocab);
      c.bytes = 4.0 * b * d.vocab;
      c.sets = Sets(c.bytes);
      auto v = std::make_shared<std::vector<Tensor>>();
      for (int s = 0; s < c.sets; ++s) v->push_back(Rand(DType::kF32, {b, d.vocab}, -8.f, 8.f));
      auto counts = std::make_shared<std::vector<int32_t>>(b, 5);
      auto chosen = std::make_shared<std::vector<int32_t>>(b, 0);
      auto out = std::make_shared<std::vector<kernels::TokenLogit>>(int64_t{b} * 5);
      auto chosen_logits = std::make_shared<std::vector<float>>(b);
      c.run = [this, v, counts, chosen, out, chosen_logits](int s) {
        be_->TopLogitsRows((*v)[s], *counts, *chosen, *out, *chosen_logits);
      };
      return c;
    });
  }
}

}  // namespace mobius::bench
