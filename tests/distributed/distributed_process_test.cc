// Replicas of real processes on loopback (UCX over TCP, rendezvous over gRPC): every collective
// with 2 and 4 ranks, a rank killed or stopped mid-run (the others must fail within 10 s, not
// hang), and a rank of a stale generation refused.
#include <fcntl.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <gtest/gtest.h>

#include <chrono>
#include <fstream>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "tests/util/child_process.h"

namespace {

using Clock = std::chrono::steady_clock;

// Below the ephemeral range and once per process (tests/util/child_process.h): a port from
// binding port 0 could be taken by an outgoing connection before the leader binds it.
using mobius::testing::FreePort;

struct Rank {
  pid_t pid = -1;
  std::string log;
  int status = -1;  // waitpid status once reaped
};

class Replica {
 public:
  Replica(int world, const std::string& scenario,
          std::vector<std::vector<std::string>> extra = {}) {
    const std::string leader = "127.0.0.1:" + std::to_string(FreePort());
    char dir[] = "/tmp/mobius-dist-XXXXXX";
    dir_ = mkdtemp(dir);
    for (int r = 0; r < world; ++r) {
      std::vector<std::string> args = {MOBIUS_RANK_BIN, "--rank=" + std::to_string(r),
                                       "--world_size=" + std::to_string(world),
                                       "--leader=" + leader, "--scenario=" + scenario};
      if (r < static_cast<int>(extra.size()))
        args.insert(args.end(), extra[r].begin(), extra[r].end());
      ranks_.push_back(Spawn(args, dir_ + "/rank" + std::to_string(r) + ".log"));
    }
  }
  ~Replica() {
    for (Rank& r : ranks_) {
      if (r.status == -1) {
        kill(r.pid, SIGKILL);
        waitpid(r.pid, nullptr, 0);
      }
    }
    std::system(("rm -rf " + dir_).c_str());
  }

  Rank& rank(int r) { return ranks_[r]; }
  int size() const { return static_cast<int>(ranks_.size()); }

  // Reaps rank r, waiting at most `limit`; false when it is still running.
  bool Wait(int r, std::chrono::milliseconds limit) {
    const auto end = Clock::now() + limit;
    while (Clock::now() < end) {
      if (waitpid(ranks_[r].pid, &ranks_[r].status, WNOHANG) == ranks_[r].pid) return true;
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
    ranks_[r].status = -1;
    return false;
  }

  std::string Log(int r) const {
    std::ifstream in(ranks_[r].log);
    std::stringstream ss;
    ss << in.rdbuf();
    return ss.str();
  }

  // Waits until every rank printed "ready" (the loop scenario runs).
  bool AllReady(std::chrono::milliseconds limit) {
    const auto end = Clock::now() + limit;
    while (Clock::now() < end) {
      int ready = 0;
      for (int r = 0; r < size(); ++r) ready += Log(r).find("ready") != std::string::npos;
      if (ready == size()) return true;
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
    return false;
  }

 private:
  static Rank Spawn(const std::vector<std::string>& args, const std::string& log) {
    Rank rank;
    rank.log = log;
    rank.pid = fork();
    if (rank.pid == 0) {
      int fd = open(log.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
      dup2(fd, 1);
      dup2(fd, 2);
      std::vector<char*> argv;
      for (const std::string& a : args) argv.push_back(const_cast<char*>(a.c_str()));
      argv.push_back(nullptr);
      execv(argv[0], argv.data());
      _exit(127);
    }
    return rank;
  }

  std::string dir_;
  std::vector<Rank> ranks_;
};

class CollectivesTest : public ::testing::TestWithParam<int> {};

TEST_P(CollectivesTest, EveryRankGetsTheExpectedValues) {
  Replica replica(GetParam(), "collectives");
  for (int r = 0; r < replica.size(); ++r) {
    ASSERT_TRUE(replica.Wait(r, std::chrono::seconds(20))) << "rank " << r << " hangs";
    EXPECT_TRUE(WIFEXITED(replica.rank(r).status) && WEXITSTATUS(replica.rank(r).status) == 0)
        << "rank " << r << ":\n"
        << replica.Log(r);
    EXPECT_NE(replica.Log(r).find("every collective matched"), std::string::npos);
    // Ranks leave cleanly: no heartbeat watch fires as they exit.
    EXPECT_EQ(replica.Log(r).find("on_failure"), std::string::npos) << replica.Log(r);
  }
}

INSTANTIATE_TEST_SUITE_P(Ranks, CollectivesTest, ::testing::Values(1, 2, 4));

// A rank dies (SIGKILL) or stalls (SIGSTOP) while the replica runs all-reduces: every other rank
// reports the group failed (on_failure, exit 3) within 10 s instead of hanging.
class RankFailureTest : public ::testing::TestWithParam<std::tuple<int, int>> {};

TEST_P(RankFailureTest, TheOthersFailFast) {
  const auto [signal, victim] = GetParam();
  Replica replica(3, "loop");
  ASSERT_TRUE(replica.AllReady(std::chrono::seconds(15))) << replica.Log(0);
  const auto killed_at = Clock::now();
  kill(replica.rank(victim).pid, signal);
  for (int r = 0; r < replica.size(); ++r) {
    if (r == victim) continue;
    ASSERT_TRUE(replica.Wait(r, std::chrono::seconds(10))) << "rank " << r << " hangs:\n"
                                                           << replica.Log(r);
    const auto took = std::chrono::duration<double>(Clock::now() - killed_at).count();
    EXPECT_TRUE(WIFEXITED(replica.rank(r).status) && WEXITSTATUS(replica.rank(r).status) == 3)
        << "rank " << r << ":\n"
        << replica.Log(r);
    EXPECT_NE(replica.Log(r).find("on_failure"), std::string::npos) << replica.Log(r);
    std::printf("rank %d failed %.2f s after rank %d got signal %d\n", r, took, victim, signal);
  }
}

INSTANTIATE_TEST_SUITE_P(Signals, RankFailureTest,
                         ::testing::Values(std::make_tuple(SIGKILL, 2), std::make_tuple(SIGKILL, 0),
                                           std::make_tuple(SIGSTOP, 1)));

TEST(Rendezvous, AStaleGenerationIsRefused) {
  Replica replica(2, "collectives",
                  {{"--generation=5", "--join_timeout_ms=1500"}, {"--generation=4"}});
  ASSERT_TRUE(replica.Wait(1, std::chrono::seconds(10)));
  EXPECT_EQ(WEXITSTATUS(replica.rank(1).status), 2);
  EXPECT_NE(replica.Log(1).find("generation 4; the group is at 5"), std::string::npos)
      << replica.Log(1);
  ASSERT_TRUE(replica.Wait(0, std::chrono::seconds(10)));  // the leader's join deadline
  EXPECT_EQ(WEXITSTATUS(replica.rank(0).status), 2);
  EXPECT_NE(replica.Log(0).find("missing ranks 1"), std::string::npos) << replica.Log(0);
}

}  // namespace
