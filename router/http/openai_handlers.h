// The OpenAI API's endpoints, independent of the connection they arrive on: routing, request
// translation, calls into InferenceService, and the response (whole, or streamed as server-sent
// events). The server runs one handler call per request on a thread of its own, since
// InferenceService::Generate blocks for the request's lifetime.
#ifndef MOBIUS_ROUTER_HTTP_OPENAI_HANDLERS_H_
#define MOBIUS_ROUTER_HTTP_OPENAI_HANDLERS_H_

#include <atomic>
#include <cstdint>
#include <string>

#include <boost/beast/http.hpp>

#include "absl/status/status.h"
#include "router/http/openai_http_server.h"
#include "router/http/openai_response.h"
#include "router/inference_service.h"

namespace mobius::router::openai {

using HttpRequest = boost::beast::http::request<boost::beast::http::string_body>;
using HttpResponse = boost::beast::http::response<boost::beast::http::string_body>;
using HttpResponseHeader = boost::beast::http::response_header<>;

// Where a handler answers: one whole response, or a stream. Called from the handler's thread;
// the stream calls block until their bytes are written (the client's pace is the stream's).
class ResponseSink {
 public:
  virtual ~ResponseSink() = default;
  // Sends a whole response; the exchange is over.
  virtual void Send(HttpResponse response) = 0;
  // Sends the header of a streamed response whose body follows in Write calls. False when the
  // client can no longer be written to.
  virtual bool StartStream(HttpResponseHeader header) = 0;
  virtual bool Write(std::string data) = 0;
  // Ends the stream; the connection is closed afterwards when `close`.
  virtual void EndStream(bool close) = 0;
  // Becomes true when the client goes away or the server stops waiting for the request.
  [[nodiscard]] virtual const std::atomic<bool>& cancelled() const = 0;
};

class OpenAiApi {
 public:
  // `service` must outlive this object.
  OpenAiApi(InferenceService& service, HttpServerOptions options);

  // Answers `request` through `sink`, exactly once.
  void Handle(const HttpRequest& request, ResponseSink& sink);

 private:
  // Answers a completion or chat request; returns its final status (OK once the response or
  // stream went out whole), for the request counter.
  absl::Status Generate(const HttpRequest& request, Endpoint endpoint, ResponseSink& sink);
  void ListModels(const HttpRequest& request, ResponseSink& sink);
  void GetModel(const HttpRequest& request, const std::string& id, ResponseSink& sink);
  // vLLM's POST /tokenize and /detokenize, through the service's tokenizer.
  void Tokenize(const HttpRequest& request, ResponseSink& sink);
  void Detokenize(const HttpRequest& request, ResponseSink& sink);
  void Health(const HttpRequest& request, ResponseSink& sink);
  void Metrics(const HttpRequest& request, ResponseSink& sink);
  // OpenAI's chat default: generate until the context is full. Left unset (the service's
  // default) when the context length is unknown.
  void DefaultChatMaxTokens(v1::SamplingParams* sampling);
  // The model's context length as the service reports it now; 0 when unknown.
  int32_t MaxContextLength();
  std::string ModelName();

  InferenceService& service_;
  const HttpServerOptions options_;
  const int64_t created_;  // Unix seconds when the server started, for /v1/models
};

// An error response with the OpenAI error object, the status' HTTP code and, for 429,
// Retry-After.
HttpResponse ErrorResponse(const HttpRequest& request, const absl::Status& status);

}  // namespace mobius::router::openai

#endif  // MOBIUS_ROUTER_HTTP_OPENAI_HANDLERS_H_
