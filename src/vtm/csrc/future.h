// FutureState: the result slot of one queued operation.
//
// The worker fills it exactly once (a value or an error) and wakes waiters.
// Values are plain ids, never owning references to the manager: the binding
// turns them into Python objects on the waiting thread, so no worker thread
// touches Python or can drop the manager's last reference.
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <exception>
#include <mutex>
#include <variant>

namespace vtm {

struct VTensorRef {
  std::uint64_t id = 0;
};

struct MatchResult {
  std::uint64_t vtensor = 0;  // 0 when nothing matched
  std::size_t num_tokens = 0;
  std::size_t restored_tokens = 0;  // of num_tokens, those copied back from the host tier
};

using FutureValue = std::variant<std::monostate, VTensorRef, MatchResult, std::int64_t>;

class FutureState {
 public:
  void SetValue(FutureValue value) {
    std::lock_guard<std::mutex> lock(mu_);
    value_ = std::move(value);
    done_ = true;
    cv_.notify_all();
  }
  void SetError(std::exception_ptr error) {
    std::lock_guard<std::mutex> lock(mu_);
    error_ = std::move(error);
    done_ = true;
    cv_.notify_all();
  }
  bool done() const {
    std::lock_guard<std::mutex> lock(mu_);
    return done_;
  }
  // Waits up to `timeout_s` seconds (forever when negative); true when done.
  bool Wait(double timeout_s) const {
    std::unique_lock<std::mutex> lock(mu_);
    if (timeout_s < 0) {
      cv_.wait(lock, [this] { return done_; });
      return true;
    }
    return cv_.wait_for(lock, std::chrono::duration<double>(timeout_s), [this] { return done_; });
  }
  // Only after Wait() returned true.
  const FutureValue& value() const { return value_; }
  std::exception_ptr error() const { return error_; }

 private:
  mutable std::mutex mu_;
  mutable std::condition_variable cv_;
  bool done_ = false;
  FutureValue value_;
  std::exception_ptr error_;
};

}  // namespace vtm
