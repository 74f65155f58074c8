// Times one server-streaming gRPC generation call by the rules the HTTP path uses: every
// message with tokens, and the final `complete`, is a chunk (the counterpart of the OpenAI
// stream's final finish_reason event), timed when Read returns it. Shared by the worker and
// router gRPC backends, whose protos differ only in message types.
#ifndef MOBIUS_BENCH_SERVE_GRPC_STREAM_TIMING_H_
#define MOBIUS_BENCH_SERVE_GRPC_STREAM_TIMING_H_

#include <chrono>
#include <string>

#include "absl/strings/str_cat.h"
#include "bench/serve/serve_metrics.h"
#include "grpcpp/support/status.h"
#include "grpcpp/support/sync_stream.h"
#include "sampling.pb.h"

namespace mobius::bench {

// "gRPC UNAVAILABLE: <message>", the message cut to a readable length.
std::string GrpcFailureReason(const grpc::Status& status);

// `tokens(response)` is the number of token ids a message carries; `usage(response)` the
// complete message's usage, or nullptr for a chunk.
template <typename Response, typename Tokens, typename CompleteUsage>
RequestOutcome ReadTimedGrpcStream(grpc::ClientReaderInterface<Response>& reader,
                                   std::chrono::steady_clock::time_point sent, int prompt_len,
                                   Tokens tokens, CompleteUsage usage) {
  using Clock = std::chrono::steady_clock;
  auto seconds = [](Clock::duration d) { return std::chrono::duration<double>(d).count(); };
  RequestOutcome outcome;
  Response response;
  int chunks = 0;
  int token_count = 0;
  const v1::Usage* final_usage = nullptr;
  v1::Usage final_copy;
  Clock::time_point last = sent;
  while (reader.Read(&response)) {
    const Clock::time_point now = Clock::now();
    const int n = tokens(response);
    const v1::Usage* u = usage(response);
    if (n == 0 && u == nullptr) continue;
    if (chunks == 0) {
      outcome.ttft_s = seconds(now - sent);
    } else {
      outcome.itl_s.push_back(seconds(now - last));
    }
    last = now;
    ++chunks;
    token_count += n;
    if (u != nullptr) {
      final_copy = *u;
      final_usage = &final_copy;
    }
  }
  const grpc::Status status = reader.Finish();
  if (!status.ok() || final_usage == nullptr) {
    RequestOutcome failed;
    failed.error = !status.ok() ? GrpcFailureReason(status)
                                : std::string("stream ended without a complete message");
    return failed;
  }
  outcome.success = true;
  outcome.latency_s = seconds(last - sent);
  outcome.output_tokens =
      final_usage->completion_tokens() > 0 ? final_usage->completion_tokens() : token_count;
  outcome.prompt_tokens =
      final_usage->prompt_tokens() > 0 ? final_usage->prompt_tokens() : prompt_len;
  return outcome;
}

}  // namespace mobius::bench

#endif  // MOBIUS_BENCH_SERVE_GRPC_STREAM_TIMING_H_
