#include "executor.h"

#include <algorithm>

#include "error.h"

namespace vtm {

Executor::Executor(int workers) {
  if (workers < 1 || workers > 256)
    Throw(ErrorCode::kInvalidArgument, "workers must be in [1, 256], got " + std::to_string(workers));
  threads_.reserve(workers);
  for (int i = 0; i < workers; ++i) threads_.emplace_back([this] { WorkerLoop(); });
}

Executor::~Executor() { Shutdown(); }

void Executor::Chain(const std::shared_ptr<Task>& before, const std::shared_ptr<Task>& task) {
  if (before == task) return;
  auto& succ = before->successors;
  if (std::find(succ.begin(), succ.end(), task) != succ.end()) return;
  succ.push_back(task);
  ++task->waiting;
}

void Executor::Submit(const std::vector<std::uint64_t>& keys, bool barrier, std::function<void()> fn) {
  auto task = std::make_shared<Task>();
  task->fn = std::move(fn);
  task->keys = keys;
  std::lock_guard<std::mutex> lock(mu_);
  if (stopping_) Throw(ErrorCode::kFailedPrecondition, "the manager is closed");
  if (barrier) {
    for (auto& t : live_) Chain(t, task);
  } else if (barrier_) {
    Chain(barrier_, task);
  }
  for (std::uint64_t key : keys) {
    auto [it, inserted] = tail_.emplace(key, task);
    if (!inserted) {
      Chain(it->second, task);
      it->second = task;
    }
  }
  if (barrier) barrier_ = task;
  live_.push_back(task);
  task->live_pos = std::prev(live_.end());
  if (task->waiting == 0) {
    ready_.push_back(task);
    cv_.notify_one();
  }
}

void Executor::Shutdown() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stopping_ = true;
    cv_.notify_all();
  }
  for (auto& t : threads_)
    if (t.joinable()) t.join();
  threads_.clear();
}

void Executor::WorkerLoop() {
  std::unique_lock<std::mutex> lock(mu_);
  for (;;) {
    cv_.wait(lock, [this] { return !ready_.empty() || (stopping_ && live_.empty()); });
    if (ready_.empty()) return;  // stopping and drained
    std::shared_ptr<Task> task = std::move(ready_.front());
    ready_.pop_front();
    lock.unlock();
    task->fn();
    task->fn = nullptr;  // drop captures outside the lock
    lock.lock();
    Finish(task);
  }
}

void Executor::Finish(const std::shared_ptr<Task>& task) {
  for (std::uint64_t key : task->keys) {
    auto it = tail_.find(key);
    if (it != tail_.end() && it->second == task) tail_.erase(it);
  }
  if (barrier_ == task) barrier_.reset();
  for (auto& next : task->successors)
    if (--next->waiting == 0) ready_.push_back(next);
  task->successors.clear();
  live_.erase(task->live_pos);
  cv_.notify_all();
}

}  // namespace vtm
