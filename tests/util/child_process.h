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
#include <mutex>
#include <set>
#include <string>
#include <vector>

#include "grpc/health/v1/health.grpc.pb.h"
#include "grpcpp/client_context.h"

namespace mobius::testing {

// A port the kernel considers free right now.
inline int FreePort() {
  // A port the kernel just had free. Binding port 0 and closing can hand the same number out
  // twice (a deployment's router and worker once got the same port in CI), so a process never
  // gets a number it was given before.
  static std::mutex mu;
  static std::set<int> given;
  std::lock_guard<std::mutex> lock(mu);
  for (int attempt = 0;; ++attempt) {
    const int fd = socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    addr.sin_port = 0;
    bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr));
    socklen_t len = sizeof(addr);
    getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len);
    close(fd);
    const int port = ntohs(addr.sin_port);
    if (given.insert(port).second || attempt >= 100) return port;
  }
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
