// Executor: CPU worker threads that run the manager's operations.
//
// Each task names the keys it touches (vTensor ids; the manager also gives
// each prefix tree a key). Submit() holds mu_ only to queue, never while a
// task runs, so submitting never waits for work in flight. A task starts only after
// every earlier task that shares a key with it has finished, so operations on
// one vTensor run in submission order, while tasks on disjoint keys may run
// on different workers at once. Tasks with no keys are ordered only by the
// queue. A task spanning several keys (a batched step) waits for all of them.
//
// Invariants (guarded by mu_):
//  * tail_[k] is the last submitted, unfinished task with key k;
//  * a task is in ready_ iff its waiting count is 0 and it has not started;
//  * every unfinished task is reachable from ready_, a running worker, or a
//    predecessor's successor list.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <list>
#include <memory>
#include <mutex>
#include <thread>
#include <unordered_map>
#include <vector>

namespace vtm {

class Executor {
 public:
  explicit Executor(int workers);
  ~Executor();
  Executor(const Executor&) = delete;
  Executor& operator=(const Executor&) = delete;

  // Queues `fn`. Throws kFailedPrecondition after Shutdown(). `fn` must not
  // throw; it reports errors through its own future. A barrier task starts
  // after every task submitted before it and before every task after it.
  void Submit(const std::vector<std::uint64_t>& keys, bool barrier, std::function<void()> fn);

  // Runs every queued task to completion, then joins the workers.
  void Shutdown();


 private:
  struct Task {
    std::function<void()> fn;
    std::vector<std::uint64_t> keys;
    int waiting = 0;  // unfinished predecessors
    std::vector<std::shared_ptr<Task>> successors;
    std::list<std::shared_ptr<Task>>::iterator live_pos;
  };
  // Makes `task` wait for `before` (which has not finished).
  static void Chain(const std::shared_ptr<Task>& before, const std::shared_ptr<Task>& task);

  void WorkerLoop();
  void Finish(const std::shared_ptr<Task>& task);

  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::shared_ptr<Task>> ready_;
  std::unordered_map<std::uint64_t, std::shared_ptr<Task>> tail_;
  std::list<std::shared_ptr<Task>> live_;  // every unfinished task, in submission order
  std::shared_ptr<Task> barrier_;          // the last barrier, while unfinished
  bool stopping_ = false;
  std::vector<std::thread> threads_;
};

}  // namespace vtm
