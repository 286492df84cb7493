// UndoLog: the inverse steps of a manager operation in progress.
//
// Each step of an operation that changes state pushes its inverse; unless
// the operation commits, the destructor runs them newest first, so a failed
// operation leaves the state as before it. An inverse that fails (the memory
// API failing twice in a row) is counted in *failures and skipped: there is
// nothing better to do.
//
// Invariant: after Commit() the log is empty and its destructor does
// nothing.
#pragma once

#include <cstdint>
#include <functional>
#include <vector>

namespace vtm {

class UndoLog {
 public:
  explicit UndoLog(std::uint64_t* failures) : failures_(failures) {}
  ~UndoLog() {
    for (auto it = steps_.rbegin(); it != steps_.rend(); ++it) {
      try {
        (*it)();
      } catch (...) {
        ++*failures_;
      }
    }
  }
  UndoLog(const UndoLog&) = delete;
  UndoLog& operator=(const UndoLog&) = delete;
  void Add(std::function<void()> step) { steps_.push_back(std::move(step)); }
  void Commit() { steps_.clear(); }

 private:
  std::vector<std::function<void()>> steps_;
  std::uint64_t* failures_;
};

}  // namespace vtm
