#include "worker/model/expert_placement.h"

#include <algorithm>
#include <fstream>
#include <numeric>
#include <sstream>
#include <utility>

#include "absl/strings/str_format.h"
#include "nlohmann/json.hpp"

namespace mobius::worker {

ExpertPlacement ExpertPlacement::Contiguous(int banks, int experts) {
  std::vector<std::vector<int32_t>> order(banks, std::vector<int32_t>(experts));
  for (auto& o : order) std::iota(o.begin(), o.end(), 0);
  return ExpertPlacement(std::move(order));
}

absl::StatusOr<ExpertPlacement> ExpertPlacement::BalanceLoads(
    const std::vector<std::vector<double>>& loads, int world) {
  if (world < 1) return absl::InvalidArgumentError(absl::StrFormat("world %d < 1", world));
  std::vector<std::vector<int32_t>> order;
  for (size_t b = 0; b < loads.size(); ++b) {
    const auto& load = loads[b];
    const int experts = static_cast<int>(load.size());
    if (experts == 0 || experts % world != 0) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "bank %d: %d experts do not split evenly over %d ranks", b, experts, world));
    }
    if (b > 0 && load.size() != loads[0].size()) {
      return absl::InvalidArgumentError(absl::StrFormat("bank %d has %d experts, bank 0 has %d", b,
                                                        load.size(), loads[0].size()));
    }
    for (int e = 0; e < experts; ++e) {
      if (!(load[e] >= 0)) {
        return absl::InvalidArgumentError(absl::StrFormat(
            "bank %d expert %d: load %g is not a non-negative number", b, e, load[e]));
      }
    }
    std::vector<int32_t> by_load(experts);
    std::iota(by_load.begin(), by_load.end(), 0);
    std::stable_sort(by_load.begin(), by_load.end(),
                     [&](int32_t x, int32_t y) { return load[x] > load[y]; });
    const int capacity = experts / world;
    std::vector<std::vector<int32_t>> held(world);
    std::vector<double> total(world, 0.0);
    for (int32_t e : by_load) {
      int best = -1;
      for (int r = 0; r < world; ++r) {
        if (static_cast<int>(held[r].size()) == capacity) continue;
        if (best < 0 || total[r] < total[best]) best = r;
      }
      held[best].push_back(e);
      total[best] += load[e];
    }
    std::vector<int32_t> o;
    for (auto& h : held) {
      std::sort(h.begin(), h.end());  // within a rank, keep the checkpoint's order
      o.insert(o.end(), h.begin(), h.end());
    }
    order.push_back(std::move(o));
  }
  return ExpertPlacement(std::move(order));
}

absl::StatusOr<ExpertPlacement> ExpertPlacement::FromLoadFile(const std::string& path, int world) {
  std::ifstream in(path);
  if (!in) return absl::NotFoundError(absl::StrFormat("expert load file %s: cannot open", path));
  std::stringstream text;
  text << in.rdbuf();
  const nlohmann::json json = nlohmann::json::parse(text.str(), nullptr, false);
  if (json.is_discarded() || !json.is_object() || !json.contains("banks") ||
      !json["banks"].is_array()) {
    return absl::InvalidArgumentError(
        absl::StrFormat("expert load file %s: expected {\"banks\": [[load, ...], ...]}", path));
  }
  std::vector<std::vector<double>> loads;
  for (const auto& bank : json["banks"]) {
    if (!bank.is_array()) {
      return absl::InvalidArgumentError(
          absl::StrFormat("expert load file %s: bank %d is not an array", path, loads.size()));
    }
    std::vector<double> l;
    for (const auto& v : bank) {
      if (!v.is_number()) {
        return absl::InvalidArgumentError(absl::StrFormat(
            "expert load file %s: bank %d entry %d is not a number", path, loads.size(), l.size()));
      }
      l.push_back(v.get<double>());
    }
    loads.push_back(std::move(l));
  }
  absl::StatusOr<ExpertPlacement> placement = BalanceLoads(loads, world);
  if (!placement.ok()) {
    return absl::InvalidArgumentError(
        absl::StrFormat("expert load file %s: %s", path, placement.status().message()));
  }
  return placement;
}

bool ExpertPlacement::identity() const {
  for (const auto& o : order_) {
    for (size_t j = 0; j < o.size(); ++j) {
      if (o[j] != static_cast<int32_t>(j)) return false;
    }
  }
  return true;
}

double ExpertPlacement::Imbalance(const std::vector<std::vector<double>>& loads, int world) const {
  std::vector<double> total(world, 0.0);
  double all = 0;
  for (size_t b = 0; b < order_.size() && b < loads.size(); ++b) {
    const int per_rank = static_cast<int>(order_[b].size()) / world;
    for (size_t j = 0; j < order_[b].size(); ++j) {
      const double l = loads[b][order_[b][j]];
      total[std::min<int>(static_cast<int>(j) / per_rank, world - 1)] += l;
      all += l;
    }
  }
  if (all <= 0) return 1.0;
  return *std::max_element(total.begin(), total.end()) / (all / world);
}

}  // namespace mobius::worker
