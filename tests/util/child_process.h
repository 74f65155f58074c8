// Helpers for tests that run the project's binaries as real processes on loopback: a child
// process that is killed if the test forgets it, a free port, and a grpc.health.v1 probe.
#ifndef MOBIUS_TESTS_UTIL_CHILD_PROCESS_H_
#define MOBIUS_TESTS_UTIL_CHILD_PROCESS_H_

#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <mutex>
#include <set>
#include <string>
#include <vector>

#include "grpc/health/v1/health.grpc.pb.h"
#include "grpcpp/client_context.h"

namespace mobius::testing {

// A port that is free right now and that the kernel does not hand out by itself. Ports from
// binding port 0 come from the ephemeral range, which every outgoing connection (gRPC clients,
// UCX between the ranks of a replica) also draws from, so a port handed out that way could be
// taken before the server bound it (CI: "cannot serve metrics on ...: Address already in use"
// with tests running in parallel). So ports come from below the ephemeral range, each process
// starting at its own offset (from its pid) and walking up, and a number is handed out once per
// process; a port counts as free when a bind to it succeeds.
inline int FreePort() {
  static std::mutex mu;
  static std::set<int> given;
  static int next = -1;
  constexpr int kLow = 10000;
  std::lock_guard<std::mutex> lock(mu);
  static const int high = [] {  // the first ephemeral port (Linux default 32768)
    int low = 32768, top = 60999;
    if (FILE* f = std::fopen("/proc/sys/net/ipv4/ip_local_port_range", "r")) {
      if (std::fscanf(f, "%d %d", &low, &top) != 2) low = 32768;
      std::fclose(f);
    }
    return low > kLow + 1000 ? low : 32768;
  }();
  const int span = high - kLow;
  if (next < 0)
    next = kLow + static_cast<int>((static_cast<unsigned>(getpid()) * 2654435761u) % span);
  for (int attempt = 0; attempt < span; ++attempt) {
    const int port = next;
    next = kLow + (next - kLow + 1) % span;
    if (given.count(port) != 0) continue;
    const int fd = socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    addr.sin_port = htons(static_cast<uint16_t>(port));
    const bool free = bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0;
    close(fd);
    if (free) {
      given.insert(port);
      return port;
    }
  }
  return 0;  // nothing free below the ephemeral range: the caller's bind then fails loudly
}

// A port that stays taken and refuses connections while this object lives: bound, never
// listening, and without SO_REUSEPORT, so no server of a test running in parallel can bind it
// (gRPC servers set SO_REUSEPORT and would otherwise share a port FreePort handed out twice).
// For "a replica that is down".
class ReservedPort {
 public:
  ReservedPort() : fd_(socket(AF_INET, SOCK_STREAM, 0)) {
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    bind(fd_, reinterpret_cast<sockaddr*>(&addr), sizeof(addr));
    socklen_t len = sizeof(addr);
    getsockname(fd_, reinterpret_cast<sockaddr*>(&addr), &len);
    port_ = ntohs(addr.sin_port);
  }
  ~ReservedPort() { close(fd_); }
  ReservedPort(const ReservedPort&) = delete;
  ReservedPort& operator=(const ReservedPort&) = delete;
  [[nodiscard]] int port() const { return port_; }

 private:
  int fd_;
  int port_ = 0;
};

// True when something accepts TCP connections on 127.0.0.1:port.
inline bool Listening(int port) {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  addr.sin_port = htons(port);
  const bool ok = connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0;
  close(fd);
  return ok;
}

// Runs args[0] (a path) with the given arguments; SIGKILLed on destruction unless it exited.
class ChildProcess {
 public:
  explicit ChildProcess(std::vector<std::string> args) {
    pid_ = fork();
    if (pid_ == 0) {
      std::vector<char*> argv;
      for (std::string& a : args) argv.push_back(a.data());
      argv.push_back(nullptr);
      execv(argv[0], argv.data());
      _exit(127);
    }
  }
  ~ChildProcess() {
    if (pid_ > 0 && !exited_) {
      kill(pid_, SIGKILL);
      waitpid(pid_, nullptr, 0);
    }
  }
  ChildProcess(const ChildProcess&) = delete;
  ChildProcess& operator=(const ChildProcess&) = delete;

  // The exit code (128 + signal when killed by one) if the process has exited, else -1; does not
  // wait.
  int ExitStatusIfExited() {
    if (exited_) return exit_code_;
    int status = 0;
    if (waitpid(pid_, &status, WNOHANG) != pid_) return -1;
    exited_ = true;
    exit_code_ = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
    return exit_code_;
  }

  // Sends SIGTERM and returns the exit code (128 + signal when killed by one).
  int Terminate() {
    if (exited_) return exit_code_;
    kill(pid_, SIGTERM);
    int status = 0;
    waitpid(pid_, &status, 0);
    exited_ = true;
    exit_code_ = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
    return exit_code_;
  }

 private:
  pid_t pid_ = -1;
  bool exited_ = false;
  int exit_code_ = -1;
};

// The server's overall health, UNKNOWN when it does not answer within a second.
inline grpc::health::v1::HealthCheckResponse::ServingStatus Health(
    grpc::health::v1::Health::Stub& stub) {
  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(1));
  grpc::health::v1::HealthCheckResponse response;
  if (!stub.Check(&context, grpc::health::v1::HealthCheckRequest(), &response).ok()) {
    return grpc::health::v1::HealthCheckResponse::UNKNOWN;
  }
  return response.status();
}

}  // namespace mobius::testing

#endif  // MOBIUS_TESTS_UTIL_CHILD_PROCESS_H_
