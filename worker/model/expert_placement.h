// Which experts of each routed bank live on which rank of an expert-parallel replica (issue 5;
// docs/distributed.md "Expert placement").
//
// A placement is an order of every bank's experts: with W ranks, rank r holds the experts at
// positions [r E / W, (r + 1) E / W) of its bank's order. The contiguous placement is the
// identity. A load-aware placement orders experts so that each rank's share of the measured
// (token, expert) load is as even as the equal expert counts allow: the hot experts of a skewed
// routing end up on different ranks. Applying an order permutes the bank's expert weights and the
// rows of its router together (router output j is expert order[j]), so the model computes the
// same function: only which rank does the work changes (a top-k tie between two equal router
// logits may resolve differently, since ties go to the lower index).
//
// A placement may also replicate hot experts: a rank then holds up to R more positions of each
// bank beyond its range (replicas(bank, rank); its local bank has E / W + that many experts). The
// (token, position) pairs routed to a position held by n ranks are spread over them by token: the
// pair of step token t goes to holder t mod n (holders in rank order, the primary rank among them),
// so each pair is still computed exactly once and the sum over ranks is unchanged. RouteTable gives
// a rank the table that maps routed positions to its local expert slots (or to -1: another rank's
// pair).
#ifndef MOBIUS_WORKER_MODEL_EXPERT_PLACEMENT_H_
#define MOBIUS_WORKER_MODEL_EXPERT_PLACEMENT_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"

namespace mobius::worker {

class ExpertPlacement {
 public:
  // The identity order for `banks` banks of `experts` experts each.
  static ExpertPlacement Contiguous(int banks, int experts);
  // Balances loads[b][e] (non-negative, e.g. token counts) over `world` ranks holding E / world
  // experts each: heaviest expert first onto the rank with the least load that still has room
  // (ties: lower rank). Deterministic, so every rank computes the same placement from the same
  // loads. InvalidArgument when world does not divide the expert count, or loads are ragged or
  // negative.
  //
  // With replicas_per_rank = R > 0 it then gives ranks up to R replicas per bank, one at a time:
  // the position with the largest load per holder goes to the least-loaded rank that has a free
  // slot and does not hold it yet, when that rank then carries no more than the position's most
  // loaded holder (loads split evenly over holders; ties: lower position, lower rank); slots that
  // no copy would help stay empty, so a balanced load gets no replicas. InvalidArgument when R
  // exceeds the positions a rank does not hold.
  static absl::StatusOr<ExpertPlacement> BalanceLoads(const std::vector<std::vector<double>>& loads,
                                                      int world, int replicas_per_rank = 0);
  // A placement from explicit orders (validated against a model by ComputeShardDims), and
  // optionally replicas[bank][rank] (positions; see Validate).
  static ExpertPlacement FromOrders(std::vector<std::vector<int32_t>> orders,
                                    std::vector<std::vector<std::vector<int32_t>>> replicas = {}) {
    return ExpertPlacement(std::move(orders), std::move(replicas));
  }
  // Reads {"banks": [[load of expert 0, 1, ...], ...]} (one array per bank) and balances it.
  // Errors name the file and what is wrong.
  static absl::StatusOr<ExpertPlacement> FromLoadFile(const std::string& path, int world,
                                                      int replicas_per_rank = 0);

  [[nodiscard]] int num_banks() const { return static_cast<int>(order_.size()); }
  // Bank b's order: order(b)[j] is the expert at position j.
  [[nodiscard]] const std::vector<int32_t>& order(int bank) const { return order_[bank]; }
  // True for the contiguous placement (identity orders, no replicas).
  [[nodiscard]] bool identity() const;
  // The most replicas any rank holds in any bank (0: none).
  [[nodiscard]] int replicas_per_rank() const;
  // The positions `rank` holds beyond its range in `bank`, ascending (empty without replicas).
  [[nodiscard]] const std::vector<int32_t>& replicas(int bank, int rank) const;
  // Checks orders and replicas for `world` ranks and `experts` experts per bank: every order a
  // permutation, each rank's replicas distinct ascending positions outside its own range.
  absl::Status Validate(int world, int experts) const;
  // Rank's local expert slots of `bank`: its range, then its replicas (positions, in slot order).
  [[nodiscard]] std::vector<int32_t> HeldPositions(int bank, int world, int rank) const;
  // The routing of `rank` in `bank`: row j (a routed position) of a [E, world + 1] table holds
  // the number n of ranks holding j, then for each holder h < n (rank order) this rank's local
  // slot of j if holder h is this rank, else -1. Pair (t, j) -> table[j][1 + t mod n].
  [[nodiscard]] std::vector<int32_t> RouteTable(int bank, int world, int rank) const;
  // The largest share of `loads` on one rank divided by the mean share (1 = perfectly even),
  // for this placement over `world` ranks, summed over banks (a replicated position's load split
  // evenly over its holders).
  [[nodiscard]] double Imbalance(const std::vector<std::vector<double>>& loads, int world) const;

 private:
  ExpertPlacement(std::vector<std::vector<int32_t>> order,
                  std::vector<std::vector<std::vector<int32_t>>> replicas)
      : order_(std::move(order)), replicas_(std::move(replicas)) {}
  // Holders of each position of `bank`, in rank order.
  [[nodiscard]] std::vector<std::vector<int>> Holders(int bank, int world) const;

  std::vector<std::vector<int32_t>> order_;
  // replicas_[bank][rank]: ascending positions; empty (no banks) without replicas.
  std::vector<std::vector<std::vector<int32_t>>> replicas_;
};

}  // namespace mobius::worker

#endif  // MOBIUS_WORKER_MODEL_EXPERT_PLACEMENT_H_
