// Python binding of vtm (module vtm._core).
//
// The Python objects hold a PyManager, which owns the C++ Manager; worker
// threads never hold either, so the manager is always destroyed on a Python
// thread. Every call into the Manager (a submission, a read, a future, a
// barrier operation, close) runs without the GIL, so a Python thread that
// waits for vtm never holds up the others; nothing here is ever called from
// a worker.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <mutex>
#include <unordered_map>

#include "backend.h"
#include "backend_checked.h"
#include "backend_faulty.h"
#include "dlpack_view.h"
#include "error.h"
#include "manager.h"
#include "mapper_client.h"

namespace py = pybind11;

namespace vtm {
namespace {

struct PyVTensor;

// One per Python-side manager: the C++ manager plus the table that keeps
// one Python object per live vTensor id.
struct PyManager {
  std::unique_ptr<Manager> core;
  std::mutex mu;
  std::unordered_map<std::uint64_t, std::weak_ptr<PyVTensor>> vtensors;
  std::size_t sweep_at = 1024;
};

struct PyVTensor {
  std::shared_ptr<PyManager> mgr;
  std::uint64_t id;
};

// `fixed` is the space's geometry and names, read once when the object is
// made: they never change, and a closed space leaves nothing behind in the
// manager to read them from.
struct PySpace {
  std::shared_ptr<PyManager> mgr;
  std::uint32_t id;
  std::shared_ptr<const SpaceInfo> fixed;
};

struct PyMatch {
  std::shared_ptr<PyVTensor> vtensor;
  std::size_t num_tokens;
  std::size_t restored_tokens;  // of num_tokens, those copied back from the host tier
};

struct PyFuture {
  std::shared_ptr<PyManager> mgr;
  std::shared_ptr<FutureState> state;
};

// The fault injector of a faults=True manager or client mapper. `get`
// keeps its owner alive and finds the injector at each call (a closed
// manager's raises).
struct PyFaults {
  std::function<FaultInjectingBackend*()> get;
};

std::shared_ptr<PyVTensor> VTensorObject(const std::shared_ptr<PyManager>& mgr, std::uint64_t id) {
  std::lock_guard<std::mutex> lock(mgr->mu);
  auto& weak = mgr->vtensors[id];
  if (auto existing = weak.lock()) return existing;
  auto vt = std::make_shared<PyVTensor>(PyVTensor{mgr, id});
  weak = vt;
  if (mgr->vtensors.size() >= mgr->sweep_at) {
    for (auto it = mgr->vtensors.begin(); it != mgr->vtensors.end();)
      it = it->second.expired() ? mgr->vtensors.erase(it) : std::next(it);
    mgr->sweep_at = std::max<std::size_t>(1024, 2 * mgr->vtensors.size());
  }
  return vt;
}

py::object ToPython(const std::shared_ptr<PyManager>& mgr, const FutureValue& value) {
  if (std::holds_alternative<VTensorRef>(value)) return py::cast(VTensorObject(mgr, std::get<VTensorRef>(value).id));
  if (std::holds_alternative<MatchResult>(value)) {
    const MatchResult& m = std::get<MatchResult>(value);
    return py::cast(
        PyMatch{m.vtensor == 0 ? nullptr : VTensorObject(mgr, m.vtensor), m.num_tokens, m.restored_tokens});
  }
  if (std::holds_alternative<std::int64_t>(value)) return py::int_(std::get<std::int64_t>(value));
  return py::none();
}

// A Python timeout as FutureState::Wait takes it: None waits forever, a
// negative one does not wait (as concurrent.futures), and one past any real
// deadline (inf, 1e300) is no deadline: as a steady_clock duration it would
// overflow and time out at once.
double TimeoutSeconds(std::optional<double> timeout) {
  if (!timeout) return -1.0;
  if (std::isnan(*timeout)) Throw(ErrorCode::kInvalidArgument, "timeout must be a number of seconds, got nan");
  constexpr double kForeverSeconds = 1e9;
  return *timeout >= kForeverSeconds ? -1.0 : std::max(*timeout, 0.0);
}

// Waits without the GIL; raises TimeoutError or the operation's error.
py::object ResultWithin(const PyFuture& f, double timeout_s) {
  bool done;
  {
    py::gil_scoped_release release;
    done = f.state->Wait(timeout_s);
  }
  if (!done) {
    PyErr_SetString(PyExc_TimeoutError, "the vtm operation did not finish in time");
    throw py::error_already_set();
  }
  if (f.state->error()) std::rethrow_exception(f.state->error());
  return ToPython(f.mgr, f.state->value());
}

py::object Result(const PyFuture& f, std::optional<double> timeout) { return ResultWithin(f, TimeoutSeconds(timeout)); }

py::object Wait(const std::shared_ptr<PyManager>& mgr, std::shared_ptr<FutureState> state) {
  return Result(PyFuture{mgr, std::move(state)}, std::nullopt);
}

Manager& Core(const std::shared_ptr<PyManager>& mgr) { return *mgr->core; }

// Runs `fn` without the GIL. Every call into the Manager goes through here:
// a read takes the manager's mutex, which an operation in flight holds for
// its whole duration, and other Python threads must not wait for that.
template <class Fn>
auto NoGil(Fn&& fn) {
  py::gil_scoped_release release;
  return fn();
}

SpaceInfo DescribeSpace(const PySpace& s) {
  return NoGil([&] { return Core(s.mgr).DescribeSpace(s.id); });
}

// A count from a dict entry or a stream handle, converted here rather than by
// pybind11 (whose cast error is a bare RuntimeError): an int, or anything
// with __index__ (numpy ints); another type is a TypeError naming `what`.
std::int64_t IntValue(const py::handle& value, const std::string& what) {
  if (!PyIndex_Check(value.ptr()))
    throw py::type_error(what + " must be an int, got " + std::string(py::str(py::type::of(value).attr("__name__"))));
  py::object index = py::reinterpret_steal<py::object>(PyNumber_Index(value.ptr()));
  if (!index) throw py::error_already_set();
  int overflow = 0;
  const long long n = PyLong_AsLongLongAndOverflow(index.ptr(), &overflow);
  if (overflow != 0)
    Throw(ErrorCode::kInvalidArgument, what + " " + std::string(py::str(index)) + " is out of the 64-bit range");
  return n;
}

// A dict key of step/shrink: a VTensor of this manager.
const PyVTensor& TargetVTensor(const std::shared_ptr<PyManager>& mgr, const py::handle& key, const char* op) {
  if (!py::isinstance<PyVTensor>(key))
    throw py::type_error(std::string(op) + ": targets map VTensors to counts, got a key of type " +
                         std::string(py::str(py::type::of(key).attr("__name__"))));
  const auto& vt = key.cast<const PyVTensor&>();
  if (vt.mgr != mgr) Throw(ErrorCode::kFailedPrecondition, std::string(op) + ": vTensor of another manager");
  return vt;
}

// The stream a fence is recorded on: None is the legacy default stream (0),
// where torch queues its kernels unless told otherwise; an int is a CUstream
// handle; anything with a `cuda_stream` attribute (torch.cuda.Stream) is that
// stream.
std::uintptr_t StreamHandle(const py::object& stream) {
  if (stream.is_none()) return 0;
  py::object handle = py::hasattr(stream, "cuda_stream") ? stream.attr("cuda_stream") : stream;
  if (!py::isinstance<py::int_>(handle))
    Throw(ErrorCode::kInvalidArgument, "stream must be None, a CUstream handle (int) or have a cuda_stream attribute");
  const std::int64_t value = IntValue(handle, "stream handle");
  if (value < 0) Throw(ErrorCode::kInvalidArgument, "stream handle must be >= 0, got " + std::to_string(value));
  return static_cast<std::uintptr_t>(value);
}

PySpace SpaceObject(const std::shared_ptr<PyManager>& mgr, std::uint32_t id) {
  return PySpace{mgr, id, std::make_shared<const SpaceInfo>(NoGil([&] { return Core(mgr).DescribeSpace(id); }))};
}

// Python ints may be negative; sizes may not.
std::size_t Count(std::int64_t n, const char* what) {
  if (n < 0) Throw(ErrorCode::kInvalidArgument, std::string(what) + " must be >= 0, got " + std::to_string(n));
  return static_cast<std::size_t>(n);
}

std::uint32_t TierAccount(std::int64_t account) {
  if (account < 0 || account > std::int64_t{UINT32_MAX})
    Throw(ErrorCode::kInvalidArgument, "tier_account must be in [0, 2^32), got " + std::to_string(account));
  return static_cast<std::uint32_t>(account);
}

py::dict SpaceDict(const SpaceInfo& s) {
  py::dict d;
  d["namespace"] = s.ns;
  d["row_bytes"] = s.row_bytes;
  d["slot_bytes"] = s.slot_bytes;
  d["max_slots"] = s.max_slots;
  d["slots_free"] = s.slots_free;
  d["vtensors"] = s.vtensors;
  d["used_tokens"] = s.used_tokens;
  d["used_bytes"] = s.used_tokens * s.row_bytes;
  d["mapped_bytes"] = s.mapped_bytes;
  d["cached_bytes"] = s.cached_bytes;
  return d;
}

// {operation: {"calls": n, "seconds": s}} for every backend operation.
py::dict CostsDict(const std::vector<CheckedBackend::OpCost>& costs) {
  py::dict d;
  for (const auto& cost : costs) {
    py::dict entry;
    entry["calls"] = cost.calls;
    entry["seconds"] = cost.seconds;
    d[cost.op] = entry;
  }
  return d;
}

py::dict StatsDict(const Stats& st) {
  py::dict d;
  d["backend"] = st.backend;
  d["chunk_bytes"] = st.chunk_bytes;
  d["capacity_bytes"] = st.capacity_bytes;
  d["chunks_created"] = st.chunks_created;
  d["chunks_free"] = st.chunks_free;
  d["chunks_held"] = st.chunks_held;
  d["chunks_mapped"] = st.chunks_mapped;
  d["chunks_cached"] = st.chunks_cached;
  d["chunks_in_tree"] = st.chunks_in_tree;
  d["tree_nodes"] = st.tree_nodes;
  d["tree_tokens"] = st.tree_tokens;
  d["index_bytes"] = st.index_bytes;
  d["index_budget_bytes"] = st.index_budget_bytes;
  d["index_drops_total"] = st.index_drops_total;
  d["window_page_drops_total"] = st.window_page_drops_total;
  d["evictions_total"] = st.evictions_total;
  d["cow_copies_total"] = st.cow_copies_total;
  d["slot_reuses_total"] = st.slot_reuses_total;
  d["prealloc_chunks_total"] = st.prealloc_chunks_total;
  d["chunks_released_total"] = st.chunks_released_total;
  d["rollback_failures_total"] = st.rollback_failures_total;
  d["prefix_unpins_total"] = st.prefix_unpins_total;
  d["reservation_free_failures_total"] = st.reservation_free_failures_total;
  d["host_tier_capacity_bytes"] = st.host_tier_capacity_bytes;
  d["host_tier_used_bytes"] = st.host_tier_used_bytes;
  d["host_tier_allocated_bytes"] = st.host_tier_allocated_bytes;
  d["host_tier_prealloc_blocks_total"] = st.host_tier_prealloc_blocks_total;
  d["host_tier_nodes"] = st.host_tier_nodes;
  d["spills_total"] = st.spills_total;
  d["spilled_bytes_total"] = st.spilled_bytes_total;
  d["spill_failures_total"] = st.spill_failures_total;
  d["spills_ahead_total"] = st.spills_ahead_total;
  d["spills_ahead_abandoned_total"] = st.spills_ahead_abandoned_total;
  d["restores_total"] = st.restores_total;
  d["restored_bytes_total"] = st.restored_bytes_total;
  d["host_tier_drops_total"] = st.host_tier_drops_total;
  d["host_tier_limit_drops_total"] = st.host_tier_limit_drops_total;
  py::dict accounts;
  for (const auto& [account, usage] : st.host_tier_accounts) {
    py::dict a;
    a["used_bytes"] = usage.first;
    a["limit_bytes"] = usage.second ? py::cast(*usage.second) : py::none();
    accounts[py::int_(account)] = a;
  }
  d["host_tier_accounts"] = accounts;
  d["restore_seconds_total"] = st.restore_seconds_total;
  d["restore_copy_seconds_total"] = st.restore_copy_seconds_total;
  d["spill_copy_seconds_total"] = st.spill_copy_seconds_total;
  py::dict spaces;
  for (const auto& [name, info] : st.spaces) spaces[py::str(name)] = SpaceDict(info);
  d["spaces"] = spaces;
  py::dict ops;
  for (const auto& [name, op] : st.ops) {
    py::dict o;
    o["count"] = op.count;
    o["errors"] = op.errors;
    o["mean_us"] = op.count ? op.total_us / static_cast<double>(op.count) : 0.0;
    o["max_us"] = op.max_us;
    ops[py::str(name)] = o;
  }
  d["ops"] = ops;
  return d;
}

// A consumer renames the capsule ("used_...") and owns the tensor from then
// on; a capsule never consumed still owns it here.
void DestroyLegacyCapsule(PyObject* capsule) {
  if (PyCapsule_IsValid(capsule, "dltensor"))
    DeleteDLPackView(PyCapsule_GetPointer(capsule, "dltensor"), /*versioned=*/false);
}

void DestroyVersionedCapsule(PyObject* capsule) {
  if (PyCapsule_IsValid(capsule, "dltensor_versioned"))
    DeleteDLPackView(PyCapsule_GetPointer(capsule, "dltensor_versioned"), /*versioned=*/true);
}

std::shared_ptr<PyManager> OpenManager(const std::string& backend, std::int64_t capacity_bytes, std::int64_t chunk_bytes,
                                       int device, int workers, std::int64_t prealloc_chunks,
                                       std::optional<std::int64_t> max_free_chunks,
                                       std::optional<std::int64_t> slot_cache_bytes,
                                       std::optional<std::int64_t> granularity, bool faults, bool record_mappings,
                                       bool export_chunks, std::int64_t host_tier_bytes,
                                       std::int64_t spill_ahead_bytes) {
  ManagerOptions o;
  o.backend = backend;
  o.capacity_bytes = Count(capacity_bytes, "capacity_bytes");
  o.chunk_bytes = Count(chunk_bytes, "chunk_bytes");
  o.device = device;
  o.workers = workers;
  o.prealloc_chunks = Count(prealloc_chunks, "prealloc_chunks");
  if (max_free_chunks) o.max_free_chunks = Count(*max_free_chunks, "max_free_chunks");
  if (slot_cache_bytes) o.slot_cache_bytes = Count(*slot_cache_bytes, "slot_cache_bytes");
  if (granularity) o.granularity = Count(*granularity, "granularity");
  o.faults = faults;
  o.record_mappings = record_mappings;
  o.export_chunks = export_chunks;
  o.host_tier_bytes = Count(host_tier_bytes, "host_tier_bytes");
  o.spill_ahead_bytes = Count(spill_ahead_bytes, "spill_ahead_bytes");
  auto mgr = std::make_shared<PyManager>();
  py::gil_scoped_release release;
  mgr->core = std::make_unique<Manager>(o);
  return mgr;
}

std::vector<py::object> PageList(const std::vector<ChunkId>& pages) {
  std::vector<py::object> out;
  out.reserve(pages.size());
  for (ChunkId c : pages) out.push_back(c == kNoChunk ? py::none() : py::object(py::int_(c)));
  return out;
}

// Page effects cross to Python as (slot, page, chunk, serial) tuples, with
// chunk -1 and serial 0 for an unmapped page.
using EffectTuple = std::tuple<int, std::size_t, std::int64_t, std::uint64_t>;

std::vector<EffectTuple> EffectsToPython(const std::vector<PageEffect>& effects) {
  std::vector<EffectTuple> out;
  out.reserve(effects.size());
  for (const PageEffect& e : effects)
    out.emplace_back(e.slot, e.page, e.chunk == kNoChunk ? -1 : static_cast<std::int64_t>(e.chunk), e.serial);
  return out;
}

std::vector<PageEffect> EffectsFromPython(const std::vector<EffectTuple>& tuples) {
  std::vector<PageEffect> out;
  out.reserve(tuples.size());
  for (const auto& [slot, page, chunk, serial] : tuples) {
    if (chunk < -1 || chunk >= static_cast<std::int64_t>(kNoChunk) || (chunk == -1) != (serial == 0))
      Throw(ErrorCode::kInvalidArgument, "malformed page effect");
    out.push_back(PageEffect{slot, page, chunk == -1 ? kNoChunk : static_cast<ChunkId>(chunk), serial});
  }
  return out;
}

VTensorInfo LiveInfo(const PyVTensor& vt) {
  VTensorInfo info = NoGil([&] { return Core(vt.mgr).DescribeVTensor(vt.id); });
  if (!info.live) Throw(ErrorCode::kFailedPrecondition, "vTensor " + std::to_string(vt.id) + " was released");
  return info;
}

}  // namespace
}  // namespace vtm

PYBIND11_MODULE(_core, m) {
  using namespace vtm;
  m.doc() = "vTensor Manager core (C++)";
  m.attr("MAX_SPACE_BYTES") = Manager::kMaxSpaceBytes;
  m.attr("_SLOT_TABLE_ENTRIES") = Manager::kSlotTableEntries;
  m.attr("_TABLE_ENTRIES_PER_CHUNK") = Manager::kTableEntriesPerChunk;
  m.attr("_MIN_TABLE_ENTRIES") = Manager::kMinTableEntries;

  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const Error& e) {
      py::object cls = py::module_::import("vtm.errors").attr(ErrorCodeName(e.code()));
      PyErr_SetString(cls.ptr(), e.what());
    }
  });

  m.def("cuda_available", &CudaDriverAvailable, py::call_guard<py::gil_scoped_release>(),
        "True when libcuda.so.1 loads and reports a device.");

  py::class_<PyFuture>(m, "Future", "The result of a queued vtm operation.")
      .def("result", &Result, py::arg("timeout") = py::none(),
           "Wait (without the GIL) and return the value, or raise the operation's error.")
      .def("done", [](const PyFuture& f) { return f.state->done(); })
      .def(
          "exception",
          [](const PyFuture& f, std::optional<double> timeout) -> py::object {
            const double timeout_s = TimeoutSeconds(timeout);  // a bad timeout raises, it is not the operation's error
            try {
              ResultWithin(f, timeout_s);
            } catch (py::error_already_set& e) {
              if (e.matches(PyExc_TimeoutError)) throw;
              return e.value();
            } catch (const Error& e) {
              py::object cls = py::module_::import("vtm.errors").attr(ErrorCodeName(e.code()));
              return cls(e.what());
            }
            return py::none();
          },
          py::arg("timeout") = py::none());

  py::class_<Fence, std::shared_ptr<Fence>>(
      m, "Fence", "The work queued on a CUDA stream when the fence was recorded (see Backend.record_fence).")
      .def("wait", &Fence::Wait, py::call_guard<py::gil_scoped_release>(),
           "Block until that work has finished.");

  py::class_<PendingCopies>(m, "PendingCopies",
                            "Copies a backend started (RawBackend.start_copy_from_host_many), not yet waited for.")
      .def("wait", &PendingCopies::Wait, py::call_guard<py::gil_scoped_release>(),
           "Block until every copy has finished; raises if one failed. Call once.");

  py::class_<PyMatch>(m, "Match", "A prefix match: the new vTensor (or None) and the matched token count.")
      .def_readonly("vtensor", &PyMatch::vtensor)
      .def_readonly("num_tokens", &PyMatch::num_tokens)
      .def_readonly("restored_tokens", &PyMatch::restored_tokens)
      .def("__repr__", [](const PyMatch& mt) {
        return "Match(num_tokens=" + std::to_string(mt.num_tokens) +
               (mt.vtensor ? ", vtensor=" + std::to_string(mt.vtensor->id) : std::string(", vtensor=None")) + ")";
      });

  py::class_<PyVTensor, std::shared_ptr<PyVTensor>>(m, "VTensor", "One request's KV: a slot and its page table.")
      .def_property_readonly("id", [](const PyVTensor& vt) { return vt.id; })
      .def_property_readonly("released",
                             [](const PyVTensor& vt) {
                               return !NoGil([&] { return Core(vt.mgr).DescribeVTensor(vt.id); }).live;
                             })
      .def_property_readonly("space", [](const PyVTensor& vt) { return SpaceObject(vt.mgr, LiveInfo(vt).space); })
      .def_property_readonly("slot", [](const PyVTensor& vt) { return LiveInfo(vt).slot; })
      .def_property_readonly("num_tokens", [](const PyVTensor& vt) { return LiveInfo(vt).num_tokens; })
      .def_property_readonly("address", [](const PyVTensor& vt) { return LiveInfo(vt).address; })
      .def_property_readonly("mapped_bytes", [](const PyVTensor& vt) { return LiveInfo(vt).mapped_bytes; })
      .def("page_chunks", [](const PyVTensor& vt) { return PageList(LiveInfo(vt).pages); })
      .def_property_readonly("low", [](const PyVTensor& vt) { return LiveInfo(vt).low; })
      .def(
          "extend",
          [](const PyVTensor& vt, std::int64_t n, std::optional<std::int64_t> low) {
            const std::size_t tokens = Count(n, "num_tokens");
            std::optional<std::size_t> mark;
            if (low) mark = Count(*low, "low");
            return PyFuture{vt.mgr, NoGil([&] { return Core(vt.mgr).Extend(vt.id, tokens, mark); })};
          },
          py::arg("num_tokens"), py::arg("low") = py::none())
      .def(
          "shrink",
          [](const PyVTensor& vt, std::int64_t n) {
            std::vector<ShrinkTarget> one{ShrinkTarget{vt.id, Count(n, "num_tokens")}};
            return PyFuture{vt.mgr, NoGil([&] { return Core(vt.mgr).Shrink(std::move(one)); })};
          },
          py::arg("num_tokens"))
      .def("release",
           [](const PyVTensor& vt) { return PyFuture{vt.mgr, NoGil([&] { return Core(vt.mgr).Release(vt.id); })}; })
      .def("__hash__", [](const PyVTensor& vt) { return std::hash<std::uint64_t>()(vt.id); })
      .def("__eq__",
           [](const PyVTensor& a, py::object b) {
             if (!py::isinstance<PyVTensor>(b)) return false;
             const auto& other = b.cast<const PyVTensor&>();
             return a.mgr == other.mgr && a.id == other.id;
           })
      .def("__repr__", [](const PyVTensor& vt) {
        VTensorInfo info = NoGil([&] { return Core(vt.mgr).DescribeVTensor(vt.id); });
        if (!info.live) return "VTensor(id=" + std::to_string(vt.id) + ", released)";
        return "VTensor(id=" + std::to_string(vt.id) + ", slot=" + std::to_string(info.slot) +
               ", num_tokens=" + std::to_string(info.num_tokens) + ")";
      });

  py::class_<PySpace>(m, "Space", "One model instance's KV area: a reservation of max_slots slots.")
      .def(
          "create",
          [](const PySpace& s, std::int64_t n) {
            const std::size_t tokens = Count(n, "num_tokens");
            return PyFuture{s.mgr, NoGil([&] { return Core(s.mgr).Create(s.id, tokens); })};
          },
          py::arg("num_tokens"))
      .def(
          "prefix_record",
          [](const PySpace& s, const PyVTensor& vt, std::vector<std::int32_t> tokens, const py::object& stream,
             bool release) {
            if (vt.mgr != s.mgr) Throw(ErrorCode::kFailedPrecondition, "prefix_record: vTensor of another manager");
            const std::uintptr_t handle = StreamHandle(stream);
            return PyFuture{s.mgr, NoGil([&] {
                              return Core(s.mgr).PrefixRecord(s.id, vt.id, std::move(tokens), handle, release);
                            })};
          },
          py::arg("vtensor"), py::arg("token_ids"), py::kw_only(), py::arg("stream") = py::none(),
          py::arg("release") = false)
      .def(
          "prefix_match",
          [](const PySpace& s, std::vector<std::int32_t> tokens, const py::object& stream,
             std::optional<std::int64_t> max_restore_bytes) {
            const std::uintptr_t handle = StreamHandle(stream);
            const std::size_t max_pages =
                max_restore_bytes ? Count(*max_restore_bytes, "max_restore_bytes") / Core(s.mgr).chunk_bytes()
                                  : SIZE_MAX;
            return PyFuture{s.mgr, NoGil([&] {
                              return Core(s.mgr).PrefixMatch(s.id, std::move(tokens), handle, max_pages);
                            })};
          },
          py::arg("token_ids"), py::kw_only(), py::arg("stream") = py::none(), py::arg("max_restore_bytes") = py::none())
      .def(
          "prefix_restore_bytes",
          [](const PySpace& s, const std::vector<std::int32_t>& tokens) {
            return NoGil([&] { return Core(s.mgr).PrefixRestorePages(s.id, tokens) * Core(s.mgr).chunk_bytes(); });
          },
          py::arg("token_ids"),
          "The host-tier bytes a prefix_match of token_ids would copy back if it ran now (0 without a tier).")
      .def(
          "prefix_forget",
          [](const PySpace& s, std::vector<std::int32_t> tokens) {
            return PyFuture{s.mgr, NoGil([&] { return Core(s.mgr).PrefixForget(s.id, std::move(tokens)); })};
          },
          py::arg("token_ids"),
          "Future[int]: takes back one prefix_record of token_ids; the path's nodes that no other record "
          "or live vTensor needs leave the tree. The tokens removed (0: nothing of the path to remove).")
      .def("clear_prefixes",
           [](const PySpace& s) { return Wait(s.mgr, NoGil([&] { return Core(s.mgr).ClearPrefixes(s.id); })); })
      .def("close", [](const PySpace& s) { Wait(s.mgr, NoGil([&] { return Core(s.mgr).CloseSpace(s.id); })); })
      .def("prefix_nodes",
           [](const PySpace& s, std::optional<std::int64_t> max_index_bytes) {
             py::list out;
             const std::size_t most = max_index_bytes ? Count(*max_index_bytes, "max_index_bytes") : SIZE_MAX;
             for (const NodeInfo& n : NoGil([&] { return Core(s.mgr).PrefixNodes(s.id, most); })) {
               py::dict d;
               d["start"] = n.start;
               d["end"] = n.end;
               d["tokens"] = n.tokens;
               d["locks"] = n.locks;
               d["pages"] = PageList(n.pages);  // None: a hole (window spaces), or on the host
               d["on_host"] = n.on_host;
               d["host_pages"] = n.host_pages;
               out.append(d);
             }
             return out;
           },
           py::kw_only(), py::arg("max_index_bytes") = py::none())
      .def(
          "_dlpack",
          [](const PySpace& s, int code, int bits, std::vector<std::int64_t> shape, bool versioned) {
            DLDataType dtype{static_cast<std::uint8_t>(code), static_cast<std::uint8_t>(bits), 1};
            void* t = MakeDLPackView(NoGil([&] { return Core(s.mgr).SpaceReservation(s.id); }), dtype, shape, versioned);
            if (versioned) return py::capsule(t, "dltensor_versioned", &DestroyVersionedCapsule);
            return py::capsule(t, "dltensor", &DestroyLegacyCapsule);
          },
          py::arg("code"), py::arg("bits"), py::arg("shape"), py::arg("versioned"))
      .def_property_readonly("_device",
                             [](const PySpace& s) {
                               const auto& b = Core(s.mgr).backend();
                               return std::make_pair(static_cast<int>(b->device_type()), b->device_id());
                             })
      .def_property_readonly("id", [](const PySpace& s) { return s.id; })
      .def_property_readonly("name", [](const PySpace& s) { return s.fixed->name; })
      .def_property_readonly("namespace", [](const PySpace& s) { return s.fixed->ns; })
      .def_property_readonly("row_bytes", [](const PySpace& s) { return s.fixed->row_bytes; })
      .def_property_readonly("window_tokens", [](const PySpace& s) { return s.fixed->window_tokens; })
      .def_property_readonly("max_tokens", [](const PySpace& s) { return s.fixed->max_tokens; })
      .def_property_readonly("max_slots", [](const PySpace& s) { return s.fixed->max_slots; })
      .def_property_readonly("slot_bytes", [](const PySpace& s) { return s.fixed->slot_bytes; })
      .def_property_readonly("pages_per_slot", [](const PySpace& s) { return s.fixed->pages_per_slot; })
      .def_property_readonly("base_address", [](const PySpace& s) { return DescribeSpace(s).base; })
      .def_property_readonly("free_slots", [](const PySpace& s) { return DescribeSpace(s).slots_free; })
      .def_property_readonly("closed", [](const PySpace& s) { return DescribeSpace(s).closed; })
      .def("__repr__", [](const PySpace& s) {
        const SpaceInfo& i = *s.fixed;
        return "Space(name='" + i.name + "', row_bytes=" + std::to_string(i.row_bytes) +
               ", max_tokens=" + std::to_string(i.max_tokens) + ", max_slots=" + std::to_string(i.max_slots) + ")";
      });

  py::class_<PyFaults>(m, "FaultInjector",
                      "Makes chosen backend calls fail (faults=True managers and client mappers only).")
      .def(
          "fail_nth",
          [](const PyFaults& f, const std::string& op, int n, bool oom, bool bad_alloc) {
            f.get()->FailNth(FaultInjectingBackend::OpFromName(op), n, oom, bad_alloc);
          },
          py::arg("op"), py::arg("n") = 1, py::arg("oom") = false, py::arg("bad_alloc") = false)
      .def(
          "delay",
          [](const PyFaults& f, const std::string& op, double seconds) {
            f.get()->SetDelay(FaultInjectingBackend::OpFromName(op), seconds);
          },
          py::arg("op"), py::arg("seconds"))
      .def(
          "set_physical_limit",
          [](const PyFaults& f, std::optional<std::size_t> bytes) { f.get()->SetPhysicalLimit(bytes); },
          py::arg("bytes"))
      .def("calls",
           [](const PyFaults& f, const std::string& op) {
             return f.get()->Calls(FaultInjectingBackend::OpFromName(op));
           })
      .def("clear", [](const PyFaults& f) { f.get()->Clear(); });

  py::class_<PyManager, std::shared_ptr<PyManager>>(m, "Manager", "The vTensor Manager.")
      .def(py::init(&OpenManager), py::arg("backend") = "auto", py::arg("capacity_bytes") = std::size_t{1} << 30,
           py::arg("chunk_bytes") = std::size_t{2} << 20, py::kw_only(), py::arg("device") = 0, py::arg("workers") = 1,
           py::arg("prealloc_chunks") = 0, py::arg("max_free_chunks") = py::none(),
           py::arg("slot_cache_bytes") = py::none(), py::arg("granularity") = py::none(), py::arg("faults") = false,
           py::arg("record_mappings") = false, py::arg("export_chunks") = false, py::arg("host_tier_bytes") = 0,
           py::arg("spill_ahead_bytes") = 0)
      .def(
          "_drain_effects",
          [](const std::shared_ptr<PyManager>& mgr, std::uint32_t space) {
            std::vector<PageEffect> effects;
            {
              py::gil_scoped_release release;
              effects = Core(mgr).DrainEffects(space);
            }
            return EffectsToPython(effects);
          },
          py::arg("space_id"))
      .def(
          "_chunk_fd",
          [](const std::shared_ptr<PyManager>& mgr, std::uint32_t chunk, std::uint64_t serial) {
            return Core(mgr).DupChunkFd(chunk, serial);
          },
          py::arg("chunk"), py::arg("serial"), py::call_guard<py::gil_scoped_release>())
      .def(
          "create_space",
          [](const std::shared_ptr<PyManager>& mgr, std::int64_t row_bytes, std::int64_t max_tokens,
             std::int64_t max_slots, std::optional<std::string> ns, std::optional<std::string> name,
             std::int64_t window_tokens, std::int64_t tier_account) {
            const std::size_t r = Count(row_bytes, "row_bytes"), t = Count(max_tokens, "max_tokens"),
                              n = Count(max_slots, "max_slots"), w = Count(window_tokens, "window_tokens");
            const std::uint32_t account = TierAccount(tier_account);
            std::uint32_t id;
            {
              py::gil_scoped_release release;
              id = Core(mgr).CreateSpace(r, t, n, ns.value_or(""), name.value_or(""), w, account);
            }
            return SpaceObject(mgr, id);
          },
          py::arg("row_bytes"), py::arg("max_tokens"), py::arg("max_slots"), py::arg("namespace") = py::none(),
          py::arg("name") = py::none(), py::kw_only(), py::arg("window_tokens") = 0, py::arg("tier_account") = 0)
      .def(
          "set_host_tier_limit",
          [](const std::shared_ptr<PyManager>& mgr, std::int64_t account, std::int64_t bytes) {
            const std::uint32_t a = TierAccount(account);
            const std::size_t b = Count(bytes, "bytes");
            NoGil([&] { Core(mgr).SetHostTierLimit(a, b); });
          },
          py::arg("account"), py::arg("bytes"),
          "The most host-tier bytes the prefixes recorded by spaces of tier_account `account` may hold "
          "(rounded down to whole chunks; 0: no limit but the tier's). Lowering it takes the excess back now: "
          "that account's least recently used prefixes on the host are dropped, or charged to an account "
          "whose prefixes extend them and that has room.")
      .def(
          "unused_host_tier_accounts",
          [](const std::shared_ptr<PyManager>& mgr, const std::vector<std::int64_t>& accounts) {
            std::vector<std::uint32_t> checked;
            for (std::int64_t a : accounts) checked.push_back(TierAccount(a));
            return NoGil([&] { return Core(mgr).UnusedTierAccounts(checked); });
          },
          py::arg("accounts"),
          "Of `accounts`, those that no open space records into and no prefix (on the device or the host) "
          "is charged to, each once, never 0: nothing can charge them again until a space names them. A "
          "broker forgets its idle clients' accounts this way (erasing their limits) and reuses their numbers.")
      .def(
          "step",
          [](const std::shared_ptr<PyManager>& mgr, py::dict targets) {
            std::vector<StepTarget> list;
            for (auto item : targets) {
              const PyVTensor& vt = TargetVTensor(mgr, item.first, "step");
              list.push_back(StepTarget{vt.id, 0, std::nullopt});
              // n_tokens, or (n_tokens, low) to raise the low mark too.
              if (py::isinstance<py::tuple>(item.second)) {
                auto pair = item.second.cast<py::tuple>();
                if (pair.size() != 2)
                  Throw(ErrorCode::kInvalidArgument, "step: a target is n_tokens or (n_tokens, low)");
                list.back().num_tokens = Count(IntValue(pair[0], "step: num_tokens"), "num_tokens");
                list.back().low = Count(IntValue(pair[1], "step: low"), "low");
              } else {
                list.back().num_tokens = Count(IntValue(item.second, "step: num_tokens"), "num_tokens");
              }
            }
            return PyFuture{mgr, NoGil([&] { return Core(mgr).Step(std::move(list)); })};
          },
          py::arg("targets"))
      .def(
          "shrink",
          [](const std::shared_ptr<PyManager>& mgr, py::dict targets) {
            std::vector<ShrinkTarget> list;
            for (auto item : targets) {
              const PyVTensor& vt = TargetVTensor(mgr, item.first, "shrink");
              list.push_back(ShrinkTarget{vt.id, Count(IntValue(item.second, "shrink: num_tokens"), "num_tokens")});
            }
            return PyFuture{mgr, NoGil([&] { return Core(mgr).Shrink(std::move(list)); })};
          },
          py::arg("targets"))
      .def(
          "trim",
          [](const std::shared_ptr<PyManager>& mgr, std::optional<std::int64_t> bytes) {
            std::optional<std::size_t> b;
            if (bytes) b = Count(*bytes, "bytes");
            return Wait(mgr, NoGil([&] { return Core(mgr).Trim(b); }));
          },
          py::arg("bytes") = py::none())
      .def(
          "stats",
          // `timeout` is the broker client's (vtm.connect): in process the
          // answer is at hand, so it is accepted and has nothing to bound.
          [](const std::shared_ptr<PyManager>& mgr, std::optional<double>) {
            Stats st;
            {
              py::gil_scoped_release release;
              st = Core(mgr).GetStats();
            }
            return StatsDict(st);
          },
          py::arg("timeout") = py::none())
      .def("backend_costs",
           [](const std::shared_ptr<PyManager>& mgr) { return CostsDict(Core(mgr).BackendCosts()); })
      .def("check", [](const std::shared_ptr<PyManager>& mgr) { Core(mgr).Check(); },
           py::call_guard<py::gil_scoped_release>())
      // The API a broker client shares (vtm.connect): an in-process manager
      // is healthy until closed and has no session to rebuild.
      .def_property_readonly(
          "healthy", [](const std::shared_ptr<PyManager>& mgr) { return NoGil([&] { return Core(mgr).open(); }); })
      .def_property_readonly("reconnects", [](const std::shared_ptr<PyManager>&) { return 0; })
      .def_property_readonly("limit_bytes", [](const std::shared_ptr<PyManager>&) { return 0; },
                             "0: no limit but the capacity (a broker client's is the operator's)")
      .def("bind_thread", [](const std::shared_ptr<PyManager>&, const py::object&) {},
           py::arg("before_revoke") = py::none(),
           "A broker client's: it revokes on that thread, after calling before_revoke. In process there is "
           "nothing to revoke, and every thread may compute on the memory.")
      .def(
          "reconnect",
          [](const std::shared_ptr<PyManager>& mgr, std::optional<double>) {
            if (!NoGil([&] { return Core(mgr).open(); }))
              Throw(ErrorCode::kFailedPrecondition, "the manager is closed");
          },
          py::arg("timeout") = py::none())
      .def("close", [](const std::shared_ptr<PyManager>& mgr) { Core(mgr).Close(); },
           py::call_guard<py::gil_scoped_release>())
      .def("__enter__", [](const std::shared_ptr<PyManager>& mgr) { return mgr; })
      .def("__exit__",
           [](const std::shared_ptr<PyManager>& mgr, py::object, py::object, py::object) {
             py::gil_scoped_release release;
             Core(mgr).Close();
           })
      .def_property_readonly("backend", [](const std::shared_ptr<PyManager>& mgr) { return Core(mgr).backend()->name(); })
      .def_property_readonly("chunk_bytes", [](const std::shared_ptr<PyManager>& mgr) { return Core(mgr).chunk_bytes(); })
      .def_property_readonly("capacity_bytes",
                             [](const std::shared_ptr<PyManager>& mgr) { return Core(mgr).capacity_bytes(); })
      .def_property_readonly("granularity",
                             [](const std::shared_ptr<PyManager>& mgr) { return Core(mgr).backend()->granularity(); })
      .def_property_readonly("faults", [](const std::shared_ptr<PyManager>& mgr) -> py::object {
        if (Core(mgr).faults() == nullptr) return py::none();
        return py::cast(PyFaults{[mgr] { return Core(mgr).faults(); }});
      });

  // A broker client's mapper (see mapper_client.h); vtm.broker.client
  // drives it from its own worker thread, without the GIL.
  py::class_<ClientMapper, std::shared_ptr<ClientMapper>>(m, "ClientMapper", "A broker client's mappings.")
      .def(py::init([](const std::string& kind, std::size_t chunk_bytes, std::size_t granularity, int device,
                       std::size_t keep_idle, bool faults) {
             std::shared_ptr<Backend> backend;
             if (kind == "host") backend = MakeHostBackend(granularity);
             else if (kind == "cuda") backend = MakeCudaBackend(device);
             else Throw(ErrorCode::kInvalidArgument, "unknown backend '" + kind + "'");
             // Inside the check, as in Manager: an injected fault is a
             // device failing a well-formed call.
             if (faults) backend = std::make_shared<FaultInjectingBackend>(std::move(backend));
             // The contract is checked here too: the client maps what a broker says.
             return std::make_shared<ClientMapper>(MakeCheckedBackend(std::move(backend)), chunk_bytes, keep_idle);
           }),
           py::arg("backend"), py::arg("chunk_bytes"), py::arg("granularity") = 0, py::arg("device") = 0,
           py::arg("keep_idle") = 256, py::arg("faults") = false)
      .def("add_space", &ClientMapper::AddSpace, py::call_guard<py::gil_scoped_release>())
      .def("remove_space", &ClientMapper::RemoveSpace, py::call_guard<py::gil_scoped_release>())
      .def("missing",
           [](const ClientMapper& m, const std::vector<EffectTuple>& effects) {
             return m.Missing(EffectsFromPython(effects));
           })
      .def("import_fd", &ClientMapper::Import, py::call_guard<py::gil_scoped_release>())
      .def("apply",
           [](ClientMapper& m, std::uint32_t space, const std::vector<EffectTuple>& effects) {
             std::vector<PageEffect> parsed = EffectsFromPython(effects);
             py::gil_scoped_release release;
             m.Apply(space, parsed);
           })
      .def("unmap_slot", &ClientMapper::UnmapSlot, py::call_guard<py::gil_scoped_release>())
      .def("unmap_space", &ClientMapper::UnmapSpace, py::call_guard<py::gil_scoped_release>())
      .def("revoke", &ClientMapper::Revoke, py::call_guard<py::gil_scoped_release>())
      .def("rename_space", &ClientMapper::RenameSpace, py::call_guard<py::gil_scoped_release>())
      .def("pages", [](const ClientMapper& m, std::uint32_t space, int slot) { return PageList(m.Pages(space, slot)); })
      .def("mapped_pages", &ClientMapper::MappedPages)
      .def("mapped_from",
           [](const ClientMapper& m, std::uint32_t space, int slot, std::size_t first) {
             return EffectsToPython(m.MappedFrom(space, slot, first));
           })
      .def("base_address",
           [](const ClientMapper& m, std::uint32_t space) -> std::uintptr_t {
             auto r = m.reservation(space);
             return r ? r->va() : 0;
           })
      .def(
          "record_fence",
          [](const ClientMapper& m, const py::object& stream) {
            const std::uintptr_t handle = StreamHandle(stream);
            py::gil_scoped_release release;
            return m.backend()->record_fence(handle);
          },
          py::arg("stream") = py::none(),
          "A Fence after the work queued on `stream`, or None on the host backend.")
      .def_property_readonly("imports", &ClientMapper::imports)
      .def_property_readonly("_device",
                             [](const ClientMapper& m) {
                               return std::make_pair(static_cast<int>(m.backend()->device_type()),
                                                     m.backend()->device_id());
                             })
      .def("close", &ClientMapper::Close, py::call_guard<py::gil_scoped_release>(),
           "Unmaps everything and releases every import; False when an unmap failed (pages stay mapped).")
      .def_property_readonly("faults",
                             [](const std::shared_ptr<ClientMapper>& m) -> py::object {
                               auto* checked = dynamic_cast<CheckedBackend*>(m->backend().get());
                               auto* faulty = checked == nullptr
                                                  ? nullptr
                                                  : dynamic_cast<FaultInjectingBackend*>(checked->inner().get());
                               if (faulty == nullptr) return py::none();
                               return py::cast(PyFaults{[m, faulty] { return faulty; }});
                             })
      .def(
          "_dlpack",
          [](const ClientMapper& m, std::uint32_t space, int code, int bits, std::vector<std::int64_t> shape,
             bool versioned) {
            auto reservation = m.reservation(space);
            if (!reservation) Throw(ErrorCode::kFailedPrecondition, "space " + std::to_string(space) + " is closed");
            DLDataType dtype{static_cast<std::uint8_t>(code), static_cast<std::uint8_t>(bits), 1};
            void* t = MakeDLPackView(reservation, dtype, shape, versioned);
            if (versioned) return py::capsule(t, "dltensor_versioned", &DestroyVersionedCapsule);
            return py::capsule(t, "dltensor", &DestroyLegacyCapsule);
          },
          py::arg("space"), py::arg("code"), py::arg("bits"), py::arg("shape"), py::arg("versioned"));

  // The raw backend, for tests of the backend rules and for measuring the
  // floor (one map + set_access) in benchmarks.
  py::class_<Backend, std::shared_ptr<Backend>>(m, "RawBackend", "Direct access to a memory backend.")
      .def_static(
          "open",
          [](const std::string& kind, std::size_t granularity, int device) {
            // Checked as the manager's backend is: the contract tests run
            // against what vtm actually sends to a device.
            if (kind == "host") return MakeCheckedBackend(MakeHostBackend(granularity));
            if (kind == "cuda") return MakeCheckedBackend(MakeCudaBackend(device));
            Throw(ErrorCode::kInvalidArgument, "unknown backend '" + kind + "'");
          },
          py::arg("kind"), py::arg("granularity") = 0, py::arg("device") = 0)
      .def_property_readonly("name", &Backend::name)
      .def_property_readonly("granularity", &Backend::granularity)
      .def("costs",
           [](const Backend& b) {
             // open() wraps every RawBackend in a CheckedBackend.
             return CostsDict(static_cast<const CheckedBackend&>(b).Costs());
           })
      .def("reserve", &Backend::reserve, py::call_guard<py::gil_scoped_release>())
      .def("free_reservation", &Backend::free_reservation, py::call_guard<py::gil_scoped_release>())
      .def("create_chunk", &Backend::create_chunk, py::call_guard<py::gil_scoped_release>())
      .def("release_chunk", &Backend::release_chunk, py::call_guard<py::gil_scoped_release>())
      .def("map", &Backend::map, py::call_guard<py::gil_scoped_release>())
      .def("set_access", &Backend::set_access, py::call_guard<py::gil_scoped_release>())
      .def("unmap", &Backend::unmap, py::call_guard<py::gil_scoped_release>())
      .def("export_fd", &Backend::export_fd, py::call_guard<py::gil_scoped_release>())
      .def("import_fd", &Backend::import_fd, py::call_guard<py::gil_scoped_release>())
      .def(
          "record_fence",
          [](Backend& b, const py::object& stream) {
            const std::uintptr_t handle = StreamHandle(stream);
            py::gil_scoped_release release;
            return b.record_fence(handle);
          },
          py::arg("stream") = py::none())
      .def(
          "copy",
          [](Backend& b, ChunkHandle dst, ChunkHandle src, std::size_t bytes, const std::shared_ptr<Fence>& after) {
            py::gil_scoped_release release;
            b.copy(dst, src, bytes, after.get());
          },
          py::arg("dst"), py::arg("src"), py::arg("bytes"), py::arg("after") = py::none())
      .def("seal", &Backend::seal, py::call_guard<py::gil_scoped_release>())
      // Host memory as an address (an int): the host tier's blocks, for
      // measuring its copies. A copy must lie inside a live allocation.
      .def(
          "alloc_host",
          [](Backend& b, std::size_t bytes) {
            py::gil_scoped_release release;
            return reinterpret_cast<std::uintptr_t>(b.alloc_host(bytes));
          },
          py::arg("bytes"))
      .def(
          "free_host",
          [](Backend& b, std::uintptr_t address, std::size_t bytes) {
            py::gil_scoped_release release;
            b.free_host(reinterpret_cast<void*>(address), bytes);
          },
          py::arg("address"), py::arg("bytes"))
      .def(
          "copy_to_host_many",
          [](Backend& b, const std::vector<std::uintptr_t>& dsts, const std::vector<ChunkHandle>& srcs,
             std::size_t bytes) {
            std::vector<void*> to(dsts.size());
            for (std::size_t i = 0; i < dsts.size(); ++i) to[i] = reinterpret_cast<void*>(dsts[i]);
            py::gil_scoped_release release;
            b.copy_to_host_many(to, srcs, bytes, nullptr);
          },
          py::arg("dsts"), py::arg("srcs"), py::arg("bytes"))
      .def(
          "copy_from_host_many",
          [](Backend& b, const std::vector<ChunkHandle>& dsts, const std::vector<std::uintptr_t>& srcs,
             std::size_t bytes) {
            std::vector<const void*> from(srcs.size());
            for (std::size_t i = 0; i < srcs.size(); ++i) from[i] = reinterpret_cast<const void*>(srcs[i]);
            py::gil_scoped_release release;
            b.copy_from_host_many(dsts, from, bytes);
          },
          py::arg("dsts"), py::arg("srcs"), py::arg("bytes"))
      .def(
          "start_copy_from_host_many",
          [](Backend& b, const std::vector<ChunkHandle>& dsts, const std::vector<std::uintptr_t>& srcs,
             std::size_t bytes) {
            std::vector<const void*> from(srcs.size());
            for (std::size_t i = 0; i < srcs.size(); ++i) from[i] = reinterpret_cast<const void*>(srcs[i]);
            py::gil_scoped_release release;
            return b.start_copy_from_host_many(dsts, from, bytes);
          },
          // The copies must not outlive their backend.
          py::keep_alive<0, 1>(), py::arg("dsts"), py::arg("srcs"), py::arg("bytes"));
}
