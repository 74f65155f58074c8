#include "worker/model/parameter_layout.h"

#include <algorithm>
#include <deque>
#include <iterator>

#include "absl/strings/str_cat.h"

namespace mobius::worker {
namespace {

int64_t Product(const std::vector<int64_t>& shape) {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

// The checkpoint tensor `name` of `shape` is the whole parameter.
CheckpointLayout Whole(std::string name, std::vector<int64_t> shape) {
  const int64_t n = Product(shape);
  return CheckpointLayout{{CheckpointPiece{std::move(name), std::move(shape), 0, n, 0}}};
}

// Rows [row0, row0 + rows) of a matrix with `row_elems` elements per row.
SliceRun RowRange(int64_t row0, int64_t rows, int64_t row_elems) {
  return SliceRun{row0 * row_elems, rows * row_elems, 1, 0};
}
// Columns [col0, col0 + cols) of every row of a [rows, row_len] matrix starting at `base`.
SliceRun ColumnRange(int64_t base, int64_t rows, int64_t row_len, int64_t col0, int64_t cols) {
  return SliceRun{base + col0, cols, rows, row_len};
}

// The pieces of `full` (contiguous runs that together cover the unsharded parameter) that hold
// the elements `runs` select, placed back to back.
CheckpointLayout SliceLayout(const CheckpointLayout& full, const std::vector<SliceRun>& runs) {
  std::vector<const CheckpointPiece*> pieces;
  for (const CheckpointPiece& piece : full.pieces) pieces.push_back(&piece);
  std::sort(pieces.begin(), pieces.end(), [](const CheckpointPiece* a, const CheckpointPiece* b) {
    return a->target_offset < b->target_offset;
  });
  // The piece holding unsharded element `f`.
  auto containing = [&](int64_t f) -> size_t {
    auto it =
        std::upper_bound(pieces.begin(), pieces.end(), f,
                         [](int64_t v, const CheckpointPiece* p) { return v < p->target_offset; });
    return static_cast<size_t>(it - pieces.begin()) - 1;
  };
  CheckpointLayout out;
  int64_t local = 0;
  for (const SliceRun& run : runs) {
    const int64_t extent = (run.repeat - 1) * run.full_stride + run.count;
    const CheckpointPiece& first = *pieces[containing(run.full_offset)];
    if (run.full_offset + extent <= first.target_offset + first.count) {
      // The whole strided run lies in one piece: one strided piece.
      out.pieces.push_back({first.tensor, first.tensor_shape,
                            first.source_offset + (run.full_offset - first.target_offset),
                            run.count, local, run.repeat, run.full_stride, run.count});
      local += run.count * run.repeat;
      continue;
    }
    for (int64_t j = 0; j < run.repeat; ++j) {
      int64_t f = run.full_offset + j * run.full_stride, left = run.count;
      while (left > 0) {
        const CheckpointPiece& p = *pieces[containing(f)];
        const int64_t n = std::min(left, p.target_offset + p.count - f);
        out.pieces.push_back(
            {p.tensor, p.tensor_shape, p.source_offset + (f - p.target_offset), n, local});
        f += n;
        left -= n;
        local += n;
      }
    }
  }
  return out;
}

// Specs live in a deque while the list is built, so that a builder function can keep references
// to the specs it added (to shard them) while it adds more.
class LayoutBuilder {
 public:
  std::vector<ParameterSpec> Take() {
    return std::vector<ParameterSpec>(std::make_move_iterator(specs_.begin()),
                                      std::make_move_iterator(specs_.end()));
  }

  ParameterSpec& Add(std::string name, std::vector<int64_t> shape, ParameterRole role,
                     ParameterGroup group, Tensor* target) {
    ParameterSpec& spec = specs_.emplace_back();
    spec.name = std::move(name);
    spec.full_shape = shape;
    spec.shape = std::move(shape);
    spec.role = role;
    spec.group = group;
    spec.target = target;
    return spec;
  }
  // A parameter stored under one checkpoint name with the same element count.
  ParameterSpec& AddWhole(std::string name, std::vector<int64_t> shape, ParameterRole role,
                          ParameterGroup group, Tensor* target, std::string tensor,
                          std::vector<int64_t> tensor_shape) {
    ParameterSpec& spec = Add(std::move(name), std::move(shape), role, group, target);
    spec.layouts.push_back(Whole(std::move(tensor), std::move(tensor_shape)));
    return spec;
  }

 private:
  std::deque<ParameterSpec> specs_;
};

// Makes `spec` (whose layouts describe the unsharded parameter) hold only the elements `runs`
// select, as a tensor of `local_shape`. A no-op when that is the whole parameter.
void Shard(ParameterSpec& spec, std::vector<int64_t> local_shape, std::vector<SliceRun> runs) {
  // The whole parameter in its own order needs no slice (a permutation of rows, e.g. an expert
  // placement's router, keeps the full shape but still needs its runs).
  int64_t full = 1;
  for (int64_t d : spec.full_shape) full *= d;
  const bool identity =
      runs.size() == 1 && runs[0].full_offset == 0 && runs[0].repeat == 1 && runs[0].count == full;
  if (local_shape == spec.full_shape && (runs.empty() || identity)) return;
  for (CheckpointLayout& layout : spec.layouts) layout = SliceLayout(layout, runs);
  spec.shape = std::move(local_shape);
  spec.slice = std::move(runs);
}

// Experts of one bank (or of the MTP layer): fused 3-D tensors, or per-expert matrices.
// `dims` (null: unsharded) selects the rank's experts and intermediate columns.
// `order` (null: identity) is the bank's expert placement (expert_placement.h): the router's
// rows and the experts are taken in that order, and a rank's experts are positions
// [expert0, expert0 + num_experts) of it, then the positions of `replicas` (null: none).
void AddExperts(LayoutBuilder& b, const std::string& engine, const std::string& ckpt, int E, int I,
                int H, ParameterGroup group, int bank, ExpertBankWeights* w, const ShardDims* dims,
                const std::vector<int32_t>* order = nullptr,
                const std::vector<int32_t>* replicas = nullptr) {
  ParameterSpec& router = b.AddWhole(engine + ".router", {E, H}, ParameterRole::kRouter, group,
                                     w ? &w->router : nullptr, ckpt + ".gate.weight", {E, H});
  router.bank = bank;

  ParameterSpec& gate_up = b.Add(engine + ".gate_up", {E, 2 * I, H}, ParameterRole::kLinear, group,
                                 w ? &w->gate_up : nullptr);
  gate_up.bank = bank;
  gate_up.layouts.push_back(Whole(ckpt + ".experts.gate_up_proj", {E, 2 * I, H}));
  CheckpointLayout per_expert_gate_up;
  const int64_t mat = int64_t{I} * H;
  for (int e = 0; e < E; ++e) {
    const std::string prefix = absl::StrCat(ckpt, ".experts.", e);
    per_expert_gate_up.pieces.push_back(
        {prefix + ".gate_proj.weight", {I, H}, 0, mat, (2 * e) * mat});
    per_expert_gate_up.pieces.push_back(
        {prefix + ".up_proj.weight", {I, H}, 0, mat, (2 * e + 1) * mat});
  }
  gate_up.layouts.push_back(std::move(per_expert_gate_up));

  ParameterSpec& down =
      b.Add(engine + ".down", {E, H, I}, ParameterRole::kLinear, group, w ? &w->down : nullptr);
  down.bank = bank;
  down.layouts.push_back(Whole(ckpt + ".experts.down_proj", {E, H, I}));
  CheckpointLayout per_expert_down;
  for (int e = 0; e < E; ++e) {
    per_expert_down.pieces.push_back(
        {absl::StrCat(ckpt, ".experts.", e, ".down_proj.weight"), {H, I}, 0, mat, e * mat});
  }
  down.layouts.push_back(std::move(per_expert_down));

  if (order != nullptr) {
    std::vector<SliceRun> router_runs;
    for (int j = 0; j < E; ++j) router_runs.push_back(RowRange((*order)[j], 1, H));
    Shard(router, {E, H}, std::move(router_runs));
  }
  if (dims == nullptr && order == nullptr) return;
  const int e0 = dims ? dims->expert0 : 0, El = dims ? dims->num_experts : E;
  const int i0 = dims ? dims->moe_i0 : 0, Il = dims ? dims->moe_i : I;
  std::vector<int> positions(El);
  for (int j = 0; j < El; ++j) positions[j] = e0 + j;
  if (replicas != nullptr) positions.insert(positions.end(), replicas->begin(), replicas->end());
  const int held = static_cast<int>(positions.size());
  std::vector<SliceRun> gate_up_runs, down_runs;
  if (Il == I && order == nullptr && held == El) {
    gate_up_runs.push_back(RowRange(e0, El, 2 * mat));
    down_runs.push_back(RowRange(e0, El, mat));
  } else {
    for (int j : positions) {
      const int e = order != nullptr ? (*order)[j] : j;
      if (Il == I) {
        gate_up_runs.push_back(RowRange(e, 1, 2 * mat));
        down_runs.push_back(RowRange(e, 1, mat));
        continue;
      }
      gate_up_runs.push_back(RowRange(int64_t{e} * 2 * I + i0, Il, H));      // gate rows
      gate_up_runs.push_back(RowRange(int64_t{e} * 2 * I + I + i0, Il, H));  // up rows
      down_runs.push_back(ColumnRange(e * mat, H, I, i0, Il));
    }
  }
  Shard(gate_up, {held, 2 * Il, H}, std::move(gate_up_runs));
  Shard(down, {held, H, Il}, std::move(down_runs));
}

// SwiGLU from separate gate_proj / up_proj / down_proj matrices.
// With a shard, the rank holds intermediate columns [i0, i0 + Il) (gate, up and down alike).
struct IntermediateSlice {
  int i0 = 0, Il = 0;
};
void AddSwiGlu(LayoutBuilder& b, const std::string& engine, const std::string& ckpt, int I, int H,
               ParameterGroup group, SwiGluWeights* w, IntermediateSlice slice = {}) {
  ParameterSpec& gate_up = b.Add(engine + ".gate_up", {2 * I, H}, ParameterRole::kLinear, group,
                                 w ? &w->gate_up : nullptr);
  const int64_t mat = int64_t{I} * H;
  gate_up.layouts.push_back(CheckpointLayout{{{ckpt + ".gate_proj.weight", {I, H}, 0, mat, 0},
                                              {ckpt + ".up_proj.weight", {I, H}, 0, mat, mat}}});
  ParameterSpec& down = b.AddWhole(engine + ".down", {H, I}, ParameterRole::kLinear, group,
                                   w ? &w->down : nullptr, ckpt + ".down_proj.weight", {H, I});
  if (slice.Il == 0 || slice.Il == I) return;
  Shard(gate_up, {2 * slice.Il, H},
        {RowRange(slice.i0, slice.Il, H), RowRange(I + slice.i0, slice.Il, H)});
  Shard(down, {H, slice.Il}, {ColumnRange(0, H, I, slice.i0, slice.Il)});
}

// `dims` (null: unsharded) selects the rank's query heads (each with its gate) and kv heads.
void AddAttention(LayoutBuilder& b, const ModelConfig& c, const std::string& engine,
                  const std::string& ckpt, ParameterGroup group, AttentionWeights* w,
                  const ShardDims* dims) {
  const int H = c.hidden_size, nh = c.num_attention_heads, nkv = c.num_key_value_heads,
            hd = c.head_dim;
  const auto L = ParameterRole::kLinear;
  ParameterSpec& q =
      b.AddWhole(engine + ".q_proj", {2 * nh * hd, H}, L, group, w ? &w->q_proj : nullptr,
                 ckpt + ".q_proj.weight", {2 * nh * hd, H});
  ParameterSpec& k = b.AddWhole(engine + ".k_proj", {nkv * hd, H}, L, group,
                                w ? &w->k_proj : nullptr, ckpt + ".k_proj.weight", {nkv * hd, H});
  ParameterSpec& v = b.AddWhole(engine + ".v_proj", {nkv * hd, H}, L, group,
                                w ? &w->v_proj : nullptr, ckpt + ".v_proj.weight", {nkv * hd, H});
  ParameterSpec& o = b.AddWhole(engine + ".o_proj", {H, nh * hd}, L, group,
                                w ? &w->o_proj : nullptr, ckpt + ".o_proj.weight", {H, nh * hd});
  if (dims != nullptr) {
    const int q0 = dims->q_head0, nq = dims->num_q_heads, kv0 = dims->kv_head0,
              nkl = dims->num_kv_heads;
    // q_proj rows are per head [query (hd); gate (hd)], so a head range is one row range.
    Shard(q, {2 * nq * hd, H}, {RowRange(int64_t{q0} * 2 * hd, 2 * nq * hd, H)});
    Shard(k, {nkl * hd, H}, {RowRange(int64_t{kv0} * hd, nkl * hd, H)});
    Shard(v, {nkl * hd, H}, {RowRange(int64_t{kv0} * hd, nkl * hd, H)});
    Shard(o, {H, nq * hd}, {ColumnRange(0, H, nh * hd, int64_t{q0} * hd, nq * hd)});
  }
  b.AddWhole(engine + ".q_norm", {hd}, ParameterRole::kNorm1p, group, w ? &w->q_norm : nullptr,
             ckpt + ".q_norm.weight", {hd});
  b.AddWhole(engine + ".k_norm", {hd}, ParameterRole::kNorm1p, group, w ? &w->k_norm : nullptr,
             ckpt + ".k_norm.weight", {hd});
}

// `dims` (null: unsharded) selects the rank's key heads and value heads: q, k, v, z, b, a, conv
// rows, A_log and dt_bias each split by head separately; out_proj by its input columns.
void AddDeltaNet(LayoutBuilder& b, const ModelConfig& c, const std::string& engine,
                 const std::string& ckpt, DeltaNetWeights* w, const ShardDims* dims) {
  const int H = c.hidden_size, Hk = c.linear_num_key_heads, Hv = c.linear_num_value_heads,
            Dk = c.linear_key_head_dim, Dv = c.linear_value_head_dim, K = c.linear_conv_kernel_dim;
  const int kd = c.key_dim(), vd = c.value_dim(), cd = c.conv_dim(), r = Hv / Hk;
  const auto L = ParameterRole::kLinear;
  const auto G = ParameterGroup::kDense;

  // Qwen3-Next packs q, k, v, z (and b, a) interleaved per key-head group.
  const std::string qkvz = ckpt + ".in_proj_qkvz.weight";
  const std::string ba = ckpt + ".in_proj_ba.weight";
  const std::vector<int64_t> qkvz_shape = {2 * kd + 2 * vd, H};
  const std::vector<int64_t> ba_shape = {2 * Hv, H};
  const int64_t group_rows = 2 * Dk + 2 * r * Dv;
  CheckpointLayout qkv_interleaved, z_interleaved, b_interleaved, a_interleaved;
  for (int g = 0; g < Hk; ++g) {
    const int64_t src = g * group_rows * H;
    qkv_interleaved.pieces.push_back({qkvz, qkvz_shape, src, int64_t{Dk} * H, int64_t{g} * Dk * H});
    qkv_interleaved.pieces.push_back(
        {qkvz, qkvz_shape, src + int64_t{Dk} * H, int64_t{Dk} * H, int64_t{kd + g * Dk} * H});
    qkv_interleaved.pieces.push_back({qkvz, qkvz_shape, src + int64_t{2 * Dk} * H,
                                      int64_t{r} * Dv * H, int64_t{2 * kd + g * r * Dv} * H});
    z_interleaved.pieces.push_back({qkvz, qkvz_shape, src + int64_t{2 * Dk + r * Dv} * H,
                                    int64_t{r} * Dv * H, int64_t{g} * r * Dv * H});
    b_interleaved.pieces.push_back(
        {ba, ba_shape, int64_t{2 * g * r} * H, int64_t{r} * H, int64_t{g * r} * H});
    a_interleaved.pieces.push_back(
        {ba, ba_shape, int64_t{2 * g * r + r} * H, int64_t{r} * H, int64_t{g * r} * H});
  }
  const bool qwen = c.family == ModelFamily::kQwen3Next;
  auto add_two = [&](std::string name, std::vector<int64_t> shape, Tensor* target,
                     CheckpointLayout separate, CheckpointLayout interleaved) -> ParameterSpec& {
    ParameterSpec& spec = b.Add(std::move(name), std::move(shape), L, G, target);
    if (qwen) std::swap(separate, interleaved);
    spec.layouts.push_back(std::move(separate));
    spec.layouts.push_back(std::move(interleaved));
    return spec;
  };
  ParameterSpec& qkv =
      add_two(engine + ".in_proj_qkv", {cd, H}, w ? &w->in_proj_qkv : nullptr,
              Whole(ckpt + ".in_proj_qkv.weight", {cd, H}), std::move(qkv_interleaved));
  ParameterSpec& z = add_two(engine + ".in_proj_z", {vd, H}, w ? &w->in_proj_z : nullptr,
                             Whole(ckpt + ".in_proj_z.weight", {vd, H}), std::move(z_interleaved));
  ParameterSpec& bp = add_two(engine + ".in_proj_b", {Hv, H}, w ? &w->in_proj_b : nullptr,
                              Whole(ckpt + ".in_proj_b.weight", {Hv, H}), std::move(b_interleaved));
  ParameterSpec& ap = add_two(engine + ".in_proj_a", {Hv, H}, w ? &w->in_proj_a : nullptr,
                              Whole(ckpt + ".in_proj_a.weight", {Hv, H}), std::move(a_interleaved));
  ParameterSpec& conv = b.AddWhole(engine + ".conv1d", {cd, K}, ParameterRole::kConv, G,
                                   w ? &w->conv1d : nullptr, ckpt + ".conv1d.weight", {cd, 1, K});
  ParameterSpec& a_log = b.AddWhole(engine + ".a_log", {Hv}, ParameterRole::kALog, G,
                                    w ? &w->a_log : nullptr, ckpt + ".A_log", {Hv});
  ParameterSpec& dt_bias = b.AddWhole(engine + ".dt_bias", {Hv}, ParameterRole::kDtBias, G,
                                      w ? &w->dt_bias : nullptr, ckpt + ".dt_bias", {Hv});
  b.AddWhole(engine + ".norm", {Dv}, ParameterRole::kPlainNorm, G, w ? &w->norm : nullptr,
             ckpt + ".norm.weight", {Dv});
  ParameterSpec& out = b.AddWhole(engine + ".out_proj", {H, vd}, L, G, w ? &w->out_proj : nullptr,
                                  ckpt + ".out_proj.weight", {H, vd});
  if (dims == nullptr) return;
  const int k0 = dims->k_head0, Hkl = dims->num_k_heads, v0 = dims->v_head0,
            Hvl = dims->num_v_heads;
  const int cdl = 2 * Hkl * Dk + Hvl * Dv;
  // Conv channels (rows of in_proj_qkv and conv1d): the rank's q heads, k heads, then v heads.
  auto conv_rows = [&](int64_t row_elems) {
    return std::vector<SliceRun>{RowRange(int64_t{k0} * Dk, Hkl * Dk, row_elems),
                                 RowRange(kd + int64_t{k0} * Dk, Hkl * Dk, row_elems),
                                 RowRange(2 * kd + int64_t{v0} * Dv, Hvl * Dv, row_elems)};
  };
  Shard(qkv, {cdl, H}, conv_rows(H));
  Shard(conv, {cdl, K}, conv_rows(K));
  Shard(z, {Hvl * Dv, H}, {RowRange(int64_t{v0} * Dv, Hvl * Dv, H)});
  Shard(bp, {Hvl, H}, {RowRange(v0, Hvl, H)});
  Shard(ap, {Hvl, H}, {RowRange(v0, Hvl, H)});
  Shard(a_log, {Hvl}, {RowRange(v0, Hvl, 1)});
  Shard(dt_bias, {Hvl}, {RowRange(v0, Hvl, 1)});
  Shard(out, {H, Hvl * Dv}, {ColumnRange(0, H, vd, int64_t{v0} * Dv, Hvl * Dv)});
}

}  // namespace

int64_t ParameterSpec::numel() const { return Product(shape); }

std::string DefaultTensorPrefix(const ModelConfig& config) {
  return config.family == ModelFamily::kInternS2Mobius ? "model.language_model." : "model.";
}

// Bank b's expert order from the shard's placement; null for the contiguous placement.
static const std::vector<int32_t>* BankOrder(const LayoutOptions& options, int bank) {
  const ExpertPlacement* p = options.shard.placement.get();
  if (p == nullptr || bank >= p->num_banks()) return nullptr;
  return &p->order(bank);
}

// The positions of bank b this rank holds as replicas; null without any.
static const std::vector<int32_t>* BankReplicas(const LayoutOptions& options, int bank) {
  const ExpertPlacement* p = options.shard.placement.get();
  if (p == nullptr || bank >= p->num_banks() || p->replicas_per_rank() == 0) return nullptr;
  return &p->replicas(bank, options.shard.ep_rank);
}

std::vector<ParameterSpec> ListParameters(const ModelConfig& c, const LayoutOptions& options,
                                          ModelWeights* weights) {
  LayoutBuilder b;
  const int H = c.hidden_size, V = c.vocab_size;
  // An invalid shard (callers check ComputeShardDims first) lists the unsharded model.
  absl::StatusOr<ShardDims> shard_dims = ComputeShardDims(c, options.shard);
  const ShardDims* dims = options.shard.sharded() && shard_dims.ok() ? &*shard_dims : nullptr;
  const IntermediateSlice shared_slice =
      dims ? IntermediateSlice{dims->shared_i0, dims->shared_i} : IntermediateSlice{};
  const IntermediateSlice dense_slice =
      dims ? IntermediateSlice{dims->dense_i0, dims->dense_i} : IntermediateSlice{};
  const std::string& p = options.prefix;
  if (weights) {
    weights->layers.assign(c.num_hidden_layers, LayerWeights{});
    bool any_moe = false;
    for (MlpType t : c.mlp_types) any_moe |= t == MlpType::kMoe;
    weights->banks.assign(any_moe ? c.num_blocks : 0, ExpertBankWeights{});
  }

  b.AddWhole("embed", {V, H}, ParameterRole::kEmbedding, ParameterGroup::kEmbedding,
             weights ? &weights->embed : nullptr, p + "embed_tokens.weight", {V, H});
  for (int i = 0; i < c.num_hidden_layers; ++i) {
    LayerWeights* lw = weights ? &weights->layers[i] : nullptr;
    const std::string engine = absl::StrCat("layers.", i);
    const std::string ckpt = absl::StrCat(p, "layers.", i);
    b.AddWhole(engine + ".input_norm", {H}, ParameterRole::kNorm1p, ParameterGroup::kDense,
               lw ? &lw->input_norm : nullptr, ckpt + ".input_layernorm.weight", {H});
    if (c.layer_types[i] == LayerType::kLinearAttention) {
      if (lw) lw->linear.emplace();
      AddDeltaNet(b, c, engine + ".linear", ckpt + ".linear_attn", lw ? &*lw->linear : nullptr,
                  dims);
    } else {
      if (lw) lw->attention.emplace();
      AddAttention(b, c, engine + ".attention", ckpt + ".self_attn", ParameterGroup::kDense,
                   lw ? &*lw->attention : nullptr, dims);
    }
    b.AddWhole(engine + ".post_norm", {H}, ParameterRole::kNorm1p, ParameterGroup::kDense,
               lw ? &lw->post_norm : nullptr, ckpt + ".post_attention_layernorm.weight", {H});
    if (c.mlp_types[i] == MlpType::kMoe) {
      AddSwiGlu(b, engine + ".shared_expert", ckpt + ".mlp.shared_expert",
                c.shared_expert_intermediate_size, H, ParameterGroup::kDense,
                lw ? &lw->shared_expert : nullptr, shared_slice);
      b.AddWhole(engine + ".shared_expert_gate", {1, H}, ParameterRole::kLinear,
                 ParameterGroup::kDense, lw ? &lw->shared_expert_gate : nullptr,
                 ckpt + ".mlp.shared_expert_gate.weight", {1, H});
      // Qwen3-Next: every layer is its own bank, stored with the layer.
      if (c.family == ModelFamily::kQwen3Next) {
        AddExperts(b, absl::StrCat("banks.", i), ckpt + ".mlp", c.num_experts,
                   c.moe_intermediate_size, H, ParameterGroup::kRoutedExperts, i,
                   weights ? &weights->banks[i] : nullptr, dims, BankOrder(options, i),
                   BankReplicas(options, i));
      }
    } else {
      AddSwiGlu(b, engine + ".mlp", ckpt + ".mlp", c.intermediate_size, H, ParameterGroup::kDense,
                lw ? &lw->shared_expert : nullptr, dense_slice);
    }
  }
  if (c.family == ModelFamily::kInternS2Mobius) {
    for (int bank = 0; bank < c.num_blocks; ++bank) {
      AddExperts(b, absl::StrCat("banks.", bank), absl::StrCat(p, "meta_mlp.", bank), c.num_experts,
                 c.moe_intermediate_size, H, ParameterGroup::kRoutedExperts, bank,
                 weights ? &weights->banks[bank] : nullptr, dims, BankOrder(options, bank),
                 BankReplicas(options, bank));
    }
  }
  b.AddWhole("final_norm", {H}, ParameterRole::kNorm1p, ParameterGroup::kDense,
             weights ? &weights->final_norm : nullptr, p + "norm.weight", {H});
  if (!c.tie_word_embeddings) {
    b.AddWhole("lm_head", {V, H}, ParameterRole::kLinear, ParameterGroup::kLmHead,
               weights ? &weights->lm_head : nullptr, "lm_head.weight", {V, H});
  }

  if (options.include_mtp && c.mtp_num_hidden_layers > 0) {
    MtpWeights* m = nullptr;
    if (weights) m = &weights->mtp.emplace();
    const auto G = ParameterGroup::kMtp;
    b.AddWhole("mtp.fc", {H, 2 * H}, ParameterRole::kLinear, G, m ? &m->fc : nullptr,
               "mtp.fc.weight", {H, 2 * H});
    for (const char* norm : {"pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"}) {
      Tensor* t = nullptr;
      if (m) {
        t = std::string(norm) == "norm"                 ? &m->norm
            : std::string(norm) == "pre_fc_norm_hidden" ? &m->pre_fc_norm_hidden
                                                        : &m->pre_fc_norm_embedding;
      }
      b.AddWhole(absl::StrCat("mtp.", norm), {H}, ParameterRole::kNorm1p, G, t,
                 absl::StrCat("mtp.", norm, ".weight"), {H});
    }
    LayerWeights* lw = m ? &m->layer : nullptr;
    if (lw) lw->attention.emplace();
    b.AddWhole("mtp.layer.input_norm", {H}, ParameterRole::kNorm1p, G,
               lw ? &lw->input_norm : nullptr, "mtp.layers.0.input_layernorm.weight", {H});
    AddAttention(b, c, "mtp.layer.attention", "mtp.layers.0.self_attn", G,
                 lw ? &*lw->attention : nullptr, nullptr);
    b.AddWhole("mtp.layer.post_norm", {H}, ParameterRole::kNorm1p, G, lw ? &lw->post_norm : nullptr,
               "mtp.layers.0.post_attention_layernorm.weight", {H});
    AddSwiGlu(b, "mtp.layer.shared_expert", "mtp.layers.0.mlp.shared_expert",
              c.shared_expert_intermediate_size, H, G, lw ? &lw->shared_expert : nullptr);
    b.AddWhole("mtp.layer.shared_expert_gate", {1, H}, ParameterRole::kLinear, G,
               lw ? &lw->shared_expert_gate : nullptr, "mtp.layers.0.mlp.shared_expert_gate.weight",
               {1, H});
    AddExperts(b, "mtp.experts", "mtp.layers.0.mlp", c.mtp_num_experts, c.moe_intermediate_size, H,
               G, -1, m ? &m->experts : nullptr, nullptr);
  }
  return b.Take();
}

}  // namespace mobius::worker
