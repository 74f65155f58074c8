#include "worker/model/expert_placement.h"

#include <algorithm>
#include <fstream>
#include <numeric>
#include <sstream>
#include <utility>

#include "absl/strings/str_format.h"
#include "nlohmann/json.hpp"

namespace mobius::worker {

namespace {
const std::vector<int32_t>& NoReplicas() {
  static const std::vector<int32_t> empty;
  return empty;
}
}  // namespace

ExpertPlacement ExpertPlacement::Contiguous(int banks, int experts) {
  std::vector<std::vector<int32_t>> order(banks, std::vector<int32_t>(experts));
  for (auto& o : order) std::iota(o.begin(), o.end(), 0);
  return ExpertPlacement(std::move(order), {});
}

absl::StatusOr<ExpertPlacement> ExpertPlacement::BalanceLoads(
    const std::vector<std::vector<double>>& loads, int world, int replicas_per_rank) {
  if (world < 1) return absl::InvalidArgumentError(absl::StrFormat("world %d < 1", world));
  if (replicas_per_rank < 0) {
    return absl::InvalidArgumentError(
        absl::StrFormat("replicas per rank %d is negative", replicas_per_rank));
  }
  std::vector<std::vector<int32_t>> order;
  std::vector<std::vector<std::vector<int32_t>>> replicas;
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
    if (replicas_per_rank > 0) {
      if (replicas_per_rank > experts - capacity) {
        return absl::InvalidArgumentError(absl::StrFormat(
            "%d replicas per rank: a rank of %d has only %d experts it does not hold",
            replicas_per_rank, world, experts - capacity));
      }
      // Replicas, one at a time: the position with the most load per holder goes to the
      // least-loaded rank with room that does not hold it yet, if that rank then carries no more
      // than the position's most loaded holder (otherwise the copy would only move the peak); a
      // position that fails is not tried again. Slots no copy helps stay empty.
      std::vector<int> holders(experts, 1);
      std::vector<std::vector<char>> holds(world, std::vector<char>(experts, 0));
      for (int j = 0; j < experts; ++j) holds[j / capacity][j] = 1;
      std::vector<double> rank_load(world, 0.0);
      for (int j = 0; j < experts; ++j) rank_load[j / capacity] += load[o[j]];
      std::vector<std::vector<int32_t>> extra(world);
      std::vector<char> exhausted(experts, 0);
      for (;;) {
        int best_j = -1, best_r = -1;
        double best_share = 0;
        for (int j = 0; j < experts; ++j) {
          if (exhausted[j]) continue;
          const double share = load[o[j]] / holders[j];
          if (share <= best_share) continue;  // ties: lower position; zero load: never
          int r_min = -1;
          for (int r = 0; r < world; ++r) {
            if (holds[r][j] || static_cast<int>(extra[r].size()) == replicas_per_rank) continue;
            if (r_min < 0 || rank_load[r] < rank_load[r_min]) r_min = r;
          }
          if (r_min < 0) {
            exhausted[j] = 1;  // every rank with room holds it already
            continue;
          }
          best_share = share;
          best_j = j;
          best_r = r_min;
        }
        if (best_j < 0) break;
        const double new_share = load[o[best_j]] / (holders[best_j] + 1);
        double peak = 0;
        for (int r = 0; r < world; ++r) {
          if (holds[r][best_j]) peak = std::max(peak, rank_load[r]);
        }
        if (rank_load[best_r] + new_share > peak) {
          exhausted[best_j] = 1;
          continue;
        }
        for (int r = 0; r < world; ++r) {
          if (holds[r][best_j]) rank_load[r] -= best_share - new_share;
        }
        rank_load[best_r] += new_share;
        holds[best_r][best_j] = 1;
        ++holders[best_j];
        extra[best_r].push_back(best_j);
      }
      for (auto& e : extra) std::sort(e.begin(), e.end());
      replicas.push_back(std::move(extra));
    }
    order.push_back(std::move(o));
  }
  return ExpertPlacement(std::move(order), std::move(replicas));
}

int ExpertPlacement::replicas_per_rank() const {
  size_t most = 0;
  for (const auto& bank : replicas_) {
    for (const auto& rank : bank) most = std::max(most, rank.size());
  }
  return static_cast<int>(most);
}

const std::vector<int32_t>& ExpertPlacement::replicas(int bank, int rank) const {
  if (bank < 0 || bank >= static_cast<int>(replicas_.size()) || rank < 0 ||
      rank >= static_cast<int>(replicas_[bank].size())) {
    return NoReplicas();
  }
  return replicas_[bank][rank];
}

absl::Status ExpertPlacement::Validate(int world, int experts) const {
  for (size_t b = 0; b < order_.size(); ++b) {
    std::vector<int32_t> sorted = order_[b];
    std::sort(sorted.begin(), sorted.end());
    for (size_t j = 0; j < sorted.size(); ++j) {
      if (static_cast<int>(sorted.size()) != experts || sorted[j] != static_cast<int>(j)) {
        return absl::InvalidArgumentError(absl::StrFormat(
            "expert placement of bank %d is not an order of the bank's %d experts", b, experts));
      }
    }
  }
  if (replicas_.empty()) return absl::OkStatus();
  if (replicas_.size() != order_.size()) {
    return absl::InvalidArgumentError(
        absl::StrFormat("expert placement has replicas for %d banks, orders for %d",
                        replicas_.size(), order_.size()));
  }
  if (world < 1 || experts % world != 0) {
    return absl::InvalidArgumentError(
        absl::StrFormat("%d experts do not split evenly over %d ranks", experts, world));
  }
  const int per_rank = experts / world;
  for (size_t b = 0; b < replicas_.size(); ++b) {
    if (static_cast<int>(replicas_[b].size()) != world) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "expert placement of bank %d has replicas for %d ranks, the replica has %d", b,
          replicas_[b].size(), world));
    }
    for (int r = 0; r < world; ++r) {
      const std::vector<int32_t>& rep = replicas_[b][r];
      for (size_t i = 0; i < rep.size(); ++i) {
        if (rep[i] < 0 || rep[i] >= experts || rep[i] / per_rank == r ||
            (i > 0 && rep[i] <= rep[i - 1])) {
          return absl::InvalidArgumentError(absl::StrFormat(
              "expert placement of bank %d: rank %d's replica %d (position %d) is out of range, "
              "its own, or not ascending",
              b, r, i, rep[i]));
        }
      }
    }
  }
  return absl::OkStatus();
}

std::vector<int32_t> ExpertPlacement::HeldPositions(int bank, int world, int rank) const {
  const int experts = bank < num_banks() ? static_cast<int>(order_[bank].size()) : 0;
  const int per_rank = world > 0 ? experts / world : 0;
  std::vector<int32_t> held(per_rank);
  std::iota(held.begin(), held.end(), rank * per_rank);
  const std::vector<int32_t>& rep = replicas(bank, rank);
  held.insert(held.end(), rep.begin(), rep.end());
  return held;
}

std::vector<std::vector<int>> ExpertPlacement::Holders(int bank, int world) const {
  const int experts = static_cast<int>(order_[bank].size());
  const int per_rank = experts / world;
  std::vector<std::vector<int>> holders(experts);
  for (int j = 0; j < experts; ++j) holders[j].push_back(std::min(j / per_rank, world - 1));
  for (int r = 0; r < world; ++r) {
    for (int32_t j : replicas(bank, r)) {
      if (j >= 0 && j < experts) holders[j].push_back(r);
    }
  }
  for (auto& h : holders) std::sort(h.begin(), h.end());
  return holders;
}

std::vector<int32_t> ExpertPlacement::RouteTable(int bank, int world, int rank) const {
  const int experts = static_cast<int>(order_[bank].size());
  const std::vector<std::vector<int>> holders = Holders(bank, world);
  const std::vector<int32_t> held = HeldPositions(bank, world, rank);
  std::vector<int32_t> slot_of(experts, -1);
  for (size_t s = 0; s < held.size(); ++s) slot_of[held[s]] = static_cast<int32_t>(s);
  std::vector<int32_t> table(static_cast<size_t>(experts) * (world + 1), -1);
  for (int j = 0; j < experts; ++j) {
    int32_t* row = table.data() + static_cast<size_t>(j) * (world + 1);
    row[0] = static_cast<int32_t>(holders[j].size());
    for (size_t h = 0; h < holders[j].size(); ++h) {
      row[1 + h] = holders[j][h] == rank ? slot_of[j] : -1;
    }
  }
  return table;
}

absl::StatusOr<ExpertPlacement> ExpertPlacement::FromLoadFile(const std::string& path, int world,
                                                              int replicas_per_rank) {
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
  absl::StatusOr<ExpertPlacement> placement = BalanceLoads(loads, world, replicas_per_rank);
  if (!placement.ok()) {
    return absl::InvalidArgumentError(
        absl::StrFormat("expert load file %s: %s", path, placement.status().message()));
  }
  return placement;
}

bool ExpertPlacement::identity() const {
  if (replicas_per_rank() > 0) return false;
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
    const int experts = static_cast<int>(order_[b].size());
    if (world < 1 || experts < world) break;
    const std::vector<std::vector<int>> holders = Holders(static_cast<int>(b), world);
    for (int j = 0; j < experts; ++j) {
      const double l = loads[b][order_[b][j]];
      for (int r : holders[j]) total[r] += l / static_cast<double>(holders[j].size());
      all += l;
    }
  }
  if (all <= 0) return 1.0;
  return *std::max_element(total.begin(), total.end()) / (all / world);
}

}  // namespace mobius::worker
