// The HTTP server (see qkv/serve/server.hpp): routes, OpenAI's request and response shapes, errors and limits.
// Requests are read by cpp-httplib; every field is checked here with an OpenAI error object naming it; generation runs
// on the Scheduler's thread and reaches the HTTP thread through a Channel (a small queue of text pieces).
#include "qkv/serve/server.hpp"

#include <arpa/inet.h>
#include <httplib.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/stat.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstdio>
#include <ctime>
#include <deque>
#include <filesystem>
#include <map>
#include <nlohmann/json.hpp>
#include <random>
#include <sstream>
#include <thread>

#include "qkv/nn/pretrained.hpp"
#include "qkv/text/hf_tokenizer.hpp"
#include "chat_page.hpp"
#include "qkv/serve/reply_text.hpp"

namespace qkv::serve {

namespace {

using json = nlohmann::json;
using Clock = std::chrono::steady_clock;

// A request the client got wrong (or the server cannot take now): an HTTP status and OpenAI's error fields
struct HttpError : std::runtime_error {
  int status;
  std::string type, param, code;
  HttpError(int status, std::string message, std::string type = "invalid_request_error", std::string param = {},
            std::string code = {})
      : std::runtime_error(std::move(message)), status(status), type(std::move(type)), param(std::move(param)),
        code(std::move(code)) {}
};

json error_body(const std::string& message, const std::string& type, const std::string& param, const std::string& code) {
  json e = {{"message", message}, {"type", type}, {"param", nullptr}, {"code", nullptr}};
  if (!param.empty()) e["param"] = param;
  if (!code.empty()) e["code"] = code;
  return json{{"error", e}};
}

void send_error(httplib::Response& res, const HttpError& e) {
  res.status = e.status;
  // replace: a message may quote the client's bytes (a JSON parse error does), which need not be UTF-8
  res.set_content(error_body(e.what(), e.type, e.param, e.code).dump(-1, ' ', false, json::error_handler_t::replace),
                  "application/json");
}

HttpError bad_field(const std::string& param, const std::string& message) {
  return HttpError(400, message, "invalid_request_error", param);
}

// Reads an optional field of a JSON object with its type and range checked
std::optional<double> number_field(const json& body, const char* name, double lo, double hi) {
  if (!body.contains(name) || body[name].is_null()) return std::nullopt;
  const json& v = body[name];
  if (!v.is_number()) throw bad_field(name, std::string(name) + " must be a number");
  const double x = v.get<double>();
  if (!std::isfinite(x) || x < lo || x > hi)
    throw bad_field(name, std::string(name) + " must be between " + json(lo).dump() + " and " + json(hi).dump());
  return x;
}

std::optional<int64_t> integer_field(const json& body, const char* name, int64_t lo, int64_t hi) {
  if (!body.contains(name) || body[name].is_null()) return std::nullopt;
  const json& v = body[name];
  if (!v.is_number_integer() && !v.is_number_unsigned())
    throw bad_field(name, std::string(name) + " must be an integer");
  if (v.is_number_unsigned() && v.get<uint64_t>() > static_cast<uint64_t>(hi))
    throw bad_field(name, std::string(name) + " must be between " + std::to_string(lo) + " and " + std::to_string(hi));
  const int64_t x = v.get<int64_t>();
  if (x < lo || x > hi)
    throw bad_field(name, std::string(name) + " must be between " + std::to_string(lo) + " and " + std::to_string(hi));
  return x;
}

bool bool_field(const json& body, const char* name, bool fallback) {
  if (!body.contains(name) || body[name].is_null()) return fallback;
  if (!body[name].is_boolean()) throw bad_field(name, std::string(name) + " must be true or false");
  return body[name].get<bool>();
}

// Random ids for responses ("chatcmpl-…"), as OpenAI gives them
std::string random_id(const char* prefix) {
  static thread_local std::mt19937_64 rng{std::random_device{}()};
  static const char* digits = "0123456789abcdefghijklmnopqrstuvwxyz";
  std::string id = prefix;
  for (int i = 0; i < 24; ++i) id += digits[rng() % 36];
  return id;
}

// A list of token ids in field `name` of a request, each inside the vocabulary [0, V)
std::vector<int64_t> token_ids_field(const json& body, const char* name, int64_t V) {
  if (!body.contains(name) || !body[name].is_array()) throw bad_field(name, std::string(name) + " must be a list of token ids");
  std::vector<int64_t> ids;
  for (const json& x : body[name]) {
    if (!x.is_number_integer()) throw bad_field(name, std::string(name) + " must be a list of integers");
    const int64_t id = x.get<int64_t>();
    if (id < 0 || id >= V)
      throw bad_field(name, "token id " + std::to_string(id) + " is outside the vocabulary [0, " + std::to_string(V) + ")");
    ids.push_back(id);
  }
  return ids;
}

// A piece of a reply's text and the tokens that gave it (a character split over tokens comes with the last of them;
// tokens whose text a stop string swallowed come with no text)
struct Piece {
  std::string text;
  std::vector<int64_t> ids;
};

// The text pieces of one request on their way from the scheduler's thread to the HTTP thread that answers it
struct Channel {
  std::mutex mutex;
  std::condition_variable ready;
  std::deque<Piece> pieces;
  bool finished = false;
  Outcome outcome;
  std::string text;           // the whole reply (non-streamed answers)
  int64_t id = 0;             // the scheduler's id (for cancel)
  std::atomic<bool> gone{false};  // the client went away: the next token cancels the request
};

// Constant-time comparison of a given key with the expected one: the time depends on the expected key's length only.
bool same_key(const std::string& given, const std::string& expected) {
  unsigned char diff = given.size() == expected.size() ? 0 : 1;
  for (size_t i = 0; i < expected.size(); ++i)
    diff |= static_cast<unsigned char>(expected[i] ^ (i < given.size() ? given[i] : 0));
  return diff == 0;
}

}  // namespace

struct Server::State {
  ServerOptions options;
  httplib::Server http;
  std::mutex mutex;                     // guards model, scheduler, load_error
  std::unique_ptr<nn::Pretrained> model;
  std::unique_ptr<Scheduler> scheduler;
  std::string model_id, load_error;
  std::atomic<bool> ready{false}, draining{false}, stopped{false};
  std::time_t created = std::time(nullptr);
  int port = 0;                         // the port bound
  // Request deadlines (the watchdog): per client address, whether a handler is answering it and since when it
  // has been reading; per open connection (by socket inode), when it was first seen
  struct Peer {
    bool responding = false;
    Clock::time_point since = Clock::now();
  };
  std::mutex peers_mutex;
  std::map<std::string, Peer> peers;
  std::map<ino_t, Clock::time_point> first_seen;
  std::thread watchdog;
  std::atomic<int64_t> dropped_slow{0};
  // Counters of HTTP answers for /metrics, by status class
  std::atomic<int64_t> http_2xx{0}, http_4xx{0}, http_5xx{0}, http_429{0};

  // The parts of a generation request that chat and text completions share
  struct Generation {
    std::vector<int64_t> prompt;
    GenerationRequest request;
    std::vector<std::string> stops;
    bool stream = false, include_usage = false;
    bool token_ids = false;  // return_token_ids (vLLM's extension): the prompt's ids, and each piece's
  };

  void check_key(const httplib::Request& req) const {
    if (options.api_key.empty()) return;
    const std::string header = req.get_header_value("Authorization");
    const std::string prefix = "Bearer ";
    const std::string given = header.compare(0, prefix.size(), prefix) == 0 ? header.substr(prefix.size()) : std::string();
    if (!same_key(given, options.api_key))
      throw HttpError(401, header.empty() ? "No API key given: send the header 'Authorization: Bearer <key>'"
                                          : "Incorrect API key provided",
                      "invalid_request_error", {}, "invalid_api_key");
  }

  // The scheduler, or 503 while the model loads or the server drains
  Scheduler& scheduler_or_throw() {
    if (draining) throw HttpError(503, "The server is shutting down", "server_error", {}, "unavailable");
    if (!ready) throw HttpError(503, "The model is still loading; retry shortly", "server_error", {}, "loading");
    return *scheduler;
  }

  static json parse_body(const httplib::Request& req) {
    try {
      json body = json::parse(req.body);
      if (!body.is_object()) throw HttpError(400, "The request body must be a JSON object");
      return body;
    } catch (const json::parse_error& e) {
      throw HttpError(400, std::string("The request body is not valid JSON: ") + e.what());
    }
  }

  // Sampling, limits, stop strings and streaming options common to both completions
  Generation read_generation(const json& body, std::vector<int64_t> prompt) {
    Scheduler& s = *scheduler;
    Generation g;
    if (body.contains("n") && !body["n"].is_null() && body["n"] != 1) throw bad_field("n", "only n = 1 is supported");
    const int64_t prompt_tokens = static_cast<int64_t>(prompt.size());
    if (prompt_tokens == 0) throw HttpError(400, "The prompt gives no tokens", "invalid_request_error", "messages");
    if (prompt_tokens >= s.context())
      throw HttpError(400, "This request's prompt has " + std::to_string(prompt_tokens) + " tokens; the server's context is " +
                               std::to_string(s.context()) + " (--ctx-size): shorten the messages",
                      "invalid_request_error", "messages", "context_length_exceeded");
    std::optional<int64_t> max_tokens = integer_field(body, "max_completion_tokens", 1, INT64_MAX);
    if (!max_tokens) max_tokens = integer_field(body, "max_tokens", 1, INT64_MAX);
    const int64_t room = s.context() - prompt_tokens;
    if (max_tokens && *max_tokens > room)
      throw HttpError(400, "max_tokens " + std::to_string(*max_tokens) + " + the prompt's " + std::to_string(prompt_tokens) +
                               " tokens pass the server's context of " + std::to_string(s.context()) +
                               " tokens; ask for at most " + std::to_string(room),
                      "invalid_request_error", "max_tokens", "context_length_exceeded");
    g.request.max_new_tokens = max_tokens ? *max_tokens : room;
    // Sampling: what the request gives, else the model's generation_config.json (greedy unless it samples)
    const nn::GenerationDefaults& d = model->generation;
    SamplingParams& p = g.request.sampling;
    p.greedy = !d.do_sample;
    p.temperature = d.temperature;
    p.top_p = d.top_p;
    p.top_k = d.top_k;
    if (auto t = number_field(body, "temperature", 0.0, 2.0)) {
      p.temperature = *t;
      p.greedy = *t == 0.0;
    }
    if (auto t = number_field(body, "top_p", 0.0, 1.0)) {
      if (*t == 0.0) throw bad_field("top_p", "top_p must be above 0 and at most 1");
      p.top_p = *t;
    }
    if (auto k = integer_field(body, "top_k", 0, 1 << 30)) p.top_k = *k;  // llama.cpp's and vLLM's extension
    if (auto x = number_field(body, "presence_penalty", -2.0, 2.0)) p.presence_penalty = *x;
    if (auto x = number_field(body, "frequency_penalty", -2.0, 2.0)) p.frequency_penalty = *x;
    if (auto seed = integer_field(body, "seed", INT64_MIN, INT64_MAX)) p.seed = static_cast<uint64_t>(*seed);
    else p.seed = std::random_device{}();
    p.vocab_limit = model->tokenizer->vocab_size();
    if (body.contains("stop") && !body["stop"].is_null()) {
      const json& stop = body["stop"];
      if (stop.is_string()) g.stops.push_back(stop.get<std::string>());
      else if (stop.is_array() && stop.size() <= 4 && std::all_of(stop.begin(), stop.end(), [](const json& x) { return x.is_string(); }))
        for (const json& x : stop) g.stops.push_back(x.get<std::string>());
      else throw bad_field("stop", "stop must be a string or a list of at most 4 strings");
    }
    for (const std::string& x : g.stops)
      if (x.size() > 256) throw bad_field("stop", "a stop string may have at most 256 bytes");
    g.stream = bool_field(body, "stream", false);
    g.token_ids = bool_field(body, "return_token_ids", false);
    if (body.contains("stream_options") && !body["stream_options"].is_null()) {
      if (!body["stream_options"].is_object()) throw bad_field("stream_options", "stream_options must be an object");
      g.include_usage = bool_field(body["stream_options"], "include_usage", false);
    }
    g.request.stop_ids = model->stop_ids;
    g.prompt = prompt;
    g.request.prompt = std::move(prompt);
    return g;
  }

  // Queues the generation; its text pieces arrive in the returned channel
  std::shared_ptr<Channel> start(Generation& g) {
    auto channel = std::make_shared<Channel>();
    auto reply = std::make_shared<ReplyText>(*model->tokenizer, g.stops);
    auto held = std::make_shared<std::vector<int64_t>>();  // tokens whose text is not out yet
    g.request.on_token = [channel, reply, held](int64_t token) {
      if (channel->gone) return TokenVerdict::Cancel;
      held->push_back(token);
      std::string text = reply->push(token);
      if (!text.empty()) {
        std::lock_guard lock(channel->mutex);
        channel->pieces.push_back({std::move(text), std::move(*held)});
        held->clear();
        channel->ready.notify_all();
      }
      return reply->stopped() ? TokenVerdict::Stop : TokenVerdict::Continue;
    };
    g.request.on_finish = [channel, reply, held](const Outcome& outcome) {
      std::string rest = outcome.finish == FinishReason::Cancelled ? std::string() : reply->finish();
      std::lock_guard lock(channel->mutex);
      if (outcome.finish != FinishReason::Cancelled && (!rest.empty() || !held->empty()))
        channel->pieces.push_back({std::move(rest), std::move(*held)});
      channel->outcome = outcome;
      channel->text = reply->text();
      channel->finished = true;
      channel->ready.notify_all();
    };
    try {
      channel->id = scheduler->submit(std::move(g.request));
    } catch (const QueueFull& e) {
      throw HttpError(429, e.what(), "rate_limit_error", {}, "rate_limit_exceeded");
    } catch (const ShapeError& e) {
      throw HttpError(503, e.what(), "server_error", {}, "unavailable");
    } catch (const ValueError& e) {
      throw HttpError(400, e.what());
    }
    return channel;
  }

  static json usage_of(const Outcome& o) {
    const int64_t completion = static_cast<int64_t>(o.tokens.size());
    // prompt_tokens_details.cached_tokens: OpenAI's field for prompt tokens its prompt cache served
    return {{"prompt_tokens", o.prompt_tokens}, {"completion_tokens", completion},
            {"total_tokens", o.prompt_tokens + completion},
            {"prompt_tokens_details", {{"cached_tokens", o.cached_tokens}}}};
  }

  // Waits for the whole reply (a non-streamed request)
  static void wait(Channel& c) {
    std::unique_lock lock(c.mutex);
    c.ready.wait(lock, [&] { return c.finished; });
  }

  // Streams a request's pieces as server-sent events: `chunk(piece)` makes the JSON of one piece (pieces without
  // text only when their ids are asked for), `last(outcome)` the closing chunk, `usage` the usage chunk when asked for.
  void stream(httplib::Response& res, std::shared_ptr<Channel> channel, bool include_usage, bool token_ids,
              std::function<json(const Piece&)> chunk, std::function<json(const Outcome&)> last,
              std::function<json(const Outcome&)> usage_chunk, std::optional<json> first = std::nullopt) {
    Scheduler* sched = scheduler.get();
    auto sent_first = std::make_shared<bool>(!first.has_value());
    res.set_header("Cache-Control", "no-cache");
    res.set_header("X-Accel-Buffering", "no");
    res.set_chunked_content_provider(
        "text/event-stream",
        [channel, sched, include_usage, token_ids, chunk, last, usage_chunk, first, sent_first](size_t,
                                                                                               httplib::DataSink& sink) {
          auto event = [&](const json& j) {
            const std::string line = "data: " + j.dump(-1, ' ', false, json::error_handler_t::replace) + "\n\n";
            return sink.write(line.data(), line.size());
          };
          auto gone = [&] {  // the client left: cancel its request at the next step
            channel->gone = true;
            sched->cancel(channel->id);
            return false;
          };
          if (!*sent_first) {
            *sent_first = true;
            if (!event(*first)) return gone();
          }
          std::deque<Piece> pieces;
          bool finished;
          {
            std::unique_lock lock(channel->mutex);
            channel->ready.wait_for(lock, std::chrono::milliseconds(250),
                                    [&] { return channel->finished || !channel->pieces.empty(); });
            pieces.swap(channel->pieces);
            finished = channel->finished;
          }
          for (const Piece& piece : pieces)
            if ((!piece.text.empty() || token_ids) && !event(chunk(piece))) return gone();
          if (pieces.empty() && !finished && !sink.is_writable()) return gone();
          if (!finished) return true;
          const Outcome& o = channel->outcome;
          if (o.finish == FinishReason::Error) {
            event(error_body("generation failed: " + o.error, "server_error", {}, {}));
          } else if (o.finish != FinishReason::Cancelled) {
            if (!event(last(o))) return gone();
            if (include_usage && !event(usage_chunk(o))) return gone();
          }
          static const std::string done = "data: [DONE]\n\n";
          sink.write(done.data(), done.size());
          sink.done();
          return true;
        },
        [channel, sched](bool success) {
          if (!success && !channel->finished) {
            channel->gone = true;
            sched->cancel(channel->id);
          }
        });
  }

  // The messages of a chat request as the template takes them
  static std::vector<text::ChatMessage> read_messages(const json& body) {
    if (!body.contains("messages")) throw bad_field("messages", "messages is required: a list of {role, content}");
    const json& list = body["messages"];
    if (!list.is_array() || list.empty()) throw bad_field("messages", "messages must be a non-empty list");
    std::vector<text::ChatMessage> messages;
    for (const json& m : list) {
      if (!m.is_object() || !m.contains("role") || !m["role"].is_string())
        throw bad_field("messages", "every message needs a string role");
      std::string role = m["role"].get<std::string>();
      if (role == "developer") role = "system";  // OpenAI's newer name for the system message
      if (role != "system" && role != "user" && role != "assistant" && role != "tool")
        throw bad_field("messages", "unknown role '" + role + "'; use system, user, assistant or tool");
      std::string content;
      const json& c = m.contains("content") ? m["content"] : json();
      if (c.is_string()) content = c.get<std::string>();
      else if (c.is_array()) {  // content parts: text only
        for (const json& part : c) {
          if (!part.is_object() || part.value("type", "") != "text" || !part.contains("text") || !part["text"].is_string())
            throw bad_field("messages", "only text content parts ({\"type\": \"text\", \"text\": …}) are supported");
          content += part["text"].get<std::string>();
        }
      } else if (!c.is_null()) {
        throw bad_field("messages", "a message's content must be a string or a list of text parts");
      }
      messages.push_back({role, content});
    }
    return messages;
  }

  void chat_completions(const httplib::Request& req, httplib::Response& res) {
    check_key(req);
    scheduler_or_throw();
    const json body = parse_body(req);
    const std::vector<text::ChatMessage> messages = read_messages(body);
    if (model->chat_template.empty())
      throw HttpError(400, "This model has no chat template; use /v1/completions", "invalid_request_error", "messages");
    std::vector<int64_t> prompt;
    try {
      prompt = model->encode_chat(messages);
    } catch (const Error& e) {
      throw HttpError(400, std::string("The chat template could not render these messages: ") + e.what(),
                      "invalid_request_error", "messages");
    }
    Generation g = read_generation(body, std::move(prompt));
    const std::string id = random_id("chatcmpl-");
    const std::time_t now = std::time(nullptr);
    const std::string name = model_id;
    auto channel = start(g);
    auto head = [id, now, name](json choices) {
      return json{{"id", id}, {"object", "chat.completion.chunk"}, {"created", now}, {"model", name},
                  {"system_fingerprint", nullptr}, {"choices", std::move(choices)}};
    };
    if (g.stream) {
      const bool usage = g.include_usage;
      auto with_usage = [usage](json j) {
        if (usage) j["usage"] = nullptr;
        return j;
      };
      json first = with_usage(head(json::array({{{"index", 0}, {"delta", {{"role", "assistant"}, {"content", ""}}},
                                                 {"logprobs", nullptr}, {"finish_reason", nullptr}}})));
      if (g.token_ids) first["prompt_token_ids"] = g.prompt;
      const bool ids = g.token_ids;
      stream(
          res, channel, usage, ids,
          [=](const Piece& piece) {
            json choice = {{"index", 0}, {"delta", {{"content", piece.text}}}, {"logprobs", nullptr}, {"finish_reason", nullptr}};
            if (ids) choice["token_ids"] = piece.ids;
            return with_usage(head(json::array({std::move(choice)})));
          },
          [=](const Outcome& o) {
            return with_usage(head(json::array({{{"index", 0}, {"delta", json::object()}, {"logprobs", nullptr},
                                                 {"finish_reason", finish_reason_name(o.finish)}}})));
          },
          [=](const Outcome& o) {
            json j = head(json::array());
            j["usage"] = usage_of(o);
            return j;
          },
          first);
      return;
    }
    wait(*channel);
    const Outcome& o = channel->outcome;
    if (o.finish == FinishReason::Error) throw HttpError(500, "generation failed: " + o.error, "server_error");
    json answer = {{"id", id}, {"object", "chat.completion"}, {"created", now}, {"model", name},
                   {"system_fingerprint", nullptr},
                   {"choices", json::array({{{"index", 0},
                                             {"message", {{"role", "assistant"}, {"content", channel->text}, {"refusal", nullptr}}},
                                             {"logprobs", nullptr},
                                             {"finish_reason", finish_reason_name(o.finish)}}})},
                   {"usage", usage_of(o)}};
    with_token_ids(answer, g, o);
    res.set_content(answer.dump(-1, ' ', false, json::error_handler_t::replace), "application/json");
  }

  // return_token_ids in a whole answer: the prompt's ids beside the choices, the reply's in its choice (as vLLM)
  static void with_token_ids(json& answer, const Generation& g, const Outcome& o) {
    if (!g.token_ids) return;
    answer["prompt_token_ids"] = g.prompt;
    answer["choices"][0]["token_ids"] = o.tokens;
  }

  void completions(const httplib::Request& req, httplib::Response& res) {
    check_key(req);
    scheduler_or_throw();
    const json body = parse_body(req);
    if (!body.contains("prompt")) throw bad_field("prompt", "prompt is required: a string, or a list of token ids");
    const json& p = body["prompt"];
    std::vector<int64_t> prompt;
    auto ids_of = [&](const json& list) {
      std::vector<int64_t> ids;
      for (const json& x : list) {
        if (!x.is_number_integer()) throw bad_field("prompt", "a token list must hold integers");
        ids.push_back(x.get<int64_t>());
      }
      return ids;
    };
    if (p.is_string()) prompt = model->tokenizer->encode(text::replace_invalid_utf8(p.get<std::string>()));
    else if (p.is_array() && p.size() == 1 && p[0].is_string())
      prompt = model->tokenizer->encode(text::replace_invalid_utf8(p[0].get<std::string>()));
    else if (p.is_array() && !p.empty() && p[0].is_number()) prompt = ids_of(p);
    else throw bad_field("prompt", "prompt must be a string, a list of one string, or a list of token ids");
    if (bool_field(body, "echo", false)) throw bad_field("echo", "echo is not supported");
    for (int64_t id : prompt)
      if (id < 0 || id >= model->model->vocab_size())
        throw bad_field("prompt", "token id " + std::to_string(id) + " is outside the vocabulary");
    Generation g = read_generation(body, std::move(prompt));
    const std::string id = random_id("cmpl-");
    const std::time_t now = std::time(nullptr);
    const std::string name = model_id;
    auto channel = start(g);
    auto head = [id, now, name](json choices) {
      return json{{"id", id}, {"object", "text_completion"}, {"created", now}, {"model", name},
                  {"system_fingerprint", nullptr}, {"choices", std::move(choices)}};
    };
    if (g.stream) {
      const bool ids = g.token_ids;
      std::optional<json> first;
      if (ids) first = json{{"id", id}, {"object", "text_completion"}, {"created", now}, {"model", name},
                            {"system_fingerprint", nullptr}, {"choices", json::array()}, {"prompt_token_ids", g.prompt}};
      stream(
          res, channel, g.include_usage, ids,
          [=](const Piece& piece) {
            json choice = {{"index", 0}, {"text", piece.text}, {"logprobs", nullptr}, {"finish_reason", nullptr}};
            if (ids) choice["token_ids"] = piece.ids;
            return head(json::array({std::move(choice)}));
          },
          [=](const Outcome& o) {
            return head(json::array(
                {{{"index", 0}, {"text", ""}, {"logprobs", nullptr}, {"finish_reason", finish_reason_name(o.finish)}}}));
          },
          [=](const Outcome& o) {
            json j = head(json::array());
            j["usage"] = usage_of(o);
            return j;
          },
          first);
      return;
    }
    wait(*channel);
    const Outcome& o = channel->outcome;
    if (o.finish == FinishReason::Error) throw HttpError(500, "generation failed: " + o.error, "server_error");
    json answer = head(json::array(
        {{{"index", 0}, {"text", channel->text}, {"logprobs", nullptr}, {"finish_reason", finish_reason_name(o.finish)}}}));
    answer["usage"] = usage_of(o);
    with_token_ids(answer, g, o);
    res.set_content(answer.dump(-1, ' ', false, json::error_handler_t::replace), "application/json");
  }

  void models(const httplib::Request& req, httplib::Response& res) {
    check_key(req);
    scheduler_or_throw();
    json answer = {{"object", "list"},
                   {"data", json::array({{{"id", model_id}, {"object", "model"}, {"created", created}, {"owned_by", "qkv"},
                                          {"meta", {{"context_length", scheduler->context()},
                                                    {"vocab_size", model->model->vocab_size()},
                                                    {"description", model->description}}}}})}};
    res.set_content(answer.dump(-1, ' ', false, json::error_handler_t::replace), "application/json");
  }

  void tokenize(const httplib::Request& req, httplib::Response& res) {
    check_key(req);
    scheduler_or_throw();
    const json body = parse_body(req);
    if (!body.contains("content") || !body["content"].is_string()) throw bad_field("content", "content must be a string");
    const bool special = bool_field(body, "add_special", false);
    std::vector<int64_t> ids = model->tokenizer->encode(text::replace_invalid_utf8(body["content"].get<std::string>()), special);
    res.set_content(json{{"tokens", ids}}.dump(), "application/json");
  }

  void detokenize(const httplib::Request& req, httplib::Response& res) {
    check_key(req);
    scheduler_or_throw();
    const json body = parse_body(req);
    const std::vector<int64_t> ids = token_ids_field(body, "tokens", model->tokenizer->vocab_size());
    res.set_content(json{{"content", model->tokenizer->decode(ids)}}.dump(-1, ' ', false, json::error_handler_t::replace),
                    "application/json");
  }

  // POST /attention (qkv's own, for the chat page): what the token at `position` of `tokens` attended to when the
  // model read it, which is what it attended to when it wrote the next token. Runs between the scheduler's steps.
  void attention(const httplib::Request& req, httplib::Response& res) {
    check_key(req);
    Scheduler& s = scheduler_or_throw();
    const json body = parse_body(req);
    const nn::Decoder& decoder = *model->model;
    const std::vector<int64_t> ids = token_ids_field(body, "tokens", decoder.vocab_size());
    const int64_t T = static_cast<int64_t>(ids.size());
    if (T == 0) throw bad_field("tokens", "tokens must hold at least one id");
    if (T > s.context())
      throw HttpError(400, "tokens has " + std::to_string(T) + " ids; the server's context is " + std::to_string(s.context()),
                      "invalid_request_error", "tokens", "context_length_exceeded");
    const int64_t position = integer_field(body, "position", 0, T - 1).value_or(T - 1);
    const int64_t L = decoder.num_layers(), H = decoder.num_heads();
    const std::optional<int64_t> layer = integer_field(body, "layer", 1, L);
    Tensor row;
    try {
      s.run_between_steps([&] { row = decoder.attention_row(ids, position); });
    } catch (const ShapeError& e) {
      throw HttpError(503, e.what(), "server_error", {}, "unavailable");
    } catch (const ValueError& e) {  // a model whose layers recorded no attention
      throw HttpError(400, std::string("No attention weights for this model: ") + e.what());
    }
    const int64_t n = position + 1;
    auto rounded = [](double w) { return std::round(w * 1e5) / 1e5; };  // five decimals: a picture, not a check
    json mean = json::array(), per_head = json::array();
    for (int64_t l = 0; l < L; ++l) {
      json line = json::array();
      for (int64_t j = 0; j < n; ++j) {
        double total = 0;
        for (int64_t h = 0; h < H; ++h) total += row.data()[(l * H + h) * n + j];
        line.push_back(rounded(total / static_cast<double>(H)));
      }
      mean.push_back(std::move(line));
    }
    if (layer)
      for (int64_t h = 0; h < H; ++h) {
        json line = json::array();
        for (int64_t j = 0; j < n; ++j) line.push_back(rounded(row.data()[((*layer - 1) * H + h) * n + j]));
        per_head.push_back(std::move(line));
      }
    json tokens = json::array();
    for (int64_t j = 0; j < n; ++j) tokens.push_back(text::replace_invalid_utf8(model->tokenizer->token_bytes(ids[static_cast<size_t>(j)])));
    json answer = {{"object", "attention"}, {"position", position}, {"layers", L}, {"heads", H},
                   {"tokens", std::move(tokens)}, {"mean", std::move(mean)}};
    if (layer) {
      answer["layer"] = *layer;
      answer["per_head"] = std::move(per_head);
    }
    res.set_content(answer.dump(-1, ' ', false, json::error_handler_t::replace), "application/json");
  }

  void health(httplib::Response& res) {
    std::string error;
    {
      std::lock_guard lock(mutex);
      error = load_error;
    }
    if (!error.empty()) throw HttpError(500, "The model failed to load: " + error, "server_error", {}, "load_failed");
    if (draining) throw HttpError(503, "The server is shutting down", "server_error", {}, "unavailable");
    if (!ready) throw HttpError(503, "Loading model", "server_error", {}, "loading");
    res.set_content(R"({"status":"ok"})", "application/json");
  }

  void metrics(const httplib::Request& req, httplib::Response& res) {
    check_key(req);
    std::ostringstream out;
    auto metric = [&](const char* name, const char* type, const char* help, double value) {
      out << "# HELP " << name << " " << help << "\n# TYPE " << name << " " << type << "\n" << name << " " << value << "\n";
    };
    SchedulerStats s;
    if (ready) s = scheduler->stats();
    metric("qkv_ready", "gauge", "1 once the model is loaded", ready ? 1 : 0);
    metric("qkv_requests_completed_total", "counter", "Generation requests that ended by a stop or their length", static_cast<double>(s.completed));
    metric("qkv_requests_cancelled_total", "counter", "Generation requests cancelled (client gone, shutdown)", static_cast<double>(s.cancelled));
    metric("qkv_requests_failed_total", "counter", "Generation requests the model failed on", static_cast<double>(s.failed));
    metric("qkv_requests_rejected_total", "counter", "Generation requests refused with 429 (queue full)", static_cast<double>(s.rejected));
    metric("qkv_http_responses_2xx_total", "counter", "HTTP answers with a 2xx status", static_cast<double>(http_2xx));
    metric("qkv_http_responses_4xx_total", "counter", "HTTP answers with a 4xx status", static_cast<double>(http_4xx));
    metric("qkv_http_responses_5xx_total", "counter", "HTTP answers with a 5xx status", static_cast<double>(http_5xx));
    metric("qkv_prompt_tokens_total", "counter", "Prompt tokens fed", static_cast<double>(s.prompt_tokens));
    metric("qkv_generated_tokens_total", "counter", "Tokens generated", static_cast<double>(s.generated_tokens));
    metric("qkv_queue_length", "gauge", "Requests waiting for a slot", static_cast<double>(s.queued));
    metric("qkv_requests_active", "gauge", "Requests generating now", static_cast<double>(s.active));
    metric("qkv_kv_cache_bytes", "gauge", "Bytes of the session's KV cache blocks in use (running and cached sequences)",
           static_cast<double>(s.kv_cache_bytes));
    metric("qkv_kv_cache_tokens", "gauge", "Positions the session's sequences hold", static_cast<double>(s.kv_cache_tokens));
    metric("qkv_kv_cache_blocks_used", "gauge", "KV cache blocks in use", static_cast<double>(s.kv_cache_blocks_used));
    metric("qkv_kv_cache_blocks_total", "gauge", "KV cache blocks the session may hold", static_cast<double>(s.kv_cache_blocks_total));
    metric("qkv_kv_cache_usage_ratio", "gauge", "KV cache blocks in use / blocks it may hold",
           s.kv_cache_blocks_total > 0 ? static_cast<double>(s.kv_cache_blocks_used) / static_cast<double>(s.kv_cache_blocks_total) : 0.0);
    metric("qkv_prompt_cache_hit_tokens_total", "counter", "Prompt tokens taken from the prompt cache instead of computed",
           static_cast<double>(s.prompt_cache_hit_tokens));
    metric("qkv_prompt_tokens_prefilled_total", "counter", "Prompt tokens computed (prompt tokens less cache hits)",
           static_cast<double>(s.prefilled_tokens));
    metric("qkv_prompt_cache_sequences", "gauge", "Finished sequences kept for the prompt cache",
           static_cast<double>(s.prompt_cache_sequences));
    metric("qkv_connections_dropped_slow_total", "counter", "Connections shut for not sending a whole request in time",
           static_cast<double>(dropped_slow));
    metric("qkv_steps_total", "counter", "Scheduler steps run", static_cast<double>(s.steps));
    out << "# HELP qkv_time_to_first_token_seconds From a request's arrival to its first token\n"
        << "# TYPE qkv_time_to_first_token_seconds summary\n"
        << "qkv_time_to_first_token_seconds_sum " << s.first_token_seconds_sum << "\n"
        << "qkv_time_to_first_token_seconds_count " << s.first_token_count << "\n";
    res.set_content(out.str(), "text/plain; version=0.0.4");
  }

  static std::string peer_key(const std::string& addr, int port) { return addr + "|" + std::to_string(port); }

  // A handler answers this client now (its request was read whole), or has answered it (a next request may come)
  void mark(const httplib::Request& req, bool responding) {
    std::lock_guard lock(peers_mutex);
    peers[peer_key(req.remote_addr, req.remote_port)] = {responding, Clock::now()};
  }

  // Every half second: a connection of this server that has been reading one request (headers and body) for longer
  // than the deadline is shut down, so a client trickling bytes cannot hold a worker. httplib's read timeout alone
  // restarts with every byte. Connections are found as the process's sockets bound to our port.
  void watch() {
    const auto deadline = std::chrono::seconds(options.request_deadline_seconds);
    while (!stopped) {
      std::this_thread::sleep_for(std::chrono::milliseconds(500));
      const auto now = Clock::now();
      std::map<ino_t, Clock::time_point> seen;
      std::vector<std::string> live;
      std::error_code ec;
      for (const auto& entry : std::filesystem::directory_iterator("/proc/self/fd", ec)) {
        const int fd = std::atoi(entry.path().filename().c_str());
        struct stat st {};
        if (fstat(fd, &st) != 0 || !S_ISSOCK(st.st_mode)) continue;
        sockaddr_storage local{}, peer{};
        socklen_t local_size = sizeof local, peer_size = sizeof peer;
        int listening = 0;
        socklen_t flag_size = sizeof listening;
        if (getsockname(fd, reinterpret_cast<sockaddr*>(&local), &local_size) != 0) continue;
        if (getsockopt(fd, SOL_SOCKET, SO_ACCEPTCONN, &listening, &flag_size) != 0 || listening) continue;
        if (getpeername(fd, reinterpret_cast<sockaddr*>(&peer), &peer_size) != 0) continue;
        char addr[INET6_ADDRSTRLEN] = "";
        int local_port = 0, peer_port = 0;
        if (local.ss_family == AF_INET) {
          local_port = ntohs(reinterpret_cast<sockaddr_in*>(&local)->sin_port);
          peer_port = ntohs(reinterpret_cast<sockaddr_in*>(&peer)->sin_port);
          inet_ntop(AF_INET, &reinterpret_cast<sockaddr_in*>(&peer)->sin_addr, addr, sizeof addr);
        } else if (local.ss_family == AF_INET6) {
          local_port = ntohs(reinterpret_cast<sockaddr_in6*>(&local)->sin6_port);
          peer_port = ntohs(reinterpret_cast<sockaddr_in6*>(&peer)->sin6_port);
          inet_ntop(AF_INET6, &reinterpret_cast<sockaddr_in6*>(&peer)->sin6_addr, addr, sizeof addr);
        } else {
          continue;
        }
        if (local_port != port) continue;
        auto first = first_seen.find(st.st_ino);
        const Clock::time_point since = seen[st.st_ino] = first == first_seen.end() ? now : first->second;
        std::lock_guard lock(peers_mutex);
        const std::string key = peer_key(addr, peer_port);
        auto p = peers.find(key);
        Clock::time_point reading_since = since;
        if (p != peers.end()) {
          live.push_back(key);
          if (p->second.responding) continue;
          reading_since = std::max(since, p->second.since);
        }
        if (now - reading_since > deadline) {
          ::shutdown(fd, SHUT_RDWR);  // the worker's read fails at once and the connection closes
          ++dropped_slow;
          std::fprintf(stderr, "qkv serve: dropped %s:%d: no whole request within %d s\n", addr, peer_port,
                       options.request_deadline_seconds);
        }
      }
      first_seen.swap(seen);
      // Forget clients whose connections are gone (not those marked during this scan: their socket may be newer)
      std::lock_guard lock(peers_mutex);
      for (auto it = peers.begin(); it != peers.end();)
        it = it->second.since < now && std::find(live.begin(), live.end(), it->first) == live.end() ? peers.erase(it) : std::next(it);
    }
  }

  // Wraps a route: HttpError → its status and OpenAI's error object; anything else → 500
  httplib::Server::Handler route(std::function<void(const httplib::Request&, httplib::Response&)> f) {
    return [this, f](const httplib::Request& req, httplib::Response& res) {
      mark(req, true);
      try {
        f(req, res);
      } catch (const HttpError& e) {
        send_error(res, e);
        if (e.status == 429) res.set_header("Retry-After", "1");
      } catch (const std::exception& e) {
        send_error(res, HttpError(500, std::string("internal error: ") + e.what(), "server_error"));
      }
    };
  }

  void routes() {
    http.Post("/v1/chat/completions", route([this](auto& q, auto& r) { chat_completions(q, r); }));
    http.Post("/v1/completions", route([this](auto& q, auto& r) { completions(q, r); }));
    http.Get("/v1/models", route([this](auto& q, auto& r) { models(q, r); }));
    http.Post("/tokenize", route([this](auto& q, auto& r) { tokenize(q, r); }));
    http.Post("/detokenize", route([this](auto& q, auto& r) { detokenize(q, r); }));
    http.Post("/attention", route([this](auto& q, auto& r) { attention(q, r); }));
    http.Get("/health", route([this](auto&, auto& r) { health(r); }));
    http.Get("/metrics", route([this](auto& q, auto& r) { metrics(q, r); }));
    // The chat page: no key needed to load it (it holds nothing); it sends the key the user types with each call.
    http.Get("/", route([](auto&, auto& r) {
      r.set_header("Content-Security-Policy",
                   "default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; connect-src 'self'");
      r.set_header("X-Content-Type-Options", "nosniff");
      r.set_content(chat_page_html(), "text/html; charset=utf-8");
    }));
    // Statuses httplib sets itself (404 no route, 413 too large, 400 malformed) get OpenAI's error object too.
    http.set_error_handler(httplib::Server::HandlerWithResponse([](const httplib::Request& req, httplib::Response& res) {
      if (!res.body.empty()) return httplib::Server::HandlerResponse::Unhandled;
      std::string message = "HTTP error " + std::to_string(res.status);
      if (res.status == 400) message = "The request is malformed";
      std::string code;
      if (res.status == 404) message = "Unknown request URL: " + req.method + " " + req.path, code = "unknown_url";
      if (res.status == 405) code = "method_not_allowed";
      if (res.status == 413) message = "The request body is too large", code = "request_too_large";
      res.set_content(error_body(message, res.status >= 500 ? "server_error" : "invalid_request_error", {}, code).dump(),
                      "application/json");
      return httplib::Server::HandlerResponse::Handled;
    }));
    http.set_logger([this](const httplib::Request& req, const httplib::Response& res) {
      mark(req, false);  // answered: a next request on this connection has the deadline afresh
      (res.status < 300 ? http_2xx : res.status < 500 ? http_4xx : http_5xx)++;
      std::fprintf(stderr, "qkv serve: %s %s → %d\n", req.method.c_str(), req.path.substr(0, 200).c_str(), res.status);
    });
  }
};

Server::Server(const ServerOptions& options) : state_(std::make_unique<State>()) {
  if (options.port < 0 || options.port > 65535) throw ValueError("--port " + std::to_string(options.port) + " is not a port (0 to 65535)");
  if (options.parallel < 1 || options.parallel > 256) throw ValueError("--parallel must be 1 to 256");
  if (options.queue_size < 0 || options.queue_size > 65536) throw ValueError("--queue-size must be 0 to 65536");
  if (options.context < 0) throw ValueError("--ctx-size must not be negative (0: the model's context length)");
  state_->options = options;
  State& s = *state_;
  const size_t threads = options.threads > 0 ? static_cast<size_t>(options.threads)
                                             : static_cast<size_t>(options.parallel + options.queue_size + 8);
  s.http.new_task_queue = [threads] { return new httplib::ThreadPool(threads); };
  s.http.set_payload_max_length(options.max_body_bytes);
  s.http.set_read_timeout(options.read_timeout_seconds, 0);
  s.http.set_write_timeout(options.write_timeout_seconds, 0);
  s.http.set_keep_alive_timeout(5);
  // A streamed token is a few small writes: without TCP_NODELAY, Nagle holds each until the client's (delayed) ACK
  s.http.set_tcp_nodelay(true);
  s.routes();
}


int Server::bind() {
  State& s = *state_;
  if (s.options.port == 0) {
    const int port = s.http.bind_to_any_port(s.options.host);
    if (port <= 0) throw IoError("cannot listen on " + s.options.host + ": is --host an address of this machine?");
    return s.port = port;
  }
  if (!s.http.bind_to_port(s.options.host, s.options.port))
    throw IoError("cannot listen on " + s.options.host + ":" + std::to_string(s.options.port) +
                  ": is another server using the port? Give another --port, or --host an address of this machine");
  return s.port = s.options.port;
}

bool Server::serve() {
  State& s = *state_;
  if (s.options.request_deadline_seconds > 0 && !s.watchdog.joinable()) s.watchdog = std::thread([&s] { s.watch(); });
  return s.http.listen_after_bind();
}

void Server::set_model(std::unique_ptr<nn::Pretrained> model, const std::string& name) {
  State& s = *state_;
  SchedulerOptions o;
  o.parallel = s.options.parallel;
  o.queue_size = s.options.queue_size;
  o.context = s.options.context;
  o.prompt_cache_tokens = s.options.prompt_cache_tokens;
  o.kv_type = s.options.kv_cache;
  auto scheduler = std::make_unique<Scheduler>(*model->model, o);
  std::lock_guard lock(s.mutex);
  s.model = std::move(model);
  s.scheduler = std::move(scheduler);
  s.model_id = s.options.model_name.empty() ? name : s.options.model_name;
  s.ready = true;
}

void Server::set_load_error(const std::string& message) {
  std::lock_guard lock(state_->mutex);
  state_->load_error = message;
}

void Server::stop() {
  State& s = *state_;
  if (s.stopped.exchange(true)) {
    s.http.stop();  // again: serve() may have begun listening since
    return;
  }
  s.draining = true;
  if (s.ready) {
    // Let what runs finish for a while, then cancel the rest; streams then end and their threads return.
    const auto deadline = Clock::now() + std::chrono::seconds(s.options.drain_seconds);
    while (Clock::now() < deadline) {
      const SchedulerStats st = s.scheduler->stats();
      if (st.active + st.queued == 0) break;
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
    s.scheduler->shutdown(true);
  }
  s.http.stop();  // closes the listening socket, then joins the workers (each ends its answer first)
}

Server::~Server() {
  stop();
  if (state_->watchdog.joinable()) state_->watchdog.join();
}

}  // namespace qkv::serve
